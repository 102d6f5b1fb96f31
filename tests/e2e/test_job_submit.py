"""The cluster path: `ray start --head` + `ray job submit` of a training config, as a user runs it.

Each head is a real Ray started by this module (random free ports, 4 logical CPUs, its own
--temp-dir) and stopped by signalling only its own process session: `ray stop` would kill every
Ray on the machine, other people's test runs included.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import psutil
import pytest
import yaml

from cluster.submit import UPLOAD_EXCLUDES, build_submit_command
from stages.callbacks import read_log

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)
RAY = os.path.join(VENV_BIN, "ray")
HEAD_START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 420


@dataclass
class Head:
    process: subprocess.Popen
    gcs_address: str
    dashboard_url: str
    temp_dir: str
    token: str | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's env without any Ray address or auth setting, and a HOME of its own so a
    token in the real ~/.ray/auth_token cannot leak into what is being tested."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")  # the cluster's `python` is the venv's
    env.update(extra)
    return env


def start_head(home: str, auth_mode: str) -> Head:
    # A short temp dir: Ray's unix socket paths live under it and must stay below ~107 chars.
    temp_dir = tempfile.mkdtemp(prefix="rf-head-", dir="/tmp")
    token = os.urandom(32).hex() if auth_mode == "token" else None
    env = _clean_env(HOME=home, RAY_AUTH_MODE=auth_mode, **({"RAY_AUTH_TOKEN": token} if token else {}))
    gcs_port, dashboard_port = _free_port(), _free_port()
    ports = {
        "ray-client-server-port", "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
    }
    command = [
        RAY, "start", "--head", "--block", f"--port={gcs_port}", "--num-cpus=4", "--disable-usage-stats",
        f"--temp-dir={temp_dir}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}", *(f"--{name}={_free_port()}" for name in sorted(ports)),
    ]
    log = open(os.path.join(temp_dir, "head.log"), "w")
    # A new session: every process this head spawns (workers included) shares its session id,
    # which is how teardown finds them and nothing else.
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = Head(process, f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dashboard_port}", temp_dir, token)
    try:
        _wait_for_dashboard(head)
    except BaseException:
        stop_head(head)
        raise
    return head


def _wait_for_dashboard(head: Head) -> None:
    deadline = time.time() + HEAD_START_TIMEOUT_S
    while time.time() < deadline:
        if head.process.poll() is not None:
            raise RuntimeError(f"ray start exited early:\n{_head_log(head)}")
        try:
            urllib.request.urlopen(head.dashboard_url + "/api/version", timeout=2)
            return
        except urllib.error.HTTPError:
            return  # 401 under token auth: the server is up
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"dashboard not up after {HEAD_START_TIMEOUT_S}s:\n{_head_log(head)}")


def _head_log(head: Head) -> str:
    with open(os.path.join(head.temp_dir, "head.log"), encoding="utf-8", errors="replace") as f:
        return f.read()[-4000:]


def stop_head(head: Head) -> None:
    """SIGTERM `ray start --block` (it drains and stops its node), then kill stragglers of its session."""
    session = head.process.pid
    if head.process.poll() is None:
        head.process.send_signal(signal.SIGTERM)
        try:
            head.process.wait(timeout=45)
        except subprocess.TimeoutExpired:
            head.process.kill()
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session:
                proc.kill()
        except (ProcessLookupError, psutil.Error, PermissionError):
            pass
    shutil.rmtree(head.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return str(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def token_head(home):
    """A head as Ray 2.60 starts it by default: token authentication on."""
    head = start_head(home, "token")
    yield head
    stop_head(head)


def _run(command: list[str], env: dict, timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def _job_status(head: Head, job_id: str, env: dict) -> str:
    result = _run([RAY, "job", "status", "--address", head.dashboard_url, job_id], env, timeout=120)
    found = re.search(rf"Job '{re.escape(job_id)}' (\w+)", result.stdout + result.stderr)
    assert found, result.stdout + result.stderr
    return found.group(1)


def _write_config(tmp_path, config: dict) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_submit_without_token_is_refused_with_a_clear_error(token_head, home, tmp_path, sft_config):
    config = _write_config(tmp_path, sft_config(max_steps=2))
    result = _run(
        [sys.executable, "-m", "cluster.submit", config, "--address", token_head.dashboard_url],
        _clean_env(HOME=home),  # no RAY_AUTH_* and no ~/.ray/auth_token: the client has no token
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Missing authentication token" in result.stdout  # Ray's own message, passed through
    assert "requires a token" in result.stderr and "RAY_AUTH_MODE=disabled" in result.stderr
    assert not os.path.exists(tmp_path / "out")  # nothing ran


def test_submitted_sft_job_succeeds_and_writes_outputs(token_head, home, tmp_path, sft_config):
    # dataset_dir stays relative: the job resolves it in the uploaded working dir, not here.
    config = _write_config(tmp_path, sft_config(max_steps=4, dataset_dir="data"))
    job_id = f"rf-sft-{os.getpid()}-{int(time.time())}"
    env = _clean_env(HOME=home, RAY_AUTH_TOKEN=token_head.token)  # cluster.submit turns token mode on
    result = _run(
        [sys.executable, "-m", "cluster.submit", config, "save_steps=2",
         "--address", token_head.dashboard_url, "--submission-id", job_id],
        env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert _job_status(token_head, job_id, _clean_env(HOME=home, RAY_AUTH_MODE="token",
                                                      RAY_AUTH_TOKEN=token_head.token)) == "succeeded"
    assert "the job reads it from" in result.stderr  # the config lives outside the working dir

    # The upload is the code and demo data, not .venv (GBs), saves/ or .git.
    size = re.search(r"Pushing file package '[^']+' \(([\d.]+)MiB\)", output)
    assert size, output[-3000:]
    assert float(size.group(1)) < 5.0

    out = tmp_path / "out"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja",
                 "trainer_state.json", "trainer_log.jsonl", "all_results.json", "rayfactory_config.yaml"):
        assert (out / name).exists(), name
    steps = [r["current_steps"] for r in read_log(str(out)) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4
    resolved = yaml.safe_load((out / "rayfactory_config.yaml").read_text())
    assert "runtime_resources" in json.dumps(resolved)  # data came from the job's working dir copy
    assert "save_steps: 2" in (out / "rayfactory_config.yaml").read_text()  # the override travelled


def test_job_runs_the_uploaded_code_without_venv_or_git(token_head, home):
    """The job's cwd is the uploaded copy: our packages import from it (no install needed), and
    the excluded folders are not there."""
    probe = (
        "import json, os, cluster, fabric, stages, registries;"
        "print('PROBE', json.dumps({'cwd': os.getcwd(), 'listing': sorted(os.listdir('.')),"
        " 'cluster': cluster.__file__, 'registries': registries.__file__}))"
    )
    command = build_submit_command("configs/quickstart.yaml", address=token_head.dashboard_url)
    command = command[: command.index("--") + 1] + ["python", "-c", probe]
    result = _run(command, _clean_env(HOME=home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token_head.token))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("PROBE "))
    probe_out = json.loads(line[len("PROBE "):])
    assert probe_out["cwd"] != REPO_ROOT and "runtime_resources" in probe_out["cwd"]
    assert probe_out["cluster"].startswith(probe_out["cwd"])
    assert probe_out["registries"].startswith(probe_out["cwd"])
    listing = set(probe_out["listing"])
    assert {"cluster", "fabric", "stages", "registries", "data", "configs"} <= listing
    assert not listing & {".git", ".venv", "saves", ".pytest_cache"}
    assert ".git" in UPLOAD_EXCLUDES


def test_rayfactory_env_reports_the_head(token_head, home):
    env = _clean_env(HOME=home, RAY_ADDRESS=token_head.gcs_address, RAY_AUTH_MODE="token",
                     RAY_AUTH_TOKEN=token_head.token)
    result = _run([os.path.join(VENV_BIN, "rayfactory"), "env"], env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    cluster_line = next(line for line in result.stdout.splitlines() if line.startswith("cluster"))
    assert "connected, 1 node(s)" in cluster_line and "CPU=4" in cluster_line


def test_head_without_auth_takes_plain_ray_job_submit(home, tmp_path):
    """The other way out of the token trap: a head started with RAY_AUTH_MODE=disabled accepts a
    client that knows nothing about tokens. The job runs `python -m cluster.cli env` there."""
    head = start_head(home, "disabled")
    try:
        command = build_submit_command("configs/quickstart.yaml", address=head.dashboard_url)
        command = command[: command.index("--") + 1] + ["python", "-m", "cluster.cli", "env"]
        result = _run(command, _clean_env(HOME=home))
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        cluster_line = next(line for line in result.stdout.splitlines() if line.startswith("cluster "))
        assert "connected, 1 node(s)" in cluster_line and "CPU=4" in cluster_line
        assert "succeeded" in result.stdout + result.stderr
    finally:
        stop_head(head)
