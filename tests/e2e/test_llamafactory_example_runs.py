"""LLaMA-Factory's examples/train_lora/qwen3_lora_kto.yaml trains, its keys as they are, on a 2-layer
Qwen3 with Qwen3's genuine tokenizer and our kto_en_demo: LoRA (the reference is the adapter off),
batch 1 with 8 accumulation steps, bf16, prompts attended once. Issue 62: it died at step 1. The
losses' equality with the full KL passes is tests/stages/test_kto_llamafactory_example.py; every
example's keys load in tests/cluster/test_llamafactory_examples.py."""

from __future__ import annotations

import os

from cluster.driver import run_exp
from stages.training.callbacks import read_log
from tests.llamafactory import lf_example, tiny_qwen3_with_its_tokenizer


def test_llamafactory_qwen3_lora_kto_example_trains(ray_session, tmp_path):
    config = lf_example("qwen3_lora_kto", model=str(tiny_qwen3_with_its_tokenizer()), output_dir=str(tmp_path / "out"),
                        ray_storage_path=str(tmp_path / "ray"), max_steps=2, logging_steps=1)
    result = run_exp(config)
    train = [r for r in read_log(result.output_dir) if "loss" in r]
    assert [r["current_steps"] for r in train] == [1, 2]
    assert all(0.0 < r["loss"] < 1.0 and r["kl"] >= 0.0 for r in train)
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json"):
        assert os.path.exists(os.path.join(result.output_dir, name)), name
