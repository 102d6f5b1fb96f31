"""ChatModel: talk to a trained output (LLaMA-Factory's Python API, on our registries).

    chat = ChatModel(spec)                     # or cluster.api.ChatModel({...} / "cfg.yaml")
    chat.chat([{"role": "user", "content": "Hi"}])[0].response_text
    for piece in chat.stream_chat(messages): print(piece, end="")

Prompts are built by the training template (``template.encode_oneturn``; for a vision template,
``chat.chat(messages, images=[...])`` with one ``<image>`` per image, expanded by its vision plugin
as in training), replies decoded by the training tokenizer; the engine (transformers or vLLM) only
maps token ids to token ids. The sync methods run the async ones on a private event loop thread;
servers call the async ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Iterator, Optional

from registries.errors import UserError
from registries.templates.tools import FunctionCall
from registries.tokenize.vision import image_token_id

from ..engines.types import Engine, GenerationRequest, SamplingSpec
from .loading import InferenceSpec, load_hf_model, load_tokenizer_and_template
from .vision_inputs import expand_images

# LLaMA-Factory's per-call generation keys, plus the OpenAI-style ones a server passes.
_END = object()  # the last item of a sync stream
STOP_WAIT_S = 60  # how long a cancelled reply may take to let go of the engine
GENERATION_KEYS = ("do_sample", "temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty", "seed")


class ChatInputError(UserError):
    """A conversation or setting a caller got wrong (servers answer it with a 400)."""


@dataclass(frozen=True)
class TokenLogprob:
    """log p of a generated token under the unmodified model (log_softmax of the raw logits),
    and the ``top`` most likely tokens at that step (token id -> log p), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Response:
    """One reply (LLaMA-Factory's fields first)."""

    response_text: str
    response_length: int  # tokens generated
    prompt_length: int
    finish_reason: str  # "stop", "length" or "tool_calls"
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprob]] = None
    tool_calls: list[FunctionCall] = field(default_factory=list)


@dataclass
class ChatDelta:
    """New text of reply ``index``; the last delta of a reply has ``finish_reason``."""

    index: int
    text: str
    finish_reason: Optional[str] = None
    logprobs: Optional[list[TokenLogprob]] = None
    tokens: int = 0  # tokens behind this delta


