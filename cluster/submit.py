"""Build (and optionally run) the ``ray job submit`` command for a training config.

    python -m cluster.submit configs/quickstart.yaml [key=value ...] --address http://HEAD:8265

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
import subprocess
import sys
from typing import Iterable, Mapping, Sequence

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


def build_submit_command(
    config_path: str,
    overrides: Sequence[str] = (),
    *,
    address: str | None = None,
    working_dir: str = REPO_ROOT,
    submission_id: str | None = None,
    no_wait: bool = False,
    ray_executable: str = "ray",
    python: str = "python",
) -> list[str]:
    """The argv of ``ray job submit`` that trains ``config_path`` on the cluster at ``address``.

    A config inside ``working_dir`` travels with it and is named relative to it; one outside is
    named by its absolute path, which then must exist on the head node too (a local cluster or
    a shared filesystem).
    """
    import json

    working_dir = os.path.abspath(working_dir)
    command = [ray_executable, "job", "submit", "--address", address or DEFAULT_DASHBOARD]
    command += ["--working-dir", working_dir]
    command += ["--runtime-env-json", json.dumps({"excludes": list(UPLOAD_EXCLUDES)})]
    if submission_id:
        command += ["--submission-id", submission_id]
    if no_wait:
        command.append("--no-wait")
    command += ["--", python, "-m", "cluster.cli", "train", config_argument(config_path, working_dir)]
    return command + list(overrides)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.submit", description="Submit a RayFactory training config as a Ray job."
    )
    parser.add_argument("config", help="YAML config; inside the working dir it is uploaded with it")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS") or DEFAULT_DASHBOARD,
                        help="the head's dashboard URL (default: $RAY_API_SERVER_ADDRESS or %(default)s)")
    parser.add_argument("--working-dir", default=REPO_ROOT, help="folder to upload (default: this checkout)")
    parser.add_argument("--submission-id", default=None)
    parser.add_argument("--no-wait", action="store_true", help="return once submitted instead of tailing logs")
    parser.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    args = parser.parse_args(argv)

    if not os.path.isfile(args.config):
        print(f"rayfactory submit: error: config file {args.config} not found (looked for "
              f"{os.path.abspath(args.config)}).", file=sys.stderr)
        return USER_ERROR_EXIT
    command = build_submit_command(
        args.config, args.overrides, address=args.address, working_dir=args.working_dir,
        submission_id=args.submission_id, no_wait=args.no_wait,
    )
    for note in config_notes(args.config, args.overrides):
        print(f"rayfactory submit: note: {note}", file=sys.stderr)
    if os.path.isabs(command[command.index("train") + 1]):
        print("rayfactory submit: note: the config lies outside the working dir, so the job reads it from "
              f"{os.path.abspath(args.config)} on the head node.", file=sys.stderr)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    return _run(command, args.address)


def _run(command: list[str], address: str) -> int:
    """Run ``ray job submit``, streaming its output; explain the one failure every new user meets."""
    process = subprocess.Popen(command, env=submission_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1)
    auth_failed = False
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(line)
        auth_failed = auth_failed or "Missing authentication token" in line
    code = process.wait()
    if code != 0 and auth_failed:
        print(f"rayfactory submit: error: {AUTH_HELP.format(address=address)}", file=sys.stderr)
        return USER_ERROR_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())
