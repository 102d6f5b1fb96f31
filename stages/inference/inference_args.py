"""The inference and export halves of a config (LLaMA-Factory's key names).

``InferenceArguments`` picks the engine behind ``ChatModel`` (chat, serve, predict) and sizes a
vLLM engine; ``ExportArguments`` says where and how ``rayfactory export`` writes a merged model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from registries.errors import ArgumentError

# LLaMA-Factory writes "huggingface"; "hf" is accepted as the same (our RL configs say hf).
BACKEND_ALIASES = {"hf": "huggingface"}


@dataclass
class InferenceArguments:
    # the engine of chat, predict and serve: huggingface (hf) or vllm
    infer_backend: Literal["huggingface", "hf", "vllm"] = "huggingface"
    # The engine's context window (prompt + reply). vLLM preallocates KV cache for it.
    vllm_maxlen: int = 4096
    vllm_gpu_util: float = 0.7  # GPU memory share of a vLLM engine (GPU only)
    vllm_max_lora_rank: int = 32  # the largest adapter rank a vLLM engine accepts
    vllm_max_loras: int = 4  # adapters a vLLM engine keeps loaded at once
    # vLLM's KV cache in GiB on CPU (vLLM otherwise takes a share of the machine's RAM).
    vllm_cpu_kv_cache_gib: float = 0.25
    vllm_config: Optional[dict[str, Any]] = None  # extra vllm engine arguments, passed as they are
    # More adapters on the same base, selected by name per request (vLLM's --lora-modules):
    # {name: adapter folder}. adapter_name_or_path stays the default model's own adapter.
    lora_modules: Optional[dict[str, str]] = None
    served_model_name: Optional[str] = None  # the default model's name (None: the adapter's or model's folder name)

    def __post_init__(self) -> None:
        self.infer_backend = BACKEND_ALIASES.get(self.infer_backend, self.infer_backend)
        if self.vllm_maxlen < 16:
            raise ArgumentError("vllm_maxlen", f"vllm_maxlen must be at least 16 tokens, got {self.vllm_maxlen}.")
        if not 0 < self.vllm_gpu_util <= 1:
            raise ArgumentError("vllm_gpu_util", f"vllm_gpu_util must be in (0, 1], got {self.vllm_gpu_util}.")
        for name, path in (self.lora_modules or {}).items():
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise ArgumentError(
                    "lora_modules", f"lora_modules maps adapter names to adapter folders, e.g. {{math: saves/math-lora}}; "
                    f"got {name!r}: {path!r}."
                )
        if self.vllm_cpu_kv_cache_gib <= 0:
            raise ArgumentError(
                "vllm_cpu_kv_cache_gib", f"vllm_cpu_kv_cache_gib must be positive, got {self.vllm_cpu_kv_cache_gib}."
            )


@dataclass
class ExportArguments:
    export_dir: Optional[str] = None  # required by `rayfactory export`
    export_size: float = 5  # largest shard, in GB (LLaMA-Factory's int; fractions allowed, e.g. 0.5)
    export_device: Literal["cpu", "auto"] = "cpu"  # where the merge runs ("auto": a GPU when there is one)
    export_legacy_format: bool = False  # false: safetensors; true: pytorch_model*.bin
    export_hub_model_id: Optional[str] = None  # pushing to the hub is not built: refused with a note
    # 8 or 4: the merged model saved with bitsandbytes-quantized linear layers (int8 / nf4), which
    # transformers loads back as it is. LLaMA-Factory's meaning is GPTQ, which needs a GPU.
    export_quantization_bit: Optional[int] = None
    # gguf: also one GGUF file for llama.cpp / Ollama (tokenizer and chat template inside) and an
    # Ollama Modelfile, next to the merged model (stages/inference/gguf_export.py).
    export_format: Literal["safetensors", "gguf"] = "safetensors"
    export_gguf_type: Literal["f32", "f16", "bf16", "q8_0"] = "f16"  # export_format gguf: the GGUF weights' type

    def __post_init__(self) -> None:
        if self.export_size <= 0:
            raise ArgumentError("export_size", f"export_size is the largest shard in GB: positive, got {self.export_size}.")
        if self.export_quantization_bit not in (None, 4, 8):
            raise ArgumentError(
                "export_quantization_bit",
                f"export_quantization_bit is 8 or 4 (bitsandbytes int8 / nf4 weights), got {self.export_quantization_bit}. "
                "Other widths (GPTQ's 2 and 3 bits) need a GPTQ tool on a GPU: export full precision, then quantize "
                "that folder with GPTQModel or llm-compressor.",
            )
        if self.export_quantization_bit and self.export_format == "gguf":
            raise ArgumentError(
                "export_quantization_bit",
                "export_quantization_bit quantizes with bitsandbytes, which a GGUF file cannot hold. For a quantized "
                "GGUF set export_gguf_type: q8_0 and remove export_quantization_bit.",
            )
        if self.export_quantization_bit and self.export_legacy_format:
            raise ArgumentError(
                "export_legacy_format",
                "bitsandbytes-quantized weights are saved as safetensors only: remove export_legacy_format or "
                "export_quantization_bit.",
            )