class ChatModel:
    def __init__(self, spec: InferenceSpec, engine: Engine | None = None):
        self.spec = spec
        self.tokenizer, self.template = load_tokenizer_and_template(spec)
        self.engine = engine or build_engine(spec, self.tokenizer, self.template)
        self.stop_token_ids = tuple(self.template.stop_token_ids(self.tokenizer))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._plain_template = None  # the template with escaping off, for image prompts (encode_prompt)

    @property
    def adapters(self) -> tuple[str, ...]:
        return self.engine.adapters

    # --- building a request ----------------------------------------------------------------

    def prompt_ids(self, messages: list[dict], system: str | None = None, tools: str | None = None,
                   images=None) -> list[int]:
        """Token ids of the conversation up to the assistant's next turn, as training encodes it
        (``images``: one per ``<image>`` in the messages, expanded into the model's vision tokens)."""
        return self.encode_prompt(messages, system, tools, images)[0]

    def encode_prompt(self, messages: list[dict], system=None, tools=None, images=None) -> tuple[list[int], Optional[dict]]:
        """(prompt ids, the image processor's tensors or None). Images are paths, bytes or PIL
        images; the template's vision plugin expands each ``<image>`` exactly as the sft stage does."""
        if not messages or not isinstance(messages, list):
            raise ChatInputError("messages must be a non-empty list of {role, content} turns ending on a user turn.")
        template, mm = self.template, None
        if images:
            try:
                messages, mm = expand_images(self.template, list(messages), list(images), self.spec.data,
                                             escape=self.template.escape_special_tokens)
            except UserError as exc:  # a text template, a placeholder count that does not match, a broken image
                raise ChatInputError(str(exc)) from None
            # The caller's text is already marked (CallerText spans that leave the image tokens out).
            template = self._unescaped_template()
        try:
            ids = template.encode_oneturn(
                self.tokenizer, list(messages) + [{"role": "assistant", "content": ""}], system, tools
            )[0]
        except ValueError as exc:  # the template's own checks: roles out of order, bad tool JSON
            raise ChatInputError(str(exc)) from None
        if mm:
            # The forward reads which ids are image tokens (Qwen2-VL's multimodal positions, Gemma 3's
            # bidirectional attention within an image); without it generate() quietly treats them as
            # text, unlike training's collators, whose rule this is.
            import torch

            from ..training.vision_collators import image_token_marks

            image_id = image_token_id(self.tokenizer, self.template)
            mm = {**mm, **image_token_marks(self.engine.model, torch.tensor([ids]), image_id)}
        return ids, mm

    def _unescaped_template(self):
        if self._plain_template is None:
            self._plain_template = dataclasses.replace(self.template, escape_special_tokens=False)
        return self._plain_template

    def sampling(self, **settings: Any) -> SamplingSpec:
        """The config's generation settings with per-call overrides (None means: the config's).
        ``do_sample: false`` or temperature 0 means greedy, as OpenAI clients use it."""
        gen = self.spec.generating
        values = {"do_sample": gen.do_sample, "temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k,
                  "max_new_tokens": gen.max_new_tokens, "repetition_penalty": gen.repetition_penalty, "seed": None}
        unknown = set(settings) - set(GENERATION_KEYS)
        if unknown:
            raise ChatInputError(f"unknown generation setting(s) {sorted(unknown)}; known: {', '.join(GENERATION_KEYS)}.")
        values.update({k: v for k, v in settings.items() if v is not None})
        if values["max_new_tokens"] < 1:
            raise ChatInputError(f"max_new_tokens must be at least 1, got {values['max_new_tokens']}.")
        greedy = not values.pop("do_sample") or values["temperature"] is None or values["temperature"] <= 0
        return SamplingSpec(
            temperature=0.0 if greedy else values["temperature"], top_p=values["top_p"], top_k=values["top_k"],
            repetition_penalty=values["repetition_penalty"], max_tokens=values["max_new_tokens"],
            stop_token_ids=self.stop_token_ids, seed=values["seed"], logprobs=None,
        )

    def request(self, messages, system=None, tools=None, *, adapter=None, n=1, stop=(), logprobs=None,
                images=None, ignore_eos=False, **settings) -> GenerationRequest:
        """``ignore_eos`` (vLLM's name): no stop token ends the reply, only max_new_tokens or a stop string."""
        if adapter is not None and adapter not in self.engine.adapters:
            raise ChatInputError(f"unknown adapter {adapter!r}; this model has {list(self.engine.adapters) or 'none'}.")
        if n < 1:
            raise ChatInputError(f"n must be at least 1, got {n}.")
        if images and self.engine.name != "huggingface":
            raise ChatInputError(f"the {self.engine.name} engine here takes no images; set infer_backend: huggingface "
                                 "to chat with a vision-language model about images.")
        sampling = replace(self.sampling(**settings), n=n, stop_strings=tuple(stop or ()), logprobs=logprobs)
        if ignore_eos:
            sampling = replace(sampling, stop_token_ids=())
        ids, mm = self.encode_prompt(messages, system, tools, images)
        return GenerationRequest(tuple(ids), sampling, adapter, mm)

    # --- async API (servers) ---------------------------------------------------------------

    async def arequest(self, messages, system=None, tools=None, **options) -> GenerationRequest:
        """``request`` off the event loop: tokenizing a long prompt there would hold every other
        request the server is answering (and its health check)."""
        return await asyncio.to_thread(self.request, messages, system, tools, **options)

    async def agenerate(self, messages, system=None, tools=None, **options) -> list[Response]:
        """Every reply whole: ``n`` of them, text cut at the first stop string, tool calls parsed."""
        return await self.generate_request(await self.arequest(messages, system, tools, **options), tools)

    async def astream(self, messages, system=None, tools=None, **options) -> AsyncIterator[ChatDelta]:
        async for delta in self.stream_request(await self.arequest(messages, system, tools, **options)):
            yield delta

    async def generate_request(self, request: GenerationRequest, tools=None) -> list[Response]:
        """The whole replies to a request built by ``arequest`` (tools: to parse the replies' calls)."""
        replies = {i: _Reply(self, request, i) for i in range(request.sampling.n)}
        async for _ in self._deltas(request, replies):
            pass
        return [replies[i].response(tools) for i in range(request.sampling.n)]

    async def stream_request(self, request: GenerationRequest) -> AsyncIterator[ChatDelta]:
        replies = {i: _Reply(self, request, i) for i in range(request.sampling.n)}
        async for delta in self._deltas(request, replies):
            yield delta

    async def _deltas(self, request: GenerationRequest, replies: dict[int, "_Reply"]) -> AsyncIterator[ChatDelta]:
        stream = self.engine.stream(request)
        try:
            async for step in stream:
                # Decoding and stop-string scanning in a thread: the event loop stays free for other requests.
                delta = await asyncio.to_thread(replies[step.index].add, step)
                if delta is not None:
                    yield delta
                if all(r.finish_reason for r in replies.values()):
                    break  # every reply ended (a stop string may end one before the engine does)
        finally:
            await stream.aclose()

    async def achat(self, messages, system=None, tools=None, **options) -> list[Response]:
        return await self.agenerate(messages, system, tools, **options)

    async def astream_chat(self, messages, system=None, tools=None, **options) -> AsyncIterator[str]:
        async for delta in self.astream(messages, system, tools, **options):
            if delta.text:
                yield delta.text

    # --- sync API (scripts, the terminal chat) ---------------------------------------------

    def chat(self, messages, system=None, tools=None, **options) -> list[Response]:
        return self._run(self.agenerate(messages, system, tools, **options))

    def batch_chat(self, conversations: list[list[dict]], system=None, tools=None, **options) -> list[list[Response]]:
        """Many conversations at once (the engine batches what it can)."""

        async def all_of_them():
            return await asyncio.gather(*(self.agenerate(c, system, tools, **options) for c in conversations))

        return self._run(all_of_them())

    def complete_all(self, requests: list[GenerationRequest]) -> list[str]:
        """The first reply's text (stop strings applied) for each of many prepared requests (evaluations)."""

        async def all_of_them():
            return await asyncio.gather(*(self.generate_request(request) for request in requests))

        return [replies[0].response_text for replies in self._run(all_of_them())]

    def score(self, sequences: list[tuple[int, ...]], batch_size: int = 8) -> dict[tuple[int, ...], list]:
        """Engine.score of each sequence, keyed by the sequence: (log-prob, greedy) of its tokens after the first."""
        scored = self._run(self.engine.score(sequences, batch_size))
        return dict(zip(sequences, scored))

    def stream_chat(self, messages, system=None, tools=None, **options) -> Iterator[str]:
        """Text pieces as they come. Interruptible: when the caller stops reading (Ctrl-C, a break,
        an error), the reply is cancelled and this waits until the engine has let go of it, so the
        next request does not queue behind a reply nobody reads."""
        return self._iterate(self.astream_chat(messages, system, tools, **options))

    def stream_deltas(self, request: GenerationRequest) -> Iterator[ChatDelta]:
        """``stream_request`` for a sync caller (the web UI's Chat tab): each delta with its token
        count and, last, the finish reason; closing the iterator cancels the reply, as in stream_chat."""
        return self._iterate(self.stream_request(request))

    def _iterate(self, stream: AsyncIterator) -> Iterator:
        """The items of an async stream, produced on this model's loop, read from this thread."""
        pieces: queue.Queue = queue.Queue()

        async def produce():
            try:
                async for item in stream:
                    pieces.put(item)
            except BaseException as exc:  # noqa: BLE001 (re-raised in the reading thread)
                pieces.put(exc)
            finally:
                pieces.put(_END)

        self._ensure_loop()
        task = asyncio.run_coroutine_threadsafe(produce(), self._loop)
        finished = False
        try:
            while (item := pieces.get()) is not _END:
                if isinstance(item, BaseException):
                    finished = True
                    if not isinstance(item, asyncio.CancelledError):
                        raise item
                    return
                yield item
            finished = True
        finally:
            if not finished:
                task.cancel()
                _drain(pieces, STOP_WAIT_S)

    def close(self) -> None:
        if self._loop is not None:
            self._run(self.engine.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        else:
            asyncio.run(self.engine.close())

    def _run(self, coro):
        self._ensure_loop()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _ensure_loop(self) -> None:
        # One loop for the sync API, for the model's lifetime: engines bind to the loop they first run on.
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="chat-model-loop", daemon=True).start()


