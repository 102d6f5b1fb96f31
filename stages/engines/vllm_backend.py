"""The vLLM engine: vLLM serving token ids, for rollouts and for requests alike.

One class, two ways to build it, because vLLM offers two front ends:
* ``VLLMEngine(config)``: an offline ``vllm.LLM`` with its engine core in this very process, for
  the RL rollout actors: ``generate_batch`` over many prompts, and the RL hooks (``load_weights``
  of a safetensors blob, or ``receive_weights`` of fabric/weight_sync.py's collective push; ``reset_cache``;
  partial rollouts' ``generate_stepwise`` and ``load_in_flight``, stages/engines/inflight_weights.py).
* ``VLLMEngine.for_requests(config)``: an ``AsyncLLM`` for chat, serve, predict and the web UI:
  concurrent requests batched by vLLM's scheduler, streamed as deltas, base and LoRA adapters.
  The engine core runs in a process of its own (AsyncLLM always does; on CPU vLLM starts it with
  ``spawn``, so a script that builds one needs the ``if __name__ == "__main__":`` guard), and all
  requests share one event loop: AsyncLLM binds its output handler to the loop of the first.

Either way: token ids only (vLLM's tokenizer is never loaded, so any tokenizer the model can use
works); a reply stops exactly at ``stop_token_ids`` (the model's own eos only when listed) with the
stop token kept, or at its budget; log-probs are vLLM's "raw_logprobs" (log_softmax of the
unmodified logits, as the transformers engine reports them and the RL math expects).
"""

from __future__ import annotations

import asyncio

import importlib.util
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from registries.errors import UserError

from .types import Completion, GenerationRequest, SamplingSpec, StreamDelta, check_prompt_fits, collect
from .inflight_weights import InFlightReceiver
from .vllm_adapters import AdapterReceiver, engine_lora_rank
from .vllm_outputs import batch_completions, sample_logprobs

# vLLM imports this by name inside its worker process and mixes it into the worker class.
WEIGHT_RECEIVER = "stages.engines.vllm_weights.WeightReceiver"

# Read by vLLM when it is imported: no usage report sent from cluster nodes, quiet tokenizers.
QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
# The rollout engines' core runs in the actor's own process: no extra process (and no second copy
# of the model) per engine, and collective_rpc hands the weight blob over without a copy.
ROLLOUT_ENV = {**QUIET_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class VLLMNotInstalled(UserError):
    """A setting that needs vLLM, on a machine without it."""


def require_vllm(setting: str, alternative: str, error: type[UserError] = VLLMNotInstalled) -> None:
    """Raise ``error`` (with the fix) unless ``import vllm`` can work; imports nothing."""
    if importlib.util.find_spec("vllm") is None:
        raise error(
            f"{setting} needs the vllm package, which is not installed in this Python environment (on every node "
            "that runs an engine). Install it with `pip install -e .[vllm]` (a CPU-only machine needs vLLM's CPU "
            f"build), or {alternative}."
        )


def rollout_env_vars() -> dict[str, str]:
    """The environment a rollout engine's process needs (a Ray actor's runtime_env). vLLM's log
    level follows ``VLLM_LOGGING_LEVEL`` of the launching process, WARNING by default."""
    return dict(ROLLOUT_ENV, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))


@dataclass(kw_only=True)
class VLLMEngineConfig:
    """What one engine loads and how. On CPU, ``kv_cache_bytes`` must be set (vLLM would
    otherwise take a share of the machine's RAM) and ``dtype`` float32; ``enforce_eager`` skips
    torch.compile / graph capture (~40 s of start-up on CPU). ``loras``: adapter name -> folder,
    served beside the base; ``extra``: the user's own vLLM engine arguments (``vllm_config``),
    which win."""

    model_path: str
    max_model_len: int
    dtype: str = "float32"
    kv_cache_bytes: Optional[int] = None
    gpu_memory_utilization: Optional[float] = None  # GPU engines only; None: vLLM's default
    enforce_eager: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False
    revision: Optional[str] = None
    download_dir: Optional[str] = None
    loras: dict[str, str] = field(default_factory=dict)
    default_adapter: Optional[str] = None  # serves requests that name none (None: the bare base)
    max_lora_rank: int = 16
    max_loras: int = 1
    rollout_lora_rank: Optional[int] = None  # set: rollouts sample through adapters pushed by load_adapter
    extra: dict = field(default_factory=dict)


