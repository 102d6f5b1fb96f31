"""Images in a request: decoded, then expanded by the template's vision plugin exactly as the sft
stage expands an image row (registries/multimodal: the same ``inputs`` and ``expand``, the same
``image_max_pixels`` / ``image_min_pixels``), so the model sees at inference the vision tokens and
pixel tensors it was trained on.

One difference from training: a request is untrusted. A user who types ``<|image_pad|>`` must not
get an image token (it would misalign the pixel features and crash the forward pass), while the
tokens the plugin put there must stay special. So the caller's own text is marked as
``CallerText`` spans around each expansion and the template's escaping applies to those spans only.
"""

from __future__ import annotations

import io
import os
from typing import Any, Sequence

from registries.errors import UserError
from registries.templates.slots import CallerText, join_text

# Roles whose text the template escapes (registries/templates/template.py PROMPT_ROLES).
_CALLER_ROLES = ("user", "observation")


class ImageInputError(UserError):
    """An image a caller gave that cannot be read (a server answers it with a 400)."""


def open_image(source: Any):
    """A PIL image from a path, raw bytes or a PIL image, fully decoded (so no file stays open)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        handle, name = io.BytesIO(bytes(source)), "the image data"
    elif isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        if not os.path.isfile(name):
            raise ImageInputError(f"image {name!r} does not exist (or is not a file); give the path of a PNG, JPEG "
                                  "or other picture file.")
        handle = name
    else:
        raise ImageInputError(f"an image must be a file path, bytes or a PIL image, not {type(source).__name__}.")
    try:
        with Image.open(handle) as image:
            image.load()
            return image.copy()
    except Exception as exc:  # noqa: BLE001 (PIL raises many kinds for a broken file)
        raise ImageInputError(f"{name} is not a picture PIL can read ({type(exc).__name__}); give a PNG, JPEG "
                              "or other image file.") from None


def expand_images(template, messages: list[dict], images: Sequence[Any], data_args=None,
                  escape: bool = False) -> tuple[list[dict], dict[str, Any]]:
    """(messages with each ``<image>`` replaced by the family's vision tokens, the processor's
    tensors). ``escape``: caller roles become CallerText whose spans leave out the expansions,
    for a template whose ``escape_special_tokens`` is then switched off (the spans do the work)."""
    from registries.multimodal import vision_plugin_of
    from registries.multimodal.images import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
    from registries.multimodal.registry import IMAGE_PLACEHOLDER, check_image_count

    plugin = vision_plugin_of(template)  # a text template: the registry's clear error
    processor = getattr(template, "image_processor", None)
    if processor is None:
        raise UserError(
            f"template {template.name!r} reads images, but the model has no image processor (its folder has no "
            "preprocessor_config.json). Use a vision-language model of that family, e.g. tiny:qwen2_vl for qwen2_vl."
        )
    check_image_count(messages, list(images))  # before any decoding: the cheap mistake first
    max_pixels = getattr(data_args, "image_max_pixels", None) or DEFAULT_MAX_PIXELS
    min_pixels = getattr(data_args, "image_min_pixels", None) or DEFAULT_MIN_PIXELS
    mm = plugin.inputs([open_image(image) for image in images], processor, max_pixels, min_pixels)
    # The plugin expands one placeholder per image: asking it for each image alone gives the
    # expansion of every placeholder, in order, without a second copy of its counting rules.
    alone = plugin.expand([{"role": "user", "content": IMAGE_PLACEHOLDER} for _ in images], mm, processor)
    expansions = iter(m["content"] for m in alone)
    out = []
    for message in messages:
        pieces = message["content"].split(IMAGE_PLACEHOLDER)
        caller = escape and message["role"] in _CALLER_ROLES
        parts: list[str] = [CallerText(pieces[0]) if caller else pieces[0]]
        for piece in pieces[1:]:
            parts += [next(expansions), CallerText(piece) if caller else piece]
        out.append({**message, "content": join_text(*parts)})
    return out, mm
