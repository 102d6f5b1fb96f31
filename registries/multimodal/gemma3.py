"""Gemma 3: a fixed number of soft tokens per image, framed. The image processor resizes every
image to one square (no crop), and the projector pools the SigLIP patches to ``image_seq_length``
tokens, so each ``<image>`` becomes Gemma3Processor's ``full_image_sequence``:

    "\\n\\n<start_of_image>" + "<image_soft_token>" * image_seq_length + "<end_of_image>\\n\\n"

as LLaMA-Factory 0.9.5's Gemma3Plugin writes it (without pan-and-scan, its default). The count is
the image processor's ``image_seq_length`` (Gemma 3's preprocessor_config.json carries it; 256
for the released checkpoints)."""

from __future__ import annotations

import copy
from typing import Any

from .images import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, processor_inputs, regularize_image
from .registry import IMAGE_PLACEHOLDER, VisionPlugin, check_image_count, register_vision_plugin

BOI_TOKEN, IMAGE_TOKEN, EOI_TOKEN = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
DEFAULT_IMAGE_SEQ_LENGTH = 256  # Gemma3Processor's default


def inputs(
    images: list, image_processor, max_pixels: int = DEFAULT_MAX_PIXELS, min_pixels: int = DEFAULT_MIN_PIXELS
) -> dict[str, Any]:
    """pixel_values (num_images, 3, size, size)."""
    mm = processor_inputs(images, image_processor, lambda image: regularize_image(image, max_pixels, min_pixels))
    mm.pop("num_crops", None)  # pan-and-scan bookkeeping; LLaMA-Factory drops it too
    return mm


def full_image_sequence(image_processor) -> str:
    count = getattr(image_processor, "image_seq_length", None) or DEFAULT_IMAGE_SEQ_LENGTH
    return f"\n\n{BOI_TOKEN}{IMAGE_TOKEN * count}{EOI_TOKEN}\n\n"


def expand(messages: list[dict[str, str]], mm_inputs: dict[str, Any], image_processor) -> list[dict[str, str]]:
    images = mm_inputs.get("pixel_values", [])
    check_image_count(messages, list(images))
    out = copy.deepcopy(messages)
    if len(images) == 0:
        return out
    sequence = full_image_sequence(image_processor)
    for message in out:
        message["content"] = message["content"].replace(IMAGE_PLACEHOLDER, sequence)
    return out


register_vision_plugin(VisionPlugin(name="gemma3", image_token=IMAGE_TOKEN, inputs=inputs, expand=expand))
