"""Which parameters train: full, freeze (some layers/modules) or LoRA (also on a quantized base).

A vision-language model's parts follow freeze_vision_tower / freeze_multi_modal_projector /
freeze_language_model in each kind (stages/training/vision_freeze.py)."""

from __future__ import annotations

import logging
import re

import torch

from registries.errors import UserError

from stages.training.vision_freeze import composite_of, frozen_parts, lora_all_excluded, lora_module_names, under

logger = logging.getLogger(__name__)


class AdapterError(UserError):
    """A finetuning option that does not fit the model (wrong module names, too many layers...)."""


def apply_finetuning(model, finetuning_args, model_args, is_trainable: bool = True):
    """Return the model with the right parameters trainable (a PeftModel for LoRA)."""
    _check_adapters(finetuning_args, model_args)
    kind = finetuning_args.finetuning_type
    if kind == "lora":
        return _apply_lora(model, finetuning_args, model_args, is_trainable)
    if not is_trainable:
        model.requires_grad_(False)
    else:  # full: all but a vision-language model's frozen parts; freeze: the chosen layers too
        trained = _trained_names(model, finetuning_args)
        for name, param in model.named_parameters():
            if name not in trained:
                param.requires_grad_(False)
            elif kind == "freeze":
                param.requires_grad_(True)
        if kind == "freeze":
            logger.info("freeze tuning: trainable layers %s", list(_freeze_patterns(model, finetuning_args)[1]))
    return model


def _trained_names(model, finetuning_args) -> set[str]:
    """The parameters full or freeze tuning trains (vision_freeze.py for a vision-language model's parts)."""
    frozen = frozen_parts(composite_of(model), finetuning_args)
    patterns = _freeze_patterns(model, finetuning_args)[0] if finetuning_args.finetuning_type == "freeze" else None
    trained = {
        name for name, _ in model.named_parameters()
        if (patterns is None or under(name, patterns)) and not under(name, frozen)
    }
    # Only the vision options can leave nothing to train (every part frozen, the projector included).
    if not trained and frozen:
        raise AdapterError(
            f"No parameter of this {model.config.model_type} model would train: freeze_vision_tower "
            f"{finetuning_args.freeze_vision_tower}, freeze_multi_modal_projector "
            f"{finetuning_args.freeze_multi_modal_projector} and freeze_language_model "
            f"{finetuning_args.freeze_language_model} freeze every part that finetuning_type "
            f"{finetuning_args.finetuning_type} would train. Set one of them to false."
        )
    return trained


