"""What ``rayfactory train`` prints: a short console, and the internals in output_dir/rayfactory.log.

The quickstart config (fewer steps) through the real CLI in a subprocess, with its own local Ray
as a user's first run has: Ray's, the workers' and the libraries' output must land in the log
file, not on the terminal, and the noise whose cause was fixed must appear in neither.
"""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from tests.e2e.conftest import REPO_ROOT, example_config

# Plan (5), data ready, the memory plan, the bar (redraws are carriage returns, not lines), eval, summary (5).
MAX_CONSOLE_LINES = 20


def test_quickstart_console_is_short_and_the_log_holds_the_internals(tmp_path):
    config = example_config("quickstart.yaml", tmp_path, max_steps=6, logging_steps=2, save_steps=100)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "RAY_ADDRESS": ""}  # a fresh local Ray, as a first run
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "train", "cfg.yaml"], cwd=str(tmp_path), env=env,
                          capture_output=True, timeout=900)
    # Decoded here: text=True would turn the bar's carriage returns (its redraws) into newlines.
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-5000:]

    lines = console.split("\n")  # not splitlines(): that would count the redraws too
    assert len(lines) <= MAX_CONSOLE_LINES, console
    for noise in ("Traceback", "LOAD_GLOBAL", "PlacementGroupCleaner", "TrainingReport", "pid="):
        assert noise not in console, console
    log_path = tmp_path / "out" / "rayfactory.log"
    assert f"log         {log_path}" in done.stdout  # the summary says where the rest went
    assert "eval at step 6: eval_loss" in done.stdout
    assert "  start-up    first step " in done.stdout and ", workers + model " in done.stdout
    # rank 0's memory plan, once: the quickstart model fits without gradient checkpointing
    assert done.stdout.count("[rayfactory] memory plan: gradient checkpointing off: ") == 1

    log = log_path.read_text()
    assert "Started a local Ray instance" in log  # the driver's Ray records
    assert "(RayTrainWorker pid=" in log  # forwarded worker output
    assert "trainable params:" in log  # logged by stages inside a worker
    assert "***** eval metrics *****" in log  # printed by transformers inside a worker
    # Fixed at the cause, so absent from the log as well.
    assert "LOAD_GLOBAL" not in log  # datasets' fingerprinting through dill, leaked by Ray Train's print patch
    assert "find_unused_parameters=True" not in log  # DDP over a PeftModel
    assert "Failed to query Ray Train Controller" not in log  # the State API a local Ray does not serve
