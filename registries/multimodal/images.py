"""Decoding and resizing images the way LLaMA-Factory's BasePlugin does, so pixel counts (and so
token counts) match it exactly."""

from __future__ import annotations

import math

# LLaMA-Factory's ProcessorArguments defaults.
DEFAULT_MAX_PIXELS = 768 * 768
DEFAULT_MIN_PIXELS = 32 * 32


def load_image(path: str):
    """Open ``path`` fully (so the file handle closes) as a PIL image."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        return image.copy()


def regularize_image(image, max_pixels: int = DEFAULT_MAX_PIXELS, min_pixels: int = DEFAULT_MIN_PIXELS):
    """Shrink above ``max_pixels`` / grow below ``min_pixels`` keeping the aspect ratio, then RGB.
    int() truncation and PIL's default resample are LLaMA-Factory's, kept for exact parity."""
    if image.width * image.height > max_pixels:
        factor = math.sqrt(max_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)))
    if image.width * image.height < min_pixels:
        factor = math.sqrt(min_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)))
    if image.mode != "RGB":
        image = image.convert("RGB")
    return image


def processor_inputs(images: list, image_processor, prepare) -> dict:
    """The image processor's tensors for ``images``, each first put through ``prepare`` (the
    family's resize rule); {} for no images."""
    if not images:
        return {}
    return dict(image_processor([prepare(image) for image in images], return_tensors="pt"))


def load_image_processor(model_path: str):
    """The image processor a model folder (or hub id) ships, or None for a text-only model.

    A local folder without ``preprocessor_config.json`` has none; a hub id that cannot serve one
    (offline, or a text model) has none either."""
    import os

    from transformers import AutoImageProcessor

    if os.path.isdir(model_path) and not os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        return None
    try:
        return AutoImageProcessor.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
