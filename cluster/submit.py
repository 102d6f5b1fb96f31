"""Build (and optionally run) the ``ray job submit`` command for a training config, and the
``ray job status|logs|stop|list`` commands that follow a submitted job.

    rayfactory submit configs/quickstart.yaml [key=value ...] --address http://HEAD:8265
    python -m cluster.submit configs/quickstart.yaml ...      # the same parser and code
    rayfactory status|logs|stop JOB_ID --address http://HEAD:8265

The job ships this checkout as its working dir and runs ``python -m cluster.cli train <cfg>``
there. ``python -m`` (not the ``rayfactory`` console script) because the working dir is not
installed on the cluster: ``-m`` puts the job's current directory, the uploaded copy, first on
``sys.path``, so the four top-level packages import from it on any node that has the
dependencies (torch, transformers, Ray ...). Ray Train workers get the same working dir.

Only the standard library and ``ray``'s CLI are used here: building the command must not need
torch, and the CLI prints Ray's own messages unchanged.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from typing import Iterable, Mapping, Sequence

from .arguments import parse_arguments

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"
USER_ERROR_EXIT = 2

# Never uploaded: virtualenvs (GBs), run outputs, git history, caches. Ray also honours
# .gitignore and .rayignore, but a checkout without them must not upload its .venv either.
# Patterns use .gitignore syntax, relative to the working dir.
UPLOAD_EXCLUDES = (
    ".git",
    ".venv",
    "venv",
    "saves",
    "outputs",
    "wandb",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    "build",
)

AUTH_HELP = (
    "the Ray cluster at {address} requires a token (Ray 2.60 enables token authentication by "
    "default), and this client sent none. Either run the client with RAY_AUTH_MODE=token and the "
    "cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN (copy it from the "
    "head node: `ray get-auth-token` there), or start the head with RAY_AUTH_MODE=disabled (only on "
    "a private network). See docs/cluster.md."
)

PIP_WITH_IMAGE = (
    "--pip and --image cannot be combined. With --image the job runs inside that container image "
    "(Ray's image_uri runtime env), and Ray accepts no other runtime-env field next to image_uri "
    "(only env_vars and config), so it would refuse the pip list. Either bake the packages into the "
    "image (a Dockerfile FROM the cluster's Ray image with RUN pip install ...) and pass only --image, "
    "or drop --image and let --pip install them on top of the image the cluster already runs."
)

IMAGE_WITH_WORKING_DIR = (
    "--image and --working-dir cannot be combined. Ray accepts no working_dir (or excludes) next to "
    "image_uri, so with --image nothing is uploaded: the job runs the RayFactory code and configs baked "
    "into the image, from the image's WORKDIR. Build the image from the folder you meant to upload "
    "(COPY it to the WORKDIR), or drop --image to upload the folder instead."
)

# The job commands `rayfactory` wraps, with their help line. `ray job <action>` takes the same name.
JOB_ACTIONS = {
    "status": "show a submitted job's status (ray job status)",
    "logs": "print a submitted job's output; --follow tails it (ray job logs)",
    "stop": "stop a submitted job (ray job stop)",
    "jobs": "list the cluster's jobs (ray job list)",
}


class SubmitError(ValueError):
    """A mistake in the submit options; the message is the paragraph printed to the user."""

UNREACHABLE_HELP = (
    "no Ray job server answers at {address}. --address (or RAY_API_SERVER_ADDRESS) must be the head "
    "node's dashboard URL, http://HEAD:8265 by default, not the GCS address HEAD:6379; check that the head "
    "is up (`ray status` on it) and that this machine can reach that port (or forward it: "
    "`ssh -L 8265:localhost:8265 HEAD`, `kubectl port-forward svc/<cluster>-head-svc 8265:8265`)."
)


def build_submit_command(
    config_path: str,
    overrides: Sequence[str] = (),
    *,
    address: str | None = None,
    working_dir: str | None = None,
    submission_id: str | None = None,
    no_wait: bool = False,
    pip: Sequence[str] = (),
    image: str | None = None,
    python: str = "python",
) -> list[str]:
    """The argv of ``ray job submit`` that trains ``config_path`` on the cluster at ``address``.

    ``working_dir`` (default: this checkout) is uploaded. A config inside it travels with it and
    is named relative to it; one outside is named by its absolute path, which then must exist on
    the head node too (a local cluster or a shared filesystem). ``pip`` / ``image`` go into the
    job's runtime env (see runtime_env); with ``image`` nothing is uploaded and the config is named
    relative to this checkout, which the image is expected to hold at its WORKDIR.
    """
    import json

    if image and working_dir:
        raise SubmitError(IMAGE_WITH_WORKING_DIR)
    working_dir = os.path.abspath(working_dir or REPO_ROOT)
    command = ["ray", "job", "submit", "--address", address or DEFAULT_DASHBOARD]
    if not image:  # Ray refuses a working_dir next to image_uri
        command += ["--working-dir", working_dir]
    command += ["--runtime-env-json", json.dumps(runtime_env(pip, image))]
    if submission_id:
        command += ["--submission-id", submission_id]
    if no_wait:
        command.append("--no-wait")
    command += ["--", python, "-m", "cluster.cli", "train", config_argument(config_path, working_dir)]
    return command + list(overrides)


def runtime_env(pip: Sequence[str] = (), image: str | None = None) -> dict:
    """The job's runtime env: the upload excludes plus packages to install, or an image to run in.

    One dict, because ``ray job submit`` takes one --runtime-env-json (Ray adds --working-dir to
    it). ``image_uri`` stands alone: Ray 2.60 refuses it next to any field but env_vars and config.
    """
    if pip and image:
        raise SubmitError(PIP_WITH_IMAGE)
    if image:
        return {"image_uri": image}  # the nodes run it with podman; the code must be in the image
    env: dict = {"excludes": list(UPLOAD_EXCLUDES)}
    if pip:
        env["pip"] = list(pip)  # installed into a virtualenv per job (it sees the image's packages)
    return env


def build_job_command(action: str, job_id: str | None = None, *, address: str | None = None,
                      follow: bool = False) -> list[str]:
    """The argv of ``ray job status|logs|stop JOB_ID`` (or ``ray job list``) for the dashboard at ``address``."""
    if action not in JOB_ACTIONS:
        raise ValueError(f"action must be one of {sorted(JOB_ACTIONS)}, got {action!r}")
    ray_action = "list" if action == "jobs" else action
    command = ["ray", "job", ray_action, "--address", address or DEFAULT_DASHBOARD]
    if follow:
        command.append("--follow")
    if action != "jobs":
        if not job_id:
            raise ValueError(f"ray job {ray_action} needs a job id")
        command.append(job_id)
    return command


def config_argument(config_path: str, working_dir: str) -> str:
    path = os.path.abspath(config_path)
    relative = os.path.relpath(path, working_dir)
    if relative.startswith(os.pardir + os.sep) or os.path.isabs(relative):
        return path
    return relative.replace(os.sep, "/")  # the head node may not share this machine's separator


def submission_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The client's environment, with token auth switched on when a token is at hand.

    Ray's client sends its token only in RAY_AUTH_MODE=token, and an unset mode means
    'disabled' for the client, even though ``ray start --head`` enables tokens by default.
    An explicit RAY_AUTH_MODE is left alone.
    """
    env = dict(os.environ if environ is None else environ)
    if "RAY_AUTH_MODE" not in env and _token_available(env):
        env["RAY_AUTH_MODE"] = "token"
    return env


