"""An inference config (``infer_backend: vllm``) as a vLLM engine's settings, checked first.

What vLLM would refuse late or obscurely is refused here in the config's own terms: an adapter
folder that is not a LoRA adapter, a LoRA rank above ``vllm_max_lora_rank``, several adapters to
merge, a tokenizer larger than the model's embedding.
"""

from __future__ import annotations

import json
import os
from typing import get_args

from ..engines.vllm_backend import VLLMEngine, VLLMEngineConfig, require_vllm
from ..loading import resolve_model_path
from .loading import DEFAULT_ADAPTER, InferenceLoadError, InferenceSpec, check_adapter_folder


def build_vllm_engine(spec: InferenceSpec, tokenizer) -> VLLMEngine:
    require_vllm("infer_backend: vllm", "set infer_backend: huggingface to generate with transformers",
                 InferenceLoadError)
    from vllm.platforms import current_platform

    inference = spec.inference
    model_path = resolve_model_path(spec.model.model_name_or_path)
    named = _adapter_folders(spec)
    for name, path in named.items():
        check_adapter_folder(path, name)
        _check_rank(path, name, inference.vllm_max_lora_rank)
    on_cpu = current_platform.is_cpu()
    config = VLLMEngineConfig(
        model_path=model_path, max_model_len=_context_window(spec, model_path, tokenizer),
        # vLLM's CPU kernels want float32 (bf16 kernels need AVX512-BF16); on a GPU the config's
        # infer_dtype, or the checkpoint's own ("auto")
        dtype="float32" if on_cpu else spec.model.infer_dtype,
        # on CPU vLLM would otherwise take a share of the machine's RAM for the KV cache
        kv_cache_bytes=int(inference.vllm_cpu_kv_cache_gib * 2**30) if on_cpu else None,
        gpu_memory_utilization=None if on_cpu else inference.vllm_gpu_util,
        trust_remote_code=spec.model.trust_remote_code, revision=spec.model.model_revision,
        download_dir=spec.model.cache_dir, loras=named,
        default_adapter=DEFAULT_ADAPTER if DEFAULT_ADAPTER in named else None,
        max_lora_rank=inference.vllm_max_lora_rank, max_loras=inference.vllm_max_loras,
        extra=dict(inference.vllm_config or {}),
    )
    return VLLMEngine.for_requests(config)


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
