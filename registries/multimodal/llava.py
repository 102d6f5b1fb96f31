"""LLaVA-1.5: a fixed number of ``<image>`` tokens per image, whatever its size, because the
CLIP image processor resizes and centre-crops every image to one square.

N = (height // patch_size) * (width // patch_size) + num_additional_image_tokens, minus 1 when
vision_feature_select_strategy is "default" (the CLS feature is dropped): 576 for 336-pixel
crops and patch 14, as LlavaProcessor and LLaMA-Factory's LlavaPlugin count."""

from __future__ import annotations

import copy
from typing import Any

from .images import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, processor_inputs, regularize_image
from .registry import IMAGE_PLACEHOLDER, VisionPlugin, check_image_count, register_vision_plugin

IMAGE_TOKEN = "<image>"
# LLaVA-1.5's processor facts (llava-hf/llava-1.5-7b-hf processor_config.json).
PATCH_SIZE, NUM_ADDITIONAL_IMAGE_TOKENS, FEATURE_STRATEGY = 14, 1, "default"


def inputs(
    images: list, image_processor, max_pixels: int = DEFAULT_MAX_PIXELS, min_pixels: int = DEFAULT_MIN_PIXELS
) -> dict[str, Any]:
    """pixel_values (num_images, 3, crop, crop)."""
    return processor_inputs(images, image_processor, lambda image: regularize_image(image, max_pixels, min_pixels))


def image_seqlen(
    mm_inputs: dict[str, Any],
    patch_size: int = PATCH_SIZE,
    num_additional_image_tokens: int = NUM_ADDITIONAL_IMAGE_TOKENS,
    vision_feature_select_strategy: str = FEATURE_STRATEGY,
) -> int:
    height, width = mm_inputs["pixel_values"].shape[-2:]
    count = (height // patch_size) * (width // patch_size) + num_additional_image_tokens
    return count - 1 if vision_feature_select_strategy == "default" else count


def expand(messages: list[dict[str, str]], mm_inputs: dict[str, Any], image_processor, **facts) -> list[dict[str, str]]:
    images = mm_inputs.get("pixel_values", [])
    check_image_count(messages, list(images))
    out = copy.deepcopy(messages)
    if len(images) == 0:
        return out
    seqlen = image_seqlen(mm_inputs, **facts)
    for message in out:
        # The placeholder and the model's token are the same text, so count first, then replace all.
        message["content"] = message["content"].replace(IMAGE_PLACEHOLDER, IMAGE_TOKEN * seqlen)
    return out


register_vision_plugin(VisionPlugin(name="llava", image_token=IMAGE_TOKEN, inputs=inputs, expand=expand))
