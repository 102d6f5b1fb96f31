"""The webchat server: the page, ``GET /api/info`` and ``POST /api/chat`` (a server-sent event stream).

The model is ``rayfactory chat``'s: the config is loaded the same way and the reply comes from
``ChatModel``'s async stream on this server's event loop, so a client that goes away (the page's
Stop button aborts its fetch) cancels the reply and the engine lets go at its next token.

Callers are untrusted, as in the web UI: its guard checks Host and Origin (DNS rebinding, other
sites' pages) and the token; its body checks (cluster/webui/bodies.py) shape a chat request; the
config's serve limits cap the body, the replies at once and their time. A caller's mistake is a
4xx with a JSON ``{"error": ...}``, never a 500.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from registries.errors import UserError, find_user_error

from ..webui import guard
from ..webui.bodies import BodyTooLarge, chat_request, limited_json_object
from . import DEFAULT_PORT, TOKEN_ENV

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# The page runs only its own script and styles (no inline code: a reply is put in with textContent,
# and even if it were not, injected markup could run nothing); it is never framed; the URL, which
# may carry ?token=, is not sent on as a referrer.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


@dataclass(frozen=True)
class Limits:
    """What callers may ask of the server: the config's serve keys, read the way serve reads them."""

    max_request_bytes: int = 1 << 20
    max_ongoing: int = 64  # replies streaming or waiting for the engine; one more is a 429
    timeout_s: float = 300  # a reply still going this long after its request is stopped

    @classmethod
    def of(cls, serve_args) -> "Limits":
        return cls(serve_args.serve_max_request_bytes, serve_args.serve_max_ongoing_requests,
                   serve_args.serve_request_timeout_s)


def create_app(chat, *, info: dict[str, Any] | None = None, default_system: str | None = None,
               limits: Limits = Limits(), token: str | None = None, host: str = "127.0.0.1",
               allowed_hosts: Iterable[str] = ()):
    """The app over a loaded ``ChatModel`` (stages.inference.chat_model)."""
    from fastapi import FastAPI
    from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
    from fastapi.staticfiles import StaticFiles
    from starlette.exceptions import HTTPException

    from stages.engines.types import PromptTooLong, check_prompt_fits
    from stages.inference.chat_model import ChatInputError

    app = FastAPI(title="RayFactory webchat", docs_url=None, redoc_url=None, openapi_url=None)
    hosts = guard.allowed_hosts(host, allowed_hosts)
    state = {"generating": 0}
    page_info = {**(info or {}), **_settings_info(chat.spec.generating, default_system),
                 "max_new_tokens_limit": chat.engine.max_model_len}

    @app.middleware("http")
    async def check_caller(request: Request, call_next):
        """Every route: the Host and Origin a browser sends, then the token for the API."""
        refusal = guard.refused_host(request.headers, hosts, *guard.listening(request.scope))
        if refusal:
            answer = JSONResponse({"error": refusal}, status_code=403)
        elif token and request.url.path.startswith("/api/") and not guard.token_matches(request.scope, token):
            answer = JSONResponse({"error": "missing or wrong access token (open the page with ?token=...)."},
                                  status_code=401)
        else:
            answer = await call_next(request)
        answer.headers.update(SECURITY_HEADERS)
        return answer

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge):
        return JSONResponse({"error": str(exc)}, status_code=413)

    @app.exception_handler(HTTPException)  # unknown paths, wrong methods: the same JSON shape
    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(Exception)  # UserError (and one a library wrapped) is the caller's: a 400
    async def other_errors(request: Request, exc: Exception):
        mistake = find_user_error(exc)
        if mistake is not None or isinstance(exc, PromptTooLong):
            return JSONResponse({"error": str(mistake or exc)}, status_code=400)
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)

    @app.get("/")
    def index():
        return FileResponse(os.path.join(STATIC_DIR, "index.html"))

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/api/info")
    def describe():
        return {**page_info, "generating": state["generating"]}

    @app.post("/api/chat")
    async def chat_route(request: Request):
        body = await limited_json_object(request, limits.max_request_bytes)
        messages, system, settings = chat_request(body)
        if state["generating"] >= limits.max_ongoing:
            return JSONResponse({"error": f"the server is answering {state['generating']} replies already, its "
                                          f"most (serve_max_ongoing_requests); try again when one ends."},
                                status_code=429)
        if settings["temperature"] is not None:  # as for OpenAI clients: above 0 samples, 0 is greedy
            settings["do_sample"] = settings["temperature"] > 0
        try:  # a mistake in the conversation is a 400 now, not an error inside a 200 stream
            prepared = await chat.arequest(messages, system, None, **settings)
            check_prompt_fits(prepared.prompt_ids, prepared.sampling, chat.engine.max_model_len)
        except (ChatInputError, PromptTooLong) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return StreamingResponse(_events(chat, prepared, state, limits.timeout_s), media_type="text/event-stream",
                                 headers={"x-accel-buffering": "no"})

    return app


