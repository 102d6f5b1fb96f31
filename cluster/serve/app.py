"""The OpenAI-compatible Serve application: one deployment = FastAPI ingress + a ChatModel.

We serve our own deployment rather than ``ray.serve.llm``: that one loads adapters from cloud
URIs only, has no transformers backend, and builds prompts with a jinja template and vLLM's tool
parsers, where ours come from the training template (the exact token sequence training used).

    build_app("cfg.yaml", ["temperature=0"])              # a Serve Application for serve.run
    import_path: cluster.serve.app:app_builder            # the same from a Serve config YAML
      args: {config: /abs/cfg.yaml, overrides: [...]}

Each replica loads the model in ``__init__`` and answers on its event loop (ChatModel's async
API); the engine queues or batches concurrent requests itself.
"""

# No `from __future__ import annotations` here: FastAPI reads the route methods' annotations
# (``request: Request``), and newer FastAPI releases (0.165, what pip picks without the vllm
# extra) do not resolve string annotations on a Serve ingress class, which turns every request
# into a 400 for a missing "request" query parameter.
import asyncio
import hmac
import os
from typing import Any, AsyncIterator, Iterable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from stages.inference.chat_model import ChatInputError, ChatModel
from stages.inference.engine import PromptTooLong
from stages.inference.loading import InferenceSpec
from stages.inference.scoring import is_reward_output
from stages.value_head import VALUE_HEAD_FILE

from . import protocol as p

DEPLOYMENT = "ChatServer"

api = FastAPI(title="RayFactory OpenAI-compatible API")


@api.exception_handler(p.APIError)
async def _api_error(request: Request, exc: p.APIError):
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(RequestValidationError)  # FastAPI's own 422 format, answered as OpenAI's 400
async def _validation_error(request: Request, exc: RequestValidationError):
    return JSONResponse(p.error_body(str(exc.errors()[:1])), status_code=400)


@api.exception_handler(StarletteHTTPException)  # unknown paths, wrong methods
async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(p.error_body(str(exc.detail), kind), status_code=exc.status_code)


@api.exception_handler(Exception)  # a bug of ours: still OpenAI's body, so clients report it sensibly
async def _server_error(request: Request, exc: Exception):
    return JSONResponse(p.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)


def _choices(delta, tokenizer) -> list[dict]:
    """The chunk choices of one delta: its content (or tool calls), then the finish reason alone."""
    out = []
    logprobs = p.logprobs_content(delta.logprobs, tokenizer) if delta.logprobs else None
    if getattr(delta, "tool_calls", None):
        calls = [dict(c, index=i) for i, c in enumerate(delta.tool_calls)]
        out.append({"index": delta.index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None})
    elif delta.text or logprobs:
        out.append({"index": delta.index, "delta": {"content": delta.text}, "logprobs": logprobs, "finish_reason": None})
    if delta.finish_reason:
        out.append({"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": delta.finish_reason})
    return out


class _WholeDelta:
    """A whole reply shaped like a ChatDelta (the streamed answer to a request with tools)."""

    def __init__(self, response):
        self.index, self.finish_reason, self.logprobs = response.index, response.finish_reason, response.logprobs
        self.tokens = response.response_length
        self.tool_calls = p.tool_calls_payload(response) if response.tool_calls else None
        self.text = "" if self.tool_calls else response.response_text


async def _response_deltas(responses):
    for response in responses:
        yield _WholeDelta(response)


class _client_errors:
    """Client mistakes found while building or running a request become 400s (never 500s)."""

    def __init__(self, *extra: type[BaseException]):
        self.extra = extra

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, PromptTooLong):
            raise p.APIError(400, str(exc), param="messages", code="context_length_exceeded") from None
        if isinstance(exc, (ChatInputError, *self.extra)):
            raise p.APIError(400, str(exc), param="messages") from None
        return False


def _score_all(scorer, converted: list[tuple[list[dict], Optional[str]]]) -> list[float]:
    """One scorer call per system prompt (the scorer takes one system for a batch), in order."""
    scores: list[Optional[float]] = [None] * len(converted)
    for system in dict.fromkeys(s for _, s in converted):
        indices = [i for i, (_, s) in enumerate(converted) if s == system]
        for i, value in zip(indices, scorer.score([converted[i][0] for i in indices], system=system)):
            scores[i] = float(value)
    return scores


def _load_scorer(spec: InferenceSpec):
    from stages.inference.scoring import RewardScorer

    return RewardScorer(spec)


