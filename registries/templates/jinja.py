"""Export a Template as a Hugging Face chat template (Jinja), so a trained model ships with the
exact format it was trained on.

``to_jinja(template, tokenizer)`` writes a template that renders, through
``tokenizer.apply_chat_template``, the same text as ``Template.render``:

- messages: an optional leading ``system`` message (else the template's default system), then
  ``user`` / ``assistant`` turns, tool results as ``tool`` (or ``observation``) turns, and tool
  calls as assistant messages with ``tool_calls`` (when the tool format's call syntax can be
  written in Jinja, see ``_calls_jinja``);
- reasoning templates: the same thinking policy as encoding (history thoughts dropped, an empty
  thought block on a final reply without one), switched by ``enable_thinking=`` (default: the
  template's); with thinking off and ``add_generation_prompt`` the prompt ends in the empty block;
- bos/eos are written as the tokenizer's token text at export time, so a later eos swap cannot
  change the rendering.

Our user slots already end with the assistant header, so a conversation ending on a user turn
renders that header whether or not ``add_generation_prompt`` is set (as in LLaMA-Factory's
export). A tool list cannot be rendered (tool formats are Python): the template raises if
``tools`` are passed, rather than silently dropping them.
"""

from __future__ import annotations

import json

from .slots import NamedToken, Slot, SpecialToken, fill, slots_to_text
from .template import Template
from .tools import FunctionCall, get_tool_format

# Placeholders pushed through the Python formatters and found again in their output.
_CONTENT = "\x00content\x00"
_IDX = "\x00idx\x00"
_NAME = "QQxNAMExQQ"  # letters only: survives json.dumps unchanged
_ARGS = {"QQxARGxQQ": 1}


def to_jinja(template: Template, tokenizer) -> str:
    """A chat template rendering like ``template.render`` with this tokenizer's bos/eos text."""
    fold = template.system_in_first_user
    system_text = _expr(template.format_system.apply(_CONTENT), tokenizer, "system_message", fold=fold)
    out = [
        _THOUGHT_MACRO if template.thought_words else "",
        "{%- if tools is defined and tools -%}{{ raise_exception("
        + _literal(
            f"This chat template was exported from RayFactory's {template.name!r} template and cannot render "
            "a tool list; put the tools in the system message instead."
        )
        + ") }}{%- endif -%}",
        "{%- if messages and messages[0]['role'] == 'system' -%}",
        "{%- set system_message = messages[0]['content'] or " + _literal(template.default_system) + " -%}",
        "{%- set loop_messages = messages[1:] -%}",
        "{%- else -%}",
        "{%- set system_message = " + _literal(template.default_system) + " -%}",
        "{%- set loop_messages = messages -%}",
        "{%- endif -%}",
    ]
    if template.thought_words:
        default = "true" if template.enable_thinking else "false"
        out += [
            "{%- set thinking = enable_thinking if enable_thinking is defined and enable_thinking is not none else "
            + default
            + " -%}",
            "{%- set ns = namespace(last_query=-1) -%}",
            "{%- for message in loop_messages -%}{%- if message['role'] == 'user' -%}"
            "{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}",
        ]
    out += [
        "{%- for message in loop_messages -%}",
        "{%- set content = message['content'] if message['content'] is string else '' -%}",
        "{%- if loop.first -%}",
        _output(_expr(template.format_prefix, tokenizer)),
        "{%- if system_message -%}",
        "{%- set content = " + system_text + " + content -%}" if fold else _output(system_text),
        "{%- endif -%}",
        "{%- endif -%}",
        "{%- if message['role'] == 'user' -%}",
        _output(_expr(template.format_user.apply(_CONTENT, idx=_IDX), tokenizer)),
        "{%- elif message['role'] in ['tool', 'observation'] -%}",
        _output(_expr(template.format_observation.apply(_CONTENT), tokenizer)),
        "{%- elif message['role'] == 'assistant' -%}",
        _thinking_policy(template),
        "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}",
        _hoist_thought(template, tokenizer, function=True),
        _calls_block(template, tokenizer),
        "{%- else -%}",
        _hoist_thought(template, tokenizer, function=False),
        _output(_expr(template.format_assistant.apply(_CONTENT), tokenizer)),
        "{%- endif -%}",
        "{%- else -%}",
        "{{ raise_exception('Unsupported role ' + message['role'] + ': this template renders system (first only), "
        "user, assistant, tool messages.') }}",
        "{%- endif -%}",
        "{%- endfor -%}",
    ]
    if template.thought_words:
        out += [
            "{%- if add_generation_prompt and not thinking and loop_messages "
            "and loop_messages[-1]['role'] in ['user', 'tool', 'observation'] -%}",
            _output(_literal(template.empty_thought())),
            "{%- endif -%}",
        ]
    return "".join(line for line in out if line)


