"""The finetuning options are judged on the module tree alone: the driver's meta-device check
raises exactly what the worker would, and `lora_target: all` means the same layers on both."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from stages.training.adapters import AdapterError, _freeze_patterns, find_linear_modules
from stages.run_args import FinetuningArguments, ModelArguments
from stages.loading import check_model_fits, load_model, model_skeleton, resolve_model_path
from registries.models import load_tokenizer

MODEL = ModelArguments(model_name_or_path="tiny:qwen2")
LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def real_model():
    return AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:qwen2"))


def test_lora_all_finds_the_same_layers_on_the_skeleton_and_the_loaded_model(real_model):
    skeleton = model_skeleton(MODEL)
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}  # no weights were read or allocated
    assert find_linear_modules(skeleton) == find_linear_modules(real_model) == LINEAR
    check_model_fits(MODEL, FinetuningArguments(finetuning_type="lora", lora_target=["all"]))
    check_model_fits(MODEL, FinetuningArguments(finetuning_type="lora", lora_target=["q_proj", "v_proj"]))


def test_unknown_lora_target_is_refused_with_the_layers_to_choose_from():
    tuning = FinetuningArguments(finetuning_type="lora", lora_target=["q_proj", "query_proj"])
    with pytest.raises(AdapterError) as raised:
        check_model_fits(MODEL, tuning)
    assert str(raised.value) == (
        f"lora_target ['query_proj'] not found in the model; its linear layers are {LINEAR} (or use lora_target: all)."
    )
    # the worker's own loading refuses it with the same words
    tokenizer = load_tokenizer(resolve_model_path("tiny:qwen2"))
    with pytest.raises(AdapterError, match=r"lora_target \['query_proj'\] not found"):
        load_model(MODEL, tuning, tokenizer)


def test_lora_on_top_of_an_adapter_does_not_check_targets():
    # the adapter's own config says which layers it wraps; lora_target is not used then
    tuning = FinetuningArguments(finetuning_type="lora", lora_target=["nonexistent"])
    check_model_fits(ModelArguments(model_name_or_path="tiny:qwen2", adapter_name_or_path=["x"]), tuning)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"freeze_trainable_modules": ["attn"]}, "freeze_trainable_modules: 'attn' is not a module of each layer; "
         "choose from ['input_layernorm', 'mlp', 'post_attention_layernorm', 'self_attn'] or 'all'."),
        ({"freeze_extra_modules": ["head"]}, "freeze_extra_modules: 'head' not found; choose from "),
    ],
)
def test_freeze_module_mistakes_are_refused_on_the_skeleton(options, message):
    with pytest.raises(AdapterError) as raised:
        check_model_fits(MODEL, FinetuningArguments(finetuning_type="freeze", **options))
    assert str(raised.value).startswith(message)


def test_freeze_trains_the_last_layers_modules(real_model):
    tuning = FinetuningArguments(finetuning_type="freeze", freeze_trainable_layers=1, freeze_trainable_modules=["mlp"],
                                 freeze_extra_modules=["norm"])
    check_model_fits(MODEL, tuning)
    n_layers = real_model.config.num_hidden_layers
    patterns, layer_ids = _freeze_patterns(real_model, tuning)
    assert list(layer_ids) == [n_layers - 1]
    assert patterns == [f".{n_layers - 1}.mlp", "norm"]


@pytest.mark.parametrize(
    "finetuning_type, adapters, message",
    [
        ("full", ["a"], "adapter_name_or_path is set but finetuning_type is 'full'; adapters only load with "
         "finetuning_type: lora."),
        ("lora", ["a", "b"], "adapter_name_or_path names 2 adapters; training continues one adapter."),
    ],
)
def test_adapter_settings_that_cannot_work_are_refused_before_loading(finetuning_type, adapters, message):
    model_args = ModelArguments(model_name_or_path="tiny:qwen2", adapter_name_or_path=adapters)
    with pytest.raises(AdapterError) as raised:
        check_model_fits(model_args, FinetuningArguments(finetuning_type=finetuning_type))
    assert str(raised.value).startswith(message)