class VLLMEngine(AdapterReceiver, InFlightReceiver):
    """One vLLM engine. Plain class: the RL launcher makes it a Ray actor."""

    name = "vllm"

    def __init__(self, config: VLLMEngineConfig, *, for_requests: bool = False):
        require_vllm("rollout_backend: vllm", "set rollout_backend: hf to sample with transformers generate "
                     "inside the policy workers")
        for key, value in (QUIET_ENV if for_requests else ROLLOUT_ENV).items():
            os.environ.setdefault(key, value)
        from vllm.lora.request import LoRARequest

        self.config = config
        self.max_model_len = config.max_model_len
        self.loras = {name: LoRARequest(name, number, os.path.abspath(path))
                      for number, (name, path) in enumerate(config.loras.items(), start=1)}
        self.adapters = tuple(self.loras)
        self.default_adapter = config.default_adapter
        args = _engine_args(config)
        if for_requests:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args, disable_log_stats=True))
        else:
            from vllm import LLM

            self.llm = LLM(**args, worker_extension_cls=WEIGHT_RECEIVER)
        self.serving = for_requests

    @classmethod
    def for_requests(cls, config: VLLMEngineConfig) -> "VLLMEngine":
        return cls(config, for_requests=True)

    def ready(self) -> bool:
        """True once the engine is up (the constructor has returned): the launcher's barrier."""
        return True

    # --- rollouts: many prompts at once ------------------------------------------------------

    def generate_batch(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        """``sampling.n`` completions per prompt, prompt by prompt, in request order."""
        self._require("generate_batch", offline=True)
        prompts, params, copies = self._batch_requests(prompt_ids, sampling)
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.rollout_lora)
        # LLM.generate returns them in request order
        return batch_completions([output.outputs for output in outputs], sampling, copies)

    def _batch_requests(self, prompt_ids: list[list[int]], sampling: SamplingSpec, stream: bool = False):
        """A batch's vLLM prompts and sampling params (one per prompt), and how many copies each
        sample stands for (a greedy sample is generated once for all n)."""
        from vllm.inputs import TokensPrompt

        too_long = [i for i, ids in enumerate(prompt_ids) if len(ids) >= self.max_model_len]
        if too_long:
            raise UserError(
                f"{len(too_long)} prompt(s) (first: #{too_long[0]}, {len(prompt_ids[too_long[0]])} tokens) do not "
                f"fit the rollout engine's max_model_len {self.max_model_len} with room for a completion. "
                "Raise vllm_max_model_len, or lower cutoff_len so prompts are cut shorter."
            )
        copies = sampling.n if sampling.greedy else 1  # greedy replies are all alike: generate one
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        # vLLM seeds the i-th of a request's n samples with seed + i; one seed for every prompt would
        # give every prompt the same random stream, so prompt k starts at seed + k * n.
        params = [_sampling_params(sampling, sampling.max_tokens, sampling.n // copies,
                                   None if sampling.seed is None else sampling.seed + k * sampling.n, stream=stream)
                  for k in range(len(prompts))]
        return prompts, params, copies

    def load_weights(self, blob: bytes) -> float:
        """Load a full HF-named state dict (``state_dict_to_bytes``) into the engine; seconds taken.
        The prefix cache is dropped after: its KV blocks were computed by the old weights."""
        self._require("load_weights", offline=True)
        start = time.perf_counter()
        self.llm.collective_rpc("rf_load_safetensors", args=(blob,))
        self.reset_cache()
        return time.perf_counter() - start

    def reset_cache(self) -> None:
        self._require("reset_cache", offline=True)
        self.llm.reset_prefix_cache()

    def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str) -> None:
        """Join the policy's weight group (stages/engines/weight_group.py): this engine's workers
        take ranks ``rank_offset`` ... Blocks until every member has joined."""
        self._require("join_weight_group", offline=True)
        self.llm.collective_rpc("rf_join_weight_group", args=(host, port, rank_offset, world_size, backend))

    def receive_weights(self, plan: list) -> float:
        """Receive one collective weight push (``plan``: the sender's buckets, ``weight_buckets``)
        and load it; seconds taken, from the call, so they include waiting for the sender. The
        prefix cache is dropped after, as for ``load_weights``."""
        self._require("receive_weights", offline=True)
        start = time.perf_counter()
        self.llm.collective_rpc("rf_receive_weights", args=(plan,))
        self.reset_cache()
        return time.perf_counter() - start

    # --- requests: concurrent, streamed ------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        return await collect(self.stream(request), request.sampling)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        from vllm.inputs import TokensPrompt

        self._require("stream", offline=False)
        sampling = request.sampling
        budget = check_prompt_fits(request.prompt_ids, sampling, self.max_model_len)
        lora = self._lora(request.adapter)
        copies = sampling.n if sampling.greedy else 1
        params = _sampling_params(sampling, budget, sampling.n // copies, sampling.seed, stream=True)
        outputs = self.llm.generate(TokensPrompt(prompt_token_ids=list(request.prompt_ids)), params,
                                    request_id=uuid.uuid4().hex, lora_request=lora)
        try:
            async for output in outputs:
                for sample in output.outputs:
                    reason = None if sample.finish_reason is None else (
                        "length" if sample.finish_reason == "length" else "stop")  # "abort": the reader left
                    if not sample.token_ids and reason is None:
                        continue
                    logprobs, top = sample_logprobs(sample, sampling.logprobs)
                    for index in range(sample.index, sample.index + copies):
                        yield StreamDelta(list(sample.token_ids), logprobs, top, reason, index)
        finally:
            # A consumer that stops early (stop string, client gone): vLLM's generator aborts the
            # request when it is closed.
            await outputs.aclose()

    async def score(self, sequences: list[tuple[int, ...]], batch_size: int = 8,
                    adapter: str | None = None) -> list[list[tuple[float, bool]]]:
        """HFEngine.score on vLLM: each sequence's prompt log-probs (vLLM batches the requests
        itself, so ``batch_size`` is not needed); a token is greedy when it ranks first."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._require("score", offline=False)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        lora = self._lora(adapter)

        async def one(ids: tuple[int, ...]) -> list[tuple[float, bool]]:
            final = None
            async for output in self.llm.generate(TokensPrompt(prompt_token_ids=list(ids)), params,
                                                  request_id=uuid.uuid4().hex, lora_request=lora):
                final = output
            # prompt_logprobs[0] is None (nothing precedes the first token); each later entry holds
            # the prompt's own token with its rank among the vocabulary.
            return [(entry[token].logprob, entry[token].rank == 1)
                    for token, entry in zip(ids[1:], final.prompt_logprobs[1:])]

        return list(await asyncio.gather(*(one(ids) for ids in sequences)))

    async def pause(self, mode: str = "wait") -> None:
        """Stop scheduling requests (to swap weights under a running server): "wait" lets the
        running ones finish first, "abort" ends them, "keep" freezes them where they are. Requests
        that arrive while paused wait for ``resume``."""
        self._require("pause", offline=False)
        await self.llm.pause_generation(mode=mode)

    async def resume(self) -> None:
        self._require("resume", offline=False)
        await self.llm.resume_generation()

    async def close(self) -> None:
        if self.llm is not None and self.serving:
            self.llm.shutdown()
            self.llm = None  # a second close does nothing

    def _lora(self, name: str | None):
        name = name or self.default_adapter
        if name is None:
            return None
        if name not in self.loras:
            raise KeyError(f"unknown adapter {name!r}; this engine has {list(self.adapters)}")
        return self.loras[name]

    def _require(self, method: str, offline: bool) -> None:
        if self.serving == offline:
            built = "for requests (AsyncLLM)" if self.serving else "for rollouts (LLM)"
            raise RuntimeError(f"VLLMEngine.{method} is not available on an engine built {built}")


def _engine_args(config: VLLMEngineConfig) -> dict:
    args = dict(
        model=str(config.model_path), dtype=config.dtype, max_model_len=config.max_model_len,
        enforce_eager=config.enforce_eager, seed=config.seed, tensor_parallel_size=config.tensor_parallel_size,
        skip_tokenizer_init=True,
        logprobs_mode="raw_logprobs",  # the default; pinned because the RL math and the HF engine agree on it
        trust_remote_code=config.trust_remote_code, revision=config.revision, download_dir=config.download_dir,
    )
    if config.kv_cache_bytes is not None:
        args["kv_cache_memory_bytes"] = int(config.kv_cache_bytes)
    if config.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.loras:
        args.update(enable_lora=True, max_lora_rank=config.max_lora_rank,
                    max_loras=min(config.max_loras, len(config.loras)))
    if config.rollout_lora_rank:  # one adapter at a time, the policy's newest
        args.update(enable_lora=True, max_lora_rank=engine_lora_rank(config.rollout_lora_rank), max_loras=1)
    args.update(config.extra)  # the user's own engine arguments win
    return args


def _sampling_params(sampling: SamplingSpec, max_tokens: int, n: int, seed: Optional[int], stream: bool = False):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    choice = dict(temperature=0.0) if sampling.greedy else dict(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0), seed=seed)
    return SamplingParams(
        n=n, max_tokens=max_tokens, repetition_penalty=sampling.repetition_penalty,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=True,  # stop at stop_token_ids only (callers list the template's eos there)
        logprobs=sampling.logprobs, detokenize=False,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY, **choice,
    )
