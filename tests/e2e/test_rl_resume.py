"""RL checkpoints (stage ppo, and grpo through the same loop): a run killed after a checkpoint and
resumed continues the very same run; a role actor killed mid-run is restarted from the last one.

Run A trains 4 PPO steps without a break. Run B is the same config in its own process, killed
(SIGKILL) while step 3 is being scored, after checkpoint-2 was committed; `resume_from_checkpoint:
auto` then picks checkpoint-2 (not a half-written checkpoint-3 left next to it) and trains steps 3
and 4. With 16 prompts and 8 per step, checkpoint-2 sits exactly at an epoch boundary, so step 3
must start the second epoch's shuffle, not train nothing. The HF rollout backend samples with a
seed per step, so B's steps 3-4 must equal A's: the same prompts, the same samples, the same
updates of the policy (LoRA) and the critic, their optimizers and schedules.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import threading
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from cluster.driver import run_exp
from stages.training.callbacks import read_log
from stages.rl.workers.checkpoint import STATE_FILE
from tests.e2e.conftest import DATA_DIR, assert_rerun_of_a_finished_run_trains_nothing, kill_run_at_its_stall

PARAM_TOL = 1e-6
# Set in the killed run's process only: its reward function stalls on this call, after writing the marker.
STALL_AT_CALL = 0
STALL_MARKER = ""


def stalling_digit_ratio(prompts, completions, **kwargs):
    """digit_ratio, except that in the process to be killed the STALL_AT_CALL-th call (step 3's
    scoring) writes a marker and waits to be killed: the kill lands at a known point."""
    stalling_digit_ratio.calls = getattr(stalling_digit_ratio, "calls", 0) + 1
    if STALL_AT_CALL and stalling_digit_ratio.calls == STALL_AT_CALL:
        with open(STALL_MARKER, "w", encoding="utf-8") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    out = []
    for c in completions:
        chars = [ch for ch in c if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return out


def ppo_config(output_dir, **overrides) -> dict:
    config = {
        "model_name_or_path": "tiny:qwen2", "template": "qwen", "stage": "ppo", "finetuning_type": "lora",
        "lora_rank": 8, "dataset": "arith_train", "dataset_dir": DATA_DIR, "max_samples": 16, "cutoff_len": 64,
        "reward_funcs": ["tests.e2e.test_rl_resume:stalling_digit_ratio"], "critic_init": "policy",
        "rollout_batch_size": 8, "max_completion_length": 6, "ppo_epochs": 2, "ppo_buffer_size": 2,
        "per_device_train_batch_size": 2, "beta": 0.1, "top_k": 50,
        "output_dir": str(output_dir), "max_steps": 4, "save_steps": 2, "logging_steps": 1,
        "learning_rate": 5e-3, "lr_scheduler_type": "linear", "seed": 7, "rollout_backend": "hf",
        "ray_num_workers": 1, "ray_storage_path": os.path.join(str(output_dir), "ray"),
    }
    config.update(overrides)
    return config


def _weights(output_dir) -> dict[str, torch.Tensor]:
    out = load_file(os.path.join(output_dir, "adapter_model.safetensors"))
    critic = os.path.join(output_dir, "critic")
    for name in sorted(os.listdir(critic)):
        if name.endswith(".safetensors"):
            out.update({f"critic/{name}/{k}": v for k, v in load_file(os.path.join(critic, name)).items()})
    return out


def _steps(output_dir) -> dict[int, dict]:
    rows = [r for r in read_log(output_dir) if r.get("current_steps", 0) > 0 and "loss" in r]
    steps = [r["current_steps"] for r in rows]
    assert len(steps) == len(set(steps)), f"repeated steps in the log: {steps}"
    return {r["current_steps"]: r for r in rows}


def run_stopped_at(finished, copy, step: int):
    """``copy``: the output folder ``finished`` had after step ``step`` (its checkpoint-``step``
    and the trainer_log lines it had written by then), for a resume to go on from."""
    shutil.copytree(finished / f"checkpoint-{step}", copy / f"checkpoint-{step}")
    with open(finished / "trainer_log.jsonl", encoding="utf-8") as f:
        lines = [line for line in f if json.loads(line)["current_steps"] <= step]
    (copy / "trainer_log.jsonl").write_text("".join(lines))
    return copy


def test_killed_ppo_run_resumes_exactly_from_the_latest_complete_checkpoint(ray_session, tmp_path):
    a = run_exp(ppo_config(tmp_path / "a"))
    assert_rerun_of_a_finished_run_trains_nothing(ppo_config(tmp_path / "a"))
    a_steps = _steps(a.output_dir)
    assert sorted(a_steps) == [1, 2, 3, 4]

    # Run B in its own driver process on the same Ray cluster, killed at step 3's scoring.
    b_dir = tmp_path / "b"
    kill_run_at_its_stall(ray_session, ppo_config(b_dir), 3, tmp_path)
    assert sorted(_steps(b_dir)) == [1, 2]
    assert os.path.isfile(b_dir / "checkpoint-2" / STATE_FILE)
    # What a crash during a save leaves: a checkpoint-3 without its state file (and a staging folder).
    (b_dir / "checkpoint-3" / "policy").mkdir(parents=True)
    (b_dir / ".checkpoint-4.partial").mkdir()

    resumed = run_exp(ppo_config(b_dir, resume_from_checkpoint="auto"))
    b_steps = _steps(resumed.output_dir)
    assert sorted(b_steps) == [1, 2, 3, 4]
    elapsed = [b_steps[s]["elapsed_time"] for s in (1, 2, 3, 4)]  # goes on from the killed run's clock
    assert all(later > earlier for earlier, later in zip(elapsed, elapsed[1:])), elapsed
    for step in (3, 4):  # the same samples scored the same and the same updates
        for key in ("reward", "score", "loss", "value_loss", "kl", "lr", "critic/lr"):
            assert b_steps[step][key] == pytest.approx(a_steps[step][key], abs=PARAM_TOL), (step, key)
    a_weights, b_weights = _weights(a.output_dir), _weights(resumed.output_dir)
    assert a_weights.keys() == b_weights.keys()
    worst = max((a_weights[k] - b_weights[k]).abs().max().item() for k in a_weights)
    print(f"resume: largest parameter difference to the uninterrupted run {worst:.2e}")
    assert worst <= PARAM_TOL
    # Step 3 changed the weights: equality above is not the trivial kind.
    assert a_steps[3]["grad_norm"] > 0 and a_steps[3]["critic/grad_norm"] > 0


def _pids_of(title: str) -> list[int]:
    """This test session's processes whose title (Ray sets "ray::<ActorClass>...") starts with
    ``title``: the session's Ray (its raylet and so every worker) descends from this process, and
    another pytest-xdist worker's Ray, with actors of the same title, does not."""
    pids = []
    for process in psutil.Process(os.getpid()).children(recursive=True):
        try:
            cmdline = " ".join(process.cmdline())
        except psutil.Error:  # ended meanwhile
            continue
        if re.match(re.escape(title) + r"(\.|\s|$)", cmdline):
            pids.append(process.pid)
    return pids


