"""``rayfactory serve cfg.yaml`` (alias ``api``): the OpenAI-compatible endpoint on Ray Serve.

Where it listens: ``--host``/``--port``, else ``API_HOST``/``API_PORT``, else the config's
``api_host``/``api_port``, else 127.0.0.1:8000. The key: ``API_KEY``, else ``api_key``. Without a
key, requests must name the server in their Host header: loopback, or a name ``--allow-host``
gives (the ``serve_allow_hosts`` key; cluster/serve/admission.py).
``--write-serve-config PATH`` writes the equivalent Ray Serve config (for ``serve run`` /
``serve deploy`` on a cluster) and starts nothing.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time

import yaml

from registries.errors import UserError

from cluster.serve.serve_args import resolve_api_key

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APP_NAME = "rayfactory"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ServeSetupError(UserError):
    """A listen address from the environment that cannot be used."""


def resolve_address(args: argparse.Namespace, cfg) -> tuple[str, int]:
    host = args.host or os.environ.get("API_HOST") or cfg.serve.api_host or "127.0.0.1"
    port = args.port
    if port is None and os.environ.get("API_PORT"):
        try:
            port = int(os.environ["API_PORT"])
        except ValueError:
            raise ServeSetupError(f"API_PORT={os.environ['API_PORT']!r} in the environment is not a port number; "
                                  "set it to a number such as 8000, or unset it.") from None
    port = port if port is not None else cfg.serve.api_port
    if not 0 < port < 65536:
        raise ServeSetupError(f"port {port} is not a TCP port (1-65535); fix --port, API_PORT or api_port.")
    return host, port


def check_exposure(host: str, api_key) -> None:
    """A server other machines can reach answers only callers that hold the API key."""
    if host not in LOOPBACK and not api_key:
        raise ServeSetupError(
            f"--host {host} opens the API to other machines, and anyone who reaches it could use the model. Set an "
            "API key (API_KEY in the environment, or api_key in the config) that clients send as 'Authorization: "
            "Bearer <key>', or keep the default host 127.0.0.1 (and forward the port: ssh -L 8000:localhost:8000).")


def _require_ray_token(ray_args) -> None:
    """Ray's token authentication for the local Ray this command starts.

    Ray's daemons listen on every interface, with no setting that keeps them to loopback. With a
    token that only this process and the Ray processes it starts know, a stranger who reaches those
    ports cannot join the Ray and run code in it. A cluster (ray_address / RAY_ADDRESS), and a
    RAY_AUTH_MODE the user set, are left as they are."""
    if ray_args.resolved_address() is not None or os.environ.get("RAY_AUTH_MODE") or "ray._raylet" in sys.modules:
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def serve_config(cfg, config_path: str, overrides: list[str], host: str, port: int) -> dict:
    """A Ray Serve config (``serve run`` / ``serve deploy``) that builds the same application."""
    from .app import DEPLOYMENT, deployment_options

    deployment = {"name": DEPLOYMENT, **deployment_options(cfg.serve)}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": port},
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": "cluster.serve.app:app_builder",
            "args": {"config": os.path.abspath(config_path), "overrides": list(overrides)},
            # `serve run` uploads this folder; `serve deploy` needs a remote URI (zip on S3/GCS) here.
            "runtime_env": {"working_dir": _REPO_ROOT},
            "deployments": [deployment],
        }],
    }


def write_serve_config(path: str, config: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("# Written by `rayfactory serve --write-serve-config`. Run: serve run " f"{os.path.basename(path)}\n"
                "# The API key is read from API_KEY (or api_key in the config) where the app is built;\n"
                "# for `serve deploy`, point runtime_env.working_dir at a zip URI of this repository.\n")
        yaml.safe_dump(config, f, sort_keys=False)
    return path


def run_serve(args: argparse.Namespace) -> int:
    from ..config import load_config

    overrides = list(args.overrides)
    if getattr(args, "allow_host", None):  # a config key, so that a written Serve config carries it too
        overrides.append(f"serve_allow_hosts={','.join(args.allow_host)}")
    cfg = load_config(args.config, overrides, purpose="infer")
    host, port = resolve_address(args, cfg)
    if getattr(args, "write_serve_config", None):
        path = write_serve_config(args.write_serve_config, serve_config(cfg, args.config, overrides, host, port))
        print(f"rayfactory: wrote the Ray Serve config {path} (serve run {path})")
        return 0

    check_exposure(host, resolve_api_key(cfg))
    _require_ray_token(cfg.ray)  # before anything imports Ray, which reads the setting once

    from ray import serve

    from fabric.ray_session import connect, shutdown, started_local_ray

    from .app import build_app

    connect(cfg.ray)
    serve.start(http_options={"host": host, "port": port})
    spec = cfg.inference_spec()
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
    names = [spec.model_name(), *(cfg.inference.lora_modules or {})]
    auth = " (API key required)" if resolve_api_key(cfg) else ""
    print(f"rayfactory: serving {', '.join(names)} at http://{host}:{port}/v1{auth}; Ctrl-C stops", flush=True)
    # SIGTERM (a service manager, `kill`) stops as Ctrl-C does: Serve and the local Ray shut down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not leave Ray half stopped
        if started_local_ray():
            shutdown()  # the Ray is this command's own: stopping it stops Serve, at once and quietly
        else:
            serve.delete(APP_NAME)  # a shared cluster: remove our application, leave the rest running
    return 0
