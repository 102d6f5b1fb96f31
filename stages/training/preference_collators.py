"""Collators of the preference stages: rm and dpo's pairs, kto's answers with their KL batch.

A batch's sequences are padded on the right to the longest, or, where the model keeps examples
apart in a shared row (``collators.padding_free_layout``, the ``padding_free`` key), laid end to
end without pads: restarting position ids, and ``sequence_ids`` saying whose each token is, so the
recipes sum per sequence (stages/training/sequence_logps.py; the value head for rm). A pair's
chosen and rejected answers then share one forward with every other sequence of the batch.
Reference log-probs computed before training (stages/training/reference_logps.py) ride along as
``ref_logps`` (and kto's ``kl_ref_logps``), one per sequence in the batch's order.

A vision-language model's dpo pairs are always padded rows, with each pair's images for both of its
sequences (vision_collators.vision_pairwise_collator; ``padding_free: true`` is refused there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stages.training.collators import PaddingCollator, PaddingFreeCollator, padding_free_layout, to_columns
from stages.training.per_example_attention import PER_EXAMPLE_SDPA
from stages.training.shared_prefix import SHARED_PREFIX_SDPA, lay_out_suffixes, shared_lengths
from stages.training.vision_collators import is_vision_model, vision_pairwise_collator

SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "labels")


@dataclass
class SequenceCollator(PaddingCollator):
    """Sequences padded, or laid out padding-free by ``rows``."""

    rows: PaddingFreeCollator | None = None
    # Second sequences laid out after the tokens they share with the first (shared_prefix.py);
    # only with one padding-free row attended per example on sdpa (the factories decide).
    share_prompts: bool = False

    @property
    def attention(self) -> str | None:
        """The attention the padding-free rows need (StageJob.build_trainer sets it on the model)."""
        if self.share_prompts:
            return SHARED_PREFIX_SDPA
        return self.rows.attention if self.rows is not None else None

    @property
    def needs_no_cache(self) -> bool:
        return self.rows is not None

    def sequences(self, columns: dict[str, list[Any]], prefix: str = "") -> dict[str, torch.Tensor]:
        """input_ids/attention_mask/labels columns -> the batch's tensors, keys prefixed."""
        if self.rows is None:
            batch = self.collate_columns({name: columns[name] for name in SEQUENCE_COLUMNS})
        else:
            batch = self.rows.lay_out(columns["input_ids"], columns["labels"], number_sequences=True)
        return {prefix + key: value for key, value in batch.items()}


@dataclass
class PairwiseCollator(SequenceCollator):
    """rm/dpo: ``2B`` sequences, all chosen first, then all rejected.

    With ``share_prompts`` (dpo in one padding-free row attended per example on sdpa), each rejected
    sequence keeps only what follows the tokens it begins with like its chosen one, and attends to
    the chosen sequence's keys for those (``borrowed_from``/``borrowed_lengths``: shared_prefix.py)."""

    def __call__(self, features) -> dict[str, torch.Tensor]:
        columns = to_columns(features)
        if any(len(pixels) for pixels in columns.get("pixel_values", ())):
            # Only a vision-language policy's collator (vision_collators.py) hands images to the model;
            # rm's value-head model would score the image tokens without the pictures.
            raise ValueError(
                "These preference pairs have images, but the model being trained does not read them here: "
                "image pairs train with stage dpo on a vision-language model (e.g. tiny:qwen2_vl), not with "
                "stage rm or a text model. Use stage dpo, or a dataset without an images column."
            )
        stacked = {name: list(columns[f"chosen_{name}"]) + list(columns[f"rejected_{name}"]) for name in SEQUENCE_COLUMNS}
        if self.share_prompts:
            pairs = len(columns["chosen_input_ids"])
            lengths = shared_lengths(columns["chosen_input_ids"], columns["rejected_input_ids"], columns["rejected_labels"])
            batch = lay_out_suffixes(stacked["input_ids"], stacked["labels"], [0] * pairs + lengths)
            batch["borrowed_from"] = torch.as_tensor([-1] * pairs + [i if n else -1 for i, n in enumerate(lengths)])
            batch["borrowed_lengths"] = torch.as_tensor([0] * pairs + lengths)
        else:
            batch = self.sequences(stacked)
        if "chosen_ref_logps" in columns:
            batch["ref_logps"] = _floats(list(columns["chosen_ref_logps"]) + list(columns["rejected_ref_logps"]))
        return batch


