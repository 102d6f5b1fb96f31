"""The Python API: ``run_exp`` (training) and ``ChatModel`` (inference) from a YAML path or dict.

    from cluster.api import ChatModel
    chat = ChatModel({"model_name_or_path": "tiny:qwen2", "adapter_name_or_path": "saves/run"})
    print(chat.chat([{"role": "user", "content": "Hi"}])[0].response_text)
"""

from __future__ import annotations

from typing import Iterable

from stages.inference.chat_model import ChatModel as _ChatModel

from .config import RunConfig, load_config
from .driver import run_exp


class ChatModel(_ChatModel):
    """``stages.inference.chat_model.ChatModel`` built from a config (the keys of a chat or
    training YAML; output_dir is not needed)."""

    def __init__(self, config: "RunConfig | dict | str | None" = None, overrides: Iterable[str] = ()):
        cfg = config if isinstance(config, RunConfig) else load_config(config, list(overrides), purpose="infer")
        super().__init__(cfg.inference_spec())


__all__ = ["ChatModel", "run_exp"]
