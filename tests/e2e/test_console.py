"""What ``rayfactory train`` prints: a short console, and the internals in output_dir/rayfactory.log.

The quickstart config (fewer steps) through the real CLI in a subprocess, with its own local Ray
as a user's first run has: Ray's, the workers' and the libraries' output must land in the log
file, not on the terminal, and the noise whose cause was fixed must appear in neither.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.e2e.conftest import REPO_ROOT, example_config

# The quickstart as it is (two Ray Train workers), and with one worker, which trains in the
# driver process by default (fabric/train_in_driver.py).
MODES = {"in the driver": {"ray_num_workers": 1}, "in workers": {}}

# Plan (5), data ready, where it trains, the memory plan, trainable params (in the driver), the bar
# (redraws are carriage returns, not lines), eval, summary (5).
MAX_CONSOLE_LINES = 20


@pytest.mark.parametrize("mode", MODES)
def test_quickstart_console_is_short_and_the_log_holds_the_internals(tmp_path, mode):
    config = example_config("quickstart.yaml", tmp_path, max_steps=6, logging_steps=2, save_steps=100, **MODES[mode])
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
    in_driver = mode == "in the driver"
    assert "  start-up    first step " in done.stdout
    labels = (", data ", ", model ") if in_driver else (", data (workers starting) ", ", workers + model ")
    assert all(label in done.stdout for label in labels), done.stdout
    assert ("[rayfactory] training in this process" in done.stdout) == in_driver
    # Counted from the command's start (Python and reading the config are seconds of it), and the
    # phases add up to the total.
    startup = next(line for line in lines if line.startswith("  start-up    first step "))
    total = float(startup.split("first step ")[1].split(" s after the start")[0])
    phases = [float(part.rsplit(" ", 2)[1]) for part in startup.split("after the start: ")[1].split(", ")]
    assert startup.split("after the start: ")[1].startswith("reading the config "), startup
    assert phases[0] > 0.5 and abs(sum(phases) - total) < 0.1 * len(phases), startup
    # rank 0's memory plan, once: the quickstart model fits without gradient checkpointing
    assert done.stdout.count("[rayfactory] memory plan: gradient checkpointing off: ") == 1

    log = log_path.read_text()
    assert "Started a local Ray instance" in log  # the driver's Ray records
    assert ("(RayTrainWorker pid=" in log) != in_driver  # forwarded worker output
    assert "trainable params:" in log  # logged by stages (inside a worker, or here)
    assert "***** eval metrics *****" in log  # printed by transformers inside a worker
    # Fixed at the cause, so absent from the log as well.
    assert "LOAD_GLOBAL" not in log  # datasets' fingerprinting through dill, leaked by Ray Train's print patch
    assert "find_unused_parameters=True" not in log  # DDP over a PeftModel
    assert "Failed to query Ray Train Controller" not in log  # the State API a local Ray does not serve


@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_stops_the_run_and_its_ray_without_a_traceback(tmp_path, mode):
    """Ctrl-C mid-training: the workers and the run's own local Ray go, a one-line message says
    so, and the exit status is the shell's usual 130."""
    import contextlib
    import signal
    import time

    import psutil

    config = example_config("quickstart.yaml", tmp_path, max_steps=100000, logging_steps=1, save_steps=100000,
                            **MODES[mode])
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "RAY_ADDRESS": ""}
    run = subprocess.Popen([sys.executable, "-m", "cluster.cli", "train", "cfg.yaml"], cwd=str(tmp_path), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first_steps = tmp_path / "out" / "trainer_log.jsonl"
        deadline = time.time() + 600
        while not first_steps.exists() and run.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert first_steps.exists(), run.communicate()
        descendants = psutil.Process(run.pid).children(recursive=True)  # the local Ray: daemons, workers
        in_worker = any("RayTrainWorker" in " ".join(p.cmdline()) for p in descendants if p.is_running())
        assert in_worker == (mode == "in workers") and any("raylet" in " ".join(p.cmdline()) for p in descendants)
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 130, stdout[-3000:] + stderr[-3000:]
        assert "rayfactory: interrupted" in stderr and "Traceback" not in stdout + stderr, stderr
    finally:  # a failed check above must not leave a 100000-step run and its Ray behind
        if run.poll() is None:
            for process in [*psutil.Process(run.pid).children(recursive=True), psutil.Process(run.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