def _token_available(env: Mapping[str, str]) -> bool:
    if env.get("RAY_AUTH_TOKEN"):
        return True
    home = env.get("HOME") or os.path.expanduser("~")
    path = env.get("RAY_AUTH_TOKEN_PATH") or os.path.join(home, ".ray", "auth_token")
    return os.path.isfile(path)


def config_mistake(config_path: str, overrides: Iterable[str] = ()) -> str | None:
    """The paragraph ``rayfactory train`` would refuse the config with (load_config's), else None."""
    from registries.errors import find_user_error

    from .config import load_config

    try:
        load_config(config_path, list(overrides), purpose="submit")  # the job's machine checks its own files
    except Exception as exc:  # noqa: BLE001 (only user errors are answered; the rest re-raises)
        mistake = find_user_error(exc)
        if mistake is None:
            raise
        return str(mistake)
    return None


def config_notes(config_path: str, overrides: Iterable[str] = ()) -> list[str]:
    """Warnings about paths that mean something else inside a job than on this machine."""
    import yaml

    try:
        with open(config_path, encoding="utf-8") as f:
            config = yaml.safe_load(f) or {}
    except OSError:
        return []
    for item in overrides:
        key, _, value = item.partition("=")
        config[key.strip()] = value
    notes = []
    output_dir = str(config.get("output_dir") or "")
    if output_dir and "://" not in output_dir and not os.path.isabs(output_dir):
        notes.append(
            f"output_dir {output_dir!r} is relative: inside a job it resolves in the job's temporary copy of "
            "the working dir on the head node (and rank 0 writes it on its own node). Use an absolute path "
            "on storage every node shares to keep the results."
        )
    return notes


def default_address() -> str:
    return os.environ.get("RAY_API_SERVER_ADDRESS") or DEFAULT_DASHBOARD


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=default_address(),
                        help="the head's dashboard URL (default: $RAY_API_SERVER_ADDRESS or %(default)s)")


