"""``export_quantization_bit: 8 | 4``: the merged model's linear layers saved bitsandbytes-quantized.

bitsandbytes quantizes while a model loads, so the full-precision export already written is
loaded back with a ``BitsAndBytesConfig`` (int8 for 8, nf4 with float32 compute for 4) and saved
over itself. transformers loads the result as it is (the quantization config is in config.json),
on CPU as on a GPU; embeddings and the output head stay full precision, as bitsandbytes keeps them.
"""

from __future__ import annotations

import os


def quantize_export(out: str, bits: int, max_shard_bytes: float) -> dict:
    """Quantize the export in ``out`` in place; what was done, for the export's note."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(out, quantization_config=config, device_map="cpu")
    for name in os.listdir(out):  # the full-precision shards and their index give way to the quantized ones
        if name.startswith("model") and (name.endswith(".safetensors") or name.endswith(".index.json")):
            os.remove(os.path.join(out, name))
    model.save_pretrained(out, max_shard_size=max(1, int(max_shard_bytes)))
    return {"method": "bitsandbytes", "bits": bits, "weights": "int8" if bits == 8 else "nf4"}
