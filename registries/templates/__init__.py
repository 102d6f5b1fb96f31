"""Chat templates: one registered Template per model family."""

from .registry import get_template, list_templates, register_template
from .slots import BOS, EOS, NamedToken
from .template import Template
from .tools import FunctionCall
from .verification import UNVERIFIED, verification_source

__all__ = [
    "BOS",
    "EOS",
    "FunctionCall",
    "NamedToken",
    "Template",
    "UNVERIFIED",
    "get_template",
    "list_templates",
    "register_template",
    "verification_source",
]
