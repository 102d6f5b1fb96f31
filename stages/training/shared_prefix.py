"""Prompts attended once: kto's KL answers and dpo's rejected answers reuse their prompt's keys.

Under causal attention a token's keys and values depend only on the tokens up to it, so two
sequences that begin with the same tokens need those computed once. Both preference stages have
such pairs (registries/tokenize/): kto's answer ``x + y`` and its KL answer ``x + y'`` (the same
prompt with another row's answer), and dpo's chosen ``x + y_w`` and rejected ``x + y_l``. The
second sequence of each then holds only what follows the shared tokens, at its true positions (so
rotary embeddings are right), and attends causally to the shared keys before its own. It restarts
at its last prompt token at the latest, whose output predicts the answer's first token. On the
benchmark's reversal cases (prompts over half of each sequence, with the template) this takes half
the tokens out of kto's two KL passes and a third out of every dpo pass, forward and backward.

``SHARED_PREFIX_SDPA`` is the attention of these batches: sdpa one example at a time
(per_example_attention.py), with the shared keys from one of two places:
* kto, two passes (the KL pass has no gradient, the answers' pass has): ``recording(prefixes)``
  around the answers' forward keeps, detached, each layer's keys and values of every example's
  first ``prefixes.lengths[i]`` tokens; ``reusing(prefixes)`` around the KL forward attends to
  them. Outside both it is plain per-example sdpa (a checkpointed forward recomputed in the
  backward runs there, unchanged), and so is a forward inside ``outside_passes()`` (chunked_loss's
  probe of a model at its first pass, which would otherwise keep its layers too). ``reusing``
  checks on leaving that every kept layer was used, ``recording`` that only the answers' row was kept;
* dpo, one row: each rejected answer borrows the first tokens of its chosen sequence in the same
  row (``BorrowedPrefixes``, a keyword of the model's forward that reaches every attention call,
  recomputes included), and the gradient flows to the prompt's keys from both answers.
A model whose attention does not come through here fails loudly instead of scoring answers without
their prompts. Log-probs, losses and gradients equal the unshared batches' to float rounding
(tests/stages/test_shared_prefix.py). The collators (preference_collators.py) lay batches out this
way when they are one padding-free row attended per example on sdpa.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F

from registries.tokenize import IGNORE_INDEX

from stages.training.per_example_attention import CUSTOM_ATTENTION, SHORT_EXAMPLE, example_bounds, per_example_sdpa

SHARED_PREFIX_SDPA = "sdpa_shared_prefix"


@dataclass
class SharedPrefixes:
    """What one pair of passes shares: each example's count of shared first tokens, and, once
    recorded, each layer's kept keys and values (views of the detached tensors)."""

    lengths: list[int]  # tokens the second pass takes from the first, per example
    suffix_lengths: list[int]  # tokens the second pass computes itself, per example
    kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)  # [layer][example]
    row_tokens: int | None = None  # the answers' row, which the recorded forward runs on (None: unchecked)

    @classmethod
    def of(cls, batch: dict, prefix: str = "kl_") -> "SharedPrefixes | None":
        """The sharing a batch was laid out for (``shared_prefix_lengths``), None if it was not."""
        lengths = batch.get("shared_prefix_lengths")
        if lengths is None:
            return None
        owners = batch[prefix + "sequence_ids"].reshape(-1)
        suffix = torch.bincount(owners[owners >= 0], minlength=lengths.numel())
        return cls(lengths=lengths.tolist(), suffix_lengths=suffix.tolist(), row_tokens=batch["input_ids"].shape[-1])


@dataclass
class _Pass:
    mode: str  # "record" or "reuse"
    prefixes: SharedPrefixes
    calls: int = 0
    plans: dict = field(default_factory=dict)  # reuse: sliding window (None: none) -> SpanPlan, made once


_active: _Pass | None = None  # set only inside recording()/reusing(), around one forward


@contextlib.contextmanager
def _in_pass(mode: str, prefixes: SharedPrefixes | None):
    global _active
    if prefixes is None:
        yield
        return
    if _active is not None:
        raise RuntimeError(f"A shared-prefix pass ({_active.mode}) is already running; they do not nest.")
    _active = _Pass(mode, prefixes)
    try:
        yield
        done = _active
    finally:
        _active = None
    if mode == "record" and not prefixes.kept:
        raise RuntimeError(f"Nothing was kept for the KL answers: the model's attention is not {SHARED_PREFIX_SDPA}.")
    if mode == "reuse" and done.calls != len(prefixes.kept):
        raise RuntimeError(
            f"The KL pass attended {done.calls} layer(s) through {SHARED_PREFIX_SDPA} but {len(prefixes.kept)} were "
            "kept: its log-probs would miss their prompts. The model must run this attention in every layer."
        )


