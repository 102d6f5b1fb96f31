"""The vLLM engine behind ChatModel: one ``AsyncLLM`` serving the base and its LoRA adapters.

Token ids only, as every engine here: vLLM's tokenizer is never loaded (``skip_tokenizer_init``),
the prompt comes from our template and ChatModel decodes the reply. Semantics follow HFEngine:
a reply stops exactly at ``stop_token_ids`` (the model's own eos only when listed) with the stop
token kept, or at the reply budget of ``check_prompt_fits``; log-probs are vLLM's
"raw_logprobs" (log_softmax of the unmodified logits, as HFEngine's output-embedding hook sees
them). Outputs come as deltas, so a streamed reply grows by each step's tokens, and a consumer
that stops reading aborts its request in vLLM.

The engine core runs in a process of its own (AsyncLLM always does; on CPU vLLM starts it with
``spawn``, so a script that builds one needs the ``if __name__ == "__main__":`` guard). Requests
from any number of coroutines are batched by vLLM's scheduler, but all on one event loop: AsyncLLM
binds its output handler to the loop of the first request (ChatModel's private loop, or a server's).
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from typing import AsyncIterator, get_args

from registries.errors import UserError

from ..loading import resolve_model_path
from .engine import DecodingParams, Generated, GenerationRequest, StreamDelta, TokenLogprob, check_prompt_fits, collect
from .loading import DEFAULT_ADAPTER, InferenceLoadError, InferenceSpec, check_adapter_folder

# Read by vLLM when it is imported (the same quiet settings as the RL rollout engines; the
# multiprocessing switch of those does not apply: AsyncLLM always runs its core in a process).
_QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


class VLLMChatEngine:
    name = "vllm"

    def __init__(self, llm, max_model_len: int, loras: dict, default_adapter: str | None = None):
        """``llm``: a started ``AsyncLLM``; ``loras``: adapter name -> ``LoRARequest``;
        ``default_adapter`` serves requests that name none (None: the bare base)."""
        self.llm = llm
        self.max_model_len = max_model_len
        self.loras = dict(loras)
        self.adapters = tuple(self.loras)
        self.default_adapter = default_adapter

    @classmethod
    def from_spec(cls, spec: InferenceSpec, tokenizer) -> "VLLMChatEngine":
        require_vllm("infer_backend: vllm", "set infer_backend: huggingface to generate with transformers")
        for key, value in _QUIET_ENV.items():
            os.environ.setdefault(key, value)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        inference = spec.inference
        model_path = resolve_model_path(spec.model.model_name_or_path)
        max_model_len = _context_window(spec, model_path, tokenizer)
        named = _adapter_folders(spec)
        for name, path in named.items():
            check_adapter_folder(path, name)
            _check_rank(path, name, inference.vllm_max_lora_rank)
        loras = {name: LoRARequest(name, number, os.path.abspath(path))
                 for number, (name, path) in enumerate(named.items(), start=1)}

        on_cpu = current_platform.is_cpu()
        infer_dtype = spec.model.infer_dtype
        args = dict(
            model=model_path, skip_tokenizer_init=True, max_model_len=max_model_len,
            # vLLM's CPU kernels want float32 (bf16 kernels need AVX512-BF16); on a GPU the config's
            # infer_dtype, or the checkpoint's own ("auto")
            dtype="float32" if on_cpu else infer_dtype,
            enforce_eager=True,  # no graph capture / torch.compile: start-up in seconds, not a minute
            logprobs_mode="raw_logprobs",  # log_softmax of the unmodified logits, as HFEngine reports
            trust_remote_code=spec.model.trust_remote_code, revision=spec.model.model_revision,
            download_dir=spec.model.cache_dir, disable_log_stats=True,
        )
        if on_cpu:  # vLLM would otherwise take a share of the machine's RAM for the KV cache
            args["kv_cache_memory_bytes"] = int(inference.vllm_cpu_kv_cache_gib * 2**30)
        else:
            args["gpu_memory_utilization"] = inference.vllm_gpu_util
        if loras:
            args.update(enable_lora=True, max_lora_rank=inference.vllm_max_lora_rank,
                        max_loras=min(inference.vllm_max_loras, len(loras)))
        args.update(inference.vllm_config or {})  # the user's own engine arguments win
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        default = DEFAULT_ADAPTER if DEFAULT_ADAPTER in loras else None
        return cls(llm, max_model_len, loras, default)

    async def generate(self, request: GenerationRequest) -> list[Generated]:
        return await collect(self.stream(request), request)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        from vllm.inputs import TokensPrompt

        budget = check_prompt_fits(request, self.max_model_len)
        lora = self._lora(request.adapter)
        # Greedy replies are all the same: generate one and hand it out n times (as HFEngine does).
        copies = 1 if request.params.do_sample else request.n
        params = _sampling_params(request.params, budget, request.n // copies, request.logprobs)
        outputs = self.llm.generate(TokensPrompt(prompt_token_ids=list(request.prompt_ids)), params,
                                    request_id=uuid.uuid4().hex, lora_request=lora)
        try:
            async for output in outputs:
                for sample in output.outputs:
                    reason = _finish_reason(sample.finish_reason)
                    if not sample.token_ids and reason is None:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = [_token_logprob(step, token, request.logprobs)
                                    for step, token in zip(sample.logprobs or (), sample.token_ids)]
                    for index in range(sample.index, sample.index + copies):
                        yield StreamDelta(list(sample.token_ids), logprobs, reason, index)
        finally:
            # A consumer that stops early (stop string, client gone): vLLM's generator aborts the
            # request when it is closed.
            await outputs.aclose()

    async def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None  # a second close does nothing

    def _lora(self, name: str | None):
        name = name or self.default_adapter
        if name is None:
            return None
        if name not in self.loras:
            raise KeyError(f"unknown adapter {name!r}; this engine has {list(self.adapters)}")
        return self.loras[name]


def _sampling_params(params: DecodingParams, budget: int, n: int, logprobs: int | None):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sampling = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or 0, seed=params.seed)
    if not params.do_sample:
        sampling = dict(temperature=0.0)
    return SamplingParams(
        n=n, max_tokens=budget, repetition_penalty=params.repetition_penalty,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,  # stop at stop_token_ids only (ChatModel lists the template's eos there)
        logprobs=logprobs, detokenize=False, output_kind=RequestOutputKind.DELTA, **sampling,
    )


def _finish_reason(reason: str | None):
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"  # "abort": the consumer stopped reading


def _token_logprob(step: dict, token: int, top: int) -> TokenLogprob:
    """vLLM's per-step dict (the chosen token plus the ``top`` most likely, each with its rank)."""
    best = sorted(((lp.rank, -lp.logprob, tid) for tid, lp in step.items() if lp.rank is not None and lp.rank <= top))
    return TokenLogprob(token, step[token].logprob, tuple((tid, -neg) for _rank, neg, tid in best[:top]))


