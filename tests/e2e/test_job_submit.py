"""The cluster path: `ray start --head`, then `rayfactory submit` of a training config and
`rayfactory status|logs|jobs|stop` (the `ray job` commands with token auth), as a user runs them.

Each head is a real Ray started by cluster/local_head.py (random free ports, 4 logical CPUs, its own
--temp-dir) and stopped by signalling only its own process session: `ray stop` would kill every
Ray on the machine, other people's test runs included.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from cluster import local_head
from cluster.local_head import Head
from cluster.submit import build_submit_command
from stages.training.callbacks import read_log

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)
JOB_TIMEOUT_S = 420


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's env without any Ray address or auth setting, and a HOME of its own so a
    token in the real ~/.ray/auth_token cannot leak into what is being tested."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")  # the cluster's `python` is the venv's
    env.update(extra)
    return env


def start_head(home: str, auth_mode: str) -> Head:
    token = os.urandom(32).hex() if auth_mode == "token" else None
    env = _clean_env(HOME=home, RAY_AUTH_MODE=auth_mode, **({"RAY_AUTH_TOKEN": token} if token else {}))
    return local_head.start_head(env, num_cpus=4, token=token)


stop_head = local_head.stop_head


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


def _cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """``rayfactory ARGS`` as a user runs it from the checkout (``python -m cluster.cli``)."""
    return _run([sys.executable, "-m", "cluster.cli", *args], env, timeout=timeout)


def _job_status(head: Head, job_id: str, env: dict) -> str:
    result = _cli("status", job_id, "--address", head.dashboard_url, env=env)
    output = result.stdout + result.stderr
    # Ray words an ended job "Job 'ID' succeeded|failed|was stopped", any other "Status for job 'ID': RUNNING"
    job = re.escape(job_id)
    found = re.search(rf"Job '{job}' (?:was )?(\w+)|Status for job '{job}': (\w+)", output)
    assert result.returncode == 0 and found, output
    return (found.group(1) or found.group(2)).upper()  # PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED


def _wait_for_job(head: Head, job_id: str, env: dict) -> str:
    """Poll ``rayfactory status`` until the job has ended; its last status."""
    deadline = time.time() + JOB_TIMEOUT_S
    while time.time() < deadline:
        status = _job_status(head, job_id, env)
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(3)
    raise AssertionError(f"job {job_id} still {status} after {JOB_TIMEOUT_S}s")


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

    # The job commands go through the same runner: the same paragraph, under their own name.
    status = _cli("status", "no-such-job", "--address", token_head.dashboard_url, env=_clean_env(HOME=home))
    assert status.returncode == 2, status.stdout + status.stderr
    assert "Missing authentication token" in status.stdout
    assert "rayfactory status: error: the Ray cluster at" in status.stderr and "requires a token" in status.stderr


def test_submitted_sft_job_succeeds_and_writes_outputs(token_head, home, tmp_path, sft_config):
    """`rayfactory submit --no-wait`, then `rayfactory status` until it ends, then `rayfactory logs`:
    the commands a user follows a job with, all through token auth."""
    # dataset_dir stays relative: the job resolves it in the uploaded working dir, not here.
    config = _write_config(tmp_path, sft_config(max_steps=4, dataset_dir="data"))
    job_id = f"rf-sft-{os.getpid()}-{int(time.time())}"
    env = _clean_env(HOME=home, RAY_AUTH_TOKEN=token_head.token)  # the CLI turns token mode on
    result = _cli("submit", config, "save_steps=2", "--no-wait", "--submission-id", job_id,
                  "--address", token_head.dashboard_url, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert job_id in result.stdout  # Ray's own "submitted successfully" lines, passed through
    assert "the job reads it from" in result.stderr  # the config lives outside the working dir

    status = _wait_for_job(token_head, job_id, env)
    logs = _cli("logs", job_id, "--address", token_head.dashboard_url, env=env)
    assert status == "SUCCEEDED", logs.stdout[-6000:]
    assert logs.returncode == 0, logs.stdout + logs.stderr
    # the job's driver is `rayfactory train`: its plan and its summary, as a local run prints them
    assert "rayfactory: stage sft, finetuning_type full, model tiny:qwen2" in logs.stdout
    assert f"outputs     {tmp_path / 'out'}" in logs.stdout
    listing = _cli("jobs", "--address", token_head.dashboard_url, env=env)
    assert listing.returncode == 0 and job_id in listing.stdout, listing.stdout + listing.stderr
    stop = _cli("stop", job_id, "--address", token_head.dashboard_url, env=env)  # an ended job stays as it was
    assert stop.returncode == 0 and f"Job '{job_id}' succeeded" in stop.stdout, stop.stdout + stop.stderr

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


def test_rayfactory_env_reports_the_head(token_head, home):
    env = _clean_env(HOME=home, RAY_ADDRESS=token_head.gcs_address, RAY_AUTH_MODE="token",
                     RAY_AUTH_TOKEN=token_head.token)
    result = _run([os.path.join(VENV_BIN, "rayfactory"), "env"], env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    cluster_line = next(line for line in result.stdout.splitlines() if line.startswith("cluster"))
    # It names the cluster it attached to, and why that one (issue 62: it attached to an unrelated Ray silently).
    port = token_head.gcs_address.rsplit(":", 1)[1]  # Ray names the node by its address, not 127.0.0.1
    assert re.search(rf"connected to [\d.]+:{port} \(RAY_ADDRESS={token_head.gcs_address}\), 1 node\(s\)", cluster_line)
    assert "CPU=4" in cluster_line


def test_head_without_auth_runs_the_uploaded_code(home):
    """The other way out of the token trap: a head started with RAY_AUTH_MODE=disabled takes a
    client that knows nothing about tokens. The job's cwd is the uploaded copy; our packages
    import from it (no install needed) and the excluded folders are not in it."""
    probe = (
        "import json, os, subprocess, cluster, fabric, stages, registries;"
        "size = int(subprocess.check_output(['du', '-sk', '.']).split()[0]);"
        "print('PROBE', json.dumps({'cwd': os.getcwd(), 'listing': sorted(os.listdir('.')), 'kib': size,"
        " 'modules': [m.__file__ for m in (cluster, fabric, stages, registries)]}))"
    )
    head = start_head(home, "disabled")
    try:
        command = build_submit_command("configs/quickstart.yaml", address=head.dashboard_url)
        command = command[: command.index("--") + 1] + ["python", "-c", probe]
        result = _run(command, _clean_env(HOME=home), timeout=180)  # no RAY_AUTH_* at all
    finally:
        stop_head(head)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("PROBE "))
    probe_out = json.loads(line[len("PROBE "):])
    cwd = probe_out["cwd"]
    assert cwd != REPO_ROOT and "runtime_resources" in cwd
    assert all(path.startswith(cwd + os.sep) for path in probe_out["modules"]), probe_out["modules"]
    listing = set(probe_out["listing"])
    assert {"cluster", "fabric", "stages", "registries", "data", "configs"} <= listing
    assert not listing & {".git", ".venv", "saves", ".pytest_cache", ".ruff_cache"}
    assert probe_out["kib"] < 10 * 1024  # code and demo data (~6 MiB by du, pictures included): .venv alone is GBs


def test_example_gpu_cluster_yaml_passes_rays_schema():
    """The cluster launcher YAML cannot be launched here (no cloud), but a typo or a field Ray
    dropped would make `ray up` fail: check it against Ray's own schema and defaults."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    path = os.path.join(REPO_ROOT, "cluster", "cluster_configs", "aws-gpu.yaml")
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    validate_config(prepare_config(config))
    assert config["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}  # the token reaches every node
    assert all("RAY_AUTH_MODE=token" in " ".join(config[k]) for k in ("head_start_ray_commands",
                                                                       "worker_start_ray_commands"))
    assert config["available_node_types"]["head"]["resources"]["GPU"] == 0  # no train worker on the head

    config["max_wrokers"] = 4  # a typo is caught
    with pytest.raises(Exception, match="max_wrokers"):
        validate_config(prepare_config(config))


def test_submit_command_names_a_config_inside_the_working_dir_relatively():
    command = build_submit_command("configs/quickstart.yaml", ["lora_rank=8"], address="http://head:8265")
    entry = command[command.index("--") + 1:]
    assert entry == ["python", "-m", "cluster.cli", "train", "configs/quickstart.yaml", "lora_rank=8"]
    assert command[command.index("--working-dir") + 1] == REPO_ROOT
    excludes = json.loads(command[command.index("--runtime-env-json") + 1])["excludes"]
    assert {".git", ".venv", "saves"} <= set(excludes)
