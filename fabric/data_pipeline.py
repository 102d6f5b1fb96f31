"""Ray Data: read -> align -> tokenize + mask (map_batches over the cluster) -> split.

The registries do the work (pure functions over column batches); this module only decides where
it runs. Rows keep their file order end to end, so the result equals running the same functions
in one process.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import ray

from registries.datasets.aligner import align_batch, aligned_table, bad_rows_batch
from registries.datasets.errors import DatasetRowError
from registries.datasets.info import get_dataset_attrs
from registries.datasets.readers import read_table
from registries.datasets.stage_fields import check_stage_fields
from registries.tokenize import get_preprocess_fn

logger = logging.getLogger(__name__)

BATCH_SIZE = 512  # rows per map_batches call; also the window sft packing fills sequences from


@dataclass
class PreparedData:
    train: "ray.data.Dataset"
    eval: Optional["ray.data.Dataset"]
    stats: dict


def prepare_datasets(cfg, tokenizer, template) -> PreparedData:
    """Tokenized train (and eval) datasets, from ``tokenized_path`` when it already holds them."""
    data_args = cfg.data
    fingerprint = _fingerprint(cfg, tokenizer, template)
    if data_args.tokenized_path and not data_args.overwrite_cache and _has_cache(data_args.tokenized_path):
        return _load_cache(data_args.tokenized_path, fingerprint)

    started = time.time()
    stage, seed = cfg.finetuning.stage, cfg.training.seed
    preprocess = get_preprocess_fn(stage, tokenizer, template, data_args)
    train = _tokenized(data_args.dataset, data_args, stage, seed, preprocess)
    evaluation = None
    if data_args.eval_dataset:
        evaluation = _tokenized(data_args.eval_dataset, data_args, stage, seed, preprocess)
    elif data_args.val_size:
        test_size = data_args.val_size if data_args.val_size < 1 else int(data_args.val_size)
        train, evaluation = train.train_test_split(test_size=test_size, shuffle=True, seed=seed)
        train, evaluation = train.materialize(), evaluation.materialize()
    stats = {"train_examples": train.count(), "eval_examples": evaluation.count() if evaluation else 0}
    logger.info("preprocessing done in %.1fs: %s", time.time() - started, stats)
    print(f"[rayfactory] data ready in {time.time() - started:.1f}s: {stats}", flush=True)
    if data_args.tokenized_path:
        _save_cache(data_args.tokenized_path, train, evaluation, fingerprint)
    return PreparedData(train, evaluation, stats)


def _tokenized(names, data_args, stage, seed, preprocess) -> "ray.data.Dataset":
    """Every named dataset aligned, mixed, then tokenized; materialized so training starts from
    blocks in the object store instead of competing with a running pipeline for CPUs."""
    attrs = get_dataset_attrs(names, data_args.dataset_dir)
    check_stage_fields(attrs, stage)  # before any work: dpo/rm need ranking, kto a kto_tag column
    aligned = [_aligned(attr, data_args, seed) for attr in attrs]
    mixed = _mix(aligned, data_args, seed)
    tokenized = mixed.map_batches(
        functools.partial(_tokenize_block, preprocess=preprocess), batch_size=BATCH_SIZE, batch_format="pyarrow"
    )
    return _run(tokenized)


def _aligned(attr, data_args, seed) -> "ray.data.Dataset":
    raw = ray.data.from_arrow(read_table(attr, data_args.max_samples, seed))
    if data_args.skip_bad_rows:
        bad = _run(raw.map_batches(functools.partial(_bad_rows_block, attr=attr), batch_format="pyarrow"))
        if bad.count():
            rows = bad.take(5)
            print(f"[rayfactory] dataset {attr.name!r}: {_skipped_summary(rows, bad.count(), raw.count())}", flush=True)
    return raw.map_batches(
        functools.partial(_align_block, attr=attr, skip_bad_rows=data_args.skip_bad_rows), batch_format="pyarrow"
    )


def _mix(datasets: list, data_args, seed) -> "ray.data.Dataset":
    if len(datasets) == 1:
        return datasets[0]
    if data_args.mix_strategy == "concat":
        return datasets[0].union(*datasets[1:])
    # Interleaving needs every dataset's length and a seeded draw across them: small index work
    # on the driver, done by the registries' mixer over the aligned rows.
    from registries.datasets.mixing import interleave

    rows = [ds.take_all() for ds in _run_all(datasets)]
    mixed = interleave(rows, data_args.interleave_probs, data_args.mix_strategy, seed)
    return ray.data.from_arrow(aligned_table({k: [r[k] for r in mixed] for k in mixed[0]}))


def _align_block(table, attr, skip_bad_rows):
    return aligned_table(align_batch(table.to_pydict(), attr, skip_bad_rows))


def _bad_rows_block(table, attr):
    import pyarrow as pa

    return pa.table(bad_rows_batch(table.to_pydict(), attr))


def _tokenize_block(table, preprocess):
    return preprocess(table.to_pydict())


def _skipped_summary(rows, bad_count, total) -> str:
    shown = "; ".join(f"row {r['_source_row']} of {r['_source_file']}: {r['_error']}" for r in rows)
    more = f"; and {bad_count - len(rows)} more" if bad_count > len(rows) else ""
    return f"skipped {bad_count} of {total} rows (skip_bad_rows is on): {shown}{more}."


def _run(dataset) -> "ray.data.Dataset":
    """Materialize, turning a user's data error raised inside a Ray task back into itself."""
    try:
        return dataset.materialize()
    except ray.exceptions.RayTaskError as err:
        cause = err.cause if isinstance(getattr(err, "cause", None), Exception) else None
        if isinstance(cause, (DatasetRowError, ValueError)):
            raise cause from None
        raise


