"""The transformers engine: ``model.generate`` on any model transformers loads.

Two ways in, one model:
* ``generate_batch`` (rollouts, evaluations): many prompts, left-padded into batches, n samples
  each; the raw log-prob of every sampled token comes from ``output_logits``. Inside an RL policy
  worker this samples from the very weights being trained, so it needs no weight sync at all.
* ``stream`` / ``generate`` (chat, serve, predict): each request's ``generate`` in a thread of
  its own; the requests take turns on the model, ``turn_s`` seconds each while others wait, so a
  short request is not held behind a long reply (hf_turns.py: what a turn sets up and takes down
  on the shared model, such as the request's adapter). Each step's tokens and raw log-probs are
  observed as they are produced (a streamer plus a forward hook on the output embedding, which
  sees the logits before any temperature or top-k), so streaming and whole replies are the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import AsyncIterator

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from .hf_turns import TURN_S, Abandoned, Turn, Turns
from .types import Completion, GenerationRequest, SamplingSpec, StreamDelta, check_prompt_fits, collect, cut_at_stop

_DONE = object()


class HFEngine:
    name = "huggingface"

    def __init__(self, model, pad_token_id: int, max_model_len: int | None = None, adapters: tuple[str, ...] = (),
                 default_adapter: str | None = None, turn_s: float = TURN_S):
        """``model``: a causal LM, or a PeftModel whose named adapters are ``adapters``;
        ``default_adapter`` is active when a request names none. ``max_model_len``: the context
        window requests must fit (None: the model's positions). ``turn_s``: how long a request
        generates while others wait (``turns.turn_s`` may change it later)."""
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len or getattr(model.config, "max_position_embeddings", None) or 2**31
        self.adapters = tuple(adapters)
        self.default_adapter = default_adapter
        self.turns = Turns(turn_s)

    # --- rollouts: many prompts at once ------------------------------------------------------

    @torch.no_grad()
    def generate_batch(self, prompt_ids: list[list[int]], sampling: SamplingSpec,
                       batch_size: int = 64) -> list[Completion]:
        """``sampling.n`` completions per prompt, each cut after its first stop token (kept), with
        the raw model log-probability of every sampled token."""
        with _evaluating(self.model):
            copies = 1 if sampling.greedy else sampling.n  # greedy replies are all alike: sample one
            expanded = [(i, ids) for i, ids in enumerate(prompt_ids) for _ in range(copies)]
            completions: list[Completion] = []
            for start in range(0, len(expanded), batch_size):
                chunk = expanded[start : start + batch_size]
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed + start)
                completions += self._batch(chunk, sampling)
        if copies == sampling.n:
            for k, c in enumerate(completions):
                c.index = k % sampling.n
            return completions
        return [Completion(list(c.token_ids), c.finish_reason, c.logprobs, c.top_logprobs, i, c.prompt_index)
                for c in completions for i in range(sampling.n)]

    def _batch(self, chunk: list[tuple[int, list[int]]], sampling: SamplingSpec) -> list[Completion]:
        width = max(len(ids) for _, ids in chunk)
        # Left padding: every prompt ends where generation starts.
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(ids)) + ids for _, ids in chunk])
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in chunk])
        out = self.model.generate(
            input_ids=input_ids.to(self.model.device), attention_mask=attention.to(self.model.device),
            max_new_tokens=sampling.max_tokens, **_sampling_kwargs(sampling),
            eos_token_id=list(sampling.stop_token_ids) or None, pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=sampling.logprobs is not None,  # raw logits, before temperature and top-p
        )
        new_tokens = out.sequences[:, width:]
        chosen, tops = None, []
        if sampling.logprobs is not None:
            # One step at a time: a [batch, steps, vocab] float32 stack would not fit for real vocabularies.
            steps = []
            for k, logits in enumerate(out.logits):
                step = logits.float().log_softmax(-1)
                steps.append(step.gather(-1, new_tokens[:, k, None]).squeeze(-1))
                if sampling.logprobs > 0:
                    tops.append(torch.topk(step, sampling.logprobs))
            chosen = torch.stack(steps, dim=1)
        completions = []
        for row, (prompt_index, _) in enumerate(chunk):
            tokens = new_tokens[row].tolist()
            end, finish = cut_at_stop(tokens, sampling.stop_token_ids)
            logprobs = top = None
            if chosen is not None:
                logprobs = chosen[row, :end].tolist()
                top = [tuple(zip(t.indices[row].tolist(), t.values[row].tolist())) for t in tops[:end]] if tops \
                    else [()] * end
            completions.append(Completion(tokens[:end], finish, logprobs, top, 0, prompt_index))
        return completions

    # --- scoring: log-probs of given tokens ------------------------------------------------

    async def score(self, sequences: list[tuple[int, ...]], batch_size: int = 8,
                    adapter: str | None = None) -> list[list[tuple[float, bool]]]:
        """For each sequence, every token after the first: (its log-prob given the tokens before
        it, whether it is the most likely token there). What evaluations of choices read."""
        return await asyncio.to_thread(self._score, sequences, batch_size, adapter)

    @torch.no_grad()
    def _score(self, sequences, batch_size: int, adapter: str | None) -> list[list[tuple[float, bool]]]:
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))  # alike lengths share a batch
        scored: dict[int, list[tuple[float, bool]]] = {}
        bare = self.select_adapter(adapter)
        try:
            with _evaluating(self.model):
                for start in range(0, len(order), batch_size):
                    chunk = order[start : start + batch_size]
                    width = max(len(sequences[i]) for i in chunk)
                    # Right padding: a causal model's real positions never see the pads after them.
                    ids = torch.tensor([list(sequences[i]) + [self.pad_token_id] * (width - len(sequences[i])) for i in chunk])
                    mask = torch.tensor([[1] * len(sequences[i]) + [0] * (width - len(sequences[i])) for i in chunk])
                    logits = self.model(input_ids=ids.to(self.model.device), attention_mask=mask.to(self.model.device)).logits
                    logprobs = logits[:, :-1].float().log_softmax(-1)
                    targets = ids[:, 1:].to(logprobs.device)
                    chosen = logprobs.gather(-1, targets[..., None]).squeeze(-1)
                    greedy = logprobs.argmax(-1) == targets
                    for row, i in enumerate(chunk):
                        n = len(sequences[i]) - 1
                        scored[i] = list(zip(chosen[row, :n].tolist(), greedy[row, :n].tolist()))
        finally:
            if bare:
                self.rest_adapters()
        return [scored[i] for i in range(len(sequences))]

    # --- requests: streamed, taking turns on the model ----------------------------------------

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        return await collect(self.stream(request), request.sampling)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        budget = check_prompt_fits(request.prompt_ids, request.sampling, self.max_model_len)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        ended = asyncio.Event()

        def emit(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                self._run(request, budget, emit, cancel)
            finally:
                loop.call_soon_threadsafe(ended.set)

        # A thread of its own, not the loop's executor: a request waiting for its turn blocks its
        # thread, and the executor's few threads also decode the replies (asyncio.to_thread).
        threading.Thread(target=work, name="hf-generate", daemon=True).start()
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()  # a consumer that stops reading (stop string, timeout, client gone) ends the generation
            self.turns.wake()  # also one still waiting for a turn
            await ended.wait()

    async def close(self) -> None:
        return None

    def _run(self, request: GenerationRequest, budget: int, emit, cancel: threading.Event) -> None:
        try:
            sampling = request.sampling
            turn = Turn(self, request, cancel)
            observer = turn.observer = _StepObserver(request, budget, emit, turn.between_steps)
            if not turn.begin():
                emit(_DONE)  # the consumer left while the request waited for its first turn
                return
            try:
                with torch.no_grad():
                    self.model.generate(
                        input_ids=torch.tensor([list(request.prompt_ids)], device=self.model.device),
                        attention_mask=torch.ones(1, len(request.prompt_ids), dtype=torch.long, device=self.model.device),
                        max_new_tokens=budget,
                        num_return_sequences=1 if sampling.greedy else sampling.n,
                        eos_token_id=list(sampling.stop_token_ids) or None,
                        pad_token_id=self.pad_token_id,
                        streamer=observer,
                        stopping_criteria=StoppingCriteriaList([_Cancelled(cancel)]),
                        **_sampling_kwargs(sampling),
                        **self._image_kwargs(request.images),
                    )
            finally:
                turn.end()
            observer.finish()
        except Abandoned:
            pass
        except BaseException as exc:  # noqa: BLE001 (handed to the awaiting coroutine)
            emit(exc)
        emit(_DONE)

    def _image_kwargs(self, images: dict | None) -> dict:
        """A vision request's processor tensors on the model's device; pixel values in the model's
        float dtype (the processor gives float32, a bf16 model would refuse them)."""
        if not images:
            return {}
        dtype = getattr(self.model, "dtype", None)
        return {key: value.to(self.model.device, dtype=dtype if value.is_floating_point() else None)
                if isinstance(value, torch.Tensor) else value for key, value in images.items()}

    def select_adapter(self, name: str | None) -> bool:
        """Activate the request's adapter; True when that switched the adapters off (the bare base),
        which ``rest_adapters`` undoes."""
        name = name or self.default_adapter
        if name is None:
            if self.adapters:
                self.model.base_model.disable_adapter_layers()
            return bool(self.adapters)
        if name not in self.adapters:
            raise KeyError(f"unknown adapter {name!r}; this engine has {list(self.adapters)}")
        self.model.set_adapter(name)
        return False

    def rest_adapters(self) -> None:
        """The adapter layers on again: how the model is left between requests."""
        self.model.base_model.enable_adapter_layers()


@contextlib.contextmanager
def _evaluating(model):
    """Eval mode (no dropout) while generating; a policy being trained goes back to training."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _sampling_kwargs(sampling: SamplingSpec) -> dict:
    kwargs = {"repetition_penalty": sampling.repetition_penalty}
    if sampling.greedy:
        return {**kwargs, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {**kwargs, "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else None}


class _StepObserver:
    """A transformers streamer: receives each step's tokens (one per reply) and turns them into
    StreamDeltas; a reply ends at its first stop token or at the budget."""

    def __init__(self, request: GenerationRequest, budget: int, emit, between_steps=lambda: None):
        self.sampling, self.budget, self.emit, self.between_steps = request.sampling, budget, emit, between_steps
        self.n = request.sampling.n
        self.stop_ids = set(request.sampling.stop_token_ids)
        self.lengths = [0] * self.n
        self.finished = [False] * self.n
        self.seen_prompt = False
        self.step_logprobs: torch.Tensor | None = None

    def see_logits(self, logits: torch.Tensor) -> None:
        self.step_logprobs = logits[:, -1, :].float().log_softmax(-1).cpu()

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:  # generate() first hands over the prompt itself
            self.seen_prompt = True
            return
        tokens = value.reshape(-1).tolist()
        rows = len(tokens)
        if rows < self.n:  # greedy: one row stands for every reply
            tokens = tokens * self.n
        for index, token in enumerate(tokens):
            if self.finished[index]:
                continue
            self.lengths[index] += 1
            reason = "stop" if token in self.stop_ids else "length" if self.lengths[index] >= self.budget else None
            self.finished[index] = reason is not None
            logprobs = top = None
            if self.sampling.logprobs is not None and self.step_logprobs is not None:
                step = self.step_logprobs[index % rows]
                logprobs, top = [float(step[token])], [_top(step, self.sampling.logprobs)]
            self.emit(StreamDelta([token], logprobs, top, reason, index))
        if not all(self.finished):  # the last step hands nothing on: the request ends with it
            self.between_steps()

    def end(self) -> None:
        pass

    def finish(self) -> None:
        """Replies still open when generate() returned (cancelled) end as "stop"."""
        for index, done in enumerate(self.finished):
            if not done:
                self.finished[index] = True
                self.emit(StreamDelta([], None, None, "stop", index))


class _Cancelled(StoppingCriteria):
    """Ends generate() once the consumer has stopped reading."""

    def __init__(self, cancel: threading.Event):
        self.cancel = cancel

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.cancel.is_set(), dtype=torch.bool, device=input_ids.device)


def _top(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    if k <= 0:
        return ()
    best = torch.topk(logprobs, k)
    return tuple(zip(best.indices.tolist(), best.values.tolist()))
