"""Which parts of a vision-language model train: LLaMA-Factory's freeze_vision_tower,
freeze_multi_modal_projector and freeze_language_model (train_mm_proj_only resolves into them,
stages/run_args.py), with LLaMA-Factory 0.9.5's meaning (its model/model_utils/visual.py, adapter.py):

* full: every parameter trains but those under a frozen part;
* freeze: the trained layers' parameters (``.{i}.`` in the name, so with the vision tower unfrozen its
  blocks of the same numbers train too, as in LLaMA-Factory), plus the projector when it is unfrozen,
  minus those under a frozen part;
* LoRA: ``lora_target: all`` is every linear layer outside the projector (and outside the vision tower
  while it is frozen), then every target under a frozen part, or under a family's LoRA conflicts
  (Qwen2-VL's patch_embed), is dropped; the targets become full module names. So LoRA stays on the
  language model by default, and the projector never gets an adapter from ``all`` (frozen under LoRA
  whatever freeze_multi_modal_projector says, as in LLaMA-Factory).

A model whose ``model_type`` is not listed here (a text model) ignores the options, as LLaMA-Factory
does. The parts are name fragments matched anywhere in a parameter's or module's name, LLaMA-Factory's
rule, so "visual.blocks" matches "model.visual.blocks.0.attn.qkv.weight".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompositeModel:
    """The name fragments of a vision-language family's parts (LLaMA-Factory's CompositeModel)."""

    projector_keys: tuple[str, ...] = ("multi_modal_projector",)
    vision_model_keys: tuple[str, ...] = ("vision_tower",)
    language_model_keys: tuple[str, ...] = ("language_model", "lm_head")
    lora_conflict_keys: tuple[str, ...] = ()


_QWEN2_VL = CompositeModel(
    projector_keys=("visual.merger",),
    vision_model_keys=("visual.patch_embed", "visual.blocks"),
    lora_conflict_keys=("patch_embed",),  # a Conv3d whose leaf name "proj" a LoRA target would catch
)
# The families RayFactory loads (registries/models/families.py: qwen2_vl; llava's plugin), keyed by
# config.model_type, with LLaMA-Factory 0.9.5's fragments.
COMPOSITE_MODELS: dict[str, CompositeModel] = {
    "qwen2_vl": _QWEN2_VL,
    "qwen2_5_vl": _QWEN2_VL,
    "llava": CompositeModel(),
    "llava_next": CompositeModel(),
    "gemma3": CompositeModel(),  # LLaMA-Factory registers gemma3 with the default fragments too
}


def composite_of(model) -> CompositeModel | None:
    """The parts of ``model`` (a PreTrainedModel, or a PeftModel around one); None for a text model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return COMPOSITE_MODELS.get(getattr(getattr(base, "config", None), "model_type", None))


def frozen_parts(composite: CompositeModel | None, finetuning_args) -> tuple[str, ...]:
    """The name fragments whose parameters stay frozen (LLaMA-Factory's get_forbidden_modules)."""
    if composite is None:
        return ()
    parts: list[str] = []
    if finetuning_args.freeze_vision_tower:
        parts += composite.vision_model_keys
    if finetuning_args.freeze_multi_modal_projector:
        parts += composite.projector_keys
    if finetuning_args.freeze_language_model:
        parts += composite.language_model_keys
    return tuple(parts)


def under(name: str, fragments) -> bool:
    return any(fragment in name for fragment in fragments)


def lora_all_excluded(composite: CompositeModel, finetuning_args) -> tuple[str, ...]:
    """What ``lora_target: all`` leaves out of its linear layers: the projector always, the vision
    tower while it is frozen (LLaMA-Factory's find_all_linear_modules)."""
    excluded = list(composite.projector_keys)
    if finetuning_args.freeze_vision_tower:
        excluded += composite.vision_model_keys
    return tuple(excluded)


def lora_module_names(model, composite: CompositeModel, finetuning_args, targets: list[str]) -> list[str]:
    """The full names of the modules LoRA wraps: those a target names (PEFT's rule: the name is the
    target or ends with ".target"), outside the frozen parts and the family's LoRA conflicts
    (LLaMA-Factory's patch_target_modules)."""
    dropped = frozen_parts(composite, finetuning_args) + composite.lora_conflict_keys
    return sorted(
        name for name, _ in model.named_modules()
        if any(name == t or name.endswith("." + t) for t in targets) and not under(name, dropped)
    )
