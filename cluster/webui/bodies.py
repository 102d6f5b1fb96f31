"""What a page's request body must hold: a JSON object of checked strings, numbers and chat turns.

Shared by the web UI (cluster/webui/server.py) and ``rayfactory webchat`` (cluster/webchat/), so a
chat request is checked by one piece of code wherever it arrives. Every mistake is a UserError
(ArgumentError names the key): the servers answer it with a 4xx, never a 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from registries.errors import ArgumentError, UserError

MAX_MESSAGES = 500
CHAT_SETTINGS = {"temperature": (0.0, 10.0), "top_p": (0.0, 1.0), "max_new_tokens": (1, 32768)}
MAX_CHAT_TEXT = 100_000  # characters in one turn or the system prompt


class BodyTooLarge(UserError):
    """A body over the server's byte limit (answered with a 413)."""


async def json_object(request: Request) -> dict[str, Any]:
    """A request's body: a JSON object, else a 400 that says what came instead (a FastAPI dependency)."""
    return await limited_json_object(request, None)


async def limited_json_object(request: Request, limit: int | None) -> dict[str, Any]:
    """``json_object``, but a body over ``limit`` bytes is refused while it arrives (never held whole)."""
    raw = bytearray()
    declared = request.headers.get("content-length", "")
    too_big = BodyTooLarge(f"the request body is over this server's limit of {limit} bytes; "
                           "send a shorter conversation.")
    if limit is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    async for piece in request.stream():
        raw += piece
        if limit is not None and len(raw) > limit:
            raise too_big
    try:
        body = json.loads(bytes(raw))
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past reason
        raise UserError("the request body must be a JSON object; this one is not JSON.") from None
    if not isinstance(body, dict):
        raise UserError(f"the request body must be a JSON object, not a JSON {json_kind(body)}.")
    return body


def json_kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def text(body: dict[str, Any], key: str, default: Any, limit: int = 100_000) -> Any:
    """``body[key]``: a string (at most ``limit`` characters), or ``default`` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ArgumentError(key, f"{key} must be a string, not a JSON {json_kind(value)}.")
    if len(value) > limit:
        raise ArgumentError(key, f"{key} is longer than {limit} characters.")
    _check_unicode(key, value)
    return value


def number(body: dict[str, Any], key: str, low: float, high: float, integer: bool = False) -> Any:
    """``body[key]`` as a number in [low, high] (a numeric string counts: the page sends its inputs'
    text), or None when absent or blank."""
    value = body.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    kind = "an integer" if integer else "a number"
    found = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        found = value
    elif isinstance(value, str) and len(value) < 40:
        try:
            found = float(value)
        except ValueError:
            pass
    if found is None or (isinstance(found, float) and not math.isfinite(found)) or (
            integer and found != int(found)):
        raise ArgumentError(key, f"{key} must be {kind} from {low} to {high}, not {value!r:.60}.")
    if not low <= found <= high:
        raise ArgumentError(key, f"{key} must be {kind} from {low} to {high}, not {found}.")
    return int(found) if integer else float(found)


def messages(body: dict[str, Any]) -> list[dict[str, str]]:
    from registries.templates.template import ROLES

    turns = body.get("messages")
    shape = "a non-empty list of {role, content} turns (strings) ending on a user turn"
    if not isinstance(turns, list) or not 0 < len(turns) <= MAX_MESSAGES:
        raise ArgumentError("messages", f"messages must be {shape}, at most {MAX_MESSAGES}.")
    for i, m in enumerate(turns):
        if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ROLES):
            raise ArgumentError("messages", f"messages[{i}] must be {{role, content}} with a role of "
                                            f"{', '.join(ROLES)} and the content a string.")
        if len(m["content"]) > MAX_CHAT_TEXT:
            raise ArgumentError("messages", f"messages[{i}] is longer than {MAX_CHAT_TEXT} characters.")
        _check_unicode(f"messages[{i}]", m["content"])
    return [{"role": m["role"], "content": m["content"]} for m in turns]


def chat_request(body: dict[str, Any]) -> tuple[list[dict[str, str]], str | None, dict[str, Any]]:
    """(messages, system prompt or None, generation settings) of a chat request: the keys of
    ``ChatModel.stream_chat``; an absent or blank setting is None (the config's value)."""
    settings = {key: number(body, key, low, high, integer=key == "max_new_tokens")
                for key, (low, high) in CHAT_SETTINGS.items()}
    return messages(body), text(body, "system", "", limit=MAX_CHAT_TEXT) or None, settings


def _check_unicode(where: str, value: str) -> None:
    """JSON lets a lone surrogate ("\\ud83d") through, which no tokenizer can encode: a 400, not a 500."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ArgumentError(where.split("[")[0], f"{where} holds a lone UTF-16 surrogate (a broken \\uD8xx "
                                                 "escape); send valid Unicode.") from None
