"""Greedy/sampled generation from chat prompts, formatted by the same template as training.

Used to measure what a run learned (exact-match accuracy on held-out prompts) and, later, by
chat and batch prediction.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def generate_replies(model, tokenizer, template, prompts: list[list[dict]], system: str | None = None,
                     max_new_tokens: int = 32, batch_size: int = 32, **generate_kwargs) -> list[str]:
    """One reply per conversation prompt (a message list ending on a user turn).

    ``generate_kwargs`` (``do_sample``, ``temperature``, ...) apply to every batch alike; greedy
    decoding unless ``do_sample=True``.
    """
    options = {"do_sample": False, **generate_kwargs}  # read once: every batch decodes the same way
    model.eval()
    stop_ids = template.stop_token_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    replies: list[str] = []
    for start in range(0, len(prompts), batch_size):
        encoded = [
            template.encode_oneturn(tokenizer, p + [{"role": "assistant", "content": ""}], system)[0]
            for p in prompts[start : start + batch_size]
        ]
        width = max(map(len, encoded))
        # Left padding: every prompt ends where generation starts.
        input_ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in encoded])
        attention = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        output = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention.to(model.device),
            max_new_tokens=max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
            **options,
        )
        for row in output[:, width:]:
            replies.append(tokenizer.decode(row, skip_special_tokens=True).strip())
    return replies


def exact_match(replies: list[str], answers: list[str]) -> float:
    if not answers:
        return 0.0
    return sum(r.strip() == a.strip() for r, a in zip(replies, answers)) / len(answers)
