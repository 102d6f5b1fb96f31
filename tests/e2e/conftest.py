"""Helpers for end-to-end runs: a real local Ray, the tiny model, our demo data."""

from __future__ import annotations

import os
import re

import pytest
import yaml

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.path.join(REPO_ROOT, "data")
# A line Ray forwards from a worker or actor of this or an earlier run: "(RayTrainWorker pid=12) ...",
# colour-coded on a terminal. It may arrive at any time, also while another test captures stderr.
RAY_FORWARDED = re.compile(r"(\x1b\[\d+m)?\(\w+ pid=\d+")


def own_lines(stderr: str) -> list[str]:
    """The lines the CLI itself printed, without Ray's forwarded worker output."""
    return [line for line in stderr.splitlines() if not RAY_FORWARDED.match(line)]


def tiny_sft_config(output_dir, **overrides) -> dict:
    """A fast sft run of the tiny Qwen2-style model on the synthetic addition task."""
    config = {
        "model_name_or_path": "tiny:qwen2",
        "template": "qwen",
        "stage": "sft",
        "finetuning_type": "full",
        "dataset": "arith_train",
        "dataset_dir": DATA_DIR,
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


def example_config(name: str, tmp_path, **overrides) -> dict:
    """configs/<name> with absolute data and deepspeed paths and the test's output folders.

    num_train_epochs is dropped: the tests set max_steps, sized for what each one measures.
    """
    with open(os.path.join(REPO_ROOT, "configs", name), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config.pop("num_train_epochs", None)
    config.update(dataset_dir=DATA_DIR, output_dir=str(tmp_path / "out"), ray_storage_path=str(tmp_path / "ray"))
    if "deepspeed" in config:
        config["deepspeed"] = os.path.join(REPO_ROOT, config["deepspeed"])
    config.update(overrides)
    return config


def tokenized_pairs(dataset: str, stage: str, tokenizer, template, dataset_dir: str = DATA_DIR) -> list[dict]:
    """A preference dataset tokenized as `stage` (dpo or rm) does it: rows of chosen_* / rejected_* columns."""
    from registries.datasets import DataArguments
    from stages.table import STAGES

    data_args = DataArguments(dataset=dataset, dataset_dir=dataset_dir, cutoff_len=64, template="qwen")
    return STAGES[stage].tokenize_here(tokenizer, template, data_args)


def output_files(output_dir) -> dict[str, str]:
    """Every file under ``output_dir`` (relative path -> sha256 of its bytes)."""
    import hashlib

    files = {}
    for root, _, names in os.walk(output_dir):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, output_dir)] = hashlib.sha256(f.read()).hexdigest()
    return files


def assert_rerun_of_a_finished_run_trains_nothing(config: dict) -> None:
    """``config``'s run has finished: rerun with resume_from_checkpoint: auto, it trains nothing,
    says so, and every file in output_dir is as it was (no checkpoint-N+1, no log line, no result)."""
    from cluster.driver import run_exp

    before = output_files(config["output_dir"])
    assert any(name.startswith("checkpoint-") for name in before), "the first run left no checkpoint"
    result = run_exp({**config, "resume_from_checkpoint": "auto"})
    assert result.data_stats == {"finished": True} and result.metrics == {} and result.checkpoint_path is None
    assert output_files(config["output_dir"]) == before


def kill_run_at_its_stall(ray_session, config: dict, stall_at_call: int, tmp_path) -> None:
    """Run ``config`` in a driver process of its own on the test's Ray cluster, with
    tests.e2e.test_rl_resume's ``stalling_digit_ratio`` set to stall on its ``stall_at_call``-th
    call, and SIGKILL that driver once it stalls: the kill lands at a known point of the run."""
    import json
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "stalled"
    config_path = tmp_path / "killed_run.json"
    runtime_env = {"env_vars": {"PYTHONPATH": REPO_ROOT}}  # a driver joining a running cluster
    config_path.write_text(json.dumps({**config, "ray_init_kwargs": {"runtime_env": runtime_env}}))
    script = (f"import json, sys; import tests.e2e.test_rl_resume as t; t.STALL_AT_CALL = {stall_at_call}; "
              "t.STALL_MARKER = sys.argv[2]; from cluster.driver import run_exp; run_exp(json.load(open(sys.argv[1])))")
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address, "PYTHONPATH": REPO_ROOT}
    proc = subprocess.Popen([sys.executable, "-c", script, str(config_path), str(marker)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not marker.exists():
            assert proc.poll() is None, "the run to be killed ended on its own"
            assert time.time() < deadline, f"the run never reached reward call {stall_at_call}"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