@dataclass
class KTOCollator(SequenceCollator):
    """kto: the answers, their mismatched KL answers (laid out on their own) and the tags.

    With ``share_prompts`` (one padding-free row attended per example on sdpa), each KL sequence
    keeps only what follows the tokens it begins with like its answer; ``shared_prefix_lengths``
    says how many, and the KL pass attends to the answers' pass's keys for them (shared_prefix.py)."""

    def __call__(self, features) -> dict[str, torch.Tensor]:
        columns = to_columns(features)
        batch = self.sequences(columns)
        if self.share_prompts:
            lengths = shared_lengths(columns["input_ids"], columns["kl_input_ids"], columns["kl_labels"])
            kl = lay_out_suffixes(columns["kl_input_ids"], columns["kl_labels"], lengths)
            batch.update({f"kl_{name}": value for name, value in kl.items()})
            batch["shared_prefix_lengths"] = torch.as_tensor(lengths, dtype=torch.long)
        else:
            batch.update(self.sequences({name: columns[f"kl_{name}"] for name in SEQUENCE_COLUMNS}, prefix="kl_"))
        batch["kto_tags"] = torch.as_tensor([bool(t) for t in columns["kto_tags"]], dtype=torch.bool)
        for name in ("ref_logps", "kl_ref_logps"):
            if name in columns:
                batch[name] = _floats(columns[name])
        return batch


def _floats(values) -> torch.Tensor:
    return torch.as_tensor([float(v) for v in values], dtype=torch.float32)


def _rows(tokenizer, data_args, model) -> PaddingFreeCollator | None:
    if model is None:  # evaluation tools without a model to ask: padded
        return None
    model = getattr(model, "pretrained_model", model)  # rm's value-head wrapper: its language model decides
    return padding_free_layout(tokenizer, data_args, model)


# Collator factories for the stage table: (tokenizer, data_args, model=None, pad_to_multiple_of=None).


def pairwise_collator(tokenizer, data_args, model=None, pad_to_multiple_of: int | None = None):
    """rm/dpo: chosen then rejected, padded or padding-free; a vision-language model's pairs padded,
    with their images (vision_collators.py)."""
    if model is not None and is_vision_model(model):
        pairs = PairwiseCollator.from_tokenizer(tokenizer, "right", pad_to_multiple_of=pad_to_multiple_of)
        return vision_pairwise_collator(pairs, data_args, model)
    return PairwiseCollator.from_tokenizer(tokenizer, "right", pad_to_multiple_of=pad_to_multiple_of,
                                           rows=_rows(tokenizer, data_args, model))


def dpo_pair_collator(tokenizer, data_args, model=None, pad_to_multiple_of: int | None = None):
    """dpo: as ``pairwise_collator``; in one row attended per example on sdpa, each rejected answer
    borrows its prompt's keys from the chosen sequence (rm's value head reads whole sequences: not there)."""
    pairs = pairwise_collator(tokenizer, data_args, model, pad_to_multiple_of)
    if isinstance(pairs, PairwiseCollator) and _shares_prompts(pairs.rows):
        pairs.share_prompts = True
    return pairs


def _shares_prompts(rows: PaddingFreeCollator | None) -> bool:
    return rows is not None and rows.one_row and rows.attention == PER_EXAMPLE_SDPA


def kto_collator(tokenizer, data_args, model=None, pad_to_multiple_of: int | None = None):
    """kto: the answers plus their KL batch and tags, padded or padding-free; in one row attended
    per example on sdpa, the KL answers share their prompts' keys with the answers."""
    rows = _rows(tokenizer, data_args, model)
    return KTOCollator.from_tokenizer(tokenizer, "right", pad_to_multiple_of=pad_to_multiple_of, rows=rows,
                                      share_prompts=_shares_prompts(rows))