# Serve pickles the deployment class when the decorator runs: what it uses is defined above it.
@serve.deployment(name=DEPLOYMENT)
@serve.ingress(api)
class ChatServer:
    def __init__(self, spec: InferenceSpec, api_key: Optional[str] = None, with_scorer: bool = False):
        self.chat = ChatModel(spec)
        self.model_name = spec.model_name()
        self.adapter_models = list((spec.inference.lora_modules or {}).keys())
        self.api_key = api_key or None
        self.scorer = _load_scorer(spec) if with_scorer else None
        self._score_lock = asyncio.Lock()  # the scorer is a plain torch model: one batch at a time

    # --- routes ------------------------------------------------------------------------------

    @api.get("/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rayfactory"}
                                           for name in [self.model_name, *self.adapter_models]]}

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        self._authorize(request)
        body: p.ChatCompletionRequest = p.parse_body(await request.body(), p.ChatCompletionRequest)
        adapter = self._adapter(body.model)
        tools = p.tools_json(body)
        with _client_errors():
            messages, system = p.to_chat_inputs(body.messages)
            options = p.chat_options(body, adapter)
            if body.stream:
                return await self._stream(body, messages, system, tools, options)
            responses = await self.chat.agenerate(messages, system, tools, **options)
        return p.completion(responses, body.model, self.chat.tokenizer)

    @api.post("/v1/score")
    async def score(self, request: Request):
        """Reward-model scores of whole conversations (each ends on the assistant reply)."""
        self._authorize(request)
        body: p.ScoreRequest = p.parse_body(await request.body(), p.ScoreRequest)
        self._adapter(body.model)  # 404 for a name this server does not know
        if self.scorer is None:
            raise p.APIError(400, f"model {self.model_name!r} is not a reward model, so it cannot score: serve the "
                                  f"output of a stage: rm run (its folder holds {VALUE_HEAD_FILE}).", param="model")
        if body.model != self.model_name:
            raise p.APIError(400, f"scores come from the reward model {self.model_name!r}, not from adapter "
                                  f"{body.model!r}.", param="model")
        if (body.messages is None) == (body.conversations is None):
            raise p.APIError(400, "send either messages (one conversation) or conversations (a list of them).",
                             param="messages")
        conversations = [body.messages] if body.messages is not None else body.conversations
        with _client_errors(ValueError):
            converted = [p.to_chat_inputs(c) for c in conversations]
            async with self._score_lock:
                scores = await asyncio.to_thread(_score_all, self.scorer, converted)
        return {"object": "list", "model": body.model, "scores": scores,
                "data": [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)]}

    # --- helpers -----------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise p.APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <API key>'.",
                             type="authentication_error", code="invalid_api_key")

    def _adapter(self, model: str) -> Optional[str]:
        """The adapter a request's ``model`` selects (None: the default model)."""
        if model in self.adapter_models:
            return model
        if model == self.model_name:
            return None
        known = ", ".join(repr(m) for m in [self.model_name, *self.adapter_models])
        raise p.APIError(404, f"the model {model!r} does not exist here; this server has {known} (GET /v1/models).",
                         type="not_found_error", param="model", code="model_not_found")

    async def _stream(self, body: p.ChatCompletionRequest, messages, system, tools, options) -> StreamingResponse:
        cid, name = p.completion_id(), body.model
        if tools:  # tool calls are parsed from the whole reply: answer once, as chunks
            deltas = _response_deltas(await self.chat.agenerate(messages, system, tools, **options))
        else:
            deltas = self.chat.astream(messages, system, tools, **options)
        prompt_tokens = len(self.chat.prompt_ids(messages, system, tools))
        first = await deltas.__anext__()  # a too-long prompt fails here, before the 200 is sent
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            started, completion_tokens = set(), 0
            try:
                delta = first
                while True:
                    if delta.index not in started:
                        started.add(delta.index)
                        yield p.sse(p.chunk(cid, name, [{"index": delta.index, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}]))
                    completion_tokens += delta.tokens
                    for choice in _choices(delta, self.chat.tokenizer):
                        yield p.sse(p.chunk(cid, name, [choice]))
                    try:
                        delta = await deltas.__anext__()
                    except StopAsyncIteration:
                        break
                if include_usage:
                    yield p.sse(p.chunk(cid, name, [], p.usage(prompt_tokens, completion_tokens)))
            except (ChatInputError, PromptTooLong) as exc:  # after the 200: the error goes in the stream
                yield p.sse(p.error_body(str(exc)))
            finally:
                await deltas.aclose()
            yield p.sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")


# --- building the application ----------------------------------------------------------------

def deployment_options(serve_args) -> dict[str, Any]:
    """Serve deployment options from the config's serve keys."""
    resources = dict(serve_args.serve_replica_resources or {})
    actor: dict[str, Any] = {"num_cpus": resources.pop("CPU", 1)}
    if resources.get("GPU"):
        actor["num_gpus"] = resources.pop("GPU")
    resources.pop("GPU", None)
    if resources:
        actor["resources"] = resources
    options: dict[str, Any] = {"max_ongoing_requests": serve_args.serve_max_ongoing_requests, "ray_actor_options": actor}
    if serve_args.serve_autoscaling:
        options["autoscaling_config"] = dict(serve_args.serve_autoscaling)
    else:
        options["num_replicas"] = serve_args.serve_num_replicas
    return options


def needs_scorer(cfg) -> bool:
    """A reward model: trained by stage rm, or its folder carries a value head."""
    return cfg.finetuning.stage == "rm" or is_reward_output(cfg.inference_spec().output_folder)


def resolve_api_key(cfg) -> Optional[str]:
    return os.environ.get("API_KEY") or cfg.serve.api_key or None


def build_app(config, overrides: Iterable[str] = (), api_key: Optional[str] = None):
    """The Serve application for a config (a RunConfig, a YAML path or a dict of keys)."""
    from ..config import RunConfig, load_config

    cfg = config if isinstance(config, RunConfig) else load_config(config, list(overrides), purpose="infer")
    key = api_key if api_key is not None else resolve_api_key(cfg)
    return ChatServer.options(**deployment_options(cfg.serve)).bind(cfg.inference_spec(), key, needs_scorer(cfg))


def app_builder(args: dict[str, Any]):
    """The Serve import path ``cluster.serve.app:app_builder``: args {"config": path, "overrides": [...]}."""
    if not isinstance(args, dict) or not args.get("config"):
        raise ValueError("cluster.serve.app:app_builder needs args: {config: /path/to/cfg.yaml, overrides: [...]}.")
    return build_app(args["config"], args.get("overrides") or [])
