"""Rollouts through a LoRA adapter the policy pushes, beside a base the engine never changes.

Adapter-only weight sync: instead of merging the adapter into a full copy of the weights and
reloading all of them (bytes that scale with the model), the policy ships its adapter alone
(``stages/rl/workers/weights.export_adapter``: one safetensors blob, adapter_config.json in its metadata)
and the engine serves it through vLLM's LoRA support. Each push is a new adapter version with a
LoRA id of its own (vLLM caches adapters by id, so reusing one would keep serving the old
tensors); the previous version is removed and its folder deleted. Every rollout after the push
samples through the newest version.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any, Optional

ADAPTER_CONFIG_KEY = "adapter_config"  # the safetensors metadata entry that carries adapter_config.json
# vLLM's LoRA kernels are compiled for these ranks; an engine reserves the smallest that fits.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(rank: int) -> int:
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"lora_rank {rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")
    return fitting[0]


def unpack_adapter(blob: bytes, folder: str) -> str:
    """Write an ``export_adapter`` blob as a PEFT adapter folder (adapter_model.safetensors and
    adapter_config.json); returns the folder."""
    from safetensors import safe_open

    os.makedirs(folder, exist_ok=True)
    weights = os.path.join(folder, "adapter_model.safetensors")
    with open(weights, "wb") as f:
        f.write(blob)
    with safe_open(weights, framework="pt") as f:
        config = json.loads(f.metadata()[ADAPTER_CONFIG_KEY])
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return folder


class AdapterReceiver:
    """Mixed into VLLMEngine: ``load_adapter`` and the adapter its rollouts sample through."""

    rollout_lora: Optional[Any] = None  # a vllm LoRARequest once an adapter was pushed
    _adapter_root: Optional[str] = None

    def load_adapter(self, blob: bytes) -> float:
        """Serve this adapter to every later rollout, in place of the last one; seconds taken
        (vLLM reads the folder when the next generation first uses it)."""
        from vllm.lora.request import LoRARequest

        self._require("load_adapter", offline=True)
        start = time.perf_counter()
        if self._adapter_root is None:
            self._adapter_root = tempfile.mkdtemp(prefix="rayfactory-adapters-")
        previous = self.rollout_lora
        version = 1 if previous is None else previous.lora_int_id + 1
        folder = unpack_adapter(blob, os.path.join(self._adapter_root, f"v{version}"))
        self.rollout_lora = LoRARequest(f"policy-v{version}", version, folder)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.reset_cache()  # cached prefixes were computed through the previous adapter
        return time.perf_counter() - start
