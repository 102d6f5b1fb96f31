"""The transformers engine: ``model.generate`` in a thread, any model transformers loads.

One generation runs at a time per engine (adapters are switched per request on a shared
PeftModel, which is not safe to do concurrently); requests queue on an asyncio lock. Each step's
tokens and raw log-probs are observed as they are produced (a streamer plus a forward hook on the
output embedding, which sees the logits before any temperature or top-k), so streaming and
non-streaming calls are the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import AsyncIterator

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from .engine import (
    DecodingParams,
    Generated,
    GenerationRequest,
    StreamDelta,
    TokenLogprob,
    check_prompt_fits,
    collect,
)

_DONE = object()


class HFEngine:
    name = "huggingface"

    def __init__(self, model, pad_token_id: int, max_model_len: int, adapters: tuple[str, ...] = (),
                 default_adapter: str | None = None):
        """``model``: a causal LM, or a PeftModel whose named adapters are ``adapters``;
        ``default_adapter`` is active when a request names none."""
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len
        self.adapters = tuple(adapters)
        self.default_adapter = default_adapter
        self._lock = asyncio.Lock()

    async def generate(self, request: GenerationRequest) -> list[Generated]:
        return await collect(self.stream(request), request)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        budget = check_prompt_fits(request, self.max_model_len)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def emit(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        async with self._lock:
            worker = loop.run_in_executor(None, self._run, request, budget, emit, cancel)
            try:
                while True:
                    item = await queue.get()
                    if item is _DONE:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                cancel.set()  # a consumer that stops reading (stop string, client gone) ends the generation
                await worker

    async def close(self) -> None:
        return None

    # --- the generation thread -------------------------------------------------------------

    def _run(self, request: GenerationRequest, budget: int, emit, cancel: threading.Event) -> None:
        try:
            active = self._select_adapter(request.adapter)
            observer = _StepObserver(request, budget, emit, cancel)
            handle = None
            if request.logprobs is not None:
                head = self.model.get_output_embeddings()
                handle = head.register_forward_hook(lambda _m, _i, out: observer.see_logits(out))
            try:
                with torch.no_grad(), active:
                    self.model.generate(
                        input_ids=torch.tensor([list(request.prompt_ids)], device=self.model.device),
                        attention_mask=torch.ones(1, len(request.prompt_ids), dtype=torch.long, device=self.model.device),
                        max_new_tokens=budget,
                        # greedy replies are all the same: generate one, hand it out n times
                        num_return_sequences=request.n if request.params.do_sample else 1,
                        eos_token_id=list(request.params.stop_token_ids) or None,
                        pad_token_id=self.pad_token_id,
                        streamer=observer,
                        stopping_criteria=StoppingCriteriaList([_Cancelled(cancel)]),
                        **_sampling_kwargs(request.params),
                    )
            finally:
                if handle is not None:
                    handle.remove()
            observer.finish()
        except BaseException as exc:  # noqa: BLE001 (handed to the awaiting coroutine)
            emit(exc)
        emit(_DONE)

    def _select_adapter(self, name: str | None):
        """Activate the request's adapter; the context to generate in (adapters off for the bare base)."""
        name = name or self.default_adapter
        if name is None:
            return self.model.disable_adapter() if self.adapters else contextlib.nullcontext()
        if name not in self.adapters:
            raise KeyError(f"unknown adapter {name!r}; this engine has {list(self.adapters)}")
        self.model.set_adapter(name)
        return contextlib.nullcontext()


def _sampling_kwargs(params: DecodingParams) -> dict:
    kwargs = {"repetition_penalty": params.repetition_penalty}
    if params.seed is not None:
        torch.manual_seed(params.seed)
    if not params.do_sample:
        return {**kwargs, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {**kwargs, "do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k or None}


class _StepObserver:
    """A transformers streamer: receives each step's tokens (one per reply) and turns them into
    StreamDeltas; a reply ends at its first stop token or at the budget."""

    def __init__(self, request: GenerationRequest, budget: int, emit, cancel: threading.Event):
        self.request, self.budget, self.emit, self.cancel = request, budget, emit, cancel
        self.stop_ids = set(request.params.stop_token_ids)
        self.lengths = [0] * request.n
        self.finished = [False] * request.n
        self.seen_prompt = False
        self.step_logprobs: torch.Tensor | None = None

    def see_logits(self, logits: torch.Tensor) -> None:
        self.step_logprobs = logits[:, -1, :].float().log_softmax(-1).cpu()

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:  # generate() first hands over the prompt itself
            self.seen_prompt = True
            return
        tokens = value.reshape(-1).tolist()
        if len(tokens) < self.request.n:  # greedy: one row stands for every reply
            tokens = tokens * self.request.n
        rows = len(value.reshape(-1))
        for index, token in enumerate(tokens):
            if self.finished[index]:
                continue
            self.lengths[index] += 1
            reason = "stop" if token in self.stop_ids else "length" if self.lengths[index] >= self.budget else None
            self.finished[index] = reason is not None
            logprobs = None
            if self.request.logprobs is not None and self.step_logprobs is not None:
                logprobs = [_token_logprob(self.step_logprobs[index % rows], token, self.request.logprobs)]
            self.emit(StreamDelta([token], logprobs, reason, index))

    def end(self) -> None:
        pass

    def finish(self) -> None:
        """Replies still open when generate() returned (cancelled) end as "stop"."""
        for index, done in enumerate(self.finished):
            if not done:
                self.finished[index] = True
                self.emit(StreamDelta([], None, "stop", index))



class _Cancelled(StoppingCriteria):
    """Ends generate() once the consumer has stopped reading."""

    def __init__(self, cancel: threading.Event):
        self.cancel = cancel

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.cancel.is_set(), dtype=torch.bool, device=input_ids.device)


def _token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    best = torch.topk(logprobs, top) if top > 0 else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(logprobs[token]), pairs)
