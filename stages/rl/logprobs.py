"""Log-probabilities of given completions under a causal LM: the one formula every RL term uses.

The rollout engines report the sampled tokens' log-probs, the policy recomputes them for its loss
(with autograd), the reference model for the KL term; all three must agree on what
"log p(token | prompt, earlier tokens)" means, so it is computed here once. Torch only: the
model may be a transformers causal LM, a peft ``PeftModel`` or either wrapped in DDP.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

# Rows of logits upcast to float32 at a time: bounds the extra memory of the softmax to ~64 MiB
# whatever the batch (a 150k vocabulary is ~110 rows).
_CHUNK_ELEMENTS = 1 << 24


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False):
    """``log_softmax(logits / temperature)`` at ``ids``, as float32, shape ``ids.shape``.

    ``logits`` is ``[..., V]`` (any float dtype), ``ids`` is ``logits.shape[:-1]``. Computed as
    ``logit[id] - logsumexp(logits)`` in row chunks, so the full ``[..., V]`` float32 log-softmax is
    never materialised at once (bf16 logits of a long batch would double in size otherwise).
    Differentiable. ``with_entropy``: returns ``(logprobs, entropy)``, the second the entropy of
    each position's whole (temperature-scaled) distribution, ``logsumexp - sum(p * logit)``, from
    the same chunks (the entropy bonus needs it with its gradient, so no second pass over the logits).
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and ids {tuple(ids.shape)} do not line up")
    vocab = logits.shape[-1]
    flat, flat_ids = logits.reshape(-1, vocab), ids.reshape(-1, 1)
    rows = max(1, _CHUNK_ELEMENTS // vocab)
    parts, entropies = [], []
    for start in range(0, flat.shape[0], rows):
        chunk = flat[start : start + rows].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(-1, flat_ids[start : start + rows]).squeeze(-1)
        lse = torch.logsumexp(chunk, dim=-1)
        parts.append(picked - lse)
        if with_entropy:
            entropies.append(lse - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
    empty = flat.new_zeros(0, dtype=torch.float32)
    out = (torch.cat(parts) if parts else empty).reshape(ids.shape)
    if with_entropy:
        return out, (torch.cat(entropies) if entropies else empty).reshape(ids.shape)
    return out


def budget_slices(lengths: list[int], max_rows: int, max_tokens: Optional[int] = None) -> list[slice]:
    """Consecutive micro-batches of sequences with these ``lengths``: at most ``max_rows`` each
    or, with a token budget (``max_tokens_per_micro_batch``, verl's per-GPU token cap), as many as
    fit ``max_tokens`` padded tokens (rows x the longest), a longer sequence alone. Consecutive, so
    per-sample results come back in order; callers that may reorder sort by length first."""
    if not max_tokens:
        return [slice(i, i + max_rows) for i in range(0, len(lengths), max_rows)]
    parts, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        wider = max(longest, length)
        if i > start and wider * (i - start + 1) > max_tokens:
            parts.append(slice(start, i))
            start, wider = i, length
        longest = wider
    if lengths:
        parts.append(slice(start, len(lengths)))
    return parts


def completion_logprobs(
    model,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    temperature: float = 1.0,
    micro_batch_size: int = 16,
    with_entropy: bool = False,
    max_tokens: Optional[int] = None,
):
    """One 1-D float32 tensor per completion: ``log p(c_t | prompt, c_<t)`` under
    ``logits / temperature``, for every token ``c_t`` of the completion.

    Sequences are grouped by length (less padding), right-padded with an attention mask and
    explicit position ids (0.. for the real tokens of every row), and only the logits from the
    shortest prompt's last token on are computed (``logits_to_keep``). Runs under whatever grad
    mode the caller is in: under ``torch.no_grad()`` for rollout/reference log-probs, with grad
    for the loss (every micro-batch's graph then stays alive until the caller's backward).
    ``temperature`` <= 0 (greedy sampling) is treated as 1. ``with_entropy``: returns
    ``(logprobs, entropies)``, two such lists, the second each position's distribution entropy.
    ``max_tokens``: micro-batches by a budget of padded tokens instead of ``micro_batch_size`` rows.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (the first completion token is predicted from it)")
    temperature = temperature if temperature > 0 else 1.0
    device = next(model.parameters()).device
    total = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    order = sorted(range(len(total)), key=total.__getitem__)
    results: list[torch.Tensor] = [torch.zeros(0)] * len(total)
    entropies: list[torch.Tensor] = [torch.zeros(0)] * len(total)
    for part in budget_slices([total[i] for i in order], micro_batch_size, max_tokens):
        batch = order[part]
        width = max(total[i] for i in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            seq = list(prompt_ids[i]) + list(completion_ids[i])
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        # Right padding: real tokens already sit at 0..len-1; pads get the last real position
        # (their outputs are never read) so no model sees a position past its real length.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # Position t's logits predict token t+1: keep from the shortest prompt's last token on.
        offset = min(len(prompt_ids[i]) for i in batch) - 1
        logits = model(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            logits_to_keep=width - offset,
            use_cache=False,
        ).logits
        targets = input_ids[:, offset + 1 :].to(device)
        # lp[:, j] is the token at offset+1+j
        lp = token_logprobs(logits[:, :-1], targets, temperature, with_entropy=with_entropy)
        lp, ent = lp if with_entropy else (lp, None)
        for row, i in enumerate(batch):
            first = len(prompt_ids[i]) - 1 - offset
            results[i] = lp[row, first : first + len(completion_ids[i])]
            if ent is not None:
                entropies[i] = ent[row, first : first + len(completion_ids[i])]
    return (results, entropies) if with_entropy else results
