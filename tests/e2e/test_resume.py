"""Killing the driver and rerunning the same command with ``resume_from_checkpoint: auto`` continues
the very same run from the newest checkpoint that was completely written.

Run A trains N steps without a break. Run B uses a config file with ``resume_from_checkpoint: auto``
(in an empty output_dir that means a fresh start). Its driver, a separate process like the user's
``rayfactory train``, gets SIGKILL once step KILL_STEP is logged, after the checkpoints at 8 and
16 were saved. Then the newest checkpoint is damaged as a crash or a full disk would leave it (a
file cut short) and the same command runs again: it must skip checkpoint-16 with a warning, resume
from checkpoint-8 and reproduce A's steps 9..N: optimizer, scheduler, RNG and data position all
come back. 8 sits mid-epoch (20 batches per epoch) and N lies in the next epoch, so both the
skipped batches and the next epoch's shuffle are exercised; a linear schedule makes the scheduler matter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray.cloudpickle
import yaml
from safetensors.torch import load_file
from transformers import TrainerCallback

from cluster.config import ConfigError
from cluster.driver import run_exp
from fabric.launcher import default_run_name
from stages.training.callbacks import LOG_FILE, read_log
from stages.training.checkpoints import MANIFEST_NAME
from tests.e2e.conftest import REPO_ROOT, output_files

# Ray pickles the callbacks to the workers, which cannot import this test module by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, SAVE_STEPS, KILL_STEP = 24, 8, 17
RESUME_STEP = 8  # checkpoint-16 is damaged before the rerun, so auto falls back to checkpoint-8
# Measured: resumed losses, grad norms, learning rates and final weights match the uninterrupted
# run bit for bit on CPU (difference 0.0). The tolerance only leaves room for float noise; it is far
# below the smallest step-to-step loss change (0.008 over steps 16..24), so a skipped, repeated or
# reshuffled batch fails.
LOSS_TOL = 1e-6
DRIVER_TIMEOUT_S = 300


class HoldForKill(TrainerCallback):
    """Once step ``step`` is in trainer_log.jsonl, rank 0 says so in ``ready`` and waits to be killed."""

    def __init__(self, step: int, ready: str):
        self.step, self.ready = step, ready

    def on_log(self, args, state, control, logs=None, **kwargs):  # after JsonlLogCallback wrote the line
        if state.global_step == self.step and state.is_world_process_zero and not os.path.exists(self.ready):
            with open(self.ready, "w", encoding="utf-8") as f:
                f.write(str(os.getpid()))
            time.sleep(DRIVER_TIMEOUT_S)
            raise RuntimeError("the driver was not killed")


class RecordBegin(TrainerCallback):
    """Writes the step each attempt starts from, to show which checkpoint (if any) was loaded."""

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{state.global_step}\n")


# The first run of B: the driver the CLI runs, plus the hold; in its own session, so that whatever
# outlives the SIGKILL can be cleaned up with the process group.
KILLED_DRIVER = """
import sys
sys.path.insert(0, {repo!r})
from cluster.config import load_config
from cluster.driver import run_exp
from tests.e2e.test_resume import HoldForKill
run_exp(load_config(sys.argv[1]), callbacks=[HoldForKill(int(sys.argv[2]), sys.argv[3])])
"""


def _losses(output_dir: str) -> dict[int, tuple[float, float]]:
    rows = [r for r in read_log(output_dir) if "loss" in r]
    steps = [r["current_steps"] for r in rows]
    assert len(steps) == len(set(steps)), f"repeated steps in the log: {steps}"
    return {r["current_steps"]: (r["loss"], r["lr"]) for r in rows}


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def _kill_driver_at(config_path: str, step: int, ready: str) -> None:
    driver = subprocess.Popen(
        [sys.executable, "-c", KILLED_DRIVER.format(repo=REPO_ROOT), config_path, str(step), ready],
        cwd=REPO_ROOT, env=_clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + DRIVER_TIMEOUT_S
        while not os.path.exists(ready):
            assert driver.poll() is None, f"the driver ended (exit {driver.returncode}) before step {step}"
            assert time.time() < deadline, f"step {step} was not reached in {DRIVER_TIMEOUT_S} s"
            time.sleep(0.2)
        os.kill(driver.pid, signal.SIGKILL)
        assert driver.wait(timeout=30) == -signal.SIGKILL
    finally:
        time.sleep(3)  # Ray's own processes die with their driver; anything left goes with the group
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_killed_driver_reruns_with_auto_from_the_newest_intact_checkpoint(ray_session, sft_config, tmp_path):
    common = dict(max_steps=N, save_steps=SAVE_STEPS, lr_scheduler_type="linear", warmup_steps=4)
    a_dir = tmp_path / "a"
    a = run_exp({**sft_config(**common), "output_dir": str(a_dir), "ray_storage_path": str(a_dir / "ray")})

    config = sft_config(**common, resume_from_checkpoint="auto")
    config_path = str(tmp_path / "b.yaml")
    with open(config_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f)
    out = config["output_dir"]
    _kill_driver_at(config_path, KILL_STEP, str(tmp_path / "ready"))

    assert sorted(_losses(out)) == list(range(1, KILL_STEP + 1))  # the killed run got as far as KILL_STEP
    for step in (8, 16):
        assert os.path.isfile(os.path.join(out, f"checkpoint-{step}", MANIFEST_NAME)), f"checkpoint-{step} uncommitted"
    with open(os.path.join(out, LOG_FILE), encoding="utf-8") as f:
        killed_log = f.readlines()
    # What a crash in the middle of writing checkpoint-16 (or a full disk) leaves: a file cut short.
    weights_16 = os.path.join(out, "checkpoint-16", "model.safetensors")
    with open(weights_16, "r+b") as f:
        f.truncate(os.path.getsize(weights_16) // 2)

    rerun = subprocess.run([sys.executable, "-m", "cluster.cli", "train", config_path], cwd=REPO_ROOT,
                           env=_clean_env(), capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
    with open(os.path.join(out, "rayfactory.log"), encoding="utf-8") as f:
        run_log = f.read()
    assert rerun.returncode == 0, rerun.stderr[-4000:] + run_log[-4000:]
    assert "resume_from_checkpoint auto: skipping" in run_log and "checkpoint-16: model.safetensors is" in run_log

    with open(os.path.join(out, LOG_FILE), encoding="utf-8") as f:
        resumed_log = f.readlines()
    # Lines 1..8 are the killed run's, untouched (the rerun began at checkpoint-8, not at 0);
    # 9..17 were written again by the rerun, 18..N are new.
    assert resumed_log[:RESUME_STEP] == killed_log[:RESUME_STEP]
    assert resumed_log[RESUME_STEP] != killed_log[RESUME_STEP]
    a_log, b_log = _losses(a.output_dir), _losses(out)
    assert sorted(b_log) == list(range(1, N + 1))  # every step exactly once, across both runs of B
    for step in range(1, N + 1):
        (loss_a, lr_a), (loss_b, lr_b) = a_log[step], b_log[step]
        assert lr_b == lr_a, f"step {step}: lr {lr_b} != {lr_a} (scheduler not restored)"
        assert abs(loss_b - loss_a) <= LOSS_TOL, f"step {step}: loss {loss_b} != {loss_a}"
    # One run summary (train_runtime, train_loss...) at the end, not a stale one from the stopped run.
    summaries = [r["current_steps"] for r in read_log(out) if "train_runtime" in r]
    assert summaries == [N]
    # elapsed_time goes on from the killed run's line 8 instead of starting again at 0
    elapsed = [r["elapsed_time"] for r in read_log(out) if "loss" in r]
    assert all(later > earlier for earlier, later in zip(elapsed, elapsed[1:])), elapsed

    weights_a = load_file(os.path.join(a.output_dir, "model.safetensors"))
    weights_b = load_file(os.path.join(out, "model.safetensors"))
    assert weights_a.keys() == weights_b.keys()
    worst = max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a)
    assert worst <= LOSS_TOL, f"final weights differ by up to {worst}"
    with open(os.path.join(out, "trainer_state.json"), encoding="utf-8") as f:
        assert json.load(f)["global_step"] == N

    # B has finished: the same command again trains nothing, says so, and touches no file (its log included).
    before = output_files(out)
    again = subprocess.run([sys.executable, "-m", "cluster.cli", "train", config_path], cwd=REPO_ROOT,
                           env=_clean_env(), capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"checkpoint-{N} is step {N} of {N}" in again.stdout and "nothing was trained" in again.stdout
    assert output_files(out) == before


def test_resume_from_missing_checkpoint_is_a_config_error(sft_config, tmp_path):
    missing = tmp_path / "out" / "checkpoint-7"
    with pytest.raises(ConfigError) as error:
        run_exp(sft_config(resume_from_checkpoint=str(missing)))
    message = str(error.value)
    assert f"resume_from_checkpoint {str(missing)!r}" in message
    assert "does not exist" in message and "Point it at a checkpoint folder, or remove it." in message


def test_new_run_name_starts_fresh_and_a_reused_ray_run_name_restores(ray_session, sft_config, tmp_path):
    """Ray Train V2 restores any run whose name already has a checkpoint snapshot in the storage
    path. Our default name is new for every run, so a rerun into the same output_dir and storage
    (overwrite_output_dir: true) starts at step 0; naming the old run in ray_run_name is the opt-in
    to continue it.
    (A run that trains in the driver copies nothing to Ray storage: these two keep their worker.)"""
    begins = str(tmp_path / "begins.txt")
    first = sft_config(max_steps=4, save_steps=2, train_in_driver=False)
    run_exp(first)
    storage = first["ray_storage_path"]
    (old_name,) = os.listdir(storage)
    assert os.path.exists(os.path.join(storage, old_name, "checkpoint_manager_snapshot.json"))

    # overwrite_output_dir replaces the first run in output_dir; a ray_storage_path the config names stays
    run_exp(sft_config(max_steps=4, save_steps=2, train_in_driver=False, overwrite_output_dir=True),
            callbacks=[RecordBegin(begins)])
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
