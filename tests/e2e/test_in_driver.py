"""Training in the driver (fabric/train_in_driver.py): what such a run hands back.

Its losses against a Ray Train worker's are in test_worker_parity.py; Ctrl-C and the console in
test_console.py; a killed run resumed from its newest intact checkpoint in test_resume.py.
"""

from __future__ import annotations

import os

import pytest
from transformers import TrainerCallback

from cluster.driver import run_exp
from stages.training.checkpoints import has_manifest


def test_the_reported_checkpoint_is_the_committed_folder_in_output_dir(ray_session, sft_config):
    """Ray Train's local mode keeps the last reported Checkpoint object only, so the run reports
    the committed checkpoint-N itself; Ray storage gets no copy (no worker group to restart), and
    the result's metrics are those of the last checkpoint's report, as a worker group's are."""
    config = sft_config(max_steps=4, save_steps=2, save_total_limit=1)
    result = run_exp(config)
    out = config["output_dir"]
    assert result.checkpoint_path == os.path.join(out, "checkpoint-4")
    assert has_manifest(result.checkpoint_path)
    assert sorted(name for name in os.listdir(out) if name.startswith("checkpoint-")) == ["checkpoint-4"]
    assert not os.path.exists(config["ray_storage_path"]) or os.listdir(config["ray_storage_path"]) == []
    assert result.metrics["epoch"] > 0 and "loss" in result.metrics


def test_a_worker_group_when_the_config_asks_for_one(ray_session, sft_config):
    """train_in_driver: false: the checkpoint is Ray Train's copy in the run's Ray storage folder."""
    config = sft_config(max_steps=2, save_steps=2, train_in_driver=False)
    result = run_exp(config)
    storage = config["ray_storage_path"]
    assert result.checkpoint_path.startswith(storage + os.sep)
    assert has_manifest(os.path.join(result.checkpoint_path, "checkpoint"))


class RecordCheckpointing(TrainerCallback):
    def __init__(self):
        self.gradient_checkpointing: list[bool] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.gradient_checkpointing.append(args.gradient_checkpointing)


@pytest.mark.parametrize("memory, checkpointing", [(2**20, True), (None, False)])
def test_the_memory_plan_reads_resources_per_worker_memory_in_the_driver_too(ray_session, sft_config, memory,
                                                                            checkpointing):
    """The driver holds no Ray resources, so the memory a config gives each worker comes with the
    payload: 1 MiB cannot hold the tiny model's weights, gradients and Adam state (~3 MB), and the
    plan turns gradient checkpointing on; without it the machine's memory is the budget."""
    resources = {"CPU": 1} | ({"memory": memory} if memory else {})
    recorder = RecordCheckpointing()
    run_exp(sft_config(max_steps=1, resources_per_worker=resources), callbacks=[recorder])
    assert recorder.gradient_checkpointing == [checkpointing]
