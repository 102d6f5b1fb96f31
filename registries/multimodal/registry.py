"""The vision plugin registry: one plugin per name, declared once (duplicates are a mistake)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UserError
from ..unique import add_unique

IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class VisionPlugin:
    """``expand(messages, image_inputs, image_processor)`` -> messages with each ``<image>`` replaced
    by the family's tokens; ``inputs(images, image_processor, max_pixels, min_pixels)`` -> the
    processor's tensors (e.g. pixel_values, image_grid_thw), from which ``expand`` takes the counts."""

    name: str
    image_token: str
    inputs: Callable[..., dict[str, Any]]
    expand: Callable[..., list[dict[str, str]]]


VISION_PLUGINS: dict[str, VisionPlugin] = {}


def register_vision_plugin(plugin: VisionPlugin) -> VisionPlugin:
    return add_unique(VISION_PLUGINS, plugin.name, plugin, "Vision plugin")


def get_vision_plugin(name: str) -> VisionPlugin:
    if name not in VISION_PLUGINS:
        known = ", ".join(sorted(VISION_PLUGINS)) or "none"
        raise UserError(f"No vision plugin named {name!r}; the registered ones are: {known}.")
    return VISION_PLUGINS[name]


def check_image_count(messages: list[dict[str, str]], images: list) -> None:
    # The same rule as LLaMA-Factory's _validate_messages; rows are checked earlier when aligned,
    # this catches callers that build messages themselves (chat, serve).
    count = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if count != len(images):
        raise UserError(
            f"The messages have {count} {IMAGE_PLACEHOLDER} placeholder(s) but {len(images)} image(s) were given; "
            f"put one {IMAGE_PLACEHOLDER} where each image goes."
        )


def vision_plugin_of(template) -> VisionPlugin:
    """The plugin a template names (``Template.mm_plugin``); a clear error for text-only templates."""
    name = getattr(template, "mm_plugin", None)
    if name is None:
        with_plugin = "qwen2_vl, llava, gemma3"
        raise UserError(
            f"Template {template.name!r} has no vision plugin, so it cannot read images. Use a vision template "
            f"(e.g. {with_plugin}) that matches the model."
        )
    return get_vision_plugin(name)