# ---------------------------------------------------------------- slots -> Jinja expressions
def _literal(text: str) -> str:
    """A single-quoted Jinja string literal (Jinja decodes Python-style backslash escapes)."""
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\r", "\\r")
    return "'" + escaped.replace("\t", "\\t") + "'"


def _output(expr: str) -> str:
    return "{{- " + expr + " -}}" if expr != "''" else ""


def _expr(slots: "list[Slot] | tuple[Slot, ...]", tokenizer, content_var: str = "content", fold: bool = False) -> str:
    """Slots (already filled with the placeholders) as one Jinja string expression.

    ``fold`` renders the slots the way a system prompt folded into the first user message is
    rendered: as text only, where bos/eos slots contribute nothing.
    """
    pieces: list[str] = []
    for slot in slots:
        if isinstance(slot, SpecialToken):
            token = None if fold else getattr(tokenizer, slot.attr, None)
            pieces.append(_literal(token if isinstance(token, str) else ""))
        elif isinstance(slot, NamedToken):
            pieces.append(_literal(slot.text))
        else:
            pieces += _text_pieces(slot, content_var)
    pieces = [p for p in pieces if p != "''"]
    return " + ".join(pieces) if pieces else "''"


def _text_pieces(text: str, content_var: str) -> list[str]:
    pieces: list[str] = []
    for i, chunk in enumerate(text.split(_CONTENT)):
        if i:
            pieces.append(content_var)
        for j, part in enumerate(chunk.split(_IDX)):
            if j:
                pieces.append("((loop.index0 // 2) | string)")
            pieces.append(_literal(part))
    return pieces


# ---------------------------------------------------------------- reasoning
# Removes every "<start>...<end>" span the way re.sub(start + ".*?" + end, "", text) does
# (an unclosed start is kept), then leading newlines: Template.remove_thought, in Jinja.
_THOUGHT_MACRO = (
    "{%- macro strip_thoughts(text, start, end) -%}"
    "{%- set parts = text.split(start) -%}"
    "{%- set st = namespace(out=parts[0], pending='', inside=false) -%}"
    "{%- for part in parts[1:] -%}"
    "{%- if not st.inside -%}{%- set st.pending = '' -%}{%- endif -%}"
    "{%- set st.pending = st.pending + start + part -%}"
    "{%- if end in part -%}{%- set st.out = st.out + part.split(end, 1)[1] -%}{%- set st.inside = false -%}"
    "{%- else -%}{%- set st.inside = true -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if st.inside -%}{%- set st.out = st.out + st.pending -%}{%- endif -%}"
    "{{- st.out.lstrip('\\n') -}}"
    "{%- endmacro -%}"
)


def _thinking_policy(template: Template) -> str:
    """Jinja for Template._apply_thinking_policy + _add_empty_thoughts on one assistant turn."""
    if not template.thought_words:
        return ""
    start, end = (_literal(w.strip()) for w in template.thought_words)
    return (
        "{%- if not thinking or loop.index0 < ns.last_query -%}"
        "{%- set content = strip_thoughts(content, " + start + ", " + end + ") -%}"
        "{%- endif -%}"
        "{%- if loop.last and not (" + start + " in content or " + end + " in content) -%}"
        + _output(_literal(template.empty_thought()))
        + "{%- endif -%}"
    )


def _hoist_thought(template: Template, tokenizer, function: bool) -> str:
    """Most reply formatters keep a thought inside the content; some (gpt-oss) write it as its
    own message in front of the reply's slots. Probe the formatter to learn which, and for the
    latter emit the thought first and format only the rest."""
    if not template.thought_words:
        return ""
    start, end = template.thought_words
    thought = start + "\x01" + end
    rest = json.dumps({"name": _NAME, "arguments": _ARGS}) if function else _CONTENT
    try:
        if function:
            joined = template.format_function.apply(thought + rest, thought_words=template.thought_words)
            alone = template.format_function.apply(rest, thought_words=template.thought_words)
        else:
            joined = template.format_assistant.apply(thought + rest)
            alone = template.format_assistant.apply(rest)
    except ValueError:
        return ""
    if slots_to_text(tokenizer, joined) != thought + slots_to_text(tokenizer, alone):
        return ""  # the thought stays inside the content
    return (
        "{%- if content.startswith(" + _literal(start) + ") and " + _literal(end) + " in content -%}"
        + _output("content.split(" + _literal(end) + ", 1)[0] + " + _literal(end))
        + "{%- set content = content.split(" + _literal(end) + ", 1)[1] -%}"
        "{%- endif -%}"
    )


# ---------------------------------------------------------------- tool calls
def _calls_block(template: Template, tokenizer) -> str:
    """Jinja for an assistant message with ``tool_calls``: the function slots around the calls
    written in the tool format's syntax, or a clear exception when that syntax is not Jinja-able."""
    calls = _calls_jinja(template.format_function.tool_format)
    if calls is None:
        return (
            "{{ raise_exception("
            + _literal(
                f"This chat template was exported from RayFactory's {template.name!r} template, whose tool "
                "format cannot be written in Jinja; it cannot render tool calls."
            )
            + ") }}"
        )
    # Text before the calls (a thought) stays in front of them, as FunctionFormatter keeps it.
    slots = fill(list(template.format_function.slots), content=_CONTENT)
    return calls + "{%- set content = content + calls_text -%}" + _output(_expr(slots, tokenizer))


