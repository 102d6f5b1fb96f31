"""What ``bf16: true`` means on a CPU worker.

Measured on this machine's CPU (AMD EPYC with avx512_bf16 and amx_bf16; benchmarks/cpu_bf16.py,
benchmarks/README.md "bf16 on a CPU worker"): bfloat16 matmuls through oneDNN run an 8.4M Llama's
training steps 1.4-1.6x faster than float32, and the loss curve stays with float32's when the
weights that train stay float32 (autocast does the arithmetic in bfloat16). Storing those weights in
bfloat16 as well (what ``bf16`` loads on a GPU) was only a little faster and let the loss drift
further, because every optimizer update is rounded to 8 bits of mantissa. So on a CPU worker:

* a CPU with native bf16 (``avx512_bf16`` or ``amx_bf16``): the Trainer's bf16 autocast, over
  float32 weights for full and freeze tuning (LLaMA-Factory likewise upcasts the trainable
  parameters to float32 unless ``pure_bf16``); LoRA's frozen base loads in bfloat16, its adapter
  stays float32 (peft's default);
* a CPU without it: bfloat16 is emulated there and slower than float32, so the worker trains in
  float32 and says so (``bf16_note``).
GPU workers are not affected. ``torch_dtype`` set explicitly always wins.
"""

from __future__ import annotations

import functools

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """Whether this machine's CPU computes bfloat16 natively (Linux: /proc/cpuinfo's flags)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in NATIVE_BF16_FLAGS)
    except OSError:
        pass
    return False


def bf16_note(bf16: bool, use_cpu: bool) -> str | None:
    """Why a CPU worker trains in float32 although ``bf16`` is true; None where bf16 stands."""
    if not (bf16 and use_cpu) or cpu_has_bf16():
        return None
    return ("bf16: true, but this CPU has no native bfloat16 (no avx512_bf16 or amx_bf16 flag): emulated bfloat16 "
            "is slower than float32 here, so this worker trains in float32.")


def training_load_dtype(model_args, finetuning_type: str, bf16: bool, fp16: bool, use_cpu: bool) -> str:
    """The dtype a training run loads its weights in: ``torch_dtype`` if set; on a CPU worker with
    bf16, float32 for the weights that train (full, freeze) and bfloat16 for LoRA's frozen base."""
    if use_cpu and bf16 and model_args.torch_dtype == "auto" and finetuning_type in ("full", "freeze"):
        return "float32"
    return model_args.load_dtype(bf16, fp16)
