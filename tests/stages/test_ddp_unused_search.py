"""Which models DDP trains without its search for parameters that got no gradient
(stages/job.py): the search walks the autograd graph again after every backward, and where a
trainable weight really is left out of the loss, skipping it makes DDP fail at the next step."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from stages.job import _every_trainable_weight_in_the_loss
from stages.loading import resolve_model_path
from stages.training.value_head import ValueHeadModel


@pytest.fixture
def causal_lm():
    return AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:qwen2"))


def _weights_without_gradient(model, loss_of) -> list[str]:
    """The trainable parameters that one forward and backward of ``loss_of(model)`` leaves without a gradient."""
    model.zero_grad(set_to_none=True)
    loss_of(model).backward()
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


def test_a_registered_familys_causal_lm_and_a_lora_model_skip_the_search(causal_lm):
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    lm_loss = lambda model: model(input_ids=ids, labels=ids).loss  # noqa: E731
    # The fact the rule relies on, on the real model: one step's loss reaches every weight.
    assert _weights_without_gradient(causal_lm, lm_loss) == []
    assert _every_trainable_weight_in_the_loss(causal_lm)
    lora = get_peft_model(causal_lm, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert _weights_without_gradient(lora, lm_loss) == []
    assert _every_trainable_weight_in_the_loss(lora)


def test_the_value_head_model_and_unregistered_architectures_keep_it(causal_lm):
    # rm's reward model scores with its value head: the LM head is trainable and never used.
    reward_model = ValueHeadModel(causal_lm)
    ids = torch.tensor([[3, 5, 7, 9]])
    reward_of = lambda model: model(input_ids=ids, attention_mask=torch.ones_like(ids)).rewards.sum()  # noqa: E731
    assert _weights_without_gradient(reward_model, reward_of) == ["pretrained_model.lm_head.weight"]
    assert not _every_trainable_weight_in_the_loss(reward_model)
    # A model type no family describes may route tokens to experts or carry unused towers.
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    assert not _every_trainable_weight_in_the_loss(gpt2)
