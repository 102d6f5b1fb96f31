"""The transformers engine's batch side on the tiny random-init Qwen2: the sampling settings hold
for every batch, greedy replies are one reply handed out n times, seeds replay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from registries.datasets import DataArguments
from registries.models import tiny_model_path
from stages.engines.hf_backend import HFEngine
from stages.engines.types import SamplingSpec
from stages.loading import load_tokenizer_and_template
from tests.replies import chat_replies, exact_match

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
    return chat_replies(model, tokenizer, template, PROMPTS, max_new_tokens=NEW_TOKENS, batch_size=2, **kwargs)


@pytest.fixture(scope="module")
def greedy(tiny) -> str:
    (reply,) = set(replies(tiny))
    assert reply  # the random-init model says something before a stop token
    return reply


def test_greedy_gives_the_same_reply_in_every_batch(tiny, greedy):
    assert replies(tiny, temperature=0.0) == [greedy] * len(PROMPTS)


def test_sampling_holds_for_every_batch_not_only_the_first(tiny, greedy):
    """At temperature 5 the tiny model's next-token distribution is nearly flat: a sampled reply
    of 12 tokens is the greedy one with negligible probability."""
    torch.manual_seed(0)
    sampled = replies(tiny, temperature=5.0, top_k=0)
    for i, reply in enumerate(sampled):
        assert reply != greedy, f"reply {i} (batch {i // 2 + 1}) is the greedy one: {reply!r}"
    assert len(set(sampled)) > 1


def test_a_seed_replays_the_same_samples(tiny):
    first = replies(tiny, temperature=5.0, top_k=0, seed=3)
    torch.manual_seed(123)  # the global generator's state does not matter: the seed sets it
    assert replies(tiny, temperature=5.0, top_k=0, seed=3) == first
    assert replies(tiny, temperature=5.0, top_k=0, seed=4) != first


def test_greedy_n_is_one_reply_handed_out_n_times(tiny):
    model, tokenizer, template = tiny
    ids = [template.encode_oneturn(tokenizer, PROMPTS[0] + [{"role": "assistant", "content": ""}])[0], [1, 2, 3]]
    engine = HFEngine(model, tokenizer.pad_token_id)
    out = engine.generate_batch(ids, SamplingSpec(n=3, temperature=0.0, max_tokens=5))
    assert [(c.prompt_index, c.index) for c in out] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert out[0].token_ids == out[1].token_ids == out[2].token_ids
    assert all(len(c.logprobs) == len(c.token_ids) and c.finish_reason == "length" for c in out)
    single = engine.generate_batch(ids[:1], SamplingSpec(n=1, temperature=0.0, max_tokens=5))
    assert single[0].token_ids == out[0].token_ids and single[0].logprobs == pytest.approx(out[0].logprobs, abs=1e-5)


def test_exact_match():
    assert exact_match([" 7", "8"], ["7", "9"]) == 0.5
    assert exact_match([], []) == 0.0


def test_batch_log_probs_are_raw_whatever_the_temperature_and_top_k_comes_with_them(tiny):
    """The rollout side reports log_softmax of the unmodified logits (the RL math compares them with
    the policy's own), at any sampling temperature, and the k most likely tokens when asked."""
    model, tokenizer, template = tiny
    ids = [template.encode_oneturn(tokenizer, PROMPTS[0] + [{"role": "assistant", "content": ""}])[0]]
    engine = HFEngine(model, tokenizer.pad_token_id)
    (hot,) = engine.generate_batch(ids, SamplingSpec(temperature=5.0, max_tokens=6, seed=1, logprobs=3))
    with torch.no_grad():
        logits = model(torch.tensor([ids[0] + hot.token_ids])).logits[0, len(ids[0]) - 1:-1].float().log_softmax(-1)
    expected = logits.gather(-1, torch.tensor(hot.token_ids)[:, None]).squeeze(-1)
    assert hot.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    for step, top in zip(logits, hot.top_logprobs):
        best = torch.topk(step, 3)
        assert [t for t, _ in top] == best.indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(best.values.tolist(), abs=1e-4)
