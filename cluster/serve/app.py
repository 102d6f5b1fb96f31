"""The OpenAI-compatible Serve application: one deployment = FastAPI ingress + a ChatModel.

We serve our own deployment rather than ``ray.serve.llm``: that one loads adapters from cloud
URIs only, has no transformers backend, and builds prompts with a jinja template and vLLM's tool
parsers, where ours come from the training template (the exact token sequence training used).

    build_app("cfg.yaml", ["temperature=0"])              # a Serve Application for serve.run
    import_path: cluster.serve.app:app_builder            # the same from a Serve config YAML
      args: {config: /abs/cfg.yaml, overrides: [...]}

Each replica loads the model in ``__init__`` and answers on its event loop (ChatModel's async
API); the engine batches concurrent requests (vLLM) or has them take turns (transformers). Who
may call, how many wait and for how long: admission.py.
"""

# No `from __future__ import annotations` here: FastAPI reads the route methods' annotations
# (``request: Request``), and newer FastAPI releases (0.165, what pip picks without the vllm
# extra) do not resolve string annotations on a Serve ingress class, which turns every request
# into a 400 for a missing "request" query parameter.
import asyncio
import hmac
from typing import Any, AsyncIterator, Awaitable, Iterable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from stages.inference.chat_model import ChatInputError, ChatModel
from stages.engines.types import PromptTooLong, check_prompt_fits
from stages.inference.loading import InferenceSpec
from stages.inference.scoring import is_reward_output
from stages.training.value_head import VALUE_HEAD_FILE

from . import protocol as p
from .admission import Admission, TimeBudget, allowed_hosts, check_host
from .images import decode_image_url
from .streams import EventStream
from cluster.serve.serve_args import RequestLimits, ServeArguments, resolve_api_key

DEPLOYMENT = "ChatServer"

