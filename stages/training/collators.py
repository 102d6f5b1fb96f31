"""Collators: tokenized rows -> padded torch tensors, one batch at a time.

They accept either shape a batch arrives in:

* a list of row dicts (Hugging Face ``Trainer`` / ``DataLoader``), or
* a dict of columns (Ray Data's ``iter_torch_batches(collate_fn=...)`` hands numpy columns).

Padding goes to the longest row in the batch (optionally rounded up to a multiple), on the
right for training or the left for generation. Each column pads with its own value: the
tokenizer's pad id for ids, IGNORE_INDEX for labels, 0 for masks and positions.

Collators hold plain numbers, not the tokenizer, so they pickle cheaply to Ray workers; build
them with ``from_tokenizer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from registries.tokenize import IGNORE_INDEX

from stages.training.chunked_loss import language_model
from stages.training.per_example_attention import PER_EXAMPLE_SDPA, attention_implementation, supports_per_example_sdpa
from stages.training.vision_collators import is_vision_model, vision_collator


def to_columns(features) -> dict[str, list[Any]]:
    """Rows or columns in, columns out."""
    if isinstance(features, Mapping):
        return {key: list(values) for key, values in features.items()}
    if not features:
        raise ValueError("Cannot collate an empty batch.")
    return {key: [row[key] for row in features] for key in features[0]}


def pad_value(column: str, pad_token_id: int) -> int:
    if column.endswith("input_ids"):
        return pad_token_id
    if column.endswith("labels"):
        return IGNORE_INDEX
    if column.endswith("attention_mask") or column.endswith("position_ids"):
        return 0
    raise ValueError(
        f"Do not know how to pad column {column!r}: collators pad *input_ids, *labels, "
        "*attention_mask and *position_ids. Drop the column before collating or add a pad rule."
    )


def pad_rows(
    rows: Sequence[Sequence[int]], value: int, side: str = "right", multiple: int | None = None,
    length: int | None = None,
) -> torch.Tensor:
    """Rows of ids -> a (len(rows), L) long tensor padded with ``value``.

    L is ``length`` if given, else the longest row rounded up to ``multiple``.
    """
    tensors = [torch.as_tensor(row, dtype=torch.long).reshape(-1) for row in rows]
    if length is None:
        length = max((len(t) for t in tensors), default=0)
        if multiple:
            length = -(-length // multiple) * multiple
    out = torch.full((len(tensors), length), value, dtype=torch.long)
    for i, t in enumerate(tensors):
        if side == "right":
            out[i, : len(t)] = t
        else:
            out[i, length - len(t) :] = t
    return out


@dataclass
class PaddingCollator:
    """Pads every list column; scalar columns (e.g. ``kto_tags``) become 1-D tensors."""

    pad_token_id: int
    padding_side: str = "right"
    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}.")

    @classmethod
    def from_tokenizer(cls, tokenizer, padding_side: str | None = None, **kwargs):
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "The tokenizer has no pad token, so batches cannot be padded. Call "
                "template.fix_tokenizer(tokenizer) first (it sets pad to eos when missing)."
            )
        return cls(pad_token_id=tokenizer.pad_token_id, padding_side=padding_side or tokenizer.padding_side, **kwargs)

    def __call__(self, features) -> dict[str, torch.Tensor]:
        return self.collate_columns(to_columns(features))

    def collate_columns(self, columns: dict[str, list[Any]], length: int | None = None) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {}
        for key, values in columns.items():
            if len(values) == 0:
                raise ValueError(f"Cannot collate an empty batch (column {key!r} has no rows).")
            if _is_sequence(values[0]):
                batch[key] = pad_rows(
                    values, pad_value(key, self.pad_token_id), self.padding_side, self.pad_to_multiple_of, length
                )
            else:
                batch[key] = torch.as_tensor(values)
        return batch


@dataclass
class NeatPackingCollator(PaddingCollator):
    """sft with ``neat_packing``: ``attention_mask`` holds example numbers (1,1,2,2,2,3,..., 0 =
    padding). Builds position ids that restart at every example and a 4-D block-diagonal causal
    mask, so packed examples cannot attend to each other.

    The mask is additive, shaped (B, 1, L, L), in ``dtype`` (the model's compute dtype): 0 where
    attention is allowed, the dtype's most negative value elsewhere. A padding row attends
    nowhere; its outputs are ignored because its labels are IGNORE_INDEX.
    """

    dtype: torch.dtype = torch.float32
    # Flash-attention kernels take no 4-D mask; given restarting position_ids and no mask,
    # transformers runs them per example ("varlen"), which isolates the examples just the same.
    four_d_mask: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.padding_side != "right":
            raise ValueError("Neat packing pads on the right (packed rows are for training, not generation).")

    def __call__(self, features) -> dict[str, torch.Tensor]:
        batch = super().__call__(features)
        segments = batch.pop("attention_mask")
        batch["position_ids"] = restarting_positions(segments)
        if self.four_d_mask:
            batch["attention_mask"] = block_diagonal_mask(segments, self.dtype)
        return batch


@dataclass
class PaddingFreeCollator(PaddingCollator):
    """pt/sft without padding: the batch's examples laid end to end, each with position ids that
    restart at 0 and no attention mask. transformers reads restarting positions as packed
    sequences (masking_utils builds a block-diagonal causal mask; flash kernels run per example),
    so an example sees only itself and the loss and gradient equal the padded batch's, while the
    model spends no compute on pad tokens.

    Each example's first label becomes IGNORE_INDEX: the causal LM loss shifts labels left, so
    that position is what the previous example's last token would predict. In a padded batch that
    label is never predicted either, so the set of trained tokens is the same.

    Examples go first-fit into rows of at most ``row_width`` tokens (None: the batch's longest
    example, the padded batch's width). Attention over a row with a block-diagonal mask (eager, and
    sdpa as transformers runs it) costs its length squared, so rows that wide never cost more than
    padding while dropping most pads (an 8.4M Llama on 2 CPU cores, benchmarks/batch_layouts.py:
    450 ms a step padded, 350 ms in rows, 429 ms in one row).
    Where attention runs each example on its own (flash kernels, or sdpa per example:
    stages/training/per_example_attention.py), ``one_row`` lays the whole batch in a single row, with no pads.
    """

    row_width: int | None = None
    one_row: bool = False
    # The attention implementation these rows need, if not the model's own (StageJob.build_trainer sets it).
    attention: str | None = None
    needs_no_cache = True  # the trainer must run with use_cache off (StageJob.build_trainer)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.padding_side != "right":
            raise ValueError("Padding-free batches are for training; they lay examples out left to right.")

    def __call__(self, features) -> dict[str, torch.Tensor]:
        columns = to_columns(features)
        return self.lay_out(columns["input_ids"], columns.get("labels", columns["input_ids"]))

    def lay_out(self, input_ids, labels, number_sequences: bool = False) -> dict[str, torch.Tensor]:
        """Examples (lists of ids and of labels) into rows; with ``number_sequences``, also
        ``sequence_ids``: each token's example (its index in the given order), -1 for pads."""
        ids = [list(map(int, row)) for row in input_ids]
        labels = [list(map(int, row)) for row in labels]
        longest = max(map(len, ids))
        width = sum(map(len, ids)) if self.one_row else max(self.row_width or longest, longest)
        rows: list[dict[str, list[int]]] = []
        owners: list[list[int]] = []  # each token's example, for sequence_ids
        for index in _first_fit([len(row) for row in ids], width):
            row = {"input_ids": [], "labels": [], "position_ids": []}
            for i in index:
                row["input_ids"] += ids[i]
                row["labels"] += [IGNORE_INDEX] + labels[i][1:]
                row["position_ids"] += list(range(len(ids[i])))
            rows.append(row)
            owners.append([i for i in index for _ in range(len(ids[i]))])
        batch = self.collate_columns({key: [row[key] for row in rows] for key in rows[0]})
        # Pads after the last example: positions 0.. of their own, so they form one more block
        # (never attended to by a real token, and their labels are ignored).
        lengths = torch.as_tensor([len(row["input_ids"]) for row in rows])
        tail = torch.arange(batch["input_ids"].shape[1]) - lengths[:, None]
        batch["position_ids"] = torch.where(tail >= 0, tail, batch["position_ids"])
        if number_sequences:
            batch["sequence_ids"] = pad_rows(owners, -1, length=batch["input_ids"].shape[1])
        return batch


def _first_fit(lengths: list[int], width: int) -> list[list[int]]:
    """Example indices grouped into rows of at most ``width`` tokens, longest first (first-fit
    decreasing); each row keeps its examples in batch order."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            rows.append([])
            room.append(width)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= lengths[i]
    return [sorted(row) for row in rows]


def supports_padding_free(model) -> bool:
    """Whether ``model`` isolates examples given restarting position ids and no mask: flash
    kernels do; sdpa, eager and flex attention do in models whose masks come from
    transformers' masking_utils (create_causal_mask), which detects the restarts."""
    import sys

    base = language_model(model)
    attn = attention_implementation(model)
    if attn.startswith("flash"):
        return True
    module = sys.modules.get(type(base).__module__)
    return attn in ("sdpa", "eager", "flex_attention") and hasattr(module, "create_causal_mask")


# Collator factories, one per tokenization kind; the stage table names them.
# Each takes (tokenizer, data_args, model=None, pad_to_multiple_of=None).


def padding_collator(tokenizer, data_args, model=None, pad_to_multiple_of: int | None = None):
    """pt: rows padded on the right, or laid end to end (padding_free, see ``causal_lm_collator``)."""
    packed = getattr(data_args, "packing", None) is not False  # pt packs unless told not to
    return causal_lm_collator(tokenizer, data_args, model, pad_to_multiple_of, packed)


def supervised_collator(tokenizer, data_args, model=None, pad_to_multiple_of: int | None = None):
    """sft pads on the right; with ``neat_packing`` it isolates packed examples, with a mask in the
    model's dtype (flash-attention kernels take restarting positions instead of a mask). A
    vision-language model gets padded rows with its image tensors (vision_collators.py)."""
    if model is not None and is_vision_model(model):
        text = PaddingCollator.from_tokenizer(tokenizer, "right", pad_to_multiple_of=pad_to_multiple_of)
        return vision_collator(text, data_args, model)
    if getattr(data_args, "neat_packing", False):
        attn = attention_implementation(model)
        dtype = getattr(model, "dtype", torch.float32)
        return NeatPackingCollator.from_tokenizer(
            tokenizer, "right", dtype=dtype, four_d_mask=not attn.startswith("flash"),
            pad_to_multiple_of=pad_to_multiple_of,
        )
    return causal_lm_collator(tokenizer, data_args, model, pad_to_multiple_of, bool(getattr(data_args, "packing", False)))


def causal_lm_collator(tokenizer, data_args, model, pad_to_multiple_of: int | None, packed: bool):
    """pt/sft batches: padding-free where ``padding_free_layout`` says so (not for rows packed
    already: they are full, and one row of them all would only make attention dearer), else
    padded on the right."""
    layout = padding_free_layout(tokenizer, data_args, model, auto=not packed)
    return layout or PaddingCollator.from_tokenizer(tokenizer, "right", pad_to_multiple_of=pad_to_multiple_of)


def padding_free_layout(tokenizer, data_args, model, auto: bool = True) -> "PaddingFreeCollator | None":
    """How a training batch goes padding-free under ``padding_free`` (null: when ``auto`` and the
    model supports it), or None for padded batches. On sdpa the batch is one row that attention
    takes one example at a time (stages/training/per_example_attention.py); on flash kernels one
    row too; elsewhere rows as wide as the longest example."""
    wanted = getattr(data_args, "padding_free", None)
    supported = model is not None and supports_padding_free(model)
    if wanted and not supported:
        attn = attention_implementation(model) or None
        raise ValueError(
            f"padding_free is true, but this model ({type(model).__name__}, attention {attn!r}) does not keep "
            "examples apart when they share a row without a mask (that needs flash attention, or sdpa/eager "
            "in a model built on transformers' masking_utils). Set padding_free: false (or remove it)."
        )
    if not (wanted or (wanted is None and supported and auto)):
        return None
    if supported and supports_per_example_sdpa(model):
        return PaddingFreeCollator.from_tokenizer(tokenizer, "right", one_row=True, attention=PER_EXAMPLE_SDPA)
    one_row = attention_implementation(model).startswith("flash")
    return PaddingFreeCollator.from_tokenizer(tokenizer, "right", one_row=one_row)


def prompt_collator(tokenizer, data_args, model=None, pad_to_multiple_of: int | None = None):
    """Prompts for generation pad on the left, so every prompt ends where generation starts."""
    return PaddingCollator.from_tokenizer(tokenizer, "left", pad_to_multiple_of=pad_to_multiple_of)


def restarting_positions(segments: torch.Tensor) -> torch.Tensor:
    """Position 0, 1, 2, ... within each example; padding (segment 0) gets 0."""
    length = segments.shape[-1]
    index = torch.arange(length).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    # Each position's example start is the last start at or before it.
    start_index = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=-1).values
    return torch.where(segments > 0, index - start_index, torch.zeros_like(index))


def block_diagonal_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, L) example numbers -> (B, 1, L, L) additive causal mask within each example."""
    length = segments.shape[-1]
    same = segments[:, :, None] == segments[:, None, :]
    real = (segments > 0)[:, :, None] & (segments > 0)[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = same & real & causal
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None, :, :]


def _is_sequence(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return True
    return hasattr(value, "shape") and len(value.shape) >= 1  # numpy arrays and tensors
