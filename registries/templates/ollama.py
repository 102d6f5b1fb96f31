"""Export a Template as an Ollama prompt template (Go's text/template, Ollama's variables).

``to_ollama(template, tokenizer)`` writes a template over Ollama's ``.System`` and ``.Messages``
(each with ``.Role`` "user", "assistant" or "tool" and ``.Content``) that renders a conversation
as ``Template.render`` does: the prefix, the system block when there is a system prompt (the
Modelfile's ``SYSTEM`` carries the template's default one), then each turn in its role's format.
Our user slots end with the assistant header, so a conversation ending on a user turn ends ready
for the reply, as Ollama needs.

Templates that fold the system prompt into the first user turn, reasoning templates (their
thinking policy rewrites history) and templates that number turns are refused: Ollama's
variables cannot say those, and a template that renders differently is worse than none.
"""

from __future__ import annotations

from .slots import slots_to_text
from .template import Template

_CONTENT = "\x00content\x00"


def to_ollama(template: Template, tokenizer) -> str:
    """The Go template; ValueError naming the reason for a template Ollama cannot express."""
    if template.system_in_first_user or template.thought_words:
        kind = "folds the system prompt into the first user turn" if template.system_in_first_user else \
            "is a reasoning template (its thinking policy rewrites earlier turns)"
        raise ValueError(f"the {template.name!r} template {kind}, which an Ollama template cannot express")

    def turn(formatter, variable: str) -> str:
        slots = formatter.apply(_CONTENT)
        if any(isinstance(s, str) and "{{idx}}" in s for s in formatter.slots):
            raise ValueError(f"the {template.name!r} template numbers its turns, which Ollama's variables cannot")
        return _go_text(slots_to_text(tokenizer, slots)).replace(_go_text(_CONTENT), variable)

    prefix = _go_text(slots_to_text(tokenizer, list(template.format_prefix)))
    system = turn(template.format_system, "{{ .System }}")
    roles = {"user": turn(template.format_user, "{{ .Content }}"),
             "assistant": turn(template.format_assistant, "{{ .Content }}"),
             "tool": turn(template.format_observation, "{{ .Content }}")}
    branches = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{text}'
                       for i, (role, text) in enumerate(roles.items()))
    return f"{prefix}{{{{ if .System }}}}{system}{{{{ end }}}}{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}"


def modelfile(gguf_file: str, template: Template, tokenizer, stop_words: list[str], parameters: dict) -> str:
    """An Ollama Modelfile: the GGUF, the template, its stop words, the default system prompt and
    the config's sampling parameters."""
    lines = [f"FROM ./{gguf_file}", "", f'TEMPLATE """{to_ollama(template, tokenizer)}"""', ""]
    lines += [f"PARAMETER stop {_go_string(word)}" for word in stop_words]
    lines += [f"PARAMETER {key} {value}" for key, value in parameters.items()]
    if template.default_system:
        lines += ["", f'SYSTEM """{template.default_system}"""']
    return "\n".join(lines) + "\n"


def _go_text(text: str) -> str:
    """Literal text inside a Go template: only the action delimiters need escaping."""
    return text.replace("{{", '{{ "{{" }}')


def _go_string(text: str) -> str:
    import json

    return json.dumps(text, ensure_ascii=False)
