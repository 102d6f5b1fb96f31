"""Helpers for end-to-end runs: a real local Ray, the tiny model, our demo data."""

from __future__ import annotations

import os

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_sft_config(output_dir, **overrides) -> dict:
    """A fast sft run of the tiny Qwen2-style model on the synthetic addition task."""
    config = {
        "model_name_or_path": "tiny:qwen2",
        "template": "qwen",
        "stage": "sft",
        "finetuning_type": "full",
        "dataset": "arith_train",
        "dataset_dir": os.path.join(REPO_ROOT, "data"),
        "cutoff_len": 64,
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 16,
        "learning_rate": 3.0e-3,
        "max_steps": 20,
        "logging_steps": 1,
        "save_steps": 1000,
        "lr_scheduler_type": "constant",
        "seed": 42,
        "report_to": "none",
        "ray_num_workers": 1,
        "ray_storage_path": os.path.join(str(output_dir), "ray"),
    }
    config.update(overrides)
    return config


@pytest.fixture
def sft_config(tmp_path):
    return lambda **overrides: tiny_sft_config(tmp_path / "out", **overrides)
