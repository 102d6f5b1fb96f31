"""Pick the registered template that matches a tokenizer's own chat template, or warn loudly
when a named one does not.

Matching is by rendering: a few probe conversations are rendered with each registered
template and with the tokenizer's chat template, and a template matches when every probe the
tokenizer's template accepts renders to the same text. Probe content has no surrounding
whitespace, so templates that trim messages (Llama-3, Gemma) still match.
"""

from __future__ import annotations

import difflib
import logging
import re
import warnings

from .registry import get_template, list_templates
from .template import Template

logger = logging.getLogger(__name__)

AUTO = "auto"
FALLBACK = "empty"

SYSTEM_PROBE = "You are a helpful assistant."

# (messages, system, add_generation_prompt). Each checks something the others cannot: the
# first reply, a system prompt across turns, and a prompt awaiting generation.
PROBES: list[tuple[list[dict], str | None, bool]] = [
    ([{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?"}], None, False),
    (
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "It is 6."},
        ],
        SYSTEM_PROBE,
        False,
    ),
    ([{"role": "user", "content": "Tell me a joke."}], None, True),
]


class TemplateMismatchWarning(UserWarning):
    """The chosen template renders differently from the tokenizer's own chat template."""


def resolve_template(name: str | None, tokenizer, model_type: str | None = None) -> Template:
    """The template to train with.

    ``None`` or ``"auto"``: the registered template whose renderings equal the tokenizer's chat
    template. A tokenizer without one (a base model, a ``tiny:`` model) gets its model family's
    template when ``model_type`` (config.json's) names a registered family, as LLaMA-Factory users
    name it by hand; ``"empty"``, with a warning, when no registered template matches or the family
    is unknown. A name: that template, with a ``TemplateMismatchWarning`` and a diff when it
    renders differently from the tokenizer's own chat template.
    """
    if name is None or name == AUTO:
        return _detect(tokenizer, model_type)
    template = get_template(name)
    if getattr(tokenizer, "chat_template", None):
        diff = _first_difference(template, tokenizer)
        if diff:
            warnings.warn(
                f"Template {name!r} renders conversations differently from the tokenizer's own chat template "
                f"(first differing probe below; '-' is {name!r}, '+' the tokenizer's). Training with it "
                "teaches a format the model's chat template will not reproduce at inference. Use "
                f"template: auto (or the matching name), or keep {name!r} and export its chat template with "
                f"the model.\n{diff}",
                TemplateMismatchWarning,
                stacklevel=2,
            )
    return template


def matching_templates(tokenizer) -> list[str]:
    """Names of every registered template that renders all probes like the tokenizer does."""
    expected = _tokenizer_renderings(tokenizer)
    if not any(text is not None for text in expected):
        return []
    return [n for n in list_templates() if _renderings(get_template(n), tokenizer, expected) == expected]


def auto_template_reason(tokenizer, resolved: str, model_type: str | None = None) -> str:
    """Why ``template: auto`` resolved to ``resolved`` for this tokenizer, in a few words (the web
    UI shows it beside the name)."""
    if not getattr(tokenizer, "chat_template", None):
        family = _family_template(model_type)
        if family and family[1] == resolved:
            return f"the tokenizer has no chat template; {resolved!r} is the {family[0]} family's template"
        return "the tokenizer has no chat template and no registered model family matches: no role markers"
    if resolved == FALLBACK:
        return "no registered template renders like the tokenizer's chat template: no role markers"
    return "it renders like the tokenizer's own chat template"


def _family_template(model_type: str | None) -> tuple[str, str] | None:
    """(family name, its default template) of the registered family of config.json's ``model_type``."""
    from registries.models.families import family_for_model_type, is_registered_model_type

    if not model_type or not is_registered_model_type(model_type):
        return None
    family = family_for_model_type(model_type)
    return family.name, family.template


def _detect(tokenizer, model_type: str | None = None) -> Template:
    if not getattr(tokenizer, "chat_template", None):
        family = _family_template(model_type)
        if family:
            logger.info("template: auto -> %r: the tokenizer has no chat template; it is the %s family's template.",
                        family[1], family[0])
            return get_template(family[1])
        warnings.warn(
            "template is not set (or 'auto') and the tokenizer has no chat template: using the 'empty' "
            "template (no role markers). Set `template:` to the model's family to train a chat model.",
            TemplateMismatchWarning,
            stacklevel=3,
        )
        return get_template(FALLBACK)
    matches = matching_templates(tokenizer)
    if not matches:
        closest = _closest(tokenizer)
        warnings.warn(
            "template is not set (or 'auto') and no registered template renders like the tokenizer's chat "
            f"template: using the 'empty' template (no role markers). The closest is {closest!r}; its "
            "difference is below. Set `template:` to the model's family, or register a template for it "
            f"(registries/templates/families/).\n{_first_difference(get_template(closest), tokenizer)}",
            TemplateMismatchWarning,
            stacklevel=3,
        )
        return get_template(FALLBACK)
    best = _best_match(matches, tokenizer)
    if len(matches) > 1:
        logger.info("Templates %s all render like the tokenizer's chat template; chose %r.", matches, best)
    return get_template(best)


def _best_match(matches: list[str], tokenizer) -> str:
    """Among equal renderings (gemma / gemma2 / gemma3 look alike), prefer the name that best
    fits the tokenizer's model path, then one that needs no new tokens, then the newest-sounding
    (alphabetically last) name."""
    path = _normalize(str(getattr(tokenizer, "name_or_path", "") or ""))
    vocab = tokenizer.get_vocab()

    def score(name: str) -> tuple[int, bool, str]:
        overlap = difflib.SequenceMatcher(None, _normalize(name), path).find_longest_match()
        needs_tokens = any(w not in vocab for w in get_template(name).stop_words)
        return overlap.size, not needs_tokens, name

    return max(matches, key=score)


def _closest(tokenizer) -> str:
    """The registered template whose probe renderings are most alike the tokenizer's."""
    expected = _tokenizer_renderings(tokenizer)

    def similarity(name: str) -> float:
        ours = _renderings(get_template(name), tokenizer, expected)
        pairs = [(a, b) for a, b in zip(ours, expected) if b is not None]
        return sum(difflib.SequenceMatcher(None, a, b).ratio() for a, b in pairs)

    return max(list_templates(), key=similarity)


def _normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


# ---------------------------------------------------------------- renderings
def _tokenizer_renderings(tokenizer) -> list[str | None]:
    """The tokenizer's own rendering of each probe; None where its template rejects the probe
    (Gemma-1/2 raise on a system message)."""
    out: list[str | None] = []
    for messages, system, generation in PROBES:
        hf_messages = ([{"role": "system", "content": system}] if system else []) + messages
        try:
            out.append(
                tokenizer.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=generation)
            )
        except Exception:  # noqa: BLE001 - any template error just means "not applicable"
            out.append(None)
    return out


