"""LLaVA-1.5 sft end to end: the tiny random-init LLaVA (``tiny:llava``: CLIP tower, MLP projector,
Llama decoder) trained on the shapes pictures through the normal command path, as
test_vision_sft.py does for Qwen2-VL. Its images are fixed-size crops with no grid, so this checks
that path of the tokenizer (Ray Data), the collator and the forward."""

from __future__ import annotations

import os

import pytest

from cluster.driver import run_exp
from stages.training.callbacks import read_log
from tests.e2e.conftest import tiny_sft_config

pytestmark = pytest.mark.ray


def test_llava_sft_runs_on_ray_and_loss_falls(ray_session, tmp_path):
    config = tiny_sft_config(
        tmp_path / "out", model_name_or_path="tiny:llava", template="llava", dataset="shapes_train",
        cutoff_len=128, per_device_train_batch_size=16, learning_rate=3.0e-3, max_steps=20,
        preprocessing_engine="ray_data",
    )
    result = run_exp(config)
    out = result.output_dir
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json", "trainer_log.jsonl"):
        assert os.path.exists(os.path.join(out, name)), name
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    # every row kept: a cut-off image row would be skipped, so this also says 16 <image> tokens fit
    assert result.data_stats == {"train_examples": 192, "eval_examples": 0}