def _run_all(datasets):
    return [_run(ds) for ds in datasets]


# ------------------------------------------------------------------ tokenized_path reuse
_META = "rayfactory_tokenized.json"


def _fingerprint(cfg, tokenizer, template) -> dict:
    d = cfg.data
    return {
        "stage": cfg.finetuning.stage,
        "template": template.name,
        "tokenizer": getattr(tokenizer, "name_or_path", ""),
        "vocab_size": len(tokenizer),
        "dataset": d.dataset,
        "eval_dataset": d.eval_dataset,
        "cutoff_len": d.cutoff_len,
        "packing": d.packing,
        "neat_packing": d.neat_packing,
        "train_on_prompt": d.train_on_prompt,
        "mask_history": d.mask_history,
        "max_samples": d.max_samples,
        "val_size": d.val_size,
    }


def _has_cache(path: str) -> bool:
    return os.path.exists(os.path.join(path, _META))


def _save_cache(path: str, train, evaluation, fingerprint: dict) -> None:
    os.makedirs(path, exist_ok=True)
    train.write_parquet(os.path.join(path, "train"))
    if evaluation is not None:
        evaluation.write_parquet(os.path.join(path, "eval"))
    with open(os.path.join(path, _META), "w", encoding="utf-8") as f:
        json.dump(fingerprint, f, indent=2)
    print(f"[rayfactory] tokenized data saved to {path}; later runs reuse it", flush=True)


def _load_cache(path: str, fingerprint: dict) -> PreparedData:
    with open(os.path.join(path, _META), encoding="utf-8") as f:
        saved = json.load(f)
    changed = sorted(k for k in fingerprint if saved.get(k) != fingerprint[k])
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {fingerprint[k]!r}" for k in changed)
        raise ValueError(
            f"tokenized_path {path} was made with different settings ({details}). Set "
            "overwrite_cache: true to tokenize again into it, or point tokenized_path at a new folder."
        )
    train = ray.data.read_parquet(os.path.join(path, "train"))
    eval_dir = os.path.join(path, "eval")
    evaluation = ray.data.read_parquet(eval_dir) if os.path.isdir(eval_dir) else None
    train, evaluation = train.materialize(), evaluation.materialize() if evaluation is not None else None
    stats = {"train_examples": train.count(), "eval_examples": evaluation.count() if evaluation else 0}
    print(f"[rayfactory] reusing tokenized data from {path}: {stats}", flush=True)
    return PreparedData(train, evaluation, stats)
