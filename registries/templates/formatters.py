"""Formatters turn one message into slots. A template is a handful of them."""

from __future__ import annotations

from dataclasses import dataclass

from .slots import Slot, fill
from .tools import get_tool_format, parse_function_message, parse_tools


@dataclass(frozen=True)
class StringFormatter:
    """Slots with a ``{{content}}`` placeholder (and optionally ``{{idx}}``, the turn index)."""

    slots: tuple[Slot, ...] = ("{{content}}",)

    def apply(self, content: str = "", **values: str) -> list[Slot]:
        return fill(list(self.slots), content=content, **values)


@dataclass(frozen=True)
class FunctionFormatter:
    """An assistant turn that calls tools: JSON calls -> the family's call syntax -> slots.

    ``thought_words`` lets a reasoning model keep its ``<think>...</think>`` block in front of
    the calls.
    """

    slots: tuple[Slot, ...] = ("{{content}}",)
    tool_format: str = "default"

    def apply(self, content: str = "", thought_words: tuple[str, str] | None = None) -> list[Slot]:
        thought = ""
        if thought_words and content.lstrip().startswith(thought_words[0].strip()):
            end = content.find(thought_words[1].strip())
            if end != -1:
                end += len(thought_words[1].strip())
                thought, content = content[:end], content[end:]
                # keep the exact separator the template uses after the closing tag
                thought = thought + thought_words[1][len(thought_words[1].rstrip()):]
                content = content.lstrip()
        calls = parse_function_message(content)
        text = thought + get_tool_format(self.tool_format).format_calls(calls)
        return fill(list(self.slots), content=text)


@dataclass(frozen=True)
class ToolFormatter:
    """The tool list, rendered as text that the template appends to the system prompt."""

    tool_format: str = "default"

    def apply(self, tools_json: str) -> str:
        tools = parse_tools(tools_json)
        return get_tool_format(self.tool_format).format_tools(tools) if tools else ""

    def extract(self, reply: str):
        return get_tool_format(self.tool_format).extract_calls(reply)
