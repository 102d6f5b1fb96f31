"""``rayfactory webui``: the page and its small JSON API (FastAPI, which Ray Serve brings along).

Everything the page does goes through the same code as the CLI: the form becomes a config dict,
``load_config`` validates it, Start runs ``rayfactory train`` as a Ray job (runs.py), Chat is the
``ChatModel`` of ``rayfactory chat`` and Export is ``rayfactory export``'s ``export_model``. The
server binds to 127.0.0.1 unless told otherwise; anywhere else it wants an access token.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from starlette.requests import Request

from registries.errors import ArgumentError, UserError, find_user_error

from . import form
from . import models
from . import guard
from .bodies import chat_request, json_kind as _json_kind, json_object as _json_object, number as _number, \
    text as _text
from .guard import LOOPBACK, TOKEN_HEADER, WILDCARDS  # noqa: F401 (TOKEN_HEADER: the page's header, by its old address)
from .code_keys import check_code_keys
from .paths import check_config, check_loadable_here, confine
from .preview import SHOWN_ROWS
from .runs import Runs

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# scripts/config_reference.py writes it from the typed config; the page's "config reference" link
CONFIG_REFERENCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "docs", "config-reference.md")
SHARED_STATIC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "webchat", "static")


def create_app(share_dir: str, token: str | None = None, job_address: str | None = None, cwd: str | None = None,
               host: str = "127.0.0.1", allowed_hosts: Iterable[str] = (), allow_code: bool = False):
    """The app. ``host`` is the address the server binds: besides the loopback names, the Host header
    may name it (and any of ``allowed_hosts``); a browser's Origin must be one of those too.
    ``allow_code``: configs may name Python modules inside ``cwd`` (code_keys.py); else only built-ins."""
    from fastapi import Depends, FastAPI
    from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
    from fastapi.staticfiles import StaticFiles

    app = FastAPI(title="RayFactory", docs_url=None, redoc_url=None, openapi_url=None)
    runs = Runs(share_dir, job_address, cwd)
    app.state.runs = runs  # run_webui stops the UI's own Ray head through it when the UI stops
    roots = runs.roots
    hosts = guard.allowed_hosts(host, allowed_hosts)
    chats = models.ChatCache()
    templates = models.TemplateCache()

    def checked(cfg: dict[str, Any]) -> dict[str, Any]:
        """A config from a request with its paths confined and resolved, and no code it may not run."""
        check_code_keys(cfg, roots, allow_code)
        return check_config(cfg, roots)

    @app.middleware("http")
    async def check_caller(request: Request, call_next):
        """Every route: the Host and Origin a browser sends (DNS rebinding, other sites' pages), then
        the token for the API."""
        refusal = guard.refused_host(request.headers, hosts, *guard.listening(request.scope))
        if refusal:
            return JSONResponse({"error": refusal}, status_code=403)
        if token and request.url.path.startswith("/api/") and not guard.token_matches(request.scope, token):
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

    Json = Depends(_json_object)

    @app.get("/")
    def index():
        return FileResponse(os.path.join(STATIC_DIR, "index.html"))

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/help/config-reference")
    def config_reference():
        """Every config key with its type, default and meaning: the generated docs page, as text
        (one fixed file; nothing in the request names a path)."""
        return FileResponse(CONFIG_REFERENCE, media_type="text/markdown; charset=utf-8")

    @app.get("/shared/events.js")
    def events_js():  # the event-stream reader webchat's page uses too: one copy
        return FileResponse(os.path.join(SHARED_STATIC_DIR, "events.js"), media_type="text/javascript")

    @app.get("/api/spec")
    def spec():
        return {**form.form_spec(), "job_address": job_address or "local Ray (started by this UI)",
                "cwd": runs.cwd}

    @app.get("/api/datasets")
    def datasets(dataset_dir: str = "data"):
        from registries.datasets.info import load_dataset_info

        return {"datasets": sorted(load_dataset_info(confine(dataset_dir, roots, "dataset_dir")))}

    @app.post("/api/config")
    def config(body: dict = Json):
        """The YAML and command of the form as it is now, and the CLI's error if it would refuse it."""
        values, text = _form_parts(body)
        try:
            cfg = form.config_from_form(values, form.parse_yaml(text))
        except UserError as exc:  # the "more keys" box does not parse
            return {"config": None, "yaml": "", "config_path": "", "command": "",
                    "error": {"key": "extra", "message": str(exc)}}
        path = runs.config_path(cfg)
        try:  # a path outside the UI's folders is shown like any other config error
            error = form.validate(checked(cfg))
        except ArgumentError as exc:
            error = {"key": exc.key if exc.key in form.FIELD_BY_KEY else "extra", "message": str(exc)}
        return {"config": cfg, "yaml": form.to_yaml(cfg), "config_path": path,
                "command": form.command_line(path, job_address), "error": error}

    @app.post("/api/template")
    def template(body: dict = Json):
        """The template a run of the form's model takes: ``auto`` resolved from the model's tokenizer as
        the run resolves it (stages/loading.py), with why; a model this UI cannot load without the
        network gets {"template": null} and the reason."""
        model = _text(body, "model_name_or_path", "", limit=4096).strip()
        name = _text(body, "template", "", limit=200).strip() or "auto"
        if name != "auto":
            return {"template": name, "auto": False, "reason": "named in the config"}
        if not model:
            return {"template": None, "auto": True, "reason": "model_name_or_path is not set"}
        try:
            keys = check_config({"model_name_or_path": model}, roots)
            check_loadable_here(keys, roots)
        except UserError as exc:
            return {"template": None, "auto": True, "reason": f"the run resolves it from the tokenizer ({exc})"}
        return {**templates.resolve(keys["model_name_or_path"]), "auto": True}

    @app.post("/api/yaml/load")
    def load_yaml(body: dict = Json):
        text = _text(body, "text", None, limit=MAX_YAML_CHARS)
        if text is None:
            path = _yaml_path(confine(body.get("path"), roots, "path"))
            try:
                if not os.path.isfile(path):  # a folder or a pipe is not read (nor waited on)
                    raise FileNotFoundError(2, "no such file")
                if os.path.getsize(path) > MAX_YAML_CHARS:
                    raise OSError(27, f"larger than {MAX_YAML_CHARS} bytes")
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise UserError(f"cannot read the YAML {path}: {getattr(exc, 'strerror', None) or exc}. Check the "
                                f"path (relative paths start at {runs.cwd}).") from None
        values, extra = form.form_from_config(form.parse_yaml(text))
        return {"values": values, "extra_text": form.extra_text(extra)}

    @app.post("/api/yaml/save")
    def save_yaml(body: dict = Json):
        cfg = _form_config(body)
        checked(cfg)
        path = _yaml_path(confine(_text(body, "path", "") or runs.config_path(cfg), roots, "path"))
        form.write_yaml(path, cfg)
        return {"path": path}

    @app.post("/api/preview")
    def preview(body: dict = Json):
        from .preview import preview as data_preview

        cfg = checked(_form_config(body))
        check_loadable_here({"model_name_or_path": cfg.get("model_name_or_path")}, roots)  # its tokenizer, offline
        dataset = _text(body, "dataset", "")
        if not dataset:
            raise UserError("dataset: choose the dataset to preview.")
        rows = _number(body, "rows", 1, MAX_PREVIEW_ROWS, integer=True)
        return data_preview(cfg, dataset, SHOWN_ROWS if rows is None else rows)

    @app.post("/api/runs")
    def start(body: dict = Json):
        cfg = _form_config(body)
        error = form.validate(checked(cfg))
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
        return {"job_id": runs.resume(job_id, checked).job_id}

    @app.post("/api/chat")
    async def chat(body: dict = Json):
        """The reply as server-sent events, like ``rayfactory webchat``'s: ``{"text"}`` per piece, then
        ``{"done", "finish_reason", "prompt_tokens", "completion_tokens"}`` (or ``{"error"}``)."""
        from starlette.concurrency import run_in_threadpool

        messages, system, settings = chat_request(body)
        keys = await run_in_threadpool(models.model_keys, body, roots)
        model = await run_in_threadpool(chats.get, keys)
        prepared = await run_in_threadpool(lambda: model.request(messages, system, None, **settings))
        deltas = model.stream_deltas(prepared)
        first = await run_in_threadpool(next, deltas, None)  # an engine's refusal is a 400 now, not in a 200 stream
        return StreamingResponse(models.chat_events(deltas, first, len(prepared.prompt_ids)),
                                 media_type="text/event-stream", headers={"x-accel-buffering": "no"})

    @app.post("/api/export")
    def export(body: dict = Json):
        return models.export(roots, body)

    return app


# --- requests: what a body must hold -----------------------------------------------------------

MAX_YAML_CHARS = 1_000_000
MAX_VALUE_CHARS = 100_000  # one form field's text
MAX_PREVIEW_ROWS = 50
SCALARS = (str, int, float, bool, type(None))


def _form_parts(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(form values, the "more keys" YAML text) of a Train-tab request, shapes checked."""
    values = body.get("values")
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ArgumentError("values", f"values must be a JSON object of form fields, not a JSON {_json_kind(values)}.")
    for key, value in values.items():
        f = form.FIELD_BY_KEY.get(key)
        if f is None:
            continue  # not a field: config_from_form never reads it
        entries = (str,) if f.kind == "datasets" else SCALARS if f.kind == "list" else None
        listed = entries is not None and isinstance(value, list) and all(isinstance(v, entries) for v in value)
        if not (listed or isinstance(value, SCALARS)):
            also = {"datasets": " (or a list of names)", "list": " (or a list of them)"}.get(f.kind, "")
            raise ArgumentError(key, f"values.{key} must be a string, a number or a boolean{also}, "
                                     f"not a JSON {_json_kind(value)}.")
        for item in value if listed else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise ArgumentError(key, f"values.{key} must be a finite number, not {item}.")
            if isinstance(item, str) and len(item) > MAX_VALUE_CHARS:
                raise ArgumentError(key, f"values.{key} is longer than {MAX_VALUE_CHARS} characters.")
    return values, _text(body, "extra_text", "", limit=MAX_YAML_CHARS)


def _form_config(body: dict[str, Any]) -> dict[str, Any]:
    """The config of a request from the page: its form values and its "more keys" YAML box."""
    values, text = _form_parts(body)
    return form.config_from_form(values, form.parse_yaml(text))


def _yaml_path(path: str) -> str:
    if not path.endswith((".yaml", ".yml")):
        raise UserError(f"{path} is not a .yaml or .yml file; the web UI reads and writes only those.")
    return path


def add_webui_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.epilog = ("Without --address the UI starts a Ray head of its own for its runs; stopping the UI (Ctrl-C, "
                     "SIGTERM) stops that head and the runs started from the UI (their checkpoints stay: Resume "
                     "continues them). With --address the cluster and its runs go on.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=7860, help="port to listen on (default %(default)s)")
    parser.add_argument("--share-dir", default="saves/webui",
                        help="where the UI keeps its configs, run records and its Ray head's address")
    parser.add_argument("--token", default=os.environ.get("RAYFACTORY_WEBUI_TOKEN"),
                        help="access token the page must send (required with a non-loopback --host); "
                             "default $RAYFACTORY_WEBUI_TOKEN")
    parser.add_argument("--address", default=None,
                        help="a Ray cluster's dashboard URL to run jobs on; its runs go on when the UI stops "
                             "(default: a Ray head this UI starts, which stops with the UI, and the runs on it)")
    parser.add_argument("--allow-code", action="store_true",
                        help="let configs name Python modules of their own (reward_funcs, tools, environment as "
                             "module.path:attr), found in the folder the UI runs in, and ray_init_kwargs; "
                             "without it the UI runs built-ins only (anyone who reaches the UI could run code)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="another host name the browser may use for the UI (repeatable; loopback names and "
                             "--host are always allowed)")
    return parser


def run_webui(args: argparse.Namespace) -> int:
    import uvicorn

    guard.refuse_open_host(args.host, args.token, "the web UI", "start jobs and read files", args.port,
                           "RAYFACTORY_WEBUI_TOKEN")
    app = create_app(args.share_dir, args.token, args.address, host=args.host, allowed_hosts=args.allow_host,
                     allow_code=args.allow_code)
    suffix = f"/?token={args.token}" if args.token else "/"
    stops = (f"runs on {args.address} go on" if args.address else
             "and its Ray head, with the runs started from the UI")
    print(f"rayfactory webui: http://{args.host}:{args.port}{suffix}  (Ctrl-C stops the UI {stops})", flush=True)
    if args.host in WILDCARDS and not args.allow_host:
        print("rayfactory webui: browsers must reach it by a loopback name, or by a name given with --allow-host",
              flush=True)
    # uvicorn shuts down on SIGINT and SIGTERM, then raises the signal again under the handlers it found:
    # SIGTERM's would end the process here, before the head is stopped; this one unwinds to `finally`.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    code = 0
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    except KeyboardInterrupt:
        code = 130
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave half a head
        try:
            print(app.state.runs.shutdown(), flush=True)
        finally:
            signal.signal(signal.SIGINT, interrupt)
    return code


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signal.SIGTERM)
