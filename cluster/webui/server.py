"""``rayfactory webui``: the page and its small JSON API (FastAPI, which Ray Serve brings along).

Everything the page does goes through the same code as the CLI: the form becomes a config dict,
``load_config`` validates it, Start runs ``rayfactory train`` as a Ray job (runs.py), Chat is the
``ChatModel`` of ``rayfactory chat`` and Export is ``rayfactory export``'s ``export_model``. The
server binds to 127.0.0.1 unless told otherwise; anywhere else it wants an access token.
"""

from __future__ import annotations

import argparse
import hmac
import os
import threading
from dataclasses import asdict
from typing import Any

from registries.errors import UserError, find_user_error

from . import form
from .runs import Runs

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
TOKEN_HEADER = "x-rayfactory-token"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def create_app(share_dir: str, token: str | None = None, job_address: str | None = None, cwd: str | None = None):
    from fastapi import Body, FastAPI, Request
    from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
    from fastapi.staticfiles import StaticFiles

    app = FastAPI(title="RayFactory", docs_url=None, redoc_url=None)
    runs = Runs(share_dir, job_address, cwd)
    chats = _ChatCache()

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if token and request.url.path.startswith("/api/"):
            given = request.headers.get(TOKEN_HEADER, "")
            if not hmac.compare_digest(given, token):
                return JSONResponse({"error": "missing or wrong access token (open the page with ?token=...)."},
                                    status_code=401)
        return await call_next(request)

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError):
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(Exception)  # anything else; a user error a library wrapped is still the user's
    async def other_errors(request: Request, exc: Exception):
        mistake = find_user_error(exc)
        if mistake is not None:  # the user's: the CLI's paragraph, no traceback
            return JSONResponse({"error": str(mistake)}, status_code=400)
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)

    @app.get("/")
    def index():
        return FileResponse(os.path.join(STATIC_DIR, "index.html"))

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/api/spec")
    def spec():
        return {**form.form_spec(), "job_address": job_address or "local Ray (started by this UI)",
                "cwd": runs.cwd}

    @app.get("/api/datasets")
    def datasets(dataset_dir: str = "data"):
        from registries.datasets.info import load_dataset_info

        return {"datasets": sorted(load_dataset_info(os.path.join(runs.cwd, dataset_dir)))}

    @app.post("/api/config")
    def config(body: dict = Body(...)):
        """The YAML and command of the form as it is now, and the CLI's error if it would refuse it."""
        try:
            cfg = _form_config(body)
        except UserError as exc:  # the "more keys" box does not parse
            return {"config": None, "yaml": "", "config_path": "", "command": "",
                    "error": {"key": "extra", "message": str(exc)}}
        path = runs.config_path(cfg)
        return {"config": cfg, "yaml": form.to_yaml(cfg), "config_path": path,
                "command": form.command_line(path, job_address), "error": form.validate(cfg)}

    @app.post("/api/yaml/load")
    def load_yaml(body: dict = Body(...)):
        text = body.get("text")
        if text is None:
            path = _inside(runs.cwd, body.get("path", ""))
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise UserError(f"cannot read the YAML {path}: {exc.strerror}. Check the path (relative paths "
                                f"start at {runs.cwd}).") from None
        values, extra = form.form_from_config(form.parse_yaml(text))
        return {"values": values, "extra_text": form.extra_text(extra)}

    @app.post("/api/yaml/save")
    def save_yaml(body: dict = Body(...)):
        cfg = _form_config(body)
        path = _inside(runs.cwd, body.get("path") or runs.config_path(cfg))
        form.write_yaml(path, cfg)
        return {"path": path}

    @app.post("/api/preview")
    def preview(body: dict = Body(...)):
        from .preview import preview as data_preview

        cfg = _form_config(body)
        return data_preview(cfg, body["dataset"], int(body.get("rows", 3)))

    @app.post("/api/runs")
    def start(body: dict = Body(...)):
        cfg = _form_config(body)
        error = form.validate(cfg)
        if error:
            return JSONResponse({"error": error["message"], "key": error["key"]}, status_code=400)
        return {"job_id": runs.start(cfg).job_id}

    @app.get("/api/runs")
    def listing():
        return {"runs": [asdict(run) for run in runs.all()]}

    @app.get("/api/runs/{job_id}")
    def status(job_id: str):
        return runs.status(job_id)

    @app.post("/api/runs/{job_id}/stop")
    def stop(job_id: str):
        return {"stopped": runs.stop(job_id)}

    @app.post("/api/runs/{job_id}/resume")
    def resume(job_id: str):
        return {"job_id": runs.resume(job_id).job_id}

    @app.post("/api/chat")
    def chat(body: dict = Body(...)):
        model = chats.get(_model_keys(body, runs.cwd))
        settings = {k: _number(body.get(k)) for k in ("temperature", "max_new_tokens", "top_p")}
        pieces = model.stream_chat(body.get("messages") or [], body.get("system") or None, **settings)
        return StreamingResponse(pieces, media_type="text/plain; charset=utf-8")

    @app.post("/api/export")
    def export(body: dict = Body(...)):
        return _export(runs.cwd, body)

    return app