# /docs and /openapi.json are off: they would answer without the API key (and the page loads its
# scripts from a CDN). serve_docs: true turns them on, for a server on a trusted network.
api = FastAPI(title="RayFactory OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(p.APIError)
async def _api_error(request: Request, exc: p.APIError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


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
    def __init__(self, spec: InferenceSpec, api_key: Optional[str] = None, with_scorer: bool = False,
                 limits: Optional[RequestLimits] = None, docs: bool = False, hosts: Iterable[str] = ()):
        self.chat = ChatModel(spec)
        self.model_name = spec.model_name()
        self.adapter_models = list((spec.inference.lora_modules or {}).keys())
        self.api_key = api_key or None
        self.hosts = allowed_hosts("", hosts)  # what Host may name when there is no key (loopback and these)
        self.limits = limits or ServeArguments().request_limits()
        turns = getattr(self.chat.engine, "turns", None)  # the transformers engine's; vLLM batches instead
        if turns is not None:
            turns.turn_s = self.limits.turn_s
        self.admission = Admission(self.limits.max_waiting if turns is not None else None)
        self.scorer = _load_scorer(spec) if with_scorer else None
        self._score_lock = asyncio.Lock()  # the scorer is a plain torch model: one batch at a time
        self.docs = docs

    # --- routes ------------------------------------------------------------------------------

    @api.get("/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self):
        self._docs_on()
        return api.openapi()

    @api.get("/docs", include_in_schema=False)
    async def docs_page(self):
        from fastapi.openapi.docs import get_swagger_ui_html

        self._docs_on()
        return get_swagger_ui_html(openapi_url="/openapi.json", title=api.title)

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rayfactory"}
                                           for name in [self.model_name, *self.adapter_models]]}

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        budget = TimeBudget(self.limits.timeout_s)  # from arrival: waiting for the engine counts
        self._authorize(request)
        body: p.ChatCompletionRequest = await self._body(request, p.ChatCompletionRequest)
        adapter = self._adapter(body.model)
        body.check_limits(self.limits)
        tools = p.tools_json(body)
        images = await self._images(body)
        with _client_errors():
            messages, system = p.to_chat_inputs(body.messages)
            prepared = await self.chat.arequest(messages, system, tools, images=images,
                                                **p.chat_options(body, adapter))
            self._check_room(prepared, body.max_completion_tokens or body.max_tokens)
            slot = self.admission.admit()
            if body.stream:
                return self._stream(body, prepared, tools, budget, slot)
            with slot:
                responses = await self._within_budget(budget, self.chat.generate_request(prepared, tools))
        return p.completion(responses, body.model, self.chat.tokenizer)

    @api.post("/v1/score")
    async def score(self, request: Request):
        """Reward-model scores of whole conversations (each ends on the assistant reply)."""
        budget = TimeBudget(self.limits.timeout_s)
        self._authorize(request)
        body: p.ScoreRequest = await self._body(request, p.ScoreRequest)
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
        if any(m.image_urls() for c in conversations for m in c):
            raise p.APIError(400, "/v1/score takes text only: the reward model reads no images.", param="messages")
        with _client_errors(ValueError):
            converted = [p.to_chat_inputs(c, ends_on_reply=True) for c in conversations]
            scores = await self._within_budget(budget, self._score(converted))
        return {"object": "list", "model": body.model, "scores": scores,
                "data": [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)]}

    # --- helpers -----------------------------------------------------------------------------

    async def _score(self, converted) -> list[float]:
        async with self._score_lock:
            return await asyncio.to_thread(_score_all, self.scorer, converted)

    def _authorize(self, request: Request) -> None:
        """The API key, or without one the Host header (admission.py)."""
        if self.api_key is None:
            check_host(request, self.hosts)
            return
        header = dict(request.headers.raw).get(b"authorization", b"")  # bytes: any header compares, none raises
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key.encode()):
            raise p.APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <API key>'.",
                             type="authentication_error", code="invalid_api_key")

    def _docs_on(self) -> None:
        if not self.docs:
            raise p.APIError(404, "the API's /docs and /openapi.json are off on this server (serve_docs: true turns "
                                  "them on).", type="not_found_error")

    async def _body(self, request: Request, model):
        """The body, read up to serve_max_request_bytes (413 past it), parsed off the event loop."""
        limit = self.limits.max_request_bytes
        declared = request.headers.get("content-length", "")
        too_big = p.APIError(413, f"the request body is over this server's limit of {limit} bytes "
                                  "(serve_max_request_bytes); send a shorter conversation.", code="request_too_large")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > limit:
                raise too_big
        return await asyncio.to_thread(p.parse_body, bytes(raw), model)

    async def _images(self, body: p.ChatCompletionRequest) -> Optional[list]:
        """The request's pictures, decoded off the event loop (None: a text request). A text model,
        or an image anywhere but a user message, is a 400 before anything is decoded."""
        found = body.image_urls()
        if not found:
            return None
        template = self.chat.template
        if getattr(template, "mm_plugin", None) is None:
            raise p.APIError(400, f"messages[{found[0][0]}].content holds an image_url part, but model "
                                  f"{self.model_name!r} takes no images (its template {template.name!r} has no vision "
                                  "plugin): this server takes text parts only.", param="messages",
                             code="images_not_supported")
        for index, _ in found:
            if body.messages[index].role != "user":
                raise p.APIError(400, f"messages[{index}] is a {body.messages[index].role} message with an image; "
                                      "images go in user messages.", param="messages")
        return await asyncio.to_thread(
            lambda: [decode_image_url(url, f"messages[{i}].content", self.limits) for i, url in found])

    def _adapter(self, model: str) -> Optional[str]:
        """The adapter a request's ``model`` selects (None: the default model)."""
        if model in self.adapter_models:
            return model
        if model == self.model_name:
            return None
        known = ", ".join(repr(m) for m in [self.model_name, *self.adapter_models])
        raise p.APIError(404, f"the model {model!r} does not exist here; this server has {known} (GET /v1/models).",
                         type="not_found_error", param="model", code="model_not_found")

    def _check_room(self, prepared, asked: Optional[int]) -> None:
        """The prompt, and the reply length the client asked for, against the context window (400s)."""
        window = self.chat.engine.max_model_len
        check_prompt_fits(prepared.prompt_ids, prepared.sampling, window)  # the prompt alone leaves room for a reply, or PromptTooLong
        if asked is not None and len(prepared.prompt_ids) + asked > window:
            raise p.APIError(400, f"the model's context window is {window} tokens, but {len(prepared.prompt_ids) + asked} "
                                  f"were asked for ({len(prepared.prompt_ids)} in the messages, {asked} in the reply). "
                                  "Lower max_tokens or shorten the messages.", param="max_tokens",
                             code="context_length_exceeded")

    async def _within_budget(self, budget: TimeBudget, work: Awaitable):
        """``work`` stopped with a 408 at the request's budget, so one request cannot hold a replica."""
        try:
            async with budget:
                return await work
        except TimeoutError:
            raise p.APIError(408, self._timeout_message(), code="timeout") from None

    def _timeout_message(self) -> str:
        return (f"the request ran past this server's time budget of {self.limits.timeout_s:g} s "
                "(serve_request_timeout_s, counted from its arrival, waiting included) and was stopped; ask for "
                "fewer tokens (max_tokens) or fewer choices (n), or retry when the server is less busy.")

    def _stream(self, body: p.ChatCompletionRequest, prepared, tools, budget: TimeBudget, slot) -> EventStream:
        cid, name = p.completion_id(), body.model
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def deltas():
            if tools:  # tool calls are parsed from the whole reply: answer once, as chunks
                for response in await self.chat.generate_request(prepared, tools):
                    yield _WholeDelta(response)
            else:
                async for delta in self.chat.stream_request(prepared):
                    yield delta

        async def events() -> AsyncIterator[str]:
            started, completion_tokens = set(), 0
            source = deltas()
            try:
                async with budget:  # counted from the request's arrival, for the whole reply
                    async for delta in source:
                        if delta.index not in started:
                            started.add(delta.index)
                            yield p.sse(p.chunk(cid, name, [{"index": delta.index, "delta": {"role": "assistant",
                                        "content": ""}, "logprobs": None, "finish_reason": None}]))
                        completion_tokens += delta.tokens
                        for choice in _choices(delta, self.chat.tokenizer):
                            yield p.sse(p.chunk(cid, name, [choice]))
                if include_usage:
                    yield p.sse(p.chunk(cid, name, [], p.usage(len(prepared.prompt_ids), completion_tokens)))
            except TimeoutError:  # after the 200: the error goes in the stream
                yield p.sse(p.error_body(self._timeout_message(), code="timeout"))
            except (ChatInputError, PromptTooLong) as exc:
                yield p.sse(p.error_body(str(exc)))
            finally:
                await source.aclose()
                slot.release()
            yield p.sse("[DONE]")

        return EventStream(events(), media_type="text/event-stream")


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
    """A reward model: trained by a stage that scores (rm), or its folder carries a value head."""
    return cfg.finetuning.spec.scores or is_reward_output(cfg.inference_spec().output_folder)


def build_app(config, overrides: Iterable[str] = (), api_key: Optional[str] = None):
    """The Serve application for a config (a RunConfig, a YAML path or a dict of keys)."""
    from ..config import RunConfig, load_config

    cfg = config if isinstance(config, RunConfig) else load_config(config, list(overrides), purpose="infer")
    key = api_key if api_key is not None else resolve_api_key(cfg)
    hosts = allowed_hosts(cfg.serve.api_host, cfg.serve.serve_allow_hosts)
    return ChatServer.options(**deployment_options(cfg.serve)).bind(
        cfg.inference_spec(), key, needs_scorer(cfg), cfg.serve.request_limits(), cfg.serve.serve_docs, hosts)


def app_builder(args: dict[str, Any]):
    """The Serve import path ``cluster.serve.app:app_builder``: args {"config": path, "overrides": [...]}."""
    if not isinstance(args, dict) or not args.get("config"):
        raise ValueError("cluster.serve.app:app_builder needs args: {config: /path/to/cfg.yaml, overrides: [...]}.")
    return build_app(args["config"], args.get("overrides") or [])
