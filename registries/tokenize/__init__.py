"""Per-stage tokenization: aligned column batches in, model-ready id columns out.

``get_preprocess_fn(stage, tokenizer, template, data_args)`` is the one entry point the data
pipeline needs. It returns a pure function of a batch (``dict[str, list]``), a
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

STAGES = ("pt", "sft", "rm", "dpo", "kto", "ppo", "predict")

PreprocessFn = Callable[[dict[str, list[Any]]], dict[str, list[Any]]]


def resolve_packing(stage: str, data_args) -> bool:
    """``packing: null`` means on for pt and off otherwise; ``neat_packing`` implies packing."""
    if getattr(data_args, "neat_packing", False):
        return True
    packing = getattr(data_args, "packing", None)
    return stage == "pt" if packing is None else bool(packing)


def get_preprocess_fn(stage: str, tokenizer, template, data_args) -> PreprocessFn:
    """The batch function for ``stage`` (pt | sft | rm | dpo | kto | ppo | predict).

    Packing applies to pt and sft only; the other stages ignore ``packing``/``neat_packing``
    (as LLaMA-Factory does), so one data config can serve an sft run and its predict pass.
    """
    if stage not in STAGES:
        raise ValueError(f"Unknown stage {stage!r} for tokenization; expected one of {', '.join(STAGES)}.")
    bound = dict(tokenizer=tokenizer, template=template, data_args=data_args)
    packing = resolve_packing(stage, data_args)
    if stage == "pt":
        return functools.partial(preprocess_pretrain, packing=packing, **bound)
    if stage == "sft":
        fn = preprocess_packed_supervised if packing else preprocess_supervised
        return functools.partial(fn, **bound)
    if stage in ("rm", "dpo"):
        return functools.partial(preprocess_pairwise, **bound)
    if stage == "kto":
        return functools.partial(preprocess_feedback, **bound)
    return functools.partial(preprocess_unsupervised, **bound)


__all__ = [
    "IGNORE_INDEX",
    "STAGES",
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