def test_critic_killed_mid_run_restarts_from_the_last_checkpoint(ray_session, tmp_path, caplog):
    """max_failures 1: the critic's process dies after step 3 is logged (checkpoint at 2); every
    role restarts from checkpoint-2 and the log ends with steps 1-4, each once."""
    out = tmp_path / "out"
    killed: list[int] = []

    def kill_critic_after_step_3() -> None:
        log = out / "trainer_log.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline:
            if log.exists() and any(r.get("current_steps") == 3 for r in read_log(str(out))):
                pids = _pids_of("ray::CriticActor")
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
                    return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_critic_after_step_3, daemon=True)
    watcher.start()
    with caplog.at_level(logging.WARNING, logger="fabric.rl_launcher"):
        result = run_exp(ppo_config(out, max_steps=4, max_failures=1, reward_funcs=["digit_ratio"]))
    watcher.join(timeout=5)

    assert killed, "the critic was never killed"
    restarts = [r.getMessage() for r in caplog.records if "restarting every role" in r.getMessage()]
    assert len(restarts) == 1 and f"{out}/checkpoint-" in restarts[0], restarts
    steps = _steps(result.output_dir)  # asserts no step is repeated
    assert sorted(steps) == [1, 2, 3, 4]
    assert json.loads((out / "all_results.json").read_text())["total_steps"] == 4


def test_grpo_resumed_from_a_named_checkpoint_repeats_the_unbroken_run(ray_session, tmp_path):
    """The same checkpoints serve stage grpo: resuming from A's own checkpoint-2 (named by its
    path, in a copy of A's output) trains steps 3-5 exactly as A did. save_steps 2 does not divide
    max_steps 5: the last step is saved too, so a rerun of A trains nothing (auto would otherwise
    resume from checkpoint-4 and train step 5 again)."""
    def grpo(output_dir, **overrides):
        return ppo_config(output_dir, stage="grpo", finetuning_type="full", num_generations=4, rollout_batch_size=4,
                          reward_funcs=["digit_ratio"], beta=0.02, critic_init=None, max_steps=5,
                          **overrides)

    a = run_exp(grpo(tmp_path / "a"))
    assert (tmp_path / "a" / "checkpoint-5").is_dir()  # the last step, saved though 2 does not divide 5
    assert_rerun_of_a_finished_run_trains_nothing(grpo(tmp_path / "a"))
    b_dir = run_stopped_at(tmp_path / "a", tmp_path / "b", 2)
    resumed = run_exp(grpo(b_dir, resume_from_checkpoint=str(b_dir / "checkpoint-2")))

    a_steps, b_steps = _steps(a.output_dir), _steps(resumed.output_dir)
    assert sorted(b_steps) == [1, 2, 3, 4, 5]
    for step in (3, 4, 5):
        for key in ("reward", "loss", "kl", "lr"):
            assert b_steps[step][key] == pytest.approx(a_steps[step][key], abs=PARAM_TOL), (step, key)
    a_weights = load_file(os.path.join(a.output_dir, "model.safetensors"))
    b_weights = load_file(os.path.join(resumed.output_dir, "model.safetensors"))
    assert max((a_weights[k] - b_weights[k]).abs().max().item() for k in a_weights) <= PARAM_TOL