def recording(prefixes: SharedPrefixes | None):
    """Keep each layer's keys and values of the shared tokens during the next forward (None: a no-op)."""
    if prefixes is not None:
        prefixes.kept.clear()
    return _in_pass("record", prefixes)


def reusing(prefixes: SharedPrefixes | None):
    """Attend the next forward's sequences after their kept tokens (None: a no-op)."""
    return _in_pass("reuse", prefixes)


@contextlib.contextmanager
def outside_passes():
    """Inside a recording or reusing block, a forward that is not the pass's own (chunked_loss's probe
    of a model it has not met, four tokens: sequence_logps.SequenceLogpsMixin) attends plainly: its
    layers neither keep keys nor take the pass's kept ones."""
    global _active
    suspended, _active = _active, None
    try:
        yield
    finally:
        _active = suspended


@dataclass
class BorrowedPrefixes:
    """One row whose sequences may begin with the first tokens of another sequence of the same row
    (dpo: each rejected answer's prompt is the chosen sequence's). Handed to the model's forward as
    the ``borrowed_prefixes`` keyword, which transformers passes on to every attention call, a
    checkpointed layer's recompute included; ``calls`` counts them, so a model that dropped it is caught."""

    sequence_lengths: list[int]  # each sequence's own tokens in the row, in row order
    lenders: list[int]  # the sequence whose first tokens each begins with; -1: none
    counts: list[int]  # how many of them
    calls: int = 0
    # sliding window (None: none) -> SpanPlan, made at the first layer with it: a model may mix
    # layers with and without a window
    plans: dict = field(default_factory=dict)

    @classmethod
    def of(cls, batch: dict, prefix: str = "") -> "BorrowedPrefixes | None":
        """The borrowing a batch was laid out with (``borrowed_from``, ``borrowed_lengths``), None if none."""
        lenders = batch.get(prefix + "borrowed_from")
        if lenders is None:
            return None
        owners = batch[prefix + "sequence_ids"].reshape(-1)
        lengths = torch.bincount(owners[owners >= 0], minlength=lenders.numel())
        return cls(lengths.tolist(), lenders.tolist(), batch[prefix + "borrowed_lengths"].tolist())


def shared_prefix_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, borrowed_prefixes: BorrowedPrefixes | None = None, **kwargs):
    """transformers' attention-function signature, as per_example_sdpa."""
    current = _active
    window = kwargs.get("sliding_window")
    if borrowed_prefixes is not None or (current is not None and current.mode == "reuse"):
        for name in ("softcap", "s_aux"):  # as per_example_sdpa: score changes sdpa cannot make
            if kwargs.get(name) is not None:
                raise RuntimeError(f"{SHARED_PREFIX_SDPA} cannot apply {name}; this model needs its own attention.")
    if borrowed_prefixes is not None:
        borrowed_prefixes.calls += 1
        return _attend_borrowed(borrowed_prefixes, query, key, value, dropout, scaling, window)
    if current is not None and current.mode == "reuse":
        return _attend_after_kept(current, query, key, value, dropout, scaling, window)
    if current is not None:
        _keep(current.prefixes, key, value, kwargs.get("position_ids"))
    return per_example_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)


def _keep(prefixes: SharedPrefixes, key: torch.Tensor, value: torch.Tensor, position_ids) -> None:
    if prefixes.row_tokens is not None and key.shape[2] != prefixes.row_tokens:
        raise RuntimeError(
            f"A forward of {key.shape[2]} tokens ran inside the recording of the answers' pass ({prefixes.row_tokens} "
            "tokens): only that pass may run there (a probe of the model belongs in shared_prefix.outside_passes())."
        )
    starts = example_bounds(position_ids[0])[:-1]
    if len(starts) != len(prefixes.lengths):
        raise RuntimeError(f"The answers' row holds {len(starts)} examples but {len(prefixes.lengths)} share a prefix.")
    key, value = key.detach(), value.detach()
    prefixes.kept.append([(key[:, :, s : s + n], value[:, :, s : s + n]) for s, n in zip(starts, prefixes.lengths)])


