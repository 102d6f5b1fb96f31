"""Attention one example at a time, for padding-free rows on sdpa.

A padding-free batch lays its examples end to end with position ids that restart at 0
(stages/training/collators.py). Flash kernels then attend each example on its own. With sdpa,
transformers builds a block-diagonal causal mask over the row instead, and the kernel computes
every query against every key of the row and throws most of it away: a row costs its length
squared. So sdpa batches went in rows as wide as their longest example, and those still hold pad
cells (17% for 8 examples of 50-210 tokens) that every linear layer computes.

``PER_EXAMPLE_SDPA`` is an attention implementation for transformers' attention interface that
does with sdpa what flash kernels do: it cuts the row where the position ids restart and runs
causal sdpa per example, on the example's own keys, without a mask. The batch then goes in one
row with no pad at all. Examples under ``SHORT_EXAMPLE`` tokens share one call instead, padded on
the right to the longest of them (exact too: causal attention never lets a real query see the
pads after it): for them a call of their own costs more than their attention. The loss and every
gradient equal the padded batch's (tests/stages/test_padding_free.py).

Measured on 2 CPU cores (benchmarks/README.md, "Attention per example"): the 9m-full case's
8.4M Llama, 8 examples of 50-210 tokens, 322-333 ms a step in rows and 285-291 ms in one row
attended this way; every example alone, or all in one padded call, were slower on one of the
two benchmark cases (the loop on tiny-lora's 20-35-token examples, the padded call on 9m-full).

Training only: StageJob.build_trainer sets it on the model when the collator asks for it (the
collator's ``attention``); the saved config does not keep it. A cache, a padding mask or a
batch of several rows has no place here, so those are refused rather than guessed at.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from functools import lru_cache, partial

import torch
import torch.nn.functional as F

from stages.training.chunked_loss import language_model

PER_EXAMPLE_SDPA = "sdpa_per_example"
SHORT_EXAMPLE = 64  # tokens; shorter examples share one padded call (measured: 64 and 128 alike, 0 and all slower)


def per_example_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     is_causal=None, **kwargs):
    """transformers' attention-function signature: (batch, heads, tokens, head_dim) tensors in,
    (batch, tokens, heads, head_dim) out, no attention weights."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise RuntimeError(
            f"{PER_EXAMPLE_SDPA} attends one padding-free training row (batch 1, position ids that restart "
            f"per example, no mask, no cache); it got a batch of {query.shape[0]}, {query.shape[2]} queries "
            f"over {key.shape[2]} keys, position ids {'given' if position_ids is not None else 'missing'}, "
            f"mask {'given' if attention_mask is not None else 'none'}. Set the model back to sdpa "
            "(model.config._attn_implementation = 'sdpa') for anything else."
        )
    for name in ("softcap", "s_aux"):  # score changes sdpa cannot make (supports_per_example_sdpa excludes them)
        if kwargs.get(name) is not None:
            raise RuntimeError(f"{PER_EXAMPLE_SDPA} cannot apply {name}; this model needs its own attention.")
    attend = partial(_causal_sdpa, window=kwargs.get("sliding_window"), dropout=dropout, scaling=scaling,
                     gqa=query.shape[1] != key.shape[1])
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (tokens, heads, head_dim) views
    plan = ExamplePlan.of(position_ids)
    pieces = []
    if plan.short_slots is not None:
        # One call for the short examples, right-padded to the longest of them: causal attention
        # never lets a real query see the pads after it, and the pads' own outputs are dropped.
        count, longest = plan.short_shape
        padded = [x.new_zeros(count * longest, *x.shape[1:])
                  .index_copy(0, plan.short_slots, x.index_select(0, plan.short_tokens))
                  .view(count, longest, *x.shape[1:]) for x in (q, k, v)]
        pieces.append(attend(*padded).reshape(count * longest, *q.shape[1:]).index_select(0, plan.short_slots))
    for start, end in plan.long_spans:
        pieces.append(attend(q[None, start:end], k[None, start:end], v[None, start:end])[0])
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if plan.row_order is not None:
        out = out.index_select(0, plan.row_order)
    return out[None], None


def _causal_sdpa(q, k, v, window, dropout, scaling, gqa):
    """Causal sdpa over (examples, tokens, heads, head_dim) tensors, in the same layout out."""
    length = q.shape[1]
    mask = None if window is None or length <= window else sliding_causal_mask(length, window, q.device)
    if gqa and mask is not None:
        # sdpa's fused CUDA kernels take grouped keys only without a mask (transformers' use_gqa_in_sdpa):
        # with one, the keys and values are repeated per query head, as transformers does.
        groups = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         dropout_p=dropout, is_causal=mask is None, scale=scaling,
                                         enable_gqa=gqa and mask is None)
    return out.transpose(1, 2)


