"""Trained-looking outputs for the inference tests, made in seconds without a training run:
the tiny Qwen2 model (head size 32, so vLLM's CPU attention takes it) plus LoRA adapters with
random non-zero weights, saved the way a finetuning_type: lora run saves its output_dir."""

from __future__ import annotations

import os

import pytest
import yaml

BASE = "tiny:qwen2,num_heads=2"
TEMPLATE = "qwen"


def make_adapter_output(folder, seed: int, rank: int = 8) -> str:
    """An adapter folder like a LoRA sft run leaves: adapter, tokenizer with the training chat
    template, rayfactory_config.yaml naming the template."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from registries.datasets.args import DataArguments
    from registries.templates.jinja import to_jinja
    from stages.args import ModelArguments
    from stages.loading import load_tokenizer_and_template, resolve_model_path

    tokenizer, template = load_tokenizer_and_template(ModelArguments(model_name_or_path=BASE), DataArguments(template=TEMPLATE))
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(BASE), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                     "up_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():  # large enough that the adapter changes greedy replies
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)
    folder = str(folder)
    model.save_pretrained(folder)
    tokenizer.chat_template = to_jinja(template, tokenizer)
    tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "rayfactory_config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump({"model_name_or_path": resolve_model_path(BASE), "template": TEMPLATE,
                        "finetuning_type": "lora"}, f)
    return folder


@pytest.fixture(scope="session")
def adapter_outputs(tmp_path_factory):
    """Two adapters on the same base: {"math": path, "poet": path}."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter_output(root / name, seed) for name, seed in (("math", 1), ("poet", 2))}


@pytest.fixture(scope="session")
def base_model_path():
    from stages.loading import resolve_model_path

    return resolve_model_path(BASE)


PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "user", "content": "Say something about the sea."}],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
     {"role": "user", "content": "count to five"}],
]