def _spans(lengths: list[int], tokens: int) -> list[tuple[int, int]]:
    if sum(lengths) != tokens:
        raise RuntimeError(f"The row has {tokens} tokens; its sequences add up to {sum(lengths)}.")
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return [(end - length, end) for length, end in zip(lengths, ends)]


def _attend_after_kept(current: _Pass, query, key, value, dropout, scaling, window):
    prefixes = current.prefixes
    if current.calls >= len(prefixes.kept):
        raise RuntimeError(f"The KL pass has more attention layers than the answers' pass kept ({len(prefixes.kept)}).")
    kept = prefixes.kept[current.calls]
    current.calls += 1
    # The kept keys go after the row's own in one source tensor the plan indexes.
    source_key = torch.cat([key] + [k for k, _ in kept], dim=2)
    source_value = torch.cat([value] + [v for _, v in kept], dim=2)
    if window not in current.plans:
        counts = [k.shape[2] for k, _ in kept]
        starts = (query.shape[2] + torch.tensor([0] + counts[:-1]).cumsum(0)).tolist()
        spans = _spans(prefixes.suffix_lengths, query.shape[2])
        current.plans[window] = SpanPlan.of(spans, starts, counts, window, query.device)
    return current.plans[window].attend(query, source_key, source_value, dropout, scaling)


def _attend_borrowed(borrowed: BorrowedPrefixes, query, key, value, dropout, scaling, window):
    if window not in borrowed.plans:
        spans = _spans(borrowed.sequence_lengths, query.shape[2])
        starts = [spans[lender][0] if lender >= 0 else 0 for lender in borrowed.lenders]
        borrowed.plans[window] = SpanPlan.of(spans, starts, borrowed.counts, window, query.device)
    return borrowed.plans[window].attend(query, key, value, dropout, scaling)


@dataclass
class SpanPlan:
    """How one row's sequences are attended, each to its kept keys (``count`` of them from ``start``
    in a source tensor) and then its own: made once per forward, the same in every layer. As in
    per_example_attention.ExamplePlan, sequences under SHORT_EXAMPLE tokens share one padded call
    (with a mask per sequence), where a call of their own costs more than their attention."""

    long: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (start, end, source key positions, mask)
    short_queries: torch.Tensor | None = None  # (sequences x longest) row positions, pads at 0
    short_keys: torch.Tensor | None = None  # (sequences x most keys) source positions, pads at 0
    short_mask: torch.Tensor | None = None  # (sequences, 1, longest, most keys)
    short_real: torch.Tensor | None = None  # the padded output's rows that are real queries, in row order
    row_order: torch.Tensor | None = None  # each row token's place in the call order; None: in order

    @classmethod
    def of(cls, spans, starts, counts, window, device) -> "SpanPlan":
        def keys_of(i):
            (start, end), kept = spans[i], range(starts[i], starts[i] + counts[i])
            return list(kept) + list(range(start, end))

        short = [i for i, (start, end) in enumerate(spans) if end - start < SHORT_EXAMPLE]
        if len(short) < 2:
            short = []
        long = [i for i in range(len(spans)) if i not in short]
        plan = cls(long=[(spans[i][0], spans[i][1], torch.tensor(keys_of(i), device=device),
                          after_prefix_mask(spans[i][1] - spans[i][0], counts[i], window, device)) for i in long])
        order = [t for i in short for t in range(*spans[i])] + [t for i in long for t in range(*spans[i])]
        if short:
            longest = max(spans[i][1] - spans[i][0] for i in short)
            most = max(counts[i] + spans[i][1] - spans[i][0] for i in short)
            queries = torch.zeros(len(short), longest, dtype=torch.long)
            keys = torch.zeros(len(short), most, dtype=torch.long)
            mask = torch.zeros(len(short), 1, longest, most, dtype=torch.bool)
            real = []
            for j, i in enumerate(short):
                (start, end), count = spans[i], counts[i]
                queries[j, : end - start] = torch.arange(start, end)
                keys[j, : count + end - start] = torch.tensor(keys_of(i))
                # Query t (position count + t) sees keys 0 .. count + t of its own; pad queries see the
                # same (a row with no key would be NaN) and are dropped.
                # Pad queries see keys too (a row with none would be NaN); their outputs are dropped.
                mask[j, 0] = _visible(longest, count, most, window, "cpu") & (torch.arange(most) < count + end - start)
                real += range(j * longest, j * longest + end - start)
            plan.short_queries, plan.short_keys = queries.flatten().to(device), keys.flatten().to(device)
            plan.short_mask, plan.short_real = mask.to(device), torch.tensor(real, device=device)
        if order != list(range(len(order))):
            plan.row_order = torch.argsort(torch.tensor(order)).to(device)  # the inverse permutation
        return plan

    def attend(self, query, key, value, dropout, scaling):
        """(1, heads, tokens, head_dim) queries and (1, kv heads, source tokens, head_dim) source keys
        and values in, (1, tokens, heads, head_dim) out."""
        gqa = query.shape[1] != key.shape[1]
        pieces = []
        if self.short_queries is not None:
            sequences, longest, most = self.short_mask.shape[0], self.short_mask.shape[2], self.short_mask.shape[3]

            def padded(x, index, length):  # (1, H, S, D) -> (sequences, H, length, D)
                return x[0].index_select(1, index).view(x.shape[1], sequences, length, x.shape[3]).transpose(0, 1)

            q = padded(query, self.short_queries, longest)
            k, v = padded(key, self.short_keys, most), padded(value, self.short_keys, most)
            out = _sdpa(q, k, v, self.short_mask, dropout, scaling, gqa)  # (sequences, H, longest, D)
            heads, dim = out.shape[1], out.shape[3]
            out = out.transpose(1, 2).reshape(sequences * longest, heads, dim)
            pieces.append(out.index_select(0, self.short_real))
        for start, end, keys, mask in self.long:
            k, v = key.index_select(2, keys), value.index_select(2, keys)
            pieces.append(_sdpa(query[:, :, start:end], k, v, mask, dropout, scaling, gqa)[0].transpose(0, 1))
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if self.row_order is not None:
            out = out.index_select(0, self.row_order)
        return out[None], None


