"""What an inference engine loads: tokenizer + template as in training, base model + adapters.

A trained output folder carries its own tokenizer (with the template's stop words), the chat
template it trained with and ``rayfactory_config.yaml``: by default inference uses that template,
so the model sees at inference exactly the prompt format it was trained on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import yaml

from registries.datasets.data_args import DataArguments
from registries.errors import UserError
from registries.templates.autodetect import AUTO

from stages.run_args import FinetuningArguments, GeneratingArguments, ModelArguments
from stages.inference.inference_args import InferenceArguments

SAVED_CONFIG = "rayfactory_config.yaml"  # written by every training run (cluster/config.py)
DEFAULT_ADAPTER = "default"


class InferenceLoadError(UserError):
    """A model or adapter folder that cannot serve as configured."""


@dataclass
class InferenceSpec:
    """The slice of a config that inference reads (chat, serve, predict, export)."""

    model: ModelArguments
    data: DataArguments = field(default_factory=DataArguments)
    finetuning: FinetuningArguments = field(default_factory=FinetuningArguments)
    generating: GeneratingArguments = field(default_factory=GeneratingArguments)
    inference: InferenceArguments = field(default_factory=InferenceArguments)

    @property
    def adapters(self) -> list[str]:
        value = self.model.adapter_name_or_path
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return list(value or [])

    @property
    def output_folder(self) -> str:
        """The folder that was trained last: the last adapter, or the model itself."""
        from ..loading import resolve_model_path  # torch: imported where a model is loaded, not with the config

        return self.adapters[-1] if self.adapters else resolve_model_path(self.model.model_name_or_path)

    def model_name(self) -> str:
        """The name the default model is served under."""
        if self.inference.served_model_name:
            return self.inference.served_model_name
        return os.path.basename(os.path.normpath(self.output_folder)) or "default"


def saved_template_name(folder: str) -> str | None:
    """The template a run trained with, from its saved config (None when the folder has none)."""
    path = os.path.join(folder, SAVED_CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        saved = yaml.safe_load(f) or {}
    name = saved.get("template") if isinstance(saved, dict) else None
    return name if isinstance(name, str) and name != AUTO else None


def load_tokenizer_and_template(spec: InferenceSpec):
    """The tokenizer the output was saved with (it carries the stop words training added) and the
    template it trained with, unless the config names one; loaded as training loads them."""
    folder = spec.output_folder
    has_tokenizer = os.path.isfile(os.path.join(folder, "tokenizer_config.json"))
    name = spec.data.template
    if name in (None, AUTO):
        name = saved_template_name(folder) or name
    source = replace(spec.model, model_name_or_path=folder) if has_tokenizer else spec.model
    from ..loading import load_tokenizer_and_template as training_tokenizer_and_template

    return training_tokenizer_and_template(source, replace(spec.data, template=name), for_requests=True)


def load_hf_model(spec: InferenceSpec, tokenizer):
    """(model, adapter names, default adapter) for the transformers engine.

    adapter_name_or_path "a,b,c" (LLaMA-Factory's meaning): a and b are merged into the base in
    order, c stays a live adapter named "default"; each ``lora_modules`` entry is one more live
    adapter on the same base, selected by its name."""
    import torch

    from ..loading import auto_model_class, model_config, model_dtype, resolve_model_path

    dtype = spec.model.infer_dtype if spec.model.infer_dtype != "auto" else None
    dtype = getattr(torch, dtype) if dtype else model_dtype(spec.model)
    # The class training loaded: a vision-language family (Qwen2-VL) is not an AutoModelForCausalLM.
    model = auto_model_class(model_config(spec.model)).from_pretrained(
        resolve_model_path(spec.model.model_name_or_path), dtype=dtype,
        trust_remote_code=spec.model.trust_remote_code, revision=spec.model.model_revision,
        cache_dir=spec.model.cache_dir,
    )
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    *merged, live = spec.adapters or [None]
    for path in merged:
        model = _peft(model, path, DEFAULT_ADAPTER).merge_and_unload()
    named = {DEFAULT_ADAPTER: live} if live else {}
    named.update(spec.inference.lora_modules or {})
    if not named:
        return model.eval(), (), None
    first, *rest = named.items()
    model = _peft(model, first[1], first[0])
    for name, path in rest:
        check_adapter_folder(path, name)
        model.load_adapter(path, adapter_name=name)
    return model.eval(), tuple(named), DEFAULT_ADAPTER if live else None


def _peft(model, path: str, name: str):
    from peft import PeftModel

    check_adapter_folder(path, name)
    return PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)


def check_adapter_folder(path: str, name: str) -> None:
    if os.path.exists(path) and not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise InferenceLoadError(
            f"adapter {name!r} at {path} holds no adapter_config.json, so it is not a LoRA adapter. Point it at "
            "the output_dir of a finetuning_type: lora run; a full or freeze run is a model: use it as "
            "model_name_or_path instead."
        )

