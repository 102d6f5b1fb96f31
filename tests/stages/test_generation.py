"""generate_replies on the tiny random-init Qwen2: the generation options hold for every batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from registries.datasets import DataArguments
from registries.models import tiny_model_path
from stages.generation import exact_match, generate_replies
from stages.loading import load_tokenizer_and_template

PROMPTS = [[{"role": "user", "content": "What is 3+4?"}]] * 6  # three batches of two
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    tokenizer, template = load_tokenizer_and_template(
        SimpleNamespace(model_name_or_path="tiny:qwen2"), DataArguments(template="qwen")
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("qwen2")).eval()
    return model, tokenizer, template


def replies(tiny, **kwargs) -> list[str]:
    model, tokenizer, template = tiny
    return generate_replies(model, tokenizer, template, PROMPTS, max_new_tokens=NEW_TOKENS, batch_size=2, **kwargs)


@pytest.fixture(scope="module")
def greedy(tiny) -> str:
    (reply,) = set(replies(tiny))
    assert reply  # the random-init model says something before a stop token
    return reply


def test_greedy_gives_the_same_reply_in_every_batch(tiny, greedy):
    assert replies(tiny, do_sample=False) == [greedy] * len(PROMPTS)


def test_do_sample_holds_for_every_batch_not_only_the_first(tiny, greedy):
    """At temperature 5 the tiny model's next-token distribution is nearly flat: a sampled reply
    of 12 tokens is the greedy one with negligible probability. Before the fix, batches 2 and 3
    lost do_sample and decoded greedily."""
    torch.manual_seed(0)
    sampled = replies(tiny, do_sample=True, temperature=5.0, top_k=0)
    for i, reply in enumerate(sampled):
        assert reply != greedy, f"reply {i} (batch {i // 2 + 1}) is the greedy one: {reply!r}"
    assert len(set(sampled)) > 1


def test_options_are_not_consumed_by_the_call(tiny, greedy):
    options = {"do_sample": True, "temperature": 5.0, "top_k": 0}
    torch.manual_seed(0)
    first = replies(tiny, **options)
    assert options == {"do_sample": True, "temperature": 5.0, "top_k": 0}
    torch.manual_seed(0)
    assert replies(tiny, **options) == first  # same seed, same samples: nothing left over between calls


def test_exact_match():
    assert exact_match([" 7", "8"], ["7", "9"]) == 0.5
    assert exact_match([], []) == 0.0
