"""`rayfactory submit|status|logs|stop|jobs` and the KubeRay RayJob example, without starting Ray.

The commands are checked through what they would run (--dry-run, build_job_command); the real
cluster path, token auth included, is tests/e2e/test_job_submit.py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from cluster.cli import build_parser, main
from cluster.config import load_config
from cluster.submit import (
    DEFAULT_DASHBOARD, IMAGE_WITH_WORKING_DIR, PIP_WITH_IMAGE, REPO_ROOT, UPLOAD_EXCLUDES, build_job_command,
    run_job,
)

RAYJOB_YAML = os.path.join(REPO_ROOT, "cluster", "cluster_configs", "kuberay-rayjob.yaml")
HEAD = "http://head:8265"


def dry_run(capsys, *args: str) -> list[str]:
    """The ``ray job submit`` argv that ``rayfactory submit --dry-run`` prints."""
    assert main(["submit", "configs/quickstart.yaml", "lora_rank=8", "--dry-run", "--address", HEAD, *args]) == 0
    return shlex.split(capsys.readouterr().out)


def runtime_env_of(command: list[str]) -> dict:
    return json.loads(command[command.index("--runtime-env-json") + 1])


def test_pip_packages_join_the_excludes_in_one_runtime_env(capsys):
    command = dry_run(capsys, "--pip", "peft==0.21.2", "--pip", "rich>=13")
    assert runtime_env_of(command) == {"excludes": list(UPLOAD_EXCLUDES), "pip": ["peft==0.21.2", "rich>=13"]}
    assert command.count("--runtime-env-json") == 1  # a second one would replace the first
    assert command[command.index("--working-dir") + 1] == REPO_ROOT
    assert command[command.index("--") + 1:] == [
        "python", "-m", "cluster.cli", "train", "configs/quickstart.yaml", "lora_rank=8"]


def test_without_pip_or_image_only_the_excludes_are_sent(capsys):
    assert runtime_env_of(dry_run(capsys)) == {"excludes": list(UPLOAD_EXCLUDES)}


def test_image_runs_the_job_in_it_and_uploads_nothing(capsys):
    # Ray 2.60 refuses working_dir, excludes and pip next to image_uri: the code is in the image.
    command = dry_run(capsys, "--image", "registry.example.com/rayfactory:gpu")
    assert runtime_env_of(command) == {"image_uri": "registry.example.com/rayfactory:gpu"}
    assert "--working-dir" not in command
    assert command[command.index("--") + 1:] == [
        "python", "-m", "cluster.cli", "train", "configs/quickstart.yaml", "lora_rank=8"]


@pytest.mark.parametrize("extra, message", [
    (["--pip", "rich"], PIP_WITH_IMAGE),
    (["--working-dir", REPO_ROOT], IMAGE_WITH_WORKING_DIR),
])
def test_image_with_pip_or_working_dir_is_refused_with_one_paragraph(capsys, extra, message):
    code = main(["submit", "configs/quickstart.yaml", "--dry-run", "--image", "rayproject/ray:2.60.0-gpu", *extra])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == f"rayfactory submit: error: {message}\n"
    assert "\n" not in message and extra[0] in message  # one paragraph, naming the option to drop


def test_the_address_defaults_to_ray_api_server_address(monkeypatch):
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://elsewhere:8265")
    assert build_parser().parse_args(["status", "j1"]).address == "http://elsewhere:8265"
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS")
    assert build_parser().parse_args(["submit", "cfg.yaml"]).address == DEFAULT_DASHBOARD


def test_job_commands_build_rays_argv():
    assert build_job_command("status", "j1", address=HEAD) == ["ray", "job", "status", "--address", HEAD, "j1"]
    assert build_job_command("logs", "j1", address=HEAD) == ["ray", "job", "logs", "--address", HEAD, "j1"]
    assert build_job_command("logs", "j1", address=HEAD, follow=True) == [
        "ray", "job", "logs", "--address", HEAD, "--follow", "j1"]
    assert build_job_command("stop", "j1", address=HEAD) == ["ray", "job", "stop", "--address", HEAD, "j1"]
    assert build_job_command("jobs", address=HEAD) == ["ray", "job", "list", "--address", HEAD]
    assert build_job_command("status", "j1") == ["ray", "job", "status", "--address", DEFAULT_DASHBOARD, "j1"]


def test_job_subcommands_parse_into_the_job_runner():
    args = build_parser().parse_args(["logs", "j1", "--follow", "--address", HEAD])
    assert (args.handler, args.job_action, args.job_id, args.follow, args.address) == (run_job, "logs", "j1", True, HEAD)
    for action in ("status", "stop"):
        args = build_parser().parse_args([action, "j1"])
        assert (args.handler, args.job_action, args.job_id) == (run_job, action, "j1")
        assert not hasattr(args, "follow")
    assert build_parser().parse_args(["jobs"]).job_action == "jobs"


@pytest.mark.parametrize("argv, overrides", [
    (["submit", "cfg.yaml", "--address", "http://head:8265", "--", "lora_rank=4", "seed=1"], ["lora_rank=4", "seed=1"]),
    (["submit", "cfg.yaml", "lora_rank=4", "--no-wait", "seed=1"], ["lora_rank=4", "seed=1"]),
    (["train", "cfg.yaml", "--verbose", "lora_rank=4"], ["lora_rank=4"]),
])
def test_overrides_may_follow_the_options(argv, overrides):
    from cluster.arguments import parse_arguments

    args = parse_arguments(build_parser(), argv)
    assert args.config == "cfg.yaml" and args.overrides == overrides


@pytest.mark.parametrize("argv", [["submit", "cfg.yaml", "--no-wait", "--", "lora_rank=4", "--bogus"],
                                  ["train", "cfg.yaml", "--verbose", "notakeyvalue"],
                                  ["status", "job-1", "lora_rank=4"]])
def test_what_is_not_an_override_after_the_options_is_still_refused(argv, capsys):
    from cluster.arguments import parse_arguments

    with pytest.raises(SystemExit) as exit_:
        parse_arguments(build_parser(), argv)
    assert exit_.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_submit_help_lists_the_options_and_the_module_form_shares_them():
    def help_of(*command: str) -> str:
        done = subprocess.run([sys.executable, "-m", *command, "--help"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    cli_help = help_of("cluster.cli", "submit")
    for option in ("--address", "--working-dir", "--submission-id", "--no-wait", "--dry-run", "--pip", "--image",
                   "key=value"):
        assert option in cli_help, option
    module_help = help_of("cluster.submit")
    # one parser-building function: the same options and texts, only the program name differs
    assert module_help.split("options:")[1] == cli_help.split("options:")[1]


# --- the KubeRay RayJob example ---------------------------------------------------------------


@pytest.fixture(scope="module")
def rayjob() -> dict:
    with open(RAYJOB_YAML, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _pods(rayjob: dict) -> dict[str, dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    pods = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    pods.update({group["groupName"]: group["template"]["spec"] for group in cluster["workerGroupSpecs"]})
    return pods


def _pvc_mount_paths(pod: dict) -> set[str]:
    claims = {v["name"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    return {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", []) if m["name"] in claims}


def test_rayjob_is_a_kuberay_rayjob_that_shuts_down(rayjob):
    assert (rayjob["apiVersion"], rayjob["kind"]) == ("ray.io/v1", "RayJob")
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    assert spec["rayClusterSpec"]["authOptions"] == {"mode": "token"}  # Ray 2.60 token auth, operator-managed
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict) and runtime_env["working_dir"].endswith(".zip")
    assert set(runtime_env) <= {"working_dir", "pip"}  # no image_uri: Ray would refuse it with working_dir


def test_rayjob_entrypoint_trains_a_repo_config_that_loads(rayjob, monkeypatch):
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "cluster.cli", "train"]
    config_path, overrides = argv[4], argv[5:]
    assert os.path.isfile(os.path.join(REPO_ROOT, config_path)), config_path
    monkeypatch.chdir(REPO_ROOT)  # the job runs in the unpacked working dir, a copy of this repo
    config = load_config(config_path, overrides)
    assert config.ray.resources_per_worker["GPU"] == 1
    assert config.ray.ray_num_workers == 2


def test_rayjob_workers_have_the_gpus_and_every_pod_the_shared_volume(rayjob, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    config = load_config(argv[4], argv[5:])
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert group["replicas"] == 2 and gpus == 1
    assert config.ray.ray_num_workers * config.ray.resources_per_worker["GPU"] <= group["replicas"] * gpus
    assert rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"].startswith(
        "rayproject/ray")

    mounts = {name: _pvc_mount_paths(pod) for name, pod in _pods(rayjob).items()}
    (shared,) = mounts["head"]
    assert all(paths == {shared} for paths in mounts.values()), mounts  # the same path on every pod
    for path in (config.training.output_dir, config.ray.ray_storage_path):
        assert path.startswith(shared + "/"), path


def test_rays_cli_is_found_beside_this_python_without_path(monkeypatch):
    from cluster.submit import ray_executable

    monkeypatch.setenv("PATH", "/nonexistent")  # `.venv/bin/rayfactory` run without activating the venv
    assert ray_executable() == os.path.join(os.path.dirname(sys.executable), "ray")


def test_a_job_command_against_no_head_ends_with_one_paragraph(capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["status", "job-1", "--address", address]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"rayfactory status: error: no Ray job server answers at {address}. --address")


def test_submit_checks_the_rules_but_not_files_and_packages_that_only_the_cluster_has(tmp_path, capsys, monkeypatch):
    """A config naming cluster-side paths (a reward model, a DeepSpeed file, a checkpoint) is sent;
    `train` on this machine refuses it; a broken rule is refused by both with the same paragraph."""
    config = tmp_path / "ppo.yaml"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    keys = {**yaml.safe_load(open(os.path.join(repo, "configs/ppo_lora.yaml"), encoding="utf-8")),
            "dataset_dir": os.path.join(repo, "data"),
            "reward_model": "/mnt/shared/rm", "resume_from_checkpoint": "/mnt/shared/run/checkpoint-8",
            "reward_funcs": ["cluster_rewards:score"]}
    # the module is in the working directory (uploaded with the job), its own import only on the cluster
    (tmp_path / "cluster_rewards.py").write_text("import package_only_on_the_cluster\n")
    monkeypatch.chdir(tmp_path)
    config.write_text(yaml.safe_dump(keys))
    assert main(["submit", str(config), "--dry-run", "--address", HEAD]) == 0
    capsys.readouterr()
    assert main(["train", str(config)]) == 2
    assert "package_only_on_the_cluster" in capsys.readouterr().err  # train runs the module here
    config.write_text(yaml.safe_dump({**keys, "temperature": 0.0}))
    assert main(["submit", str(config), "--dry-run", "--address", HEAD]) == 2
    submitted = capsys.readouterr().err
    assert "greedy rollouts make every completion of a prompt the same" in submitted
