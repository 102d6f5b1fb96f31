"""The models the web UI's Chat, Export and template routes load, in the UI's own process.

A request names a model and an adapter; ``model_keys`` confines local paths to the UI's folders and
refuses what cannot be loaded offline (paths.py). One chat model is kept loaded at a time, and the
template ``auto`` resolves to is remembered per model.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from registries.errors import UserError

from .bodies import number as _number, text as _text
from .paths import check_config, check_loadable_here, confine


def model_keys(body: dict[str, Any], roots: tuple[str, ...]) -> dict[str, Any]:
    """The model keys the Chat or Export tab sends. A local path must lie in the UI's folders and is
    passed on resolved (``saves/run`` would otherwise read as a hub id, as in LLaMA-Factory's org/name);
    a hub id or tiny:/demo: id as it is."""
    keys = {k: _text(body, k, "", limit=4096).strip() for k in ("model_name_or_path", "adapter_name_or_path",
                                                              "template")}
    resolved = check_config({k: v for k, v in keys.items() if v}, roots)
    check_loadable_here(resolved, roots)
    return resolved


def export(roots: tuple[str, ...], body: dict[str, Any]) -> dict[str, Any]:
    from stages.inference.export import check_export_request, export_model

    from ..config import load_config

    export_dir = confine(_text(body, "export_dir", ""), roots, "export_dir")  # the request's own keys first
    size = _number(body, "export_size", 0.001, 1000.0)
    keys = {**model_keys(body, roots), "export_dir": export_dir}
    if size is not None:
        keys["export_size"] = size
    cfg = load_config(keys, purpose="infer")
    spec = cfg.inference_spec()
    check_export_request(spec, cfg.export)
    files = export_model(spec, cfg.export, log=lambda *_: None)
    return {"export_dir": cfg.export.export_dir, "files": files}


async def chat_events(deltas, first, prompt_tokens: int):
    """The events of one reply. When the page stops reading (its Stop button aborts the request) the
    delta stream is closed, which cancels the reply in the engine (ChatModel.stream_deltas)."""
    import anyio
    from starlette.concurrency import run_in_threadpool

    tokens, reason = 0, None
    delta = first
    try:
        while delta is not None:
            tokens += delta.tokens
            reason = delta.finish_reason or reason
            if delta.text:
                yield sse({"text": delta.text})
            delta = await run_in_threadpool(next, deltas, None)
        yield sse({"done": True, "finish_reason": reason or "stop", "prompt_tokens": prompt_tokens,
                    "completion_tokens": tokens})
    except UserError as exc:
        yield sse({"error": str(exc)})
    finally:
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(deltas.close)


def sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode("utf-8")


class TemplateCache:
    """What ``template: auto`` resolves to per model (tokenizers of built-in ids do not change; a
    folder is looked at again each time)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.known: dict[str, dict[str, Any]] = {}

    def resolve(self, model: str) -> dict[str, Any]:
        with self.lock:
            if model not in self.known:
                answer = _resolve_auto_template(model)
                if not model.startswith(("tiny:", "demo:")):
                    return answer
                self.known[model] = answer
            return self.known[model]


def _resolve_auto_template(model: str) -> dict[str, Any]:
    import warnings

    from registries.models.demo import DEMO_PREFIX, get_demo_model
    from registries.templates.autodetect import auto_template_reason, resolve_template
    from stages.loading import auto_model_type, load_tokenizer, resolve_model_path
    from stages.run_args import ModelArguments

    if model.startswith(DEMO_PREFIX):  # its converted folder may not be made yet: the registry knows its template
        name = get_demo_model(model[len(DEMO_PREFIX):]).template
        return {"template": name, "reason": "the demo model's own chat template"}
    args = ModelArguments(model_name_or_path=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reason below says what the run's warning would
        tokenizer = load_tokenizer(resolve_model_path(model))
        model_type = auto_model_type(args, "auto", tokenizer)
        name = resolve_template("auto", tokenizer, model_type).name
    return {"template": name, "reason": auto_template_reason(tokenizer, name, model_type)}


class ChatCache:
    """One loaded model at a time: the page chats with one output, and a model holds memory."""

    def __init__(self):
        self.lock = threading.Lock()
        self.key: tuple | None = None
        self.model = None

    def get(self, keys: dict[str, Any]):
        from ..api import ChatModel
        from ..config import load_config

        key = tuple(sorted(keys.items()))
        with self.lock:
            if key != self.key:
                cfg = load_config(dict(keys), purpose="infer")
                if self.model is not None:
                    self.model.close()
                    self.model = None
                self.model = ChatModel(cfg)
                self.key = key
            return self.model
