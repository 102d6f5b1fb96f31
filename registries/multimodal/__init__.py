"""Vision plugins: how a template family turns ``<image>`` placeholders into its vision tokens
and an image list into its processor's tensors (LLaMA-Factory's ``mm_plugin``)."""

from .images import load_image, load_image_processor, regularize_image
from .registry import VISION_PLUGINS, VisionPlugin, get_vision_plugin, register_vision_plugin, vision_plugin_of
from . import gemma3 as _gemma3  # noqa: F401  (registers "gemma3")
from . import llava as _llava  # noqa: F401  (registers "llava")
from . import qwen2_vl as _qwen2_vl  # noqa: F401  (registers "qwen2_vl")

__all__ = [
    "VISION_PLUGINS",
    "VisionPlugin",
    "get_vision_plugin",
    "load_image",
    "load_image_processor",
    "register_vision_plugin",
    "regularize_image",
    "vision_plugin_of",
]
