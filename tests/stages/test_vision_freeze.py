"""freeze_vision_tower / freeze_multi_modal_projector / freeze_language_model / train_mm_proj_only on
the tiny Qwen2-VL: exactly which parameters train in full, freeze and LoRA tuning, the same sets as
LLaMA-Factory 0.9.5's own init_adapter gives on the same model, and text models unaffected."""

from __future__ import annotations

import pytest

from stages.loading import auto_model_class, model_config, model_skeleton, resolve_model_path
from stages.run_args import FinetuningArguments, ModelArguments
from stages.training.adapters import AdapterError, apply_finetuning, check_finetuning_fits
from tests.llamafactory import run_in_llamafactory

VL = ModelArguments(model_name_or_path="tiny:qwen2_vl")
LM_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
VISION_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


def fresh_model(model_args=VL):
    config = model_config(model_args)
    return auto_model_class(config).from_config(config)


def trained(finetuning_args, model_args=VL) -> set[str]:
    model = apply_finetuning(fresh_model(model_args), finetuning_args, model_args)
    return {name for name, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def parts() -> dict[str, set[str]]:
    """The tiny Qwen2-VL's parameters by part (the names LLaMA-Factory's fragments match)."""
    names = [name for name, _ in fresh_model().named_parameters()]
    groups = {
        "vision": {n for n in names if n.startswith(("model.visual.patch_embed.", "model.visual.blocks."))},
        "projector": {n for n in names if n.startswith("model.visual.merger.")},
        "language": {n for n in names if n.startswith(("model.language_model.", "lm_head."))},
    }
    assert set().union(*groups.values()) == set(names) and sum(map(len, groups.values())) == len(names)
    assert len(groups["projector"]) == 6 and "lm_head.weight" in groups["language"]
    return groups


def layers(group: set[str], prefix: str, ids=(0, 1)) -> set[str]:
    return {n for n in group if any(n.startswith(f"{prefix}.{i}.") for i in ids)}


def lora_weights(modules) -> set[str]:
    return {f"base_model.model.{m}.lora_{ab}.default.weight" for m in modules for ab in "AB"}


def lm_linears() -> list[str]:
    return [f"model.language_model.layers.{i}.{leaf}" for i in (0, 1) for leaf in LM_LINEARS]


def vision_linears() -> list[str]:
    return [f"model.visual.blocks.{i}.{leaf}" for i in (0, 1) for leaf in VISION_LINEARS]


CASES = {  # name: FinetuningArguments keys
    "full": dict(finetuning_type="full"),
    "full_vision": dict(finetuning_type="full", freeze_vision_tower=False),
    "full_projector": dict(finetuning_type="full", freeze_multi_modal_projector=False),
    "full_everything": dict(finetuning_type="full", freeze_vision_tower=False, freeze_multi_modal_projector=False),
    "full_no_language": dict(finetuning_type="full", freeze_language_model=True, freeze_multi_modal_projector=False),
    "freeze": dict(finetuning_type="freeze"),
    "freeze_vision": dict(finetuning_type="freeze", freeze_vision_tower=False),
    "freeze_projector": dict(finetuning_type="freeze", freeze_multi_modal_projector=False),
    "freeze_last_layer": dict(finetuning_type="freeze", freeze_trainable_layers=1, freeze_multi_modal_projector=False),
    "lora": dict(finetuning_type="lora"),
    "lora_vision": dict(finetuning_type="lora", freeze_vision_tower=False),
    "lora_projector": dict(finetuning_type="lora", freeze_multi_modal_projector=False),
    "lora_named": dict(finetuning_type="lora", lora_target="q_proj,fc1", freeze_vision_tower=False),
}


def expected(case: str, parts) -> set[str]:
    vision, projector, language = parts["vision"], parts["projector"], parts["language"]
    lm_layers = layers(language, "model.language_model.layers")
    return {
        "full": language,
        "full_vision": language | vision,
        "full_projector": language | projector,
        "full_everything": language | vision | projector,
        "full_no_language": projector,
        "freeze": lm_layers,
        # LLaMA-Factory's rule: the trained layers are name fragments ".0.", ".1.", so with the vision
        # tower unfrozen its blocks 0 and 1 train as well.
        "freeze_vision": lm_layers | layers(vision, "model.visual.blocks"),
        "freeze_projector": lm_layers | projector,
        "freeze_last_layer": layers(language, "model.language_model.layers", ids=(1,)) | projector,
        "lora": lora_weights(lm_linears()),
        "lora_vision": lora_weights(lm_linears() + vision_linears()),
        # The projector gets no adapter from lora_target all, and stays frozen under LoRA (as in LLaMA-Factory).
        "lora_projector": lora_weights(lm_linears()),
        "lora_named": lora_weights([m for m in lm_linears() + vision_linears() if m.endswith(("q_proj", "fc1"))]),
    }[case]


@pytest.mark.parametrize("case", list(CASES))
def test_each_option_trains_exactly_its_parts(case, parts):
    assert trained(FinetuningArguments(**CASES[case])) == expected(case, parts)


def test_train_mm_proj_only_trains_the_projector_alone(parts):
    assert trained(FinetuningArguments(finetuning_type="full", train_mm_proj_only=True)) == parts["projector"]


def test_lora_targets_are_the_language_models_linears_by_default():
    from stages.training.adapters import _lora_targets

    skeleton = model_skeleton(VL)
    assert _lora_targets(skeleton, FinetuningArguments()) == sorted(lm_linears())
    assert _lora_targets(skeleton, FinetuningArguments(freeze_vision_tower=False)) == sorted(lm_linears() + vision_linears())
    # patch_embed.proj (a Conv3d) is a LoRA conflict even with the tower unfrozen; "proj" names attn.proj only
    assert _lora_targets(skeleton, FinetuningArguments(lora_target="proj", freeze_vision_tower=False)) == [
        "model.visual.blocks.0.attn.proj", "model.visual.blocks.1.attn.proj"]


def test_settings_that_train_nothing_are_refused_before_any_worker_starts():
    skeleton = model_skeleton(VL)
    with pytest.raises(AdapterError, match="No parameter of this qwen2_vl model would train"):
        check_finetuning_fits(skeleton, FinetuningArguments(finetuning_type="full", freeze_language_model=True), VL)
    with pytest.raises(AdapterError, match="names no linear layer outside the frozen parts"):
        check_finetuning_fits(skeleton, FinetuningArguments(freeze_language_model=True), VL)
    with pytest.raises(AdapterError, match="names no linear layer outside the frozen parts"):
        check_finetuning_fits(skeleton, FinetuningArguments(lora_target="fc1"), VL)  # the tower is frozen
    check_finetuning_fits(skeleton, FinetuningArguments(finetuning_type="freeze", freeze_multi_modal_projector=False), VL)


def test_text_models_ignore_the_vision_options():
    text = ModelArguments(model_name_or_path="tiny:qwen2")
    every = {name for name, _ in fresh_model(text).named_parameters()}
    options = dict(freeze_vision_tower=False, freeze_multi_modal_projector=False, freeze_language_model=True)
    assert trained(FinetuningArguments(finetuning_type="full", **options), text) == every
    lora = trained(FinetuningArguments(**options), text)
    assert lora and all(".lora_" in name for name in lora)


LF_SCRIPT = r"""
import json, sys
from transformers import AutoConfig, AutoModelForImageTextToText
from llamafactory.hparams import FinetuningArguments, ModelArguments
from llamafactory.model.adapter import init_adapter
args = json.loads(sys.argv[1])
out = {}
for name, case in args["cases"].items():
    config = AutoConfig.from_pretrained(args["path"])
    model = init_adapter(config, AutoModelForImageTextToText.from_config(config),
                         ModelArguments(model_name_or_path=args["path"]), FinetuningArguments(**case), is_trainable=True)
    out[name] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
print(json.dumps(out))
"""


def test_the_same_parameters_train_as_in_llamafactory():
    reference = run_in_llamafactory(LF_SCRIPT, {"path": resolve_model_path("tiny:qwen2_vl"), "cases": CASES})
    for name, keys in CASES.items():
        assert trained(FinetuningArguments(**keys)) == set(reference[name]), name
