"""``rayfactory chat cfg.yaml [key=value ...]``: talk to a model or a trained output in the terminal.

Like LLaMA-Factory's ``llamafactory-cli chat``: type a message, the reply streams in; ``clear``
forgets the conversation, ``exit`` (or Ctrl-D, or Ctrl-C at the prompt) quits, Ctrl-C during a
reply stops that reply. Generation settings (temperature, max_new_tokens, ...) and
default_system come from the config, as everywhere else.

With a vision-language model (a template with a vision plugin, e.g. qwen2_vl), ``/image PATH``
reads a local picture and attaches it to the next message (an ``<image>`` is put at the start of
that message unless the message places its own); the conversation keeps its images, ``clear``
forgets them too.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from registries.errors import find_user_error

from .config import RunConfig, load_config

EXIT_WORDS = ("exit",)
CLEAR_WORDS = ("clear",)
IMAGE_COMMAND = "/image"
IMAGE_PLACEHOLDER = "<image>"  # where an image goes in a message, as in training data


def run_chat(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides, purpose="infer")
    with warnings.catch_warnings():
        # The chat screen is for the conversation: loading bars and library warnings stay out of it.
        warnings.simplefilter("ignore")
        _quiet_libraries(cfg)
        from stages.inference.chat_model import ChatModel

        try:
            chat = ChatModel(cfg.inference_spec())
        except KeyboardInterrupt:  # Ctrl-C while the model loads: no traceback for a change of mind
            print(file=sys.stderr)
            return 130
        try:
            return _Session(chat, cfg).loop()
        finally:
            chat.close()


class _Session:
    def __init__(self, chat, cfg: RunConfig):
        self.chat, self.cfg = chat, cfg
        self.history: list[dict] = []
        self.images: list = []  # the history's pictures, one per <image> in it, in order
        self.pending: list = []  # attached with /image, sent with the next message

    def loop(self) -> int:
        _enable_line_editing()
        print(self.banner(), flush=True)
        while True:
            try:
                text = input("User: ").strip()
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave cleanly
                print(flush=True)
                return 0
            if not text:
                continue
            if text.lower() in EXIT_WORDS:
                return 0
            if text.lower() in CLEAR_WORDS:
                self.history, self.images, self.pending = [], [], []
                print("History has been removed.", flush=True)
                continue
            command, _, argument = text.partition(" ")
            if command.lower() == IMAGE_COMMAND:
                self.attach(argument.strip())
                continue
            self.answer(text)

    def attach(self, path: str) -> None:
        """Read a local picture now (a wrong path is said at once, not after the next message)."""
        from registries.errors import UserError
        from registries.multimodal import vision_plugin_of
        from stages.inference.vision_inputs import open_image

        if not path:
            print(f"rayfactory: usage: {IMAGE_COMMAND} PATH (a PNG, JPEG or other picture on this machine).", flush=True)
            return
        try:
            vision_plugin_of(self.chat.template)  # a text model: the registry's one-line explanation
            image = open_image(os.path.expanduser(path))
        except UserError as error:
            print(f"rayfactory: error: {error}", flush=True)
            return
        self.pending.append(image)
        print(f"Image attached: {path} ({image.width}x{image.height}); it goes with your next message.", flush=True)

    def answer(self, text: str) -> None:
        pending = self.pending
        self.pending = []  # sent with this message, or dropped with it if the reply fails
        if pending and text.count(IMAGE_PLACEHOLDER) != len(pending):
            text = IMAGE_PLACEHOLDER * len(pending) + text
        messages = self.history + [{"role": "user", "content": text}]
        images = self.images + pending
        print("Assistant: ", end="", flush=True)
        reply: list[str] = []
        try:
            for piece in self.chat.stream_chat(messages, system=self.cfg.data.default_system, images=images or None):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:  # stream_chat has stopped the reply and waited for the engine
            # A half reply would teach the model nothing the user wanted: the exchange is dropped.
            print("\n(reply stopped; this exchange is not kept in the history)", flush=True)
            return
        except Exception as error:  # noqa: BLE001 (_report re-raises what is not the user's)
            self._report(error)
            return
        print(flush=True)
        self.history = messages + [{"role": "assistant", "content": "".join(reply)}]
        self.images = images

    @staticmethod
    def _report(error: BaseException) -> None:
        """A conversation the model cannot take (too long for its window, ...) is said in a line and
        the session goes on; anything else is a bug and keeps its traceback."""
        from stages.engines.types import PromptTooLong

        if isinstance(error, PromptTooLong):
            print(f"\nrayfactory: {error} Type `clear` to start a new conversation.", flush=True)
        elif find_user_error(error) is not None:
            print(f"\nrayfactory: error: {find_user_error(error)}", flush=True)
        else:
            raise error

    def banner(self) -> str:
        spec = self.cfg.inference_spec()
        adapters = list(spec.adapters) + [f"{name}={path}" for name, path in (spec.inference.lora_modules or {}).items()]
        rows = [
            ("model", spec.model.model_name_or_path),
            ("adapter", ", ".join(adapters) or "none"),
            ("template", self.chat.template.name),
            ("backend", spec.inference.infer_backend),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
        if getattr(self.chat.template, "mm_plugin", None):
            lines.append(f"`{IMAGE_COMMAND} PATH` attaches a picture to your next message.")
        lines.append("Type a message and press Enter. `clear` removes the history, `exit` quits (Ctrl-D too); "
                     "Ctrl-C stops a reply.")
        return "\n".join(lines)


def _quiet_libraries(cfg: RunConfig) -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass
    if cfg.inference.infer_backend == "vllm":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vLLM is imported, below


def _enable_line_editing() -> None:
    """Arrow keys and the history of typed lines at the prompt, where Python has readline."""
    if not sys.stdin.isatty():
        return
    try:
        import readline  # noqa: F401 (importing it is what makes input() use it)
    except ImportError:
        pass
