"""cluster.console without Ray: what reaches the terminal, and what only the log file."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every channel a run's internals take, inside a Console; then what the user is meant to read.
SCRIPT = """
import logging, os, sys, warnings
from types import SimpleNamespace
from cluster.console import Console

with Console(sys.argv[1], verbose=sys.argv[2] == "verbose") as console:
    print("a library's print")
    os.write(2, b"a C-level line on fd 2\\n")
    logging.getLogger("some.library").info("a library's record")
    warnings.warn("a library's warning")
    console.mark("checks")
    console.mark("Ray")
    logging.getLogger("fabric.data.prepare").info("data ready in 1.0s")
    console.mark("data")
    import time
    now = time.time()  # rank 0 stamps its records: the split uses those times, not their arrival
    console.progress({"event": "begin", "step": 0, "max_steps": 4, "time": now + 2.0})
    console.progress({"event": "first_step", "step": 1, "max_steps": 4, "time": now + 2.5})
    console.progress({"event": "log", "step": 2, "max_steps": 4, "loss": 2.5, "learning_rate": 1e-3})
    console.progress({"event": "log", "step": 4, "max_steps": 4, "train_runtime": 1.0, "train_loss": 2.0})
    console.progress({"event": "log", "step": 4, "max_steps": 4, "eval_loss": 1.5, "eval_runtime": 0.1})
    console.summary(SimpleNamespace(metrics={}, checkpoint=None), sys.argv[1])
print("after the run")
"""


def run_console(tmp_path, mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode], cwd=str(tmp_path), env=env,
                          capture_output=True, timeout=60)
    # Decoded here: text=True would turn the bar's carriage returns into newlines.
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return done


def test_internals_go_to_the_log_and_the_terminal_gets_the_console(tmp_path):
    done = run_console(tmp_path, "quiet")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = [line.split("\r")[-1] for line in done.stdout.split("\n")]  # the bar's last redraw
    assert lines[0] == "[rayfactory] data ready in 1.0s"
    assert lines[1].startswith("train: 100%") and "loss 2.5" in lines[1]
    # Where the wait before the first step went, phase by phase (each phase's own seconds).
    startup = lines.pop(5)
    assert re.fullmatch(r"  start-up    first step \d+\.\d s after the start: checks \d+\.\d s, Ray \d+\.\d s, "
                        r"data \d+\.\d s, workers \+ model 2\.\d s, first step 0\.5 s", startup), startup
    assert lines[2:] == ["eval at step 4: eval_loss 1.5", "done in 0s: train_loss 2, eval_loss 1.5",
                         f"  outputs     {tmp_path}", f"  log         {tmp_path / 'rayfactory.log'}",
                         "after the run", ""]
    log = (tmp_path / "rayfactory.log").read_text()
    for internal in ("a library's print", "a C-level line on fd 2", "a library's record", "a library's warning",
                     "data ready in 1.0s"):
        assert internal in log, internal


def test_verbose_leaves_the_terminal_as_it_is(tmp_path):
    done = run_console(tmp_path, "verbose")
    assert done.returncode == 0, done.stderr
    assert "a library's print" in done.stdout
    assert "a C-level line on fd 2" in done.stderr and "a library's warning" in done.stderr
    assert "[rayfactory] data ready in 1.0s" in done.stdout
    assert "a library's record" in (tmp_path / "rayfactory.log").read_text()