def _sdpa(q, k, v, mask, dropout, scaling, gqa):
    """sdpa over (batch, heads, tokens, head_dim); ``mask`` None: plain causal."""
    if gqa and mask is not None:  # as per_example_attention._causal_sdpa: grouped keys only without a mask
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                          scale=scaling, enable_gqa=gqa and mask is None)


@lru_cache(maxsize=64)
def after_prefix_mask(queries: int, kept: int, window: int | None, device) -> torch.Tensor | None:
    """Query t (position kept + t) sees keys 0 .. kept + t, within ``window`` of it; None: plain causal."""
    if kept == 0 and (window is None or queries <= window):
        return None
    return _visible(queries, kept, kept + queries, window, device)


def _visible(queries: int, kept: int, keys: int, window: int | None, device) -> torch.Tensor:
    """(queries, keys) bool: query t, at position kept + t, sees keys 0 .. kept + t within ``window``."""
    position = torch.arange(queries, device=device)[:, None] + kept
    key = torch.arange(keys, device=device)[None, :]
    allowed = key <= position
    if window is not None:
        allowed &= key > position - window
    return allowed


CUSTOM_ATTENTION[SHARED_PREFIX_SDPA] = shared_prefix_sdpa


# ------------------------------------------------------------------------------ the layout


def shared_lengths(input_ids, kl_input_ids, kl_labels) -> list[int]:
    """Per example, the KL sequence's first tokens the answers' pass can attend for it: those both
    sequences begin with, ending before the KL answer's last unlabelled token (its output predicts
    the answer's first token, so the KL pass computes it)."""
    lengths = []
    for ids, kl_ids, labels in zip(input_ids, kl_input_ids, kl_labels):
        common = 0
        for a, b in zip(ids, kl_ids):
            if a != b:
                break
            common += 1
        first_label = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
        lengths.append(max(0, min(common, first_label - 1)))
    return lengths


def lay_out_suffixes(kl_input_ids, kl_labels, lengths: list[int]) -> dict[str, torch.Tensor]:
    """The KL sequences without their shared tokens, end to end in one row at their true positions,
    with ``sequence_ids``; each one's first label is unlabelled (a prompt token), as in any padding-free row."""
    ids, labels, positions, owners = [], [], [], []
    for index, (row, row_labels, shared) in enumerate(zip(kl_input_ids, kl_labels, lengths)):
        ids += list(row[shared:])
        labels += [IGNORE_INDEX] + list(row_labels[shared + 1 :])
        positions += range(shared, len(row))
        owners += [index] * (len(row) - shared)
    return {name: torch.as_tensor([values], dtype=torch.long) for name, values in
            (("input_ids", ids), ("labels", labels), ("position_ids", positions), ("sequence_ids", owners))}
