"""Stopping `rayfactory webui` stops the Ray head it started, and the runs on that head (issue 62): before,
Ctrl-C left the head's ~22 processes running. A restarted UI shows such a run as stopped, from its log,
without starting a head for it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request

import psutil
import pytest

from cluster.local_head import Head, _in_session, free_port, session_processes
from tests.webui.conftest import REPO_ROOT, SERVER_START_TIMEOUT_S, wait_for

RUN_TIMEOUT_S = 300


def start_ui(cwd, share):
    """`rayfactory webui` on a free port in a subprocess: (process, url, log path) once it answers."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = REPO_ROOT
    log_path = os.path.join(cwd, f"webui-{port}.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "cluster.cli", "webui", "--share-dir", str(share), "--port",
                                    str(port)], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def answers():
        if process.poll() is not None:
            raise AssertionError(f"the web UI exited:\n{open(log_path).read()[-3000:]}")
        try:
            return urllib.request.urlopen(url + "/api/spec", timeout=5).status == 200
        except OSError:
            return False

    wait_for(answers, SERVER_START_TIMEOUT_S, "the web UI to answer")
    return process, url, log_path


def call(url, path, body=None):
    request = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def stopped(process, sig, timeout=90):
    process.send_signal(sig)
    return process.wait(timeout=timeout)


@pytest.mark.ray
def test_stopping_the_ui_stops_its_head_and_the_runs_on_it(tmp_path):
    cwd = tmp_path
    shutil.copytree(os.path.join(REPO_ROOT, "data"), cwd / "data")
    share = cwd / "share"
    process, url, log_path = start_ui(cwd, share)
    head = None
    try:
        values = {"model_name_or_path": "tiny:qwen2", "template": "auto", "dataset": ["arith_train"],
                  "dataset_dir": "data", "cutoff_len": 64, "output_dir": "saves/stop-check", "max_steps": 5000,
                  "logging_steps": 5, "save_steps": 1000, "per_device_train_batch_size": 4}
        job = call(url, "/api/runs", {"values": values, "extra_text": "do_train: true\n"})["job_id"]  # starts the head
        wait_for(lambda: call(url, f"/api/runs/{job}")["status"] == "RUNNING", RUN_TIMEOUT_S, "the job to run")
        head = Head.read(os.path.join(share, "ray-head.json"))
        driver = lambda: [p for p in session_processes(head) if "cluster.cli train" in " ".join(_cmdline(p))]  # noqa: E731
        wait_for(driver, RUN_TIMEOUT_S, "the run's driver process")
        before = session_processes(head)
        assert len(before) > 5, [p.name() for p in before]

        code = stopped(process, signal.SIGINT)  # Ctrl-C
        output = open(log_path).read()
        assert code == 0, output  # as before: Ctrl-C is how the UI is meant to stop
        assert f"stopped, and its Ray head at {head.dashboard_url}" in output, output
        assert "runs started from the UI stopped with it" in output
        left = [p for p in psutil.process_iter() if _in_session(p, head.session_id)]
        assert not left, [(p.pid, _cmdline(p)) for p in left]
        alive = [p for p in before if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [(p.pid, _cmdline(p)) for p in alive]  # the run's driver (a session of its own) too
        assert not os.path.exists(os.path.join(share, "ray-head.json"))

        # started again: the run is shown as stopped from its record and log; no head is started for it
        process, url, log_path = start_ui(cwd, share)
        status = call(url, f"/api/runs/{job}")
        assert status["status"] == "STOPPED" and status["ended"] and "Ray head is gone" in status["console"]
        assert not os.path.exists(os.path.join(share, "ray-head.json"))
        assert stopped(process, signal.SIGTERM) == 128 + signal.SIGTERM
        assert "stopped (no Ray head of its own was running)" in open(log_path).read()
    finally:
        if process.poll() is None:
            process.kill()
        if head is not None:  # whatever a failed check left
            from cluster.local_head import stop_head

            stop_head(head)


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []
