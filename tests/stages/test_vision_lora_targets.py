"""LoRA on LLaVA and Gemma 3 adapts the language model only: their vision towers (CLIP, SigLIP) have
q_proj / k_proj / v_proj layers of the same names as the language model's, so both ``lora_target: all``
and an explicit list must leave the tower (while frozen, LLaMA-Factory's default) and the projector
out. The adapted modules are listed by full name and compared with LLaMA-Factory 0.9.5's own
init_adapter on the same tiny models."""

from __future__ import annotations

import pytest

from stages.loading import auto_model_class, model_config, model_skeleton, resolve_model_path
from stages.run_args import FinetuningArguments, ModelArguments
from stages.training.adapters import AdapterError, apply_finetuning, check_finetuning_fits
from tests.llamafactory import run_in_llamafactory

FAMILIES = ("tiny:llava", "tiny:gemma3_vl")
LM_LEAVES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TOWER_LEAVES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                "mlp.fc1", "mlp.fc2")
# SigLIP's attention-pooling head (Gemma 3's tower only): linear layers inside the vision tower too.
SIGLIP_HEAD = ("model.vision_tower.head.attention.out_proj", "model.vision_tower.head.mlp.fc1",
               "model.vision_tower.head.mlp.fc2")

CASES = {  # name: FinetuningArguments keys
    "all": dict(finetuning_type="lora"),
    "listed": dict(finetuning_type="lora", lora_target="q_proj,v_proj"),
    # an unfrozen projector still gets no adapter from "all" (as in LLaMA-Factory)
    "all_projector_unfrozen": dict(finetuning_type="lora", freeze_multi_modal_projector=False),
    # only an unfrozen tower takes adapters, from "all" or a list alike
    "all_tower_unfrozen": dict(finetuning_type="lora", freeze_vision_tower=False),
    "listed_tower_unfrozen": dict(finetuning_type="lora", lora_target="q_proj,v_proj", freeze_vision_tower=False),
}


def language(leaves=LM_LEAVES) -> list[str]:
    return [f"model.language_model.layers.{i}.{leaf}" for i in (0, 1) for leaf in leaves]


def tower(model: str, leaves=TOWER_LEAVES) -> list[str]:
    names = [f"model.vision_tower.encoder.layers.{i}.{leaf}" for i in (0, 1) for leaf in leaves]
    if model == "tiny:gemma3_vl" and leaves == TOWER_LEAVES:
        names += SIGLIP_HEAD
    return names


def expected(model: str, case: str) -> list[str]:
    qv = ("self_attn.q_proj", "self_attn.v_proj")
    return sorted({
        "all": language(),
        "listed": language(qv),
        "all_projector_unfrozen": language(),
        "all_tower_unfrozen": language() + tower(model),
        "listed_tower_unfrozen": language(qv) + tower(model, qv),
    }[case])


def adapted_modules(peft_model) -> list[str]:
    """Full names (in the base model) of the modules that hold a LoRA adapter."""
    prefix = "base_model.model."
    return sorted(name[len(prefix):] for name, module in peft_model.named_modules() if hasattr(module, "lora_A"))


def ours(model: str, case: str) -> tuple[list[str], set[str]]:
    """The adapted modules and the trainable parameters after RayFactory's apply_finetuning."""
    args = ModelArguments(model_name_or_path=model)
    config = model_config(args)
    base = auto_model_class(config).from_config(config)
    peft_model = apply_finetuning(base, FinetuningArguments(**CASES[case]), args)
    return adapted_modules(peft_model), {n for n, p in peft_model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", FAMILIES)
def test_lora_adapts_exactly_the_expected_modules(model, case):
    modules, trainable = ours(model, case)
    assert modules == expected(model, case)
    # nothing else trains: the adapters' A and B matrices only (the projector stays frozen under LoRA)
    assert trainable == {f"base_model.model.{m}.lora_{ab}.default.weight" for m in modules for ab in "AB"}
    if "tower_unfrozen" not in case:
        assert not [m for m in modules if "vision_tower" in m or "multi_modal_projector" in m]


@pytest.mark.parametrize("model", FAMILIES)
def test_targets_that_name_only_frozen_parts_are_refused_before_any_worker_starts(model):
    args = ModelArguments(model_name_or_path=model)
    skeleton = model_skeleton(args)
    # fc1 / out_proj exist only in the vision tower, frozen by default
    for target in ("fc1", "out_proj"):
        with pytest.raises(AdapterError, match="names no linear layer outside the frozen parts"):
            check_finetuning_fits(skeleton, FinetuningArguments(lora_target=target), args)
    check_finetuning_fits(skeleton, FinetuningArguments(lora_target="fc1", freeze_vision_tower=False), args)


def test_llava_projector_linears_are_never_targets_of_all_but_can_be_named_once_unfrozen():
    from stages.training.adapters import _lora_targets

    skeleton = model_skeleton(ModelArguments(model_name_or_path="tiny:llava"))
    unfrozen = FinetuningArguments(freeze_multi_modal_projector=False)
    assert _lora_targets(skeleton, unfrozen) == sorted(language())
    assert _lora_targets(skeleton, FinetuningArguments(lora_target="linear_1", freeze_multi_modal_projector=False)) == [
        "model.multi_modal_projector.linear_1"]
    with pytest.raises(AdapterError, match="names no linear layer outside the frozen parts"):
        _lora_targets(skeleton, FinetuningArguments(lora_target="linear_1"))


LF_SCRIPT = r"""
import json, sys
from transformers import AutoConfig, AutoModelForImageTextToText
from llamafactory.hparams import FinetuningArguments, ModelArguments
from llamafactory.model.adapter import init_adapter
args = json.loads(sys.argv[1])
out = {}
for path in args["paths"]:
    for name, case in args["cases"].items():
        config = AutoConfig.from_pretrained(path)
        model = init_adapter(config, AutoModelForImageTextToText.from_config(config),
                             ModelArguments(model_name_or_path=path), FinetuningArguments(**case), is_trainable=True)
        out[path + "|" + name] = {
            "modules": sorted(n[len("base_model.model."):] for n, m in model.named_modules() if hasattr(m, "lora_A")),
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        }
print(json.dumps(out))
"""


def test_the_same_modules_are_adapted_as_in_llamafactory():
    paths = {model: resolve_model_path(model) for model in FAMILIES}
    reference = run_in_llamafactory(LF_SCRIPT, {"paths": list(paths.values()), "cases": CASES})
    for model, path in paths.items():
        for case in CASES:
            modules, trainable = ours(model, case)
            lf = reference[f"{path}|{case}"]
            assert modules == lf["modules"], (model, case)
            assert trainable == set(lf["trainable"]), (model, case)