def add_submit_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``rayfactory submit`` and ``python -m cluster.submit`` (one list for both)."""
    parser.add_argument("config", help="YAML config; inside the working dir it is uploaded with it")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override config keys (right after the config), e.g. lora_rank=16")
    _add_address(parser)
    parser.add_argument("--working-dir", default=None, help=f"folder to upload (default: this checkout, {REPO_ROOT})")
    parser.add_argument("--submission-id", default=None, help="the job's id (default: Ray picks one)")
    parser.add_argument("--no-wait", action="store_true", help="return once submitted instead of tailing logs")
    parser.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    parser.add_argument("--pip", action="append", default=[], metavar="SPEC",
                        help="a package for the job's runtime env, e.g. --pip 'peft==0.21.2' (repeatable); "
                             "Ray installs it on every node the job uses")
    parser.add_argument("--image", default=None, metavar="IMAGE",
                        help="run the job in this container image (runtime env image_uri; the nodes need "
                             "podman): nothing is uploaded, the image holds this checkout at its WORKDIR; "
                             "not together with --pip or --working-dir")
    return parser


def add_job_arguments(parser: argparse.ArgumentParser, action: str) -> argparse.ArgumentParser:
    """The options of ``rayfactory status|logs|stop|jobs``."""
    if action != "jobs":
        parser.add_argument("job_id", metavar="JOB_ID", help="the submission id (printed by submit)")
    _add_address(parser)
    if action == "logs":
        parser.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    parser.set_defaults(job_action=action)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.submit", description="Submit a RayFactory training config as a Ray job."
    )
    return run_submit(parse_arguments(add_submit_arguments(parser), argv))


def run_submit(args: argparse.Namespace) -> int:
    """Submit ``args.config`` (or print the command with --dry-run); the exit status of ``ray job submit``."""
    if not os.path.isfile(args.config):
        print(f"rayfactory submit: error: config file {args.config} not found (looked for "
              f"{os.path.abspath(args.config)}).", file=sys.stderr)
        return USER_ERROR_EXIT
    mistake = config_mistake(args.config, args.overrides)
    if mistake is not None:  # the job would refuse it with this paragraph: nothing is sent
        print(f"rayfactory submit: error: {mistake}", file=sys.stderr)
        return USER_ERROR_EXIT
    try:
        command = build_submit_command(
            args.config, args.overrides, address=args.address, working_dir=args.working_dir,
            submission_id=args.submission_id, no_wait=args.no_wait, pip=args.pip, image=args.image,
        )
    except SubmitError as exc:
        print(f"rayfactory submit: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    for note in config_notes(args.config, args.overrides):
        print(f"rayfactory submit: note: {note}", file=sys.stderr)
    if os.path.isabs(command[command.index("train") + 1]):
        where = "inside the image" if args.image else "on the head node"
        print("rayfactory submit: note: the config lies outside the working dir, so the job reads it from "
              f"{os.path.abspath(args.config)} {where}.", file=sys.stderr)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    return _run(command, args.address)


def run_job(args: argparse.Namespace) -> int:
    """``rayfactory status|logs|stop|jobs``: the ``ray job`` command with token auth; ray's exit status."""
    command = build_job_command(args.job_action, getattr(args, "job_id", None), address=args.address,
                                follow=getattr(args, "follow", False))
    return _run(command, args.address, f"rayfactory {args.job_action}")


def ray_executable() -> str | None:
    """Ray's CLI: the one installed beside this Python (``.venv/bin/rayfactory`` runs without the
    venv on PATH), else the one on PATH, else None."""
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    return beside if os.access(beside, os.X_OK) else shutil.which("ray")


def _run(command: list[str], address: str, prog: str = "rayfactory submit") -> int:
    """Run a ``ray job ...`` command with token auth, streaming its output; explain the one failure
    every new user meets (exit status 2), else return ray's exit status."""
    ray_cli = ray_executable()
    if ray_cli is None:
        print(f"{prog}: error: Ray's command-line tool `ray` was found neither next to this Python "
              f"({os.path.dirname(sys.executable)}) nor on PATH. Install Ray into this environment "
              "(`pip install -e .` in the checkout installs it) or put its bin folder on PATH.", file=sys.stderr)
        return USER_ERROR_EXIT
    command = [ray_cli, *command[1:]]  # built as "ray ..." (what --dry-run shows), run with the one found
    process = subprocess.Popen(command, env=submission_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1)
    auth_failed = unreachable = False
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(line)
        auth_failed = auth_failed or "Missing authentication token" in line
        unreachable = unreachable or "Failed to connect to Ray at address" in line
    code = process.wait()
    if code != 0 and auth_failed:
        print(f"{prog}: error: {AUTH_HELP.format(address=address)}", file=sys.stderr)
        return USER_ERROR_EXIT
    if code != 0 and unreachable:
        print(f"{prog}: error: {UNREACHABLE_HELP.format(address=address)}", file=sys.stderr)
        return USER_ERROR_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())