# --- building the engine -------------------------------------------------------------------


def require_vllm(setting: str, alternative: str, error: type[UserError] = InferenceLoadError) -> None:
    """Raise ``error`` (with the fix) unless ``import vllm`` can work; imports nothing. The RL
    rollout engines use it too, with their own setting and alternative."""
    if importlib.util.find_spec("vllm") is None:
        raise error(
            f"{setting} needs the vllm package, which is not installed in this Python environment (on every node "
            "that runs an engine). Install it with `pip install -e .[vllm]` (a CPU-only machine needs vLLM's CPU "
            f"build), or {alternative}."
        )


def _adapter_folders(spec: InferenceSpec) -> dict[str, str]:
    """Adapter name -> folder: the default adapter, then ``lora_modules``."""
    if len(spec.adapters) > 1:
        raise InferenceLoadError(
            f"adapter_name_or_path lists {len(spec.adapters)} adapters ({', '.join(spec.adapters)}); the vLLM engine "
            "serves one adapter on an unchanged base, it cannot merge the earlier ones. Merge them first with "
            "`rayfactory export` (model_name_or_path + the adapters to merge, export_dir: a folder), then use that "
            "folder as model_name_or_path with only the last adapter, or use infer_backend: huggingface."
        )
    named = {DEFAULT_ADAPTER: spec.adapters[0]} if spec.adapters else {}
    for name, path in (spec.inference.lora_modules or {}).items():
        if name in named:
            raise InferenceLoadError(
                f"lora_modules names an adapter {name!r}, the name of the default adapter (adapter_name_or_path). "
                "Give it another name."
            )
        named[name] = path
    return named


def _check_rank(path: str, name: str, max_rank: int) -> None:
    from vllm.config.lora import MaxLoRARanks

    allowed = get_args(MaxLoRARanks)
    if max_rank not in allowed:
        raise InferenceLoadError(
            f"vllm_max_lora_rank is {max_rank}, but vLLM accepts only one of {', '.join(map(str, allowed))}. "
            "Set vllm_max_lora_rank to the smallest of these that is at least your adapters' rank."
        )
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise InferenceLoadError(f"adapter {name!r}: {path} does not exist or holds no adapter_config.json.")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    rank = max([int(config.get("r") or 0), *map(int, (config.get("rank_pattern") or {}).values())])
    if rank > max_rank:
        raise InferenceLoadError(
            f"adapter {name!r} ({path}) has LoRA rank {rank}, above vllm_max_lora_rank {max_rank}, the largest rank "
            f"this vLLM engine accepts. Set vllm_max_lora_rank to at least {rank} (one of "
            f"{', '.join(str(a) for a in allowed if a >= rank)})."
        )


def _context_window(spec: InferenceSpec, model_path: str, tokenizer) -> int:
    """vllm_maxlen capped by the model's positions; refuses a tokenizer the embedding cannot hold."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=spec.model.trust_remote_code,
                                        revision=spec.model.model_revision, cache_dir=spec.model.cache_dir)
    text = config.get_text_config()
    rows = getattr(text, "vocab_size", None)
    if rows is not None and len(tokenizer) > rows:
        raise InferenceLoadError(
            f"the tokenizer has {len(tokenizer)} tokens but the model {model_path} has {rows} embedding rows: the "
            "training run added tokens and resized the embeddings, which vLLM cannot do on a base model. Merge the "
            "adapter into the base with `rayfactory export` and serve the exported folder, or use "
            "infer_backend: huggingface."
        )
    limit = getattr(text, "max_position_embeddings", None) or spec.inference.vllm_maxlen
    return min(limit, spec.inference.vllm_maxlen)
