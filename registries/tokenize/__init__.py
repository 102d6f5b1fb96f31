"""Per-stage tokenization: aligned column batches in, model-ready id columns out.

``get_preprocess_fn(kind, tokenizer, template, data_args, packing)`` is the one entry point the
data pipeline needs; the stage table maps each stage to its kind. It returns a pure function of a batch (``dict[str, list]``), a
``functools.partial`` that pickles, so Ray Data can ship it to its workers and call it from
``map_batches``. Rows a stage cannot use are skipped and logged per batch (see
``common.SkipCounter``); malformed rows raise a ValueError that names the row.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .common import IGNORE_INDEX
from .feedback import preprocess_feedback
from .packing import greedy_knapsack, pack_examples, preprocess_packed_supervised
from .pairwise import preprocess_pairwise
from .pretrain import preprocess_pretrain
from .seqlen import infer_seqlen
from .supervised import encode_supervised_example, preprocess_supervised
from .unsupervised import preprocess_unsupervised

# Tokenization kinds: what shape of example a stage trains on. The stage table
# (stages/table.py) names one per stage; this module knows kinds, not stages.
KINDS = {
    "pretrain": preprocess_pretrain,  # plain text, every token labelled (packing blocks by default)
    "supervised": preprocess_supervised,  # prompt -> response, prompt masked (packing optional)
    "pairwise": preprocess_pairwise,  # prompt -> chosen and rejected responses
    "feedback": preprocess_feedback,  # prompt -> response labelled good/bad, plus a mismatched KL pair
    "unsupervised": preprocess_unsupervised,  # prompts for generation (rollouts, predict)
}
PACKABLE = ("pretrain", "supervised")

PreprocessFn = Callable[[dict[str, list[Any]]], dict[str, list[Any]]]


def resolve_packing(data_args, default: bool) -> bool:
    """``packing: null`` takes the stage's default (on for pt); ``neat_packing`` implies packing."""
    if getattr(data_args, "neat_packing", False):
        return True
    packing = getattr(data_args, "packing", None)
    return default if packing is None else bool(packing)


def get_preprocess_fn(kind: str, tokenizer, template, data_args, packing: bool = False) -> PreprocessFn:
    """The batch function for a tokenization ``kind`` (see KINDS).

    ``packing`` applies to pretrain and supervised only; the other kinds ignore it (as
    LLaMA-Factory does), so one data config can serve an sft run and its predict pass.
    """
    if kind not in KINDS:
        raise ValueError(f"Unknown tokenization kind {kind!r}; expected one of {', '.join(KINDS)}.")
    bound = dict(tokenizer=tokenizer, template=template, data_args=data_args)
    if kind == "pretrain":
        return functools.partial(preprocess_pretrain, packing=packing, **bound)
    if kind == "supervised" and packing:
        return functools.partial(preprocess_packed_supervised, **bound)
    return functools.partial(KINDS[kind], **bound)


__all__ = [
    "IGNORE_INDEX",
    "KINDS",
    "PACKABLE",
    "encode_supervised_example",
    "get_preprocess_fn",
    "greedy_knapsack",
    "infer_seqlen",
    "pack_examples",
    "preprocess_feedback",
    "preprocess_packed_supervised",
    "preprocess_pairwise",
    "preprocess_pretrain",
    "preprocess_supervised",
    "preprocess_unsupervised",
    "resolve_packing",
]