def _probe_call() -> FunctionCall:
    return FunctionCall(_NAME, json.dumps(_ARGS, ensure_ascii=False))


def _calls_jinja(tool_format: str) -> str | None:
    """Sets ``calls_text`` from ``message['tool_calls']`` the way the tool format's Python writes
    the calls, learned by formatting placeholder calls. ``None`` when the output does not
    follow "opening + item + (separator + item)* + closing"."""
    fmt = get_tool_format(tool_format)
    try:
        one = fmt.format_calls([_probe_call()])
    except ValueError:
        return None
    try:
        two = fmt.format_calls([_probe_call()] * 2)
        three = fmt.format_calls([_probe_call()] * 3)
    except ValueError:  # a format that takes one call per turn
        two = three = None
    args_json = json.dumps(_ARGS, ensure_ascii=False)
    item = _item_template(one, args_json)
    if item is None:
        return None
    item_text, single_open, single_close = item
    multi = _multi_layout(two, three, item_text) if two is not None else None
    lines = [
        "{%- set cs = namespace(text='') -%}",
        "{%- for call in message['tool_calls'] -%}",
        "{%- set fn = call['function'] if call['function'] is defined else call -%}",
        "{%- set args = fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson -%}",
        "{%- set name = fn['name'] -%}",
        "{%- set item = " + _item_expr(item_text, args_json) + " -%}",
        "{%- if loop.length == 1 -%}",
        "{%- set cs.text = " + _literal(single_open) + " + item + " + _literal(single_close) + " -%}",
    ]
    if multi is None:
        lines.append(
            "{%- else -%}{{ raise_exception("
            + _literal(f"The {tool_format!r} tool format takes one function call per assistant turn.")
            + ") }}"
        )
    else:
        opening, separator, closing = multi
        lines.append(
            "{%- else -%}{%- set cs.text = cs.text + (" + _literal(opening) + " if loop.first else "
            + _literal(separator) + ") + item + (" + _literal(closing) + " if loop.last else '') -%}"
        )
    lines += ["{%- endif -%}", "{%- endfor -%}", "{%- set calls_text = cs.text -%}"]
    return "".join(lines)


def _item_template(one: str, args_json: str) -> tuple[str, str, str] | None:
    """Split the single-call text into (item, opening, closing): the item runs from the name
    (with its JSON quotes, if quoted) to the arguments, whichever order they come in."""
    if one.count(args_json) != 1 or one.count(_NAME) != 1:
        return None
    name_at, args_at = one.index(_NAME), one.index(args_json)
    name_span = (name_at, name_at + len(_NAME))
    if one[name_at - 1 : name_at] == '"' and one[name_span[1] : name_span[1] + 1] == '"':
        name_span = (name_at - 1, name_span[1] + 1)
    start = min(name_span[0], args_at)
    end = max(name_span[1], args_at + len(args_json))
    return one[start:end], one[:start], one[end:]


def _multi_layout(two: str, three: str, item: str) -> tuple[str, str, str] | None:
    first = two.find(item)
    second = two.find(item, first + len(item))
    if first == -1 or second == -1:
        return None
    opening, separator, closing = two[:first], two[first + len(item) : second], two[second + len(item) :]
    if opening + item + separator + item + separator + item + closing != three:
        return None
    return opening, separator, closing


def _item_expr(item: str, args_json: str) -> str:
    """The item text as Jinja, with the placeholders replaced by the call's name and arguments.
    A name that sits inside JSON quotes is written with ``tojson`` so it is escaped as JSON."""
    pieces: list[str] = []
    rest = item
    while rest:
        at_name = rest.find(_NAME)
        at_args = rest.find(args_json)
        hits = [(i, kind) for i, kind in ((at_name, "name"), (at_args, "args")) if i != -1]
        if not hits:
            pieces.append(_literal(rest))
            break
        i, kind = min(hits)
        before = rest[:i]
        if kind == "name":
            quoted = before.endswith('"') and rest[i + len(_NAME) :].startswith('"')
            if quoted:
                pieces.append(_literal(before[:-1]))
                pieces.append("(name | tojson)")
                rest = rest[i + len(_NAME) + 1 :]
            else:
                pieces.append(_literal(before))
                pieces.append("name")
                rest = rest[i + len(_NAME) :]
        else:
            pieces.append(_literal(before))
            pieces.append("args")
            rest = rest[i + len(args_json) :]
    pieces = [p for p in pieces if p != "''"]
    return " + ".join(pieces) if pieces else "''"