@dataclass(frozen=True)
class ExamplePlan:
    """How one row's examples are attended: the short ones (under SHORT_EXAMPLE tokens, where a
    call of their own costs more than their attention) in one padded call, each other one alone.
    Index tensors, so that gathering and putting back are one operation each."""

    long_spans: list[tuple[int, int]]  # (start, end) in the row
    short_tokens: torch.Tensor | None = None  # the short examples' row positions, in row order
    short_slots: torch.Tensor | None = None  # where each lands in the (examples x longest) padded layout
    short_shape: tuple[int, int] = (0, 0)  # (examples, longest)
    # Each row token's place in the call order (the short ones, then each long one); None: the same order.
    row_order: torch.Tensor | None = None

    @classmethod
    def of(cls, position_ids: torch.Tensor) -> "ExamplePlan":
        """The plan for a (1, tokens) row; every layer of one forward gets the same position ids
        object, so the plan is made once for them all."""
        global _last_plan
        # Inference tensors have no version counter to tell a change by: planned each time.
        key = None if position_ids.is_inference() else (position_ids._version, position_ids.shape)
        if key is not None and _last_plan is not None and _last_plan[0]() is position_ids and _last_plan[1] == key:
            return _last_plan[2]
        plan = cls.build(example_bounds(position_ids[0]), position_ids.device)
        if key is not None:
            _last_plan = (weakref.ref(position_ids), key, plan)
        return plan

    @classmethod
    def build(cls, bounds: list[int], device) -> "ExamplePlan":
        spans = list(zip(bounds[:-1], bounds[1:]))
        short = [(start, end) for start, end in spans if end - start < SHORT_EXAMPLE]
        if len(short) < 2:
            return cls(long_spans=spans)
        long_spans = [(start, end) for start, end in spans if end - start >= SHORT_EXAMPLE]
        longest = max(end - start for start, end in short)
        tokens = [t for start, end in short for t in range(start, end)]
        slots = [j * longest + t for j, (start, end) in enumerate(short) for t in range(end - start)]
        order = tokens + [t for start, end in long_spans for t in range(start, end)]
        in_order = order == list(range(len(order)))
        row_order = None if in_order else torch.argsort(torch.tensor(order)).to(device)  # the inverse permutation
        return cls(long_spans=long_spans, short_tokens=torch.tensor(tokens, device=device),
                   short_slots=torch.tensor(slots, device=device), short_shape=(len(short), longest),
                   row_order=row_order)


_last_plan: tuple | None = None  # (weak reference to the position ids, their version and shape, the plan)


def example_bounds(position_ids: torch.Tensor) -> list[int]:
    """Where each example starts in a row, and the row's end. An example starts wherever the
    position ids do not go up by one, as transformers' find_packed_sequence_indices reads them."""
    restarts = torch.nonzero(position_ids[1:] - position_ids[:-1] != 1).flatten() + 1
    return [0, *restarts.tolist(), position_ids.shape[0]]


@lru_cache(maxsize=8)  # the same few lengths in every layer of a forward
def sliding_causal_mask(length: int, window: int, device) -> torch.Tensor:
    """Query i sees keys i - window + 1 .. i (transformers' sliding_window_overlay on a causal mask)."""
    full = torch.ones(length, length, dtype=torch.bool, device=device)
    return full.tril() & full.triu(-(window - 1))


def no_mask(*args, attention_mask=None, **kwargs):
    """The mask function for PER_EXAMPLE_SDPA: none, the position ids say where examples start.
    A padding mask has no place in a padding-free row: refused, not dropped."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise RuntimeError(
            f"{PER_EXAMPLE_SDPA} attends padding-free training rows, which have no pads; this batch has a "
            "padding mask. Set the model back to sdpa (model.config._attn_implementation = 'sdpa') for padded batches."
        )
    return None


# Attention functions for padding-free rows built on this one, by name (shared_prefix.py's adds
# itself when imported). Like it, they take their examples from the position ids and need no mask.
CUSTOM_ATTENTION: dict = {}


def register() -> None:
    """Make PER_EXAMPLE_SDPA and every CUSTOM_ATTENTION name ones transformers' models look up (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name, function in {PER_EXAMPLE_SDPA: per_example_sdpa, **CUSTOM_ATTENTION}.items():
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, no_mask)


def attention_implementation(model) -> str:
    """The attention a model (or a PeftModel's base model) runs: "sdpa", "eager", "flash_attention_2"...;
    "" when it has no config saying so."""
    config = getattr(language_model(model), "config", None)
    return str(getattr(config, "_attn_implementation", "") or "")


def supports_per_example_sdpa(model) -> bool:
    """Whether a model that takes padding-free rows (collators.supports_padding_free: its position
    ids reach attention) runs on sdpa with attention that is plain causal sdpa per example: no
    score softcapping, no bidirectional attention. Sliding windows are applied per example."""
    config = getattr(language_model(model), "config", None)
    return (attention_implementation(model) == "sdpa"
            and getattr(config, "attn_logit_softcapping", None) is None
            and not getattr(config, "use_bidirectional_attention", False))


def use_attention(model, implementation: str) -> None:
    """Set the attention ``model`` runs from its next forward on; the saved config does not keep it."""
    if implementation == PER_EXAMPLE_SDPA or implementation in CUSTOM_ATTENTION:
        register()
    language_model(model).config._attn_implementation = implementation


@contextlib.contextmanager
def attending(model, implementation: str | None):
    """``model`` runs ``implementation`` inside the block and its own attention again after (None:
    unchanged). For a model that also takes padded batches, as the RL policy does when it generates:
    PER_EXAMPLE_SDPA refuses them. A backward that recomputes attention (gradient checkpointing)
    must run inside the block too, or it would recompute with the other attention."""
    before = attention_implementation(model)
    if not implementation or implementation == before:
        yield
        return
    use_attention(model, implementation)
    try:
        yield
    finally:
        use_attention(model, before)
