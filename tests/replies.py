"""Replies of an in-memory model to chat prompts, through the transformers engine: how tests measure
what a run learned (exact-match accuracy on held-out prompts)."""

from __future__ import annotations

from stages.engines.hf_backend import HFEngine
from stages.engines.types import SamplingSpec


def chat_replies(model, tokenizer, template, prompts: list[list[dict]], max_new_tokens: int = 32,
                 batch_size: int = 32, temperature: float = 0.0, **sampling) -> list[str]:
    """One reply per conversation (a message list ending on a user turn), prompted with the
    training template; greedy unless a temperature above 0 is given."""
    ids = [template.encode_oneturn(tokenizer, p + [{"role": "assistant", "content": ""}])[0] for p in prompts]
    spec = SamplingSpec(temperature=temperature, max_tokens=max_new_tokens, logprobs=None,
                        stop_token_ids=tuple(template.stop_token_ids(tokenizer)), **sampling)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else spec.stop_token_ids[0]
    completions = HFEngine(model, pad).generate_batch(ids, spec, batch_size=batch_size)
    return [tokenizer.decode(c.token_ids, skip_special_tokens=True).strip() for c in completions]


def exact_match(replies: list[str], answers: list[str]) -> float:
    if not answers:
        return 0.0
    return sum(r.strip() == a.strip() for r, a in zip(replies, answers)) / len(answers)