def _form_config(body: dict[str, Any]) -> dict[str, Any]:
    """The config of a request from the page: its form values and its "more keys" YAML box."""
    extra = form.parse_yaml(body.get("extra_text") or "")
    return form.config_from_form(body.get("values") or {}, extra)


def _model_keys(body: dict[str, Any], cwd: str) -> dict[str, Any]:
    """The model keys the Chat or Export tab sends; a folder under the UI's folder by its full path
    (``saves/run`` would otherwise read as a hub id, as in LLaMA-Factory's org/name)."""
    keys = {k: str(body.get(k) or "").strip() for k in ("model_name_or_path", "adapter_name_or_path", "template")}
    for key in ("model_name_or_path", "adapter_name_or_path"):
        if keys[key] and os.path.isdir(os.path.join(cwd, keys[key])):
            keys[key] = os.path.join(cwd, keys[key])
    return {k: v for k, v in keys.items() if v}


def _number(value: Any) -> Any:
    if value in (None, ""):
        return None
    number = float(value)
    return int(number) if number.is_integer() and not isinstance(value, float) else number


class _ChatCache:
    """One loaded model at a time: the page chats with one output, and a model holds memory."""

    def __init__(self):
        self.lock = threading.Lock()
        self.key: tuple | None = None
        self.model = None

    def get(self, keys: dict[str, Any]):
        from ..api import ChatModel
        from ..config import load_config
        from ..driver import check_local_paths

        key = tuple(sorted(keys.items()))
        with self.lock:
            if key != self.key:
                cfg = load_config(dict(keys), purpose="infer")
                check_local_paths(cfg)  # a missing folder is named now, not taken for a hub id
                if self.model is not None:
                    self.model.close()
                    self.model = None
                self.model = ChatModel(cfg)
                self.key = key
            return self.model


def _export(cwd: str, body: dict[str, Any]) -> dict[str, Any]:
    from stages.inference.export import check_export_request, export_model

    from ..config import load_config
    from ..driver import check_local_paths

    keys = _model_keys(body, cwd)
    keys["export_dir"] = _inside(cwd, str(body.get("export_dir") or ""))
    if body.get("export_size"):
        keys["export_size"] = float(body["export_size"])
    cfg = load_config(keys, purpose="infer")
    check_local_paths(cfg)
    spec = cfg.inference_spec()
    check_export_request(spec, cfg.export)
    files = export_model(spec, cfg.export, log=lambda *_: None)
    return {"export_dir": cfg.export.export_dir, "files": files}


def _inside(cwd: str, path: str) -> str:
    if not path:
        raise UserError("a path is needed here (relative paths are taken from the folder the web UI runs in).")
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))


def add_webui_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share-dir", default="saves/webui",
                        help="where the UI keeps its configs, run records and its Ray head's address")
    parser.add_argument("--token", default=os.environ.get("RAYFACTORY_WEBUI_TOKEN"),
                        help="access token the page must send (required with a non-loopback --host); "
                             "default $RAYFACTORY_WEBUI_TOKEN")
    parser.add_argument("--address", default=None,
                        help="a Ray cluster's dashboard URL to run jobs on (default: a local Ray this UI starts)")
    return parser


def run_webui(args: argparse.Namespace) -> int:
    import uvicorn

    if args.host not in LOOPBACK and not args.token:
        raise UserError(
            f"--host {args.host} opens the web UI to other machines, and anyone who reaches it can start jobs and "
            "read files. Set an access token (--token or RAYFACTORY_WEBUI_TOKEN) and open the page with "
            "?token=<it>, or keep the default --host 127.0.0.1 (and forward the port: ssh -L 7860:localhost:7860)."
        )
    app = create_app(args.share_dir, args.token, args.address)
    suffix = f"/?token={args.token}" if args.token else "/"
    print(f"rayfactory webui: http://{args.host}:{args.port}{suffix}  (Ctrl-C stops the UI; started runs go on)",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
