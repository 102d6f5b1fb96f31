"""The OpenAI chat-completions subset we serve, and its translation to and from ChatModel.

Requests are validated here (pydantic v2) and converted to our roles: system messages become the
``system`` argument, ``tool`` -> ``observation``, an assistant turn with ``tool_calls`` -> a
``function`` turn whose content is the JSON list ``[{"name", "arguments"}]`` training encodes;
an ``image_url`` content part becomes an ``<image>`` in the text, its URL kept for the server to
decode (images.py) when the model reads images.
Replies (``Response`` / ``ChatDelta``) become OpenAI objects. Nothing here touches Ray or HTTP.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from stages.inference.chat_model import ChatInputError, Response

from .extensions import refused_extension


# --- errors ----------------------------------------------------------------------------------

class APIError(Exception):
    """An answer other than 200, with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, worded for a client, as a 400."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{where or 'body'}: {message}", param=where or None,
                    code="invalid_value")


MAX_JSON_DEPTH = 64  # deeper bodies are refused (an OpenAI request nests about 6 levels; tool schemas a few more)


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The request body as ``model``; every way it can be wrong is a 400 (run it off the event loop:
    a large body takes a while)."""
    try:
        data = json.loads(raw or b"")
    except ValueError as exc:  # not JSON, not UTF-8, or a number too long for Python to read
        raise APIError(400, f"the request body is not valid JSON ({exc}).", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object.", code="invalid_json")
    _check_json_tree(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _check_json_tree(data: Any) -> None:
    """No nesting deeper than MAX_JSON_DEPTH, and text that is Unicode (JSON lets a lone surrogate
    such as "\\ud83d" through, which no tokenizer can encode)."""
    stack = [(data, 1, "body")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"{where}: the text holds a lone UTF-16 surrogate (a broken \\uD8xx escape); "
                                    "send valid Unicode.", param=where, code="invalid_value") from None
        elif isinstance(value, dict):
            stack += [(k, depth, where) for k in value]
            stack += [(v, depth + 1, f"{where}.{k}") for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value)]


# --- requests --------------------------------------------------------------------------------

class FunctionCallBody(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallBody


IMAGE_PLACEHOLDER = "<image>"  # where an image part stood, as training data marks it (registries/multimodal)


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Text, or OpenAI's content parts normalised to {"type": "text", "text"} / {"type": "image_url",
    # "url"}; whether this model may take images is the server's call (app.py), not the parser's.
    content: Union[str, list[dict[str, str]], None] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else None
                if not isinstance(url, str):
                    raise ValueError(f'content[{i}] is an image_url part without a URL; send {{"type": "image_url", '
                                     '"image_url": {"url": "data:image/png;base64,..."}}')
                parts.append({"type": "image_url", "url": url})
            elif isinstance(kind, str) and kind != "text":
                raise ValueError(f"content[{i}] is a part of type {kind!r}: this server takes text and image_url "
                                 "parts only (no audio or file input)")
            else:
                raise ValueError(f'content[{i}] must be a text part, {{"type": "text", "text": "..."}}, or an '
                                 'image_url part')
        return parts

    def text(self) -> str:
        """The text, with ``<image>`` where each image part stood."""
        if isinstance(self.content, list):
            return "".join(p["text"] if p["type"] == "text" else IMAGE_PLACEHOLDER for p in self.content)
        return self.content or ""

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p["url"] for p in self.content if p["type"] == "image_url"]


class FunctionSpec(BaseModel):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ToolSpec(BaseModel):
    """One entry of ``tools``: checked here, passed on to the template as the client sent it."""

    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    # Fields named nowhere here are kept aside: check_limits refuses those that would change the
    # reply (cluster/serve/extensions.py), the rest are ignored.
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    n: int = Field(1, ge=1)  # the most is serve_max_n
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=0, lt=2**63)  # an int64, as OpenAI's
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's sampling extensions that our engines honour
    top_k: Optional[int] = Field(None, ge=-1)  # 0 or -1: no cut
    repetition_penalty: Optional[float] = Field(None, gt=0)
    ignore_eos: bool = False  # the reply runs to max_tokens, past the end-of-turn token (stop strings still cut)

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools):
        for i, tool in enumerate(tools or ()):
            try:
                ToolSpec.model_validate(tool)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first.get("loc", ()))
                raise ValueError(f"tools[{i}]{'.' + where if where else ''}: {first.get('msg')}; each tool is "
                                 '{"type": "function", "function": {"name": ..., "description": ..., '
                                 '"parameters": {...}}}') from None
        return tools

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def image_urls(self) -> list[tuple[int, str]]:
        """(message index, URL) of every image part, in the order the images fill the ``<image>``s."""
        return [(i, url) for i, m in enumerate(self.messages) for url in m.image_urls()]

    def check_limits(self, limits) -> None:
        """What this request asks for against the server's ``RequestLimits``, and fields it sets that
        this server would have to ignore (400s)."""
        refused = refused_extension(self.model_extra or {})
        if refused:
            raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")
        images = len(self.image_urls())
        if images > limits.max_images:
            raise APIError(400, f"the messages hold {images} images; this server takes at most {limits.max_images} "
                                "per request (serve_max_images).", param="messages", code="too_many_images")
        if self.n > limits.max_n:
            raise APIError(400, f"n is {self.n}; this server answers at most {limits.max_n} choices per request "
                                "(serve_max_n).", param="n", code="invalid_value")
        stops = self.stops()
        if len(stops) > limits.max_stop:
            raise APIError(400, f"stop has {len(stops)} strings; this server takes at most {limits.max_stop} "
                                "(serve_max_stop).", param="stop", code="invalid_value")
        longest = max(stops, key=len, default="")
        if len(longest) > limits.max_stop_length:
            raise APIError(400, f"a stop string is {len(longest)} characters; this server takes at most "
                                f"{limits.max_stop_length} (serve_max_stop_length).", param="stop", code="invalid_value")


class ScoreRequest(BaseModel):
    model: str
    messages: Optional[list[ChatMessage]] = Field(None, min_length=2)
    conversations: Optional[list[list[ChatMessage]]] = Field(None, min_length=1)


def to_chat_inputs(messages: list[ChatMessage], ends_on_reply: bool = False) -> tuple[list[dict], Optional[str]]:
    """(our messages, system) from OpenAI messages. Leading system/developer messages are the
    system prompt; consecutive tool results are one observation turn (our templates alternate
    prompt and response turns, which is checked here, in the client's own terms)."""
    system_parts: list[str] = []
    out: list[dict] = []
    where: list[int] = []  # the request's index of each of our turns
    for i, msg in enumerate(messages):
        if msg.role in ("system", "developer"):
            if out:
                raise ChatInputError(f"messages[{i}] is a {msg.role} message after the conversation began; "
                                     "put system messages first.")
            system_parts.append(msg.text())
        elif msg.role == "tool" and out and out[-1]["role"] == "observation":
            out[-1]["content"] += "\n" + msg.text()
        else:
            if msg.role == "tool":
                turn = {"role": "observation", "content": msg.text()}
            elif msg.role == "assistant" and msg.tool_calls:
                turn = {"role": "function", "content": json.dumps(
                    [{"name": c.function.name, "arguments": _arguments(c, i)} for c in msg.tool_calls], ensure_ascii=False)}
            else:
                turn = {"role": msg.role, "content": msg.text()}
            _check_turn_order(turn, out, messages, i)
            out.append(turn)
            where.append(i)
    if not out:
        raise ChatInputError("messages holds only system messages; add the user message to answer.")
    last_is_reply = out[-1]["role"] in ("assistant", "function")
    if last_is_reply != ends_on_reply:
        raise ChatInputError(
            f"messages[{where[-1]}], the last message, is a{'n' if messages[where[-1]].role == 'assistant' else ''} "
            f"{messages[where[-1]].role} message; "
            + ("a conversation to score must end with the assistant reply being scored." if ends_on_reply
               else "the reply is generated after a user or tool message, so end on one."))
    return out, ("\n".join(system_parts) if system_parts else None)


def _check_turn_order(turn: dict, before: list[dict], messages: list[ChatMessage], index: int) -> None:
    """User (or tool) messages and assistant messages alternate, starting with a user message."""
    is_reply = turn["role"] in ("assistant", "function")
    if is_reply == (len(before) % 2 == 1):
        return
    role = messages[index].role
    if not before:
        raise ChatInputError(f"messages[{index}] is an assistant message before any user message; the conversation "
                             "(after the system messages) starts with a user message.")
    raise ChatInputError(f"messages[{index}] is a{'n' if role == 'assistant' else ''} {role} message right after "
                         f"another {'assistant' if is_reply else 'user or tool'} message; user (or tool) and "
                         "assistant messages must alternate. Join the two into one message.")


def _arguments(call: ToolCall, index: int) -> Any:
    try:
        return json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        raise ChatInputError(f"messages[{index}].tool_calls: arguments of {call.function.name!r} are not JSON: "
                             f"{call.function.arguments[:80]!r}.") from None


def tools_json(request: ChatCompletionRequest) -> Optional[str]:
    """The request's tools as the JSON text our templates take; none when tool_choice is "none"."""
    if not request.tools or request.tool_choice == "none":
        return None
    return json.dumps(request.tools, ensure_ascii=False)


def chat_options(request: ChatCompletionRequest, adapter: Optional[str]) -> dict[str, Any]:
    """ChatModel keyword arguments for the request. A temperature above 0 asks for sampling, as
    it does for OpenAI; without one the config's do_sample holds."""
    options: dict[str, Any] = dict(
        adapter=adapter, n=request.n, stop=request.stops(), seed=request.seed, temperature=request.temperature,
        top_p=request.top_p, max_new_tokens=request.max_completion_tokens or request.max_tokens,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        top_k=request.top_k, repetition_penalty=request.repetition_penalty, ignore_eos=request.ignore_eos,
    )
    if request.temperature is not None and request.temperature > 0:
        options["do_sample"] = True
    return options


# --- replies ---------------------------------------------------------------------------------

def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def logprobs_content(logprobs, tokenizer) -> Optional[dict]:
    """OpenAI's ``logprobs`` object for one reply (tokens decoded one by one)."""
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, p) for t, p in lp.top])
                        for lp in logprobs]}


def tool_calls_payload(response: Response) -> list[dict]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for call in response.tool_calls]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(responses: list[Response], model: str, tokenizer) -> dict:
    """A ``chat.completion`` object from ChatModel's replies."""
    choices = []
    for r in responses:
        message: dict[str, Any] = {"role": "assistant", "content": r.response_text}
        if r.tool_calls:
            message = {"role": "assistant", "content": None, "tool_calls": tool_calls_payload(r)}
        choices.append({"index": r.index, "message": message, "finish_reason": r.finish_reason,
                        "logprobs": logprobs_content(r.logprobs, tokenizer)})
    prompt = responses[0].prompt_length if responses else 0
    return {"id": completion_id(), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt, sum(r.response_length for r in responses))}


def chunk(cid: str, model: str, choices: list[dict], usage_: Optional[dict] = None) -> dict:
    body = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
