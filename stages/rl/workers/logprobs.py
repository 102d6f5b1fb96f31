"""Log-probabilities of given completions under a causal LM: the one formula every RL term uses.

The rollout engines report the sampled tokens' log-probs, the policy recomputes them for its loss
(with autograd), the reference model for the KL term; all three must agree on what
"log p(token | prompt, earlier tokens)" means, so it is computed here once. Torch only: the
model may be a transformers causal LM, a peft ``PeftModel`` or either wrapped in DDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:
    from stages.training.collators import PaddingFreeCollator

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


def budget_slices(lengths: list[int], max_rows: int, max_tokens: Optional[int] = None,
                  padded: bool = True) -> list[slice]:
    """Consecutive micro-batches of sequences with these ``lengths``: at most ``max_rows`` each
    or, with a token budget (``max_tokens_per_micro_batch``, verl's per-GPU token cap), as many as
    fit ``max_tokens`` tokens, a longer sequence alone. ``padded``: a micro-batch costs rows x the
    longest (padded rows); else the sum of its lengths (padding-free rows hold no pads).
    Consecutive, so per-sample results come back in order; callers that may reorder sort by length first."""
    if not max_tokens:
        return [slice(i, i + max_rows) for i in range(0, len(lengths), max_rows)]
    parts, start, longest, summed = [], 0, 0, 0
    for i, length in enumerate(lengths):
        wider, fuller = max(longest, length), summed + length
        if i > start and (wider * (i - start + 1) if padded else fuller) > max_tokens:
            parts.append(slice(start, i))
            start, wider, fuller = i, length, length
        longest, summed = wider, fuller
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
    rows: Optional["PaddingFreeCollator"] = None,
):
    """One 1-D float32 tensor per completion: ``log p(c_t | prompt, c_<t)`` under
    ``logits / temperature``, for every token ``c_t`` of the completion.

    Sequences are grouped by length, then each micro-batch is either right-padded (``rows`` None:
    an attention mask and explicit position ids; logits from the shortest prompt's last token on)
    or laid out padding-free by ``rows`` (trainable.forward_rows: end to end, position ids
    restarting per sequence, no pads to compute; logits only where a completion token is
    predicted; the model must run the attention those rows need, ``rows.attention``, as
    TrainableRole.forwards sets it). Runs under whatever grad mode the caller is in: under ``torch.no_grad()``
    for rollout/reference log-probs, with grad for the loss (every micro-batch's graph then stays
    alive until the caller's backward). ``temperature`` <= 0 (greedy sampling) is treated as 1.
    ``with_entropy``: returns ``(logprobs, entropies)``, two such lists, the second each position's
    distribution entropy. ``max_tokens``: micro-batches by a token budget instead of
    ``micro_batch_size`` rows (padded tokens, or real ones when padding-free).
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (the first completion token is predicted from it)")
    temperature = temperature if temperature > 0 else 1.0
    total = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    order = sorted(range(len(total)), key=total.__getitem__)  # padded: less padding; padding-free: harmless
    results: list[torch.Tensor] = [torch.zeros(0)] * len(total)
    entropies: list[torch.Tensor] = [torch.zeros(0)] * len(total)
    for part in budget_slices([total[i] for i in order], micro_batch_size, max_tokens, padded=rows is None):
        batch = order[part]
        prompts, completions = [prompt_ids[i] for i in batch], [completion_ids[i] for i in batch]
        if rows is None:
            lps, ents = _padded_logprobs(model, prompts, completions, pad_token_id, temperature, with_entropy)
        else:
            lps, ents = _packed_logprobs(model, pack_completions(prompts, completions, rows), temperature, with_entropy)
        for j, i in enumerate(batch):
            results[i] = lps[j]
            if ents is not None:
                entropies[i] = ents[j]
    return (results, entropies) if with_entropy else results


def _padded_logprobs(model, prompts, completions, pad_token_id: int, temperature: float, with_entropy: bool):
    """One micro-batch right-padded: (per-completion log-probs, per-completion entropies or None)."""
    device = next(model.parameters()).device
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        seq = list(p) + list(c)
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    # Right padding: real tokens already sit at 0..len-1; pads get the last real position
    # (their outputs are never read) so no model sees a position past its real length.
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # Position t's logits predict token t+1: keep from the shortest prompt's last token on.
    offset = min(len(p) for p in prompts) - 1
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
    spans = [(len(p) - 1 - offset, len(c)) for p, c in zip(prompts, completions)]
    return ([lp[row, first : first + n] for row, (first, n) in enumerate(spans)],
            None if ent is None else [ent[row, first : first + n] for row, (first, n) in enumerate(spans)])


def _packed_logprobs(model, packed: "PackedCompletions", temperature: float, with_entropy: bool):
    """One micro-batch laid out padding-free: the same two lists as ``_padded_logprobs``."""
    device = next(model.parameters()).device
    width = packed.input_ids.shape[1]
    # logits_to_keep as indices: only the columns that predict a completion token reach the head.
    keep, where = torch.unique(packed.before % width, return_inverse=True)
    logits = model(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
                   logits_to_keep=keep.to(device), use_cache=False).logits
    if logits.shape[0] == 1 and torch.equal(where, torch.arange(where.numel())):
        picked = logits[0]  # one row, kept columns in order: every kept logit is a wanted one, no copy
    else:
        picked = logits[(packed.before // width).to(device), where.to(device)]
    lp = token_logprobs(picked, packed.targets.to(device), temperature, with_entropy=with_entropy)
    lp, ent = lp if with_entropy else (lp, None)
    return lp.split(packed.counts), None if ent is None else ent.split(packed.counts)


@dataclass(frozen=True)
class PackedCompletions:
    """prompt + completion sequences laid out padding-free, and where each completion token's
    prediction sits in them (the policy's log-probs and the critic's values read the same places)."""

    input_ids: torch.Tensor  # (rows, width)
    position_ids: torch.Tensor  # restarting at 0 per sequence
    sequence_ids: torch.Tensor  # each token's sequence, -1 on the pads at a row's end
    before: torch.Tensor  # flat index into the rows of the position before each completion token, completions in order
    counts: list[int]  # tokens per completion

    @property
    def targets(self) -> torch.Tensor:
        """The completion tokens themselves, flat, in the order of ``before``."""
        return self.input_ids.reshape(-1)[self.before + 1]


def pack_completions(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     rows: "PaddingFreeCollator") -> PackedCompletions:
    """Lay the sequences out as ``rows`` lays out training examples (stages/training/collators.py:
    one row, or rows as wide as the longest, by the model's attention)."""
    from stages.training.value_head import last_token_of_each

    sequences = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    batch = rows.lay_out(sequences, sequences, number_sequences=True)  # the labels are not read
    lengths = torch.tensor([len(s) for s in sequences])
    counts = torch.tensor([len(c) for c in completion_ids])
    first = last_token_of_each(batch["sequence_ids"]) - lengths + 1  # each sequence's first token
    # Completion token j of sequence i is predicted at first_i + len(prompt_i) - 1 + j.
    base = first + torch.tensor([len(p) for p in prompt_ids]) - 1
    step = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts).repeat_interleave(counts)
    return PackedCompletions(batch["input_ids"], batch["position_ids"], batch["sequence_ids"],
                             base.repeat_interleave(counts) + step, counts.tolist())
