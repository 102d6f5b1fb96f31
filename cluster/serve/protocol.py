"""The OpenAI chat-completions subset we serve, and its translation to and from ChatModel.

Requests are validated here (pydantic v2) and converted to our roles: system messages become the
``system`` argument, ``tool`` -> ``observation``, an assistant turn with ``tool_calls`` -> a
``function`` turn whose content is the JSON list ``[{"name", "arguments"}]`` training encodes.
Replies (``Response`` / ``ChatDelta``) become OpenAI objects. Nothing here touches Ray or HTTP.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stages.inference.chat_model import ChatInputError, Response


# --- errors ----------------------------------------------------------------------------------

class APIError(Exception):
    """An answer other than 200, with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, worded for a client, as a 400."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return APIError(400, f"{where or 'body'}: {first.get('msg', 'invalid value')}", param=where or None,
                    code="invalid_value")


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        data = json.loads(raw or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}).", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


# --- requests --------------------------------------------------------------------------------

class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCallBody(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI fields we do not implement are accepted

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    n: int = Field(1, ge=1, le=64)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None


class ScoreRequest(BaseModel):
    model: str
    messages: Optional[list[ChatMessage]] = Field(None, min_length=2)
    conversations: Optional[list[list[ChatMessage]]] = Field(None, min_length=1)


def to_chat_inputs(messages: list[ChatMessage]) -> tuple[list[dict], Optional[str]]:
    """(our messages, system) from OpenAI messages. Leading system/developer messages are the
    system prompt; consecutive tool results are one observation turn (our templates alternate
    prompt and response turns)."""
    system_parts: list[str] = []
    out: list[dict] = []
    for i, msg in enumerate(messages):
        if msg.role in ("system", "developer"):
            if out:
                raise ChatInputError(f"messages[{i}] is a {msg.role} message after the conversation began; "
                                     "put system messages first.")
            system_parts.append(msg.text())
        elif msg.role == "tool":
            if out and out[-1]["role"] == "observation":
                out[-1]["content"] += "\n" + msg.text()
            else:
                out.append({"role": "observation", "content": msg.text()})
        elif msg.role == "assistant" and msg.tool_calls:
            out.append({"role": "function", "content": json.dumps(
                [{"name": c.function.name, "arguments": _arguments(c, i)} for c in msg.tool_calls], ensure_ascii=False)})
        else:
            out.append({"role": msg.role, "content": msg.text()})
    return out, ("\n".join(system_parts) if system_parts else None)


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
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    options: dict[str, Any] = dict(
        adapter=adapter, n=request.n, stop=stop, seed=request.seed, temperature=request.temperature,
        top_p=request.top_p, max_new_tokens=request.max_completion_tokens or request.max_tokens,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
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
