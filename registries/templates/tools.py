"""Tool-calling formats: how a family lists tools in the system prompt, writes a function call,
and how a model's reply is parsed back into calls.

One ``register_tool_format`` call per format; templates name a format by its string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from ..unique import add_unique


class FunctionCall(NamedTuple):
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ToolFormat:
    name: str
    format_tools: Callable[[list[dict[str, Any]]], str]  # tools -> text for the system prompt
    format_calls: Callable[[list[FunctionCall]], str]  # calls -> assistant text
    extract_calls: Callable[[str], "str | list[FunctionCall]"]  # reply -> calls (or the text)


TOOL_FORMATS: dict[str, ToolFormat] = {}


def register_tool_format(fmt: ToolFormat) -> ToolFormat:
    return add_unique(TOOL_FORMATS, fmt.name, fmt, "Tool format")


def get_tool_format(name: str) -> ToolFormat:
    if name not in TOOL_FORMATS:
        raise ValueError(f"Unknown tool format {name!r}; known: {', '.join(sorted(TOOL_FORMATS))}.")
    return TOOL_FORMATS[name]


def parse_function_message(content: str) -> list[FunctionCall]:
    """Parse a ``function`` turn: a JSON object ``{"name", "arguments"}`` or a list of them."""
    try:
        calls = json.loads(content)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"A function-call turn must be JSON like {{\"name\": ..., \"arguments\": {{...}}}}, got {content[:80]!r} ({err})."
        ) from None
    if not isinstance(calls, list):
        calls = [calls]
    try:
        return [FunctionCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
    except (KeyError, TypeError):
        raise ValueError(f"Each function call needs 'name' and 'arguments' keys, got {content[:80]!r}.") from None


def parse_tools(content: str) -> list[dict[str, Any]]:
    """Parse the tools column: a JSON list of function schemas (bare or OpenAI-wrapped)."""
    try:
        tools = json.loads(content)
    except json.JSONDecodeError as err:
        raise ValueError(f"Tools must be a JSON list of function schemas, got {content[:80]!r} ({err}).") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise ValueError(f"Tools must be a JSON list of function schemas, got {content[:80]!r}.")
    for i, tool in enumerate(tools):
        schema = _function_schema(tool) if isinstance(tool, dict) else None
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise ValueError(
                f"Tool {i} has no 'name': each tool must be a function schema like "
                f'{{"name": ..., "description": ..., "parameters": {{...}}}} or '
                f'{{"type": "function", "function": {{...}}}}; got {json.dumps(tool)[:80]!r}.'
            )
    return tools


def _function_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """Accept both OpenAI style ``{"type": "function", "function": {...}}`` and bare schemas."""
    return tool["function"] if tool.get("type") == "function" and "function" in tool else tool


# ---- default: ReAct-like "Action: / Action Input:" text, for families without their own format.

_DEFAULT_TOOL_PROMPT = (
    "You have access to the following tools:\n{tool_text}"
    "Use the following format if using a tool:\n"
    "```\n"
    "Action: tool name (one of [{tool_names}])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    '(e.g. ```{{"input": "hello world", "num_beams": 5}}```)\n'
    "```\n"
)


def _default_tools(tools: list[dict[str, Any]]) -> str:
    tool_text, names = "", []
    for tool in map(_function_schema, tools):
        params = tool.get("parameters", {}) or {}
        required = set(params.get("required", []))
        lines = []
        for pname, pinfo in (params.get("properties") or {}).items():
            req = ", required" if pname in required else ""
            enum = f", should be one of [{', '.join(map(str, pinfo['enum']))}]" if pinfo.get("enum") else ""
            items = f", where each item should be {pinfo['items'].get('type', '')}" if pinfo.get("items") else ""
            lines.append(f"  - {pname} ({pinfo.get('type', '')}{req}): {pinfo.get('description', '')}{enum}{items}")
        tool_text += f"> Tool Name: {tool['name']}\nTool Description: {tool.get('description', '')}\n"
        tool_text += "Tool Args:\n" + "\n".join(lines) + "\n\n"
        names.append(tool["name"])
    return _DEFAULT_TOOL_PROMPT.format(tool_text=tool_text, tool_names=", ".join(names))


def _default_calls(calls: list[FunctionCall]) -> str:
    return "\n".join(f"Action: {c.name}\nAction Input: {c.arguments}" for c in calls)


_ACTION_RE = re.compile(r"Action:\s*([a-zA-Z0-9_]+)\s*Action Input:\s*(.+?)(?=\s*Action:|\s*$)", re.DOTALL)


def _default_extract(content: str) -> "str | list[FunctionCall]":
    calls = []
    for name, args in _ACTION_RE.findall(content):
        args = args.strip().strip('"').strip("```")
        try:
            calls.append(FunctionCall(name, json.dumps(json.loads(args), ensure_ascii=False)))
        except json.JSONDecodeError:
            return content
    return calls or content


register_tool_format(ToolFormat("default", _default_tools, _default_calls, _default_extract))


# ---- shared helpers for the JSON-based formats below.


def _openai_wrapped(tool: dict[str, Any]) -> dict[str, Any]:
    """Families trained on OpenAI-style tool lists see ``{"type": "function", "function": schema}``."""
    return tool if tool.get("type") == "function" and "function" in tool else {"type": "function", "function": tool}


def _json_calls(payload: Any, args_key: str) -> "list[FunctionCall] | None":
    """``{"name", <args_key>}`` or a list of them -> calls; None when the shape is wrong."""
    items = payload if isinstance(payload, list) else [payload]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or args_key not in item:
            return None
        calls.append(FunctionCall(item["name"], json.dumps(item[args_key], ensure_ascii=False)))
    return calls or None


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


# ---- llama3: Meta's JSON tool calling with the tools in the system prompt
# (``tools_in_user_message=False`` in Meta's template).

# The tool prompt names today's date. A live date would make the same dataset tokenize
# differently from one day to the next (and caches go stale), so it is fixed: this is the
# ``date_string`` that Meta's own Llama 3.1 template falls back to when none is passed.
# For another date, register a variant: ``register_tool_format(llama3_tool_format("llama3_2025", "01 Jan 2025"))``.
LLAMA3_TOOL_DATE = "26 Jul 2024"

_LLAMA3_TOOL_PROMPT = (
    "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a "
    'function call. Respond in the format {{"name": function name, "parameters": dictionary of '
    'argument name and its value}}. Do not use variables.\n\n{tool_text}'
)


def llama3_tool_format(name: str = "llama3", date: str = LLAMA3_TOOL_DATE) -> ToolFormat:
    """The llama3 tool format with the given "Today Date" line (see ``LLAMA3_TOOL_DATE``)."""

    def format_tools(tools: list[dict[str, Any]]) -> str:
        tool_text = "".join(json.dumps(_openai_wrapped(t), indent=4, ensure_ascii=False) + "\n\n" for t in tools)
        return _LLAMA3_TOOL_PROMPT.format(date=date, tool_text=tool_text)

    return ToolFormat(name, format_tools, _llama3_calls, _llama3_extract)


def _llama3_calls(calls: list[FunctionCall]) -> str:
    objects = [{"name": c.name, "parameters": json.loads(c.arguments)} for c in calls]
    return json.dumps(objects[0] if len(objects) == 1 else objects, ensure_ascii=False)


def _llama3_extract(content: str) -> "str | list[FunctionCall]":
    # Llama 3.x may open a call with <|python_tag|>; some checkpoints write "arguments".
    text = content.strip().removeprefix("<|python_tag|>").strip()
    payload = _loads_or_none(text)
    if payload is None:
        return content
    return _json_calls(payload, "parameters") or _json_calls(payload, "arguments") or content


register_tool_format(llama3_tool_format())


# ---- qwen: Hermes-style <tool_call> blocks (Qwen2.5 / Qwen3 and their derivatives).

_QWEN_TOOL_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)
_QWEN_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _qwen_tools(tools: list[dict[str, Any]]) -> str:
    tool_text = "".join("\n" + json.dumps(_openai_wrapped(t), ensure_ascii=False) for t in tools)
    return _QWEN_TOOL_PROMPT.format(tool_text=tool_text)


def _qwen_calls(calls: list[FunctionCall]) -> str:
    blocks = []
    for c in calls:
        body = json.dumps({"name": c.name, "arguments": json.loads(c.arguments)}, ensure_ascii=False)
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(blocks)


def _qwen_extract(content: str) -> "str | list[FunctionCall]":
    calls: list[FunctionCall] = []
    for block in _QWEN_CALL_RE.findall(content):
        parsed = _json_calls(_loads_or_none(block.strip()), "arguments")
        if parsed is None:  # one malformed block: treat the whole reply as text
            return content
        calls += parsed
    return calls or content


register_tool_format(ToolFormat("qwen", _qwen_tools, _qwen_calls, _qwen_extract))


# ---- mistral: [AVAILABLE_TOOLS] / [TOOL_CALLS] JSON lists (Mistral v0.3 instruct tokenizer).


def _mistral_tools(tools: list[dict[str, Any]]) -> str:
    wrapped = [_openai_wrapped(t) for t in tools]
    return "[AVAILABLE_TOOLS] " + json.dumps(wrapped, ensure_ascii=False) + "[/AVAILABLE_TOOLS]"


def _mistral_calls(calls: list[FunctionCall]) -> str:
    # The [TOOL_CALLS] marker belongs to the template's function slot, not to the call text.
    return json.dumps([{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls], ensure_ascii=False)


def _mistral_extract(content: str) -> "str | list[FunctionCall]":
    # A reply decoded with special tokens kept still starts with the marker.
    text = content.strip().removeprefix("[TOOL_CALLS]").strip()
    payload = _loads_or_none(text)
    if payload is None:
        return content
    return _json_calls(payload, "arguments") or content


register_tool_format(ToolFormat("mistral", _mistral_tools, _mistral_calls, _mistral_extract))


# ---- glm4: GLM-4 / ChatGLM3 function calling. The prompt text is the model's own (Chinese);
# a call is the function name on one line and its JSON arguments on the next.

_GLM4_TOOL_PROMPT = (
    "你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具{tool_text}"
)


def _glm4_tools(tools: list[dict[str, Any]]) -> str:
    tool_text = ""
    for tool in map(_function_schema, tools):
        schema = json.dumps(tool, indent=4, ensure_ascii=False)
        tool_text += f"\n\n## {tool['name']}\n\n{schema}\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
    return _GLM4_TOOL_PROMPT.format(tool_text=tool_text)


def _glm4_calls(calls: list[FunctionCall]) -> str:
    if len(calls) != 1:
        names = ", ".join(c.name for c in calls) or "none"
        raise ValueError(
            f"The glm4 tool format takes exactly one function call per assistant turn, got {len(calls)} "
            f"({names}). Split parallel calls into separate function/observation turns, or use a template "
            "whose tool format allows parallel calls (e.g. qwen)."
        )
    return f"{calls[0].name}\n{calls[0].arguments}"


def _glm4_extract(content: str) -> "str | list[FunctionCall]":
    name, sep, args = content.strip().partition("\n")
    arguments = _loads_or_none(args.strip()) if sep else None
    if not name.strip() or not isinstance(arguments, dict):
        return content
    return [FunctionCall(name.strip(), json.dumps(arguments, ensure_ascii=False))]


register_tool_format(ToolFormat("glm4", _glm4_tools, _glm4_calls, _glm4_extract))
