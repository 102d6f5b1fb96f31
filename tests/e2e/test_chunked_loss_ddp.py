"""chunked_loss under DDP: two Ray Train workers full-fine-tuning (DistributedDataParallel with its
unused-parameter search) log the same losses as with the plain loss. The chunked loss runs inside the
model's forward, through DDP's wrapper; were it computed around it, the gradient all-reduce would be
skipped and the ranks' weights, and so the losses after the first step, would drift apart."""

from __future__ import annotations

from cluster.driver import run_exp
from stages.training.callbacks import read_log
from tests.e2e.conftest import tiny_sft_config


def _losses(output_dir: str) -> list[float]:
    return [r["loss"] for r in read_log(output_dir) if "loss" in r]


def test_two_workers_train_alike_with_and_without_the_chunked_loss(ray_session, tmp_path):
    runs = {}
    for name, options in {"plain": {"chunked_loss": False}, "chunked": {"chunked_loss": True, "chunked_loss_tokens": 16}}.items():
        config = tiny_sft_config(tmp_path / name, ray_num_workers=2, per_device_train_batch_size=8, max_steps=6,
                                 **options)
        runs[name] = _losses(run_exp(config).output_dir)
    plain, chunked = runs["plain"], runs["chunked"]
    assert len(plain) == len(chunked) == 6
    assert max(abs(a - b) / b for a, b in zip(chunked, plain)) < 1e-5, (chunked, plain)
    assert plain[-1] < 0.9 * plain[0]  # it trained: a flat curve would match trivially