def _num_layers(config) -> int:
    config = getattr(config, "text_config", None) or config
    for name in ("num_hidden_layers", "num_layers", "n_layer"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise AdapterError(f"Cannot find the layer count of model type {config.model_type!r}; use lora or full.")


def _freeze_patterns(model, finetuning_args) -> tuple[list[str], range]:
    """Name fragments of the parameters freeze tuning trains (the last N layers, or the first N with
    a negative count, optionally only some modules), and the trained layer ids."""
    n_layers = _num_layers(model.config)
    n = finetuning_args.freeze_trainable_layers
    layer_ids = range(max(0, n_layers - n), n_layers) if n > 0 else range(min(-n, n_layers))

    names = [name for name, _ in model.named_parameters()]
    layer_modules = {m.group(1) for name in names if (m := re.search(r"\.\d+\.([^.]+)", name))}
    other_modules = {name.split(".")[-2] for name in names if not re.search(r"\.\d+\.", name)}

    patterns = []
    for module in _as_list(finetuning_args.freeze_trainable_modules) or ["all"]:
        if module != "all" and module not in layer_modules:
            raise AdapterError(
                f"freeze_trainable_modules: {module!r} is not a module of each layer; "
                f"choose from {sorted(layer_modules)} or 'all'."
            )
        patterns += [f".{i}." + ("" if module == "all" else module) for i in layer_ids]
    for module in _as_list(finetuning_args.freeze_extra_modules):
        if module not in other_modules:
            raise AdapterError(
                f"freeze_extra_modules: {module!r} not found; choose from {sorted(other_modules)}."
            )
        patterns.append(module)
    composite = composite_of(model)
    if composite is not None and not finetuning_args.freeze_multi_modal_projector:
        patterns += composite.projector_keys  # LLaMA-Factory trains an unfrozen projector next to the layers
    return patterns, layer_ids


def _check_adapters(finetuning_args, model_args) -> None:
    """adapter_name_or_path: one adapter, continued with finetuning_type lora."""
    adapters = _as_list(model_args.adapter_name_or_path)
    kind = finetuning_args.finetuning_type
    if adapters and kind != "lora":
        raise AdapterError(
            f"adapter_name_or_path is set but finetuning_type is {kind!r}; adapters only load with "
            "finetuning_type: lora. Merge the adapter first (export) or switch to lora."
        )
    if len(adapters) > 1:
        raise AdapterError(
            f"adapter_name_or_path names {len(adapters)} adapters; training continues one adapter. "
            "Merge the others into the base first (export), or name only the one to continue."
        )


def check_finetuning_fits(model, finetuning_args, model_args) -> None:
    """Raise AdapterError where the adapter settings do not fit, or lora_target / freeze_* name
    modules the model lacks.

    Needs only the module tree, so the driver runs it on a meta-device skeleton of the model
    and the mistake is reported before any worker starts.
    """
    _check_adapters(finetuning_args, model_args)
    if finetuning_args.finetuning_type in ("full", "freeze"):
        _trained_names(model, finetuning_args)
    elif finetuning_args.finetuning_type == "lora" and not model_args.adapter_name_or_path:
        _lora_targets(model, finetuning_args)


def find_linear_modules(model, excluded: tuple[str, ...] = ()) -> list[str]:
    """Leaf names of every linear layer except the output head (what ``lora_target: all`` means),
    and except those whose full name holds one of ``excluded`` (a vision-language model's parts)."""
    linear_types = (torch.nn.Linear,)
    try:  # quantized bases replace nn.Linear with bitsandbytes layers
        import bitsandbytes as bnb

        linear_types += (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    except ImportError:
        pass
    head = {"lm_head", "output_layer", "score", "v_head"}
    names = set()
    for full_name, module in model.named_modules():
        leaf = full_name.split(".")[-1]
        if isinstance(module, linear_types) and leaf not in head and not under(full_name, excluded):
            names.add(leaf)
    return sorted(names)


def _apply_lora(model, finetuning_args, model_args, is_trainable: bool):
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model

    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)

    adapters = _as_list(model_args.adapter_name_or_path)
    if adapters:  # continue training this adapter (_check_adapters allows one)
        return PeftModel.from_pretrained(model, adapters[0], is_trainable=is_trainable)
    if not is_trainable:
        return model

    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=finetuning_args.lora_rank,
        lora_alpha=finetuning_args.lora_alpha or 2 * finetuning_args.lora_rank,
        lora_dropout=finetuning_args.lora_dropout,
        target_modules=_lora_targets(model, finetuning_args),
        use_rslora=finetuning_args.use_rslora,
        use_dora=finetuning_args.use_dora,
        modules_to_save=_as_list(finetuning_args.additional_target) or None,
    )
    return get_peft_model(model, config)


def _lora_targets(model, finetuning_args) -> list[str]:
    """The linear layers' leaf names LoRA wraps (``all``: every one but the output head); for a
    vision-language model the full names of those outside its frozen parts (vision_freeze.py)."""
    targets = _as_list(finetuning_args.lora_target) or ["all"]
    composite = composite_of(model)
    if targets == ["all"]:
        excluded = () if composite is None else lora_all_excluded(composite, finetuning_args)
        targets = find_linear_modules(model, excluded)
    else:
        available = find_linear_modules(model)
        missing = [t for t in targets if t not in available]
        if missing:
            raise AdapterError(
                f"lora_target {missing} not found in the model; its linear layers are {available} "
                "(or use lora_target: all)."
            )
    if composite is None:
        return targets
    names = lora_module_names(model, composite, finetuning_args, targets)
    if not names:
        raise AdapterError(
            f"lora_target {targets} names no linear layer outside the frozen parts of this "
            f"{model.config.model_type} model (freeze_vision_tower {finetuning_args.freeze_vision_tower}, "
            f"freeze_language_model {finetuning_args.freeze_language_model}). Set freeze_language_model: false, "
            "or name layers of an unfrozen part."
        )
    return names


def _as_list(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value)


def count_parameters(model) -> tuple[int, int]:
    def numel(p):  # ZeRO-3 leaves each rank an empty placeholder; ds_numel is the full size
        return getattr(p, "ds_numel", None) or p.numel()

    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(numel(p) for p in model.parameters())
    return trainable, total
