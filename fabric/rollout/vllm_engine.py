"""A vLLM rollout engine: one offline ``vllm.LLM`` in a process of its own, meant to be a Ray actor.

The RL launcher places N of these next to the policy workers
(``ray.remote(VLLMEngine).options(num_cpus=..., runtime_env=engine_runtime_env(), ...)``), sends
them prompts as token ids (``SamplingSpec`` in, ``Completion`` out, the same types as the HF
backend) and pushes the policy's weights into them after each update (``fabric/weight_sync.py``).

Token ids only: vLLM's tokenizer is never loaded (``skip_tokenizer_init``), so any tokenizer the
policy can load works, and nothing is decoded. Stopping is exactly ``SamplingSpec.stop_token_ids``
(the model's own eos is ignored unless listed there), the stop token is kept in ``token_ids``,
and ``logprobs`` are vLLM's "raw_logprobs": ``log_softmax`` of the unmodified logits, before
temperature / top-k / top-p, i.e. ``completion_logprobs(..., temperature=1.0)``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from registries.errors import UserError
from stages.inference.vllm_engine import require_vllm as require_vllm_package
from stages.rl.types import Completion, SamplingSpec

# vLLM imports this by name inside its worker process and mixes it into the worker class.
WEIGHT_RECEIVER = "fabric.rollout.vllm_extension.WeightReceiver"

# Read by vLLM when it is imported; set in the actor's runtime_env (and again in __init__ for
# an engine built outside Ray).
ENGINE_ENV = {
    # Engine core in the actor's own process: no extra process (and no second copy of the
    # model) per engine, and collective_rpc hands the weight blob over without a copy.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",  # no usage report sent from cluster nodes
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class VLLMNotInstalled(UserError):
    """``rollout_backend: vllm`` on a machine without vLLM."""


def require_vllm() -> None:
    """Raise ``VLLMNotInstalled`` (with the fix) unless ``import vllm`` can work; imports nothing."""
    require_vllm_package("rollout_backend: vllm", "set rollout_backend: hf to sample with transformers generate "
                         "inside the policy workers", VLLMNotInstalled)


def engine_runtime_env() -> dict:
    """The ``runtime_env`` an engine actor needs (merge it into the launcher's own). vLLM's log
    level follows ``VLLM_LOGGING_LEVEL`` of the launching process, WARNING by default."""
    env = dict(ENGINE_ENV, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    return {"env_vars": env}


@dataclass(kw_only=True)
class VLLMEngineConfig:
    """What one engine loads and how. On CPU, ``kv_cache_bytes`` must be set (vLLM would
    otherwise take a share of the machine's RAM) and ``dtype`` float32; ``enforce_eager`` skips
    torch.compile / graph capture (~40 s of start-up on CPU). ``weight_transfer``: "nccl" makes
    the engine join ``NcclBroadcastSync``'s process group (GPU only); None ships weights as bytes."""

    model_path: str
    dtype: str = "float32"
    kv_cache_bytes: int
    enforce_eager: bool = True
    max_model_len: int
    seed: int = 0
    tensor_parallel_size: int = 1
    weight_transfer: Optional[str] = None
    gpu_memory_utilization: Optional[float] = None  # GPU engines only; None: vLLM's default


class VLLMEngine:
    """One vLLM engine. Plain class: the launcher makes it a Ray actor."""

    def __init__(self, config: VLLMEngineConfig):
        require_vllm()
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        self.config = config
        extra = {}
        if config.weight_transfer:
            extra["weight_transfer_config"] = {"backend": config.weight_transfer}
        if config.gpu_memory_utilization is not None:
            extra["gpu_memory_utilization"] = config.gpu_memory_utilization
        self.llm = LLM(
            model=str(config.model_path),
            dtype=config.dtype,
            kv_cache_memory_bytes=int(config.kv_cache_bytes),
            enforce_eager=config.enforce_eager,
            max_model_len=config.max_model_len,
            seed=config.seed,
            tensor_parallel_size=config.tensor_parallel_size,
            skip_tokenizer_init=True,
            worker_extension_cls=WEIGHT_RECEIVER,
            logprobs_mode="raw_logprobs",  # the default; pinned because the RL math depends on it
            **extra,
        )

    def ready(self) -> bool:
        """True once the engine is up (the constructor has returned): the launcher's barrier."""
        return True

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        """``sampling.n`` completions per prompt, prompt by prompt, in request order."""
        from vllm.inputs import TokensPrompt

        too_long = [i for i, ids in enumerate(prompt_ids) if len(ids) >= self.config.max_model_len]
        if too_long:
            raise UserError(
                f"{len(too_long)} prompt(s) (first: #{too_long[0]}, {len(prompt_ids[too_long[0]])} tokens) do not "
                f"fit the rollout engine's max_model_len {self.config.max_model_len} with room for a completion. "
                "Raise vllm_max_model_len, or lower cutoff_len so prompts are cut shorter."
            )
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        params = [_sampling_params(sampling, index) for index in range(len(prompts))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        completions = []
        for index, output in enumerate(outputs):  # LLM.generate returns them in request order
            for sample in sorted(output.outputs, key=lambda s: s.index):
                if sample.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended a completion of prompt {index} with {sample.finish_reason!r}")
                ids = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, ids)]
                completions.append(Completion(index, ids, logprobs, sample.finish_reason))
        return completions

    def load_weights(self, blob: bytes) -> float:
        """Load a full HF-named state dict (``state_dict_to_bytes``) into the engine; seconds taken.

        The prefix cache is dropped after: its KV blocks were computed by the old weights.
        """
        start = time.perf_counter()
        self.llm.collective_rpc("rf_load_safetensors", args=(blob,))
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    # --- NCCL weight transfer (GPU; driven by fabric.weight_sync.NcclBroadcastSync) -------------

    def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        """Join the trainer's NCCL group: this engine's workers take ranks ``rank_offset`` ...
        (vLLM's own NCCL weight-transfer engine: StatelessProcessGroup + PyNcclCommunicator).
        Blocks until the trainer joins too."""
        self._require_weight_transfer()
        init_info = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                         world_size=world_size, packed=False)
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def receive_broadcast(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> float:
        """Receive one full weight update, one broadcast per tensor in this order, from rank 0;
        seconds taken (from the call, so it includes waiting for the sender)."""
        self._require_weight_transfer()
        start = time.perf_counter()
        update_info = dict(names=names, dtype_names=dtype_names, shapes=shapes)
        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})
        self.llm.collective_rpc("finish_weight_update")  # vLLM's post-load processing of the new weights
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def _require_weight_transfer(self) -> None:
        if self.config.weight_transfer != "nccl":
            raise RuntimeError("this engine was built without weight_transfer='nccl' (VLLMEngineConfig)")


def _sampling_params(sampling: SamplingSpec, prompt_index: int):
    """vLLM's parameters for one prompt.

    vLLM seeds the i-th of a request's n samples with ``seed + i``; one seed for every prompt
    would give every prompt the same random stream (identical completions wherever the
    distributions are alike), so prompt k starts at ``seed + k * n``.
    """
    from vllm import SamplingParams

    return SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        max_tokens=sampling.max_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=True,  # stop at stop_token_ids only (the caller lists eos there), as the HF backend does
        logprobs=0,  # the sampled token's own log-prob only
        detokenize=False,
        seed=None if sampling.seed is None else sampling.seed + prompt_index * sampling.n,
    )
