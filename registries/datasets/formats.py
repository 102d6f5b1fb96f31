"""Format aligners: one raw row of a given ``formatting`` -> the ALIGNED example.

One ``register_format`` call per format. Each aligner returns
``{"_prompt", "_response", "_system", "_tools", "_kto_tag"}`` (see aligner.py for the contract)
and raises DatasetRowError, through RowContext, for anything it cannot read.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ..templates.tools import parse_function_message
from ..unique import add_unique
from .errors import describe_type
from .media import check_placeholders, read_images
from .rowcontext import RowContext

Aligned = dict[str, Any]
FORMAT_ALIGNERS: dict[str, Callable[[RowContext], Aligned]] = {}

_ALL_ROLES = ("user", "assistant", "observation", "function", "system")
PROMPT_ROLES = ("user", "observation")
RESPONSE_ROLES = ("assistant", "function")
# What LLaMA-Factory puts between several tool results that answer one call turn.
TOOL_RESULT_JOINER = "\n</tool_response>\n<tool_response>\n"


def register_format(name: str, aligner: Callable[[RowContext], Aligned]) -> None:
    add_unique(FORMAT_ALIGNERS, name, aligner, "Dataset format")


def _message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _example(ctx: RowContext, prompt: list, response: list, system: str) -> Aligned:
    example = {
        "_prompt": prompt,
        "_response": response,
        "_system": system,
        "_tools": ctx.tools(),
        "_kto_tag": ctx.kto_tag(),
    }
    if ctx.attr.has_images:
        # Only datasets with an images column carry ``_images``, so text datasets keep their schema.
        images = read_images(ctx)
        # Ranking rows hold two answers to one prompt; each pairs with the same images, so count
        # placeholders over the prompt and the first answer only.
        check_placeholders(ctx, prompt + response[:1], images)
        example["_images"] = images
    return example


# ====================================================================== alpaca
def align_alpaca(ctx: RowContext) -> Aligned:
    attr = ctx.attr
    prompt = _alpaca_history(ctx)
    prompt_col, query_col = attr.column("prompt"), attr.column("query")
    parts = [t for t in (ctx.text(prompt_col, required=prompt_col is not None), ctx.text(query_col)) if t]
    if not parts:
        named = " and ".join(repr(c) for c in (prompt_col, query_col) if c) or "(none configured)"
        ctx.fail(prompt_col or query_col or "prompt", f"the prompt is empty (columns {named} have no text)")
    prompt.append(_message("user", "\n".join(parts)))  # "instruction\ninput", as LLaMA-Factory joins them

    if attr.ranking:
        response = [_message("assistant", ctx.text(attr.column(k), required=True)) for k in ("chosen", "rejected")]
    elif attr.has_kto_tag:
        response = [_message("assistant", ctx.text(attr.column("response"), required=True))]
    else:
        column = attr.column("response")
        value = ctx.value(column, required=False) if column else None
        # No response column (pretraining text) or no value (prediction-only rows): no response.
        response = [] if value is None else [_message("assistant", ctx.text(column))]
    return _example(ctx, prompt, response, ctx.system())


def _alpaca_history(ctx: RowContext) -> list[dict[str, str]]:
    column = ctx.attr.column("history")
    value = ctx.value(column, required=False) if column else None
    if value is None:
        return []
    pairs = ctx.structured(column, value, list, "a list of [prompt, response] pairs")
    messages = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            problem = f"history item {i} is {short_json(pair)}, expected a pair of strings [prompt, response]"
            ctx.fail(f"{column}[{i}]", problem)
        messages += [_message("user", pair[0]), _message("assistant", pair[1])]
    return messages


# ====================================================================== sharegpt / openai
def align_sharegpt(ctx: RowContext) -> Aligned:
    return _align_conversation(ctx, openai=False)


def align_openai(ctx: RowContext) -> Aligned:
    return _align_conversation(ctx, openai=True)


def _align_conversation(ctx: RowContext, openai: bool) -> Aligned:
    attr = ctx.attr
    column = attr.column("messages")
    raw = ctx.structured(column, ctx.value(column, required=True), list, "a list of messages")
    turns = [(i, *_read_turn(ctx, f"{column}[{i}]", f"message {i}", m, openai)) for i, m in enumerate(raw)]

    system = ctx.system()
    if turns and turns[0][1] == "system":  # a leading system message overrides the system column
        system = turns.pop(0)[2]
    for index, role, _ in turns:
        if role == "system":
            ctx.fail(f"{column}[{index}]", f"message {index} is a system message; only the first message may be one")
    if openai:
        turns = _merge_tool_results(turns)
    if not turns:
        ctx.fail(column, f"column {column!r} has no user/assistant messages")

    for position, (index, role, content) in enumerate(turns):
        expected = PROMPT_ROLES if position % 2 == 0 else RESPONSE_ROLES
        if role not in expected:
            tags = " or ".join(repr(_tag_of(attr, r)) for r in expected)
            ctx.fail(
                f"{column}[{index}].{attr.tag('role_tag')}",
                f"message {index} has role {_tag_of(attr, role)!r} where {tags} is expected "
                "(prompt and response turns must alternate, starting with a prompt)",
            )
        if role == "function":
            _check_function_call(ctx, f"{column}[{index}].{attr.tag('content_tag')}", content)

    messages = [_message(role, content) for _, role, content in turns]
    last_index, last_role = turns[-1][0], turns[-1][1]
    if attr.ranking:
        if last_role in RESPONSE_ROLES:
            ctx.fail(
                f"{column}[{last_index}]",
                "the conversation ends with a response; in a ranking dataset it ends on the prompt and the two "
                f"answers go in columns {attr.column('chosen')!r} and {attr.column('rejected')!r}",
            )
        response = [_read_answer(ctx, attr.column(k), openai) for k in ("chosen", "rejected")]
        return _example(ctx, messages, response, system)
    if last_role in PROMPT_ROLES:
        answer = " or ".join(repr(_tag_of(attr, r)) for r in RESPONSE_ROLES)
        ctx.fail(
            f"{column}[{last_index}]",
            f"the conversation ends on a {_tag_of(attr, last_role)!r} message; it must end with a {answer} message",
        )
    return _example(ctx, messages[:-1], messages[-1:], system)


def _read_turn(ctx: RowContext, where: str, label: str, message: Any, openai: bool) -> tuple[str, str]:
    """One message -> (role, content). ``where`` is its field path, ``label`` how to name it."""
    attr = ctx.attr
    role_tag, content_tag = attr.tag("role_tag"), attr.tag("content_tag")
    if not isinstance(message, dict):
        expected = f"an object with {role_tag!r} and {content_tag!r}"
        ctx.fail(where, f"{label} is {describe_type(message)}, expected {expected}")
    if role_tag not in message:
        ctx.fail(f"{where}.{role_tag}", f"{label} has no {role_tag!r} key (it has: {', '.join(map(repr, message))})")
    tag = message[role_tag]
    role = {attr.tag(f"{r}_tag"): r for r in _ALL_ROLES}.get(tag)
    if role is None:
        known = ", ".join(repr(attr.tag(f"{r}_tag")) for r in _ALL_ROLES)
        ctx.fail(f"{where}.{role_tag}", f"{label} has role {tag!r}, expected one of {known}")
    if openai and role == "assistant" and message.get("tool_calls"):
        return "function", _openai_tool_calls(ctx, f"{where}.tool_calls", message["tool_calls"])
    content = message.get(content_tag)
    if openai and isinstance(content, list):  # OpenAI content parts: keep the text parts
        content = _text_parts(ctx, f"{where}.{content_tag}", content)
    if not isinstance(content, str):
        ctx.fail(f"{where}.{content_tag}", f"{label} content is {describe_type(content)}, expected a string")
    return role, content


def _openai_tool_calls(ctx: RowContext, where: str, calls: Any) -> str:
    """OpenAI ``tool_calls`` -> our function-turn content, a JSON list of {name, arguments}."""
    if not isinstance(calls, list):
        ctx.fail(where, f"tool_calls is {describe_type(calls)}, expected a list")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            ctx.fail(f"{where}[{i}]", f"tool call {i} has no 'function' object with a 'name'")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):  # the API sends arguments as JSON text
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                ctx.fail(f"{where}[{i}].function.arguments", f"tool call {i} arguments are not valid JSON ({err.msg})")
        if not isinstance(arguments, dict):
            problem = f"tool call {i} arguments are {describe_type(arguments)}, expected an object"
            ctx.fail(f"{where}[{i}].function.arguments", problem)
        out.append({"name": function["name"], "arguments": arguments})
    return json.dumps(out, ensure_ascii=False)


def _text_parts(ctx: RowContext, where: str, parts: list) -> str:
    texts = []
    for i, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            text_part = '{"type": "text", "text": ...}'
            problem = f"content part {i} is not a text part ({text_part}); only text is supported"
            ctx.fail(f"{where}[{i}]", problem)
        texts.append(part["text"])
    return "".join(texts)


def _merge_tool_results(turns: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    # OpenAI sends one "tool" message per call; our conversation has one observation turn.
    merged: list[tuple[int, str, str]] = []
    for index, role, content in turns:
        if role == "observation" and merged and merged[-1][1] == "observation":
            first_index, _, previous = merged[-1]
            merged[-1] = (first_index, role, previous + TOOL_RESULT_JOINER + content)
        else:
            merged.append((index, role, content))
    return merged


def _read_answer(ctx: RowContext, column: str, openai: bool) -> dict[str, str]:
    """A ranking answer: a message object (or a plain string, read as an assistant message)."""
    attr = ctx.attr
    value = ctx.value(column, required=True)
    if isinstance(value, str) and value.strip()[:1] != "{":
        return _message("assistant", value)
    expected = f"a message object with {attr.tag('role_tag')!r} and {attr.tag('content_tag')!r}"
    value = ctx.structured(column, value, dict, expected)
    role, content = _read_turn(ctx, column, f"column {column!r}", value, openai)
    if role not in RESPONSE_ROLES:
        tags = " or ".join(repr(_tag_of(attr, r)) for r in RESPONSE_ROLES)
        problem = f"column {column!r} has role {_tag_of(attr, role)!r}, expected {tags}"
        ctx.fail(f"{column}.{attr.tag('role_tag')}", problem)
    if role == "function":
        _check_function_call(ctx, f"{column}.{attr.tag('content_tag')}", content)
    return _message(role, content)


def _check_function_call(ctx: RowContext, where: str, content: str) -> None:
    try:
        parse_function_message(content)
    except ValueError as err:
        ctx.fail(where, f"function call content is not valid: {err}")


def _tag_of(attr, role: str) -> str:
    return attr.tag(f"{role}_tag")


def short_json(value: Any) -> str:
    """``value`` as JSON, cut to 60 characters: how a message quotes a value someone sent."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


register_format("alpaca", align_alpaca)
register_format("sharegpt", align_sharegpt)
register_format("openai", align_openai)