def _renderings(template: Template, tokenizer, expected: list[str | None]) -> list[str | None]:
    out: list[str | None] = []
    for (messages, system, _), want in zip(PROBES, expected):
        if want is None:
            out.append(None)
            continue
        try:
            out.append(template.render(tokenizer, messages, system))
        except Exception:  # noqa: BLE001 - e.g. a stop token this tokenizer lacks
            out.append("")
    return out


def _first_difference(template: Template, tokenizer, max_lines: int = 24) -> str:
    """A short unified diff of the first probe that renders differently, or ""."""
    expected = _tokenizer_renderings(tokenizer)
    ours = _renderings(template, tokenizer, expected)
    for mine, theirs in zip(ours, expected):
        if theirs is not None and mine != theirs:
            lines = difflib.unified_diff(
                _visible(mine).splitlines(),
                _visible(theirs).splitlines(),
                f"template {template.name!r}",
                "tokenizer chat_template",
                lineterm="",
            )
            lines = list(lines)
            more = f"\n... ({len(lines) - max_lines} more diff lines)" if len(lines) > max_lines else ""
            return "\n".join(lines[:max_lines]) + more
    return ""


def _visible(text: str) -> str:
    """Line breaks shown as '\\n' at each line end, so whitespace-only changes show in a diff."""
    return text.replace("\n", "\\n\n")