async def _events(chat, prepared, state: dict[str, int], timeout_s: float):
    """``data: {"text": ...}`` per new piece of the reply, then ``{"done": true, ...}`` (or
    ``{"error": ...}``). Cancelled when the client goes away: ChatModel's stream then stops the engine."""
    from stages.engines.types import PromptTooLong
    from stages.inference.chat_model import ChatInputError

    state["generating"] += 1
    tokens, reason = 0, None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    stream = chat.stream_request(prepared)
    try:
        while True:
            try:  # each step within what is left of the budget (asyncio.timeout is Python 3.11+)
                delta = await asyncio.wait_for(stream.__anext__(), max(deadline - loop.time(), 0))
            except StopAsyncIteration:
                break
            tokens += delta.tokens
            reason = delta.finish_reason or reason
            if delta.text:
                yield _sse({"text": delta.text})
        yield _sse({"done": True, "finish_reason": reason or "stop", "prompt_tokens": len(prepared.prompt_ids),
                    "completion_tokens": tokens})
    except asyncio.TimeoutError:
        yield _sse({"error": f"the reply ran past this server's time budget of {timeout_s:g} s "
                             "(serve_request_timeout_s) and was stopped."})
    except (ChatInputError, PromptTooLong) as exc:
        yield _sse({"error": str(exc)})
    finally:
        try:
            await stream.aclose()  # the engine lets go of a reply nobody reads (Stop, a closed tab)
        finally:
            state["generating"] -= 1  # counted down once the engine is free: /api/info shows it


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode("utf-8")


def _settings_info(gen, default_system: str | None) -> dict[str, Any]:
    """The page's starting values: the config's generation keys (greedy shown as temperature 0)."""
    return {"system": default_system or "", "temperature": gen.temperature if gen.do_sample else 0.0,
            "top_p": gen.top_p, "max_new_tokens": gen.max_new_tokens}


def model_info(cfg, chat) -> dict[str, Any]:
    """What the page's header says about the model (as `rayfactory chat`'s banner does)."""
    spec = cfg.inference_spec()
    return {"model": str(spec.model.model_name_or_path), "adapter": ", ".join(map(str, spec.adapters)) or "none",
            "template": chat.template.name, "backend": spec.inference.infer_backend}


def run_webchat(args: argparse.Namespace) -> int:
    import uvicorn

    from ..chat_cli import _quiet_libraries
    from ..config import load_config

    # Before the model loads: a refusal, or a config mistake, costs no wait.
    guard.refuse_open_host(args.host, args.token, "the chat page", "use the model", args.port, TOKEN_ENV)
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be a TCP port (1-65535), got {args.port}.")
    cfg = load_config(args.config, args.overrides, purpose="infer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _quiet_libraries(cfg)
        from stages.inference.chat_model import ChatModel

        chat = ChatModel(cfg.inference_spec())
    try:
        app = create_app(chat, info=model_info(cfg, chat), default_system=cfg.data.default_system,
                         limits=Limits.of(cfg.serve), token=args.token, host=args.host,
                         allowed_hosts=args.allow_host)
        suffix = f"/?token={args.token}" if args.token else "/"
        print(f"rayfactory webchat: http://{args.host}:{args.port}{suffix}  (Ctrl-C stops it)", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        chat.close()
    return 0


__all__ = ["DEFAULT_PORT", "Limits", "create_app", "run_webchat"]
