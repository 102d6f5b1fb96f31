"""Giving the heap's freed memory back between a preference step's passes (stages/training/heap_release.py)."""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainingArguments

from stages.recipes.dpo import PreferenceTrainer
from stages.training.reference import Reference
from stages.run_args import FinetuningArguments
from stages.training import heap_release
from stages.training.preference_collators import PairwiseCollator
from tests.stages.test_sequence_logps import pairs, tiny_llama

GLIBC = heap_release._malloc_trim() is not None


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not GLIBC or not os.path.exists("/proc/self/statm"),
                    reason="malloc_trim is glibc's, and resident memory is read from Linux's /proc")
def test_freed_blocks_between_live_ones_go_back_to_the_system_only_when_trimmed():
    # 3,000 blocks of 64 KiB (under glibc's mmap threshold: heap blocks), each written to; every
    # tenth stays. The 2,700 freed ones sit between live blocks, so glibc cannot give them back from
    # the heap's top: the pattern a pass's activations leave behind.
    # First hand back what earlier work in this process freed: the new blocks must land on pages
    # that are not resident yet, or the pattern is invisible in the resident size.
    heap_release.release_freed_heap()
    before = resident_bytes()
    blocks = [torch.ones(16 * 1024) for _ in range(3000)]
    kept = blocks[::10]
    del blocks
    held = resident_bytes()
    assert held - before > 150 * 2**20, "the freed blocks were given back without a trim"
    assert heap_release.release_freed_heap() is True
    released = held - resident_bytes()
    assert released > 120 * 2**20, f"only {released / 2**20:.0f} MiB went back"
    assert all(block[0].item() == 1.0 for block in kept)  # the live blocks are untouched


def test_a_worker_trims_only_on_a_cpu_with_gradient_checkpointing():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert heap_release.releases_heap(SimpleNamespace(gradient_checkpointing=True, device=cpu))
    assert not heap_release.releases_heap(SimpleNamespace(gradient_checkpointing=False, device=cpu))
    assert not heap_release.releases_heap(SimpleNamespace(gradient_checkpointing=True, device=cuda))


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_dpo_trainer_trims_around_each_pass_and_its_loss_is_unchanged(checkpointing, tmp_path, monkeypatch):
    import datasets

    trims = []
    real = heap_release.release_freed_heap
    monkeypatch.setattr(heap_release, "release_freed_heap", lambda: trims.append(1) or real())
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, report_to=[],
                             remove_unused_columns=False, save_strategy="no", gradient_checkpointing=checkpointing)
    reference = Reference("model", copy.deepcopy(tiny_llama(seed=5)).eval().requires_grad_(False))
    trainer = PreferenceTrainer(model=tiny_llama(), args=args, train_dataset=datasets.Dataset.from_list(pairs()),
                                data_collator=PairwiseCollator(pad_token_id=0), reference=reference,
                                finetuning_args=FinetuningArguments(stage="dpo", finetuning_type="full"))
    batch = PairwiseCollator(pad_token_id=0)(pairs())
    loss, _ = trainer.batch_loss(trainer.model, batch)
    # Two passes (the policy's, the reference's), a trim before and after each; none without checkpointing.
    assert len(trims) == (4 if checkpointing else 0)
    trainer._releases_heap = not trainer._releases_heap  # the other way on the same batch: the same loss
    again, _ = trainer.batch_loss(trainer.model, batch)
    assert len(trims) == 4
    assert again.item() == loss.item()
