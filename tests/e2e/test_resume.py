"""Stopping after a checkpoint and rerunning with resume_from_checkpoint (auto: the latest complete
checkpoint in output_dir) continues the very same run.

Run A trains N steps without a break. Run B is the same config stopped right after the checkpoint
at step K (what a user's Ctrl-C after a save leaves behind), then rerun from output_dir/checkpoint-K.
B's steps K+1..N must reproduce A's: optimizer, scheduler, RNG and data position all come back.
K sits mid-epoch (20 batches per epoch) and N lies in the next epoch, so both the skipped
batches and the next epoch's shuffle are exercised; a linear schedule makes the scheduler matter.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import ray.cloudpickle
from safetensors.torch import load_file
from transformers import TrainerCallback

from cluster.config import ConfigError
from cluster.driver import run_exp
from fabric.launcher import default_run_name
from stages.callbacks import read_log

# Ray pickles the callbacks to the workers, which cannot import this test module by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, SAVE_STEPS, K = 24, 8, 16
# Measured: resumed losses, grad norms, learning rates and final weights match the uninterrupted
# run bit for bit on CPU (difference 0.0). The tolerance only leaves room for float noise; it is far
# below the smallest step-to-step loss change (0.008 over steps 16..24), so a skipped, repeated or
# reshuffled batch fails.
LOSS_TOL = 1e-6


class StopAfterSave(TrainerCallback):
    """Ends training right after the checkpoint at ``step`` is written and reported."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class RecordBegin(TrainerCallback):
    """Writes the step each attempt starts from, to show which checkpoint (if any) was loaded."""

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{state.global_step}\n")


def _losses(output_dir: str) -> dict[int, tuple[float, float]]:
    rows = [r for r in read_log(output_dir) if "loss" in r]
    steps = [r["current_steps"] for r in rows]
    assert len(steps) == len(set(steps)), f"repeated steps in the log: {steps}"
    return {r["current_steps"]: (r["loss"], r["lr"]) for r in rows}


def test_rerun_with_resume_from_checkpoint_continues_the_same_run(ray_session, sft_config, tmp_path):
    common = dict(max_steps=N, save_steps=SAVE_STEPS, lr_scheduler_type="linear", warmup_steps=4)
    a_dir = tmp_path / "a"
    a = run_exp({**sft_config(**common), "output_dir": str(a_dir), "ray_storage_path": str(a_dir / "ray")})

    begins = str(tmp_path / "begins.txt")
    stopped = run_exp(sft_config(**common), callbacks=[StopAfterSave(K), RecordBegin(begins)])
    out = stopped.output_dir
    assert sorted(_losses(out)) == list(range(1, K + 1))
    assert sorted(os.listdir(out)).count(f"checkpoint-{K}") == 1

    # What a crash in the middle of a save leaves: a later checkpoint folder without trainer_state.json,
    # which the Trainer writes last. `auto` must pass over it to checkpoint-K.
    os.makedirs(os.path.join(out, f"checkpoint-{K + 4}"))
    with open(os.path.join(out, f"checkpoint-{K + 4}", "config.json"), "w", encoding="utf-8") as f:
        f.write("{}")
    resumed = run_exp(sft_config(**common, resume_from_checkpoint="auto"), callbacks=[RecordBegin(begins)])
    with open(begins, encoding="utf-8") as f:
        assert f.read().split() == ["0", str(K)]  # the rerun started at the checkpoint, not at 0

    a_log, b_log = _losses(a.output_dir), _losses(resumed.output_dir)
    assert sorted(b_log) == list(range(1, N + 1))  # every step exactly once, across both runs of B
    for step in range(1, N + 1):
        (loss_a, lr_a), (loss_b, lr_b) = a_log[step], b_log[step]
        assert lr_b == lr_a, f"step {step}: lr {lr_b} != {lr_a} (scheduler not restored)"
        assert abs(loss_b - loss_a) <= LOSS_TOL, f"step {step}: loss {loss_b} != {loss_a}"
    # One run summary (train_runtime, train_loss...) at the end, not a stale one from the stopped run.
    summaries = [r["current_steps"] for r in read_log(out) if "train_runtime" in r]
    assert summaries == [N]
    # elapsed_time goes on from the stopped run's last line instead of starting again at 0
    elapsed = [r["elapsed_time"] for r in read_log(out) if "loss" in r]
    assert all(later > earlier for earlier, later in zip(elapsed, elapsed[1:])), elapsed

    weights_a = load_file(os.path.join(a.output_dir, "model.safetensors"))
    weights_b = load_file(os.path.join(resumed.output_dir, "model.safetensors"))
    assert weights_a.keys() == weights_b.keys()
    worst = max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a)
    assert worst <= LOSS_TOL, f"final weights differ by up to {worst}"
    with open(os.path.join(out, "trainer_state.json"), encoding="utf-8") as f:
        assert json.load(f)["global_step"] == N


def test_resume_from_missing_checkpoint_is_a_config_error(sft_config, tmp_path):
    missing = tmp_path / "out" / "checkpoint-7"
    with pytest.raises(ConfigError) as error:
        run_exp(sft_config(resume_from_checkpoint=str(missing)))
    message = str(error.value)
    assert f"resume_from_checkpoint {str(missing)!r}" in message
    assert "does not exist" in message and "Point it at a checkpoint folder, or remove it." in message


def test_new_run_name_starts_fresh_and_a_reused_ray_run_name_restores(ray_session, sft_config, tmp_path):
    """Ray Train V2 restores any run whose name already has a checkpoint snapshot in the storage
    path. Our default name is new for every run, so a plain rerun into the same output_dir and
    storage starts at step 0; naming the old run in ray_run_name is the opt-in to continue it."""
    begins = str(tmp_path / "begins.txt")
    first = sft_config(max_steps=4, save_steps=2)
    run_exp(first)
    storage = first["ray_storage_path"]
    (old_name,) = os.listdir(storage)
    assert os.path.exists(os.path.join(storage, old_name, "checkpoint_manager_snapshot.json"))

    run_exp(sft_config(max_steps=4, save_steps=2), callbacks=[RecordBegin(begins)])
    assert len(os.listdir(storage)) == 2  # a second run folder, not the first one reopened

    run_exp(sft_config(max_steps=6, save_steps=2, ray_run_name=old_name), callbacks=[RecordBegin(begins)])
    with open(begins, encoding="utf-8") as f:
        # fresh name: from scratch, although step 4 of the first run sits in the same storage;
        # reused name: from that run's last Ray checkpoint (step 4), trains 5..6 only.
        assert f.read().split() == ["0", "4"]
    assert [r["current_steps"] for r in read_log(first["output_dir"]) if "loss" in r] == list(range(1, 7))


def test_default_run_names_differ_within_one_second():
    names = {default_run_name("saves/qwen/lora/sft") for _ in range(5)}
    assert len(names) == 5 and all(name.startswith("sft-") for name in names)