def _drain(pieces: queue.Queue, timeout: float) -> None:
    """Wait for a cancelled reply's producer to end (the engine stops at its next token); a second
    Ctrl-C, or the timeout, stops waiting."""
    try:
        while pieces.get(timeout=timeout) is not _END:
            pass
    except (queue.Empty, KeyboardInterrupt):
        pass


class _Reply:
    """One reply as it grows: its tokens, the text decoded so far, stop strings applied."""

    def __init__(self, chat: ChatModel, request: GenerationRequest, index: int):
        self.chat, self.request, self.index = chat, request, index
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[TokenLogprob]] = [] if request.sampling.logprobs is not None else None
        self.text = ""  # what has been handed out
        self.finish_reason: Optional[str] = None
        self.stop_ids = set(request.sampling.stop_token_ids)
        self.skip_special = chat.spec.generating.skip_special_tokens
        self.reported = 0  # tokens handed out in deltas (held-back steps join the next delta)

    def add(self, step) -> Optional[ChatDelta]:
        if self.finish_reason:
            return None
        self.token_ids += step.token_ids
        if self.logprobs is not None and step.logprobs:
            top = step.top_logprobs or [()] * len(step.logprobs)
            self.logprobs += [TokenLogprob(t, lp, pairs) for t, lp, pairs in zip(step.token_ids, step.logprobs, top)]
        content = [t for t in self.token_ids if t not in self.stop_ids]
        full = self.chat.tokenizer.decode(content, skip_special_tokens=self.skip_special)
        reason = step.finish_reason
        cut = _first_stop(full, self.request.sampling.stop_strings)
        if cut is not None:
            full, reason = full[:cut], "stop"
        elif reason is None:
            # Hold back an unfinished character and anything that may begin a stop string.
            full = full[: len(full) - _held_back(full, self.request.sampling.stop_strings)]
        new = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += new
        self.finish_reason = reason
        if not new and reason is None:
            return None
        start, self.reported = self.reported, len(self.token_ids)
        logprobs = self.logprobs[start:] if self.logprobs is not None else None
        return ChatDelta(step.index, new, reason, logprobs, self.reported - start)

    def response(self, tools) -> Response:
        calls: list[FunctionCall] = []
        reason = self.finish_reason or "stop"
        if tools:
            extracted = self.chat.template.extract_tool_calls(self.text)
            if isinstance(extracted, list) and extracted:
                calls, reason = extracted, "tool_calls"
        return Response(self.text, len(self.token_ids), len(self.request.prompt_ids), reason,
                        self.index, list(self.token_ids), self.logprobs, calls)


def _first_stop(text: str, stops: tuple[str, ...]) -> Optional[int]:
    found = [i for i in (text.find(s) for s in stops if s) if i != -1]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    if text.endswith("\ufffd"):  # a multi-byte character whose remaining bytes are still to come
        return 1
    for size in range(min(len(text), max((len(s) for s in stops), default=0)), 0, -1):
        if any(s.startswith(text[-size:]) for s in stops):
            return size
    return 0


def build_engine(spec: InferenceSpec, tokenizer, template) -> Engine:
    """The configured engine over the spec's model and adapters."""
    backend = spec.inference.infer_backend
    if backend == "vllm":
        from .vllm_setup import build_vllm_engine

        return build_vllm_engine(spec, tokenizer)
    from ..engines.hf_backend import HFEngine

    model, adapters, default = load_hf_model(spec, tokenizer)
    limit = getattr(model.config, "max_position_embeddings", None) or spec.inference.vllm_maxlen
    return HFEngine(model, tokenizer.pad_token_id, min(limit, spec.inference.vllm_maxlen), adapters, default)
