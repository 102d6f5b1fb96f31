"""Qwen2-VL: dynamic resolution. Each image becomes
``<|vision_start|>`` + ``<|image_pad|>`` * N + ``<|vision_end|>`` with
N = grid_t * grid_h * grid_w // merge_size**2 from the image processor's ``image_grid_thw``."""

from __future__ import annotations

import copy
from typing import Any

from .images import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, processor_inputs, regularize_image
from .registry import IMAGE_PLACEHOLDER, VisionPlugin, check_image_count, register_vision_plugin

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
_MIN_SIDE = 28  # the processor needs at least one 28-pixel merged patch per side
_MAX_RATIO, _RATIO_TARGET = 200, 180  # Qwen2-VL rejects aspect ratios above 200


def preprocess(image, max_pixels: int = DEFAULT_MAX_PIXELS, min_pixels: int = DEFAULT_MIN_PIXELS):
    """LLaMA-Factory's Qwen2VLPlugin._preprocess_image: the common resize, then Qwen's own limits."""
    image = regularize_image(image, max_pixels, min_pixels)
    if min(image.width, image.height) < _MIN_SIDE:
        image = image.resize((max(image.width, _MIN_SIDE), max(image.height, _MIN_SIDE)))
    if image.width / image.height > _MAX_RATIO:
        image = image.resize((image.height * _RATIO_TARGET, image.height))
    if image.height / image.width > _MAX_RATIO:
        image = image.resize((image.width, image.width * _RATIO_TARGET))
    return image


def inputs(
    images: list, image_processor, max_pixels: int = DEFAULT_MAX_PIXELS, min_pixels: int = DEFAULT_MIN_PIXELS
) -> dict[str, Any]:
    """pixel_values (patches of all images, concatenated) and image_grid_thw (one row per image)."""
    return processor_inputs(images, image_processor, lambda image: preprocess(image, max_pixels, min_pixels))


def image_token_counts(mm_inputs: dict[str, Any], image_processor) -> list[int]:
    merge = image_processor.merge_size**2
    return [int(thw.prod()) // merge for thw in mm_inputs.get("image_grid_thw", [])]


def expand(messages: list[dict[str, str]], mm_inputs: dict[str, Any], image_processor) -> list[dict[str, str]]:
    counts = image_token_counts(mm_inputs, image_processor)
    check_image_count(messages, counts)
    out, index = copy.deepcopy(messages), 0
    for message in out:
        content = message["content"]
        while IMAGE_PLACEHOLDER in content:  # in order: image i fills the i-th placeholder
            content = content.replace(IMAGE_PLACEHOLDER, VISION_START + IMAGE_PAD * counts[index] + VISION_END, 1)
            index += 1
        message["content"] = content
    return out


register_vision_plugin(VisionPlugin(name="qwen2_vl", image_token=IMAGE_PAD, inputs=inputs, expand=expand))
