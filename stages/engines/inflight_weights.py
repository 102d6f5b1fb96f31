"""Partial rollouts: a weight push loaded between two decoding steps of the generation in flight.

vLLM's offline engine runs a batch as a loop of ``LLMEngine.step()`` calls (one decoding step of
every running request each). ``generate_stepwise`` runs that loop itself, and a push arriving on
another thread (the rollout actor's ``weights`` concurrency group, fabric/rollout.py) is loaded
between two steps by ``load_in_flight``: the requests keep their place and their KV cache (computed
by the old weights, kept rather than recomputed: PipelineRL's and AReaL's choice), and every token
they sample after the load comes from the new weights. So a push never waits for the longest
sequence in flight, and the tokens still to come are fresher.

Versions are counted on both sides: the engine counts the pushes it has loaded this way, and each
token is stamped with that count when it is sampled (``Completion.versions``). A batch is sent
with the number of pushes sent before it (``after_loads``) and starts only once that many are
loaded, so no token of it is older than the controller's stamp; tokens after an in-flight load
are newer. The rollout correction is per token (the sampler's log-prob of each), so a completion
sampled by two versions is corrected token by token.

The prefix cache is dropped after a load as after any push, but not while requests run (vLLM
keeps it while blocks are in use): then at the end of the batch, before the next one starts.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from typing import Iterator, Optional

from .types import Completion, SamplingSpec
from .vllm_outputs import batch_completions

DEFAULT_WAIT_S = 600.0  # how long a batch waits for the pushes sent before it


class StepGate:
    """Turns at the engine between the generation loop (one step a turn) and weight loads, a load
    waiting first; and the count of loads done, which a batch can wait for."""

    def __init__(self):
        self._cond = threading.Condition()
        self._busy = False
        self._loads_waiting = 0
        self.loads = 0

    @contextmanager
    def turn(self, load: bool) -> Iterator[None]:
        with self._cond:
            self._loads_waiting += load
            try:
                self._cond.wait_for(lambda: not self._busy and (load or not self._loads_waiting))
            finally:
                self._loads_waiting -= load
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def loaded(self) -> None:
        """Count a load (called inside its turn, once it has succeeded)."""
        with self._cond:
            self.loads += 1
            self._cond.notify_all()

    def wait_for_loads(self, count: int, timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.loads >= count, timeout_s):
                raise TimeoutError(f"the rollout engine waited {timeout_s:.0f} s for weight push {count} (it has "
                                   f"loaded {self.loads}): the policy's push never arrived")


class _Sample:
    """One sample's pieces as the step loop receives them (the fields ``batch_completions`` reads)."""

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: Optional[list] = None
        self.finish_reason: Optional[str] = None
        self.versions: list[int] = []


class InFlightReceiver:
    """Mixed into VLLMEngine (offline): ``generate_stepwise`` and ``load_in_flight``."""

    _gate: Optional[StepGate] = None
    _cache_stale = False
    steps_done = 0  # decoding steps run by generate_stepwise

    @property
    def gate(self) -> StepGate:
        if self._gate is None:
            self._gate = StepGate()
        return self._gate

    def generate_stepwise(self, prompt_ids: list[list[int]], sampling: SamplingSpec, after_loads: int = 0,
                          wait_s: float = DEFAULT_WAIT_S) -> list[Completion]:
        """``generate_batch``'s completions, each token stamped with the engine's loads count when
        it was sampled; starts once ``after_loads`` pushes are loaded."""
        self._require("generate_stepwise", offline=True)
        prompts, params, copies = self._batch_requests(prompt_ids, sampling, stream=True)
        self.gate.wait_for_loads(after_loads, wait_s)
        engine = self.llm.llm_engine
        names = {f"rf-{uuid.uuid4().hex}-{k}": k for k in range(len(prompts))}
        samples: list[dict[int, _Sample]] = [{} for _ in prompts]
        with self.gate.turn(load=False):
            for name, k in names.items():
                engine.add_request(name, prompts[k], params[k], lora_request=self.rollout_lora)
        try:
            while True:
                with self.gate.turn(load=False):
                    if not engine.has_unfinished_requests():
                        self._drop_stale_cache()
                        break
                    outputs = engine.step()
                    version = self.gate.loads
                    self.steps_done += 1
                for output in outputs:
                    for piece in output.outputs:  # DELTA: this step's new tokens of each sample
                        sample = samples[names[output.request_id]].setdefault(piece.index, _Sample(piece.index))
                        sample.token_ids += piece.token_ids
                        sample.versions += [version] * len(piece.token_ids)
                        if piece.logprobs is not None:
                            sample.logprobs = (sample.logprobs or []) + list(piece.logprobs)
                        if piece.finish_reason is not None:
                            sample.finish_reason = piece.finish_reason
        except BaseException:
            with self.gate.turn(load=False):
                engine.abort_request(list(names))
            raise
        versions = {(k, s.index): s.versions for k, by_index in enumerate(samples) for s in by_index.values()}
        return batch_completions([list(by_index.values()) for by_index in samples], sampling, copies, versions)

    def load_in_flight(self, kind: str, payload) -> float:
        """Load a push between two steps of the batch in flight (or now, when idle): ``kind``
        "blob" (``load_weights``'s safetensors bytes) or "plan" (``receive_weights``'s collective
        plan). Seconds taken, from the call: they include waiting for the step in progress."""
        self._require("load_in_flight", offline=True)
        if kind not in ("blob", "plan"):
            raise ValueError(f"load_in_flight takes a 'blob' or a 'plan', got {kind!r}")
        start = time.perf_counter()
        with self.gate.turn(load=True):
            self.llm.collective_rpc("rf_load_safetensors" if kind == "blob" else "rf_receive_weights", args=(payload,))
            self.gate.loaded()
            self._cache_stale = True
            if not self.llm.llm_engine.has_unfinished_requests():
                self._drop_stale_cache()
        return time.perf_counter() - start

    def loads_done(self) -> int:
        return self.gate.loads

    def steps_taken(self) -> int:
        """Decoding steps run by ``generate_stepwise`` so far (how far a batch in flight has got)."""
        return self.steps_done

    def _drop_stale_cache(self) -> None:
        """Drop the prefix cache after an in-flight load, once no request holds its blocks."""
        if self._cache_stale:
            self.reset_cache()
            self._cache_stale = False
