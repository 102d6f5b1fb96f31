"""The template registry: one ``register_template`` call per family, duplicates rejected.

The built-in families (``families/``) are registered lazily, by the first call into this
registry, user registrations included: a user's ``register_template`` under a built-in name is
then refused at that call, and can never break the families' own registration later.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Sequence

from .formatters import FunctionFormatter, StringFormatter, ToolFormatter
from .slots import EOS, Slot
from .template import Template

TEMPLATES: dict[str, Template] = {}
# "unloaded" -> "loading" (families/ being imported; its own register_template calls land here)
# -> "loaded". A failed import goes back to "unloaded", so the next call retries and re-raises.
_families_state = "unloaded"


def register_template(
    name: str,
    *,
    user: Sequence[Slot] = ("{{content}}",),
    assistant: Sequence[Slot] | None = None,
    system: Sequence[Slot] | None = None,
    function: Sequence[Slot] | None = None,
    observation: Sequence[Slot] | None = None,
    prefix: Sequence[Slot] = (),
    tool_format: str = "default",
    default_system: str = "",
    stop_words: Sequence[str] = (),
    thought_words: tuple[str, str] | None = None,
    enable_thinking: bool = True,
    efficient_eos: bool = False,
    replace_eos: bool = False,
    system_in_first_user: bool = False,
    mm_plugin: str | None = None,
    notes: str = "",
    assistant_formatter: StringFormatter | None = None,
    function_formatter: FunctionFormatter | None = None,
) -> Template:
    """Declare a family's chat format.

    Unset parts default the way LLaMA-Factory's do: the assistant turn is ``content + eos``
    (just ``content`` with ``efficient_eos``), system and observation look like a user turn,
    and a function call is written with the assistant's slots. A family whose turns need more
    than slots (gpt-oss puts the thought before the reply's channel header) passes its own
    ``assistant_formatter`` / ``function_formatter``.
    """
    _load_families()  # built-ins first: a user's duplicate of one is refused here, not at a later lookup
    if name in TEMPLATES:
        raise ValueError(f"Template {name!r} is already registered.")
    if assistant is None:
        assistant = ("{{content}}",) if efficient_eos else ("{{content}}", EOS)
    template = Template(
        name=name,
        format_user=StringFormatter(tuple(user)),
        format_assistant=assistant_formatter or StringFormatter(tuple(assistant)),
        format_system=StringFormatter(tuple(system if system is not None else ("{{content}}",))),
        format_function=function_formatter
        or FunctionFormatter(tuple(function if function is not None else assistant), tool_format),
        format_observation=StringFormatter(tuple(observation if observation is not None else user)),
        format_tools=ToolFormatter(tool_format),
        format_prefix=tuple(prefix),
        default_system=default_system,
        stop_words=tuple(stop_words),
        thought_words=thought_words,
        enable_thinking=enable_thinking,
        efficient_eos=efficient_eos,
        replace_eos=replace_eos,
        system_in_first_user=system_in_first_user,
        mm_plugin=mm_plugin,
        notes=notes,
    )
    TEMPLATES[name] = template
    return template


def get_template(name: str) -> Template:
    """The registered template called ``name``; an unknown name lists the closest ones."""
    _load_families()
    if name not in TEMPLATES:
        close = difflib.get_close_matches(name, TEMPLATES, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"Unknown template {name!r}.{hint} Run `rayfactory templates` or call "
            f"registries.templates.list_templates() to see all {len(TEMPLATES)} names."
        )
    return TEMPLATES[name]


def list_templates() -> list[str]:
    _load_families()
    return sorted(TEMPLATES)


def _load_families() -> None:
    """Register every built-in family, once. Reentrant: the families' own ``register_template``
    calls (made while families/ is being imported) find it loading and go straight on."""
    global _families_state
    if _families_state != "unloaded":
        return
    _families_state = "loading"
    try:
        importlib.import_module(f"{__package__}.families")
    except BaseException:
        _families_state = "unloaded"
        raise
    _families_state = "loaded"
