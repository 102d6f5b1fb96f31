"""Reference log-probs computed once, before the first step (TRL's ``precompute_ref_log_probs``).

dpo and kto compare the policy with a frozen reference on every sequence of every step. The
reference never changes, so its log-probs can be computed in one pass over the worker's data and
kept as columns (``chosen_ref_logps``/``rejected_ref_logps``; kto: ``ref_logps``/``kl_ref_logps``)
that the collators hand to the loss. A separate reference model (full or freeze tuning, or an
explicit ``ref_model``) is then freed before training: its weights do not sit next to the
policy's for the whole run. The losses are the same (tests/stages/test_sequence_logps.py).

``precompute_ref_log_probs``: true, false, or null (planned here): on when training visits the
rows two times or more (the pass computes each once, training would have computed it each time);
off otherwise: for one epoch the pass was measured slower than the same reference forwards made
within the steps (vs_llamafactory.py's dpo-full and kto-full, benchmarks/README.md), so setting it
true is a trade of some speed for the separate copy's memory. Off for streamed data (no columns
to add), and under DeepSpeed ZeRO-3 (there the reference's forward is a collective, and workers'
shares may differ in length). With several workers each computes every world_size-th row and
the columns are gathered from all. The pass runs inside ``trainer.train()`` (from
``get_train_dataloader``, as TRL does); the Trainer's clock starts after it, so its time is added
to ``train_runtime`` (logged as ``reference_pass_runtime`` too) and the rates count it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def plan_precompute(setting: bool | None, reference_kind: str, dataset, training_args) -> tuple[bool, str]:
    """(whether to precompute, why) for this worker's ``dataset`` under ``training_args``."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if reference_kind not in ("model", "adapter_disabled"):
        return False, "no reference model"
    refusal = None
    if not hasattr(dataset, "add_column") or not hasattr(dataset, "__len__"):
        refusal = "the training data is streamed (there is no table to add the log-probs to)"
    elif is_deepspeed_zero3_enabled():
        refusal = "under DeepSpeed ZeRO-3 the reference's forward is a collective over workers whose shards differ"
    if refusal is not None:
        if setting:
            raise ValueError(f"precompute_ref_log_probs is true, but {refusal}. Set precompute_ref_log_probs: false.")
        return False, refusal
    if setting is not None:
        return bool(setting), "precompute_ref_log_probs is set"
    visits = rows_visited(len(dataset), training_args) / max(len(dataset), 1)
    if visits >= 2:
        return True, f"training visits every row {visits:.1f} times; the pass computes each once"
    return False, f"training visits {visits:.1f}x of the rows: computing them per step costs less"


def rows_visited(rows: int, training_args) -> int:
    """Rows the run trains on, all workers together (max_steps, else the epochs). Every worker
    holds the whole dataset; the Trainer's sampler gives each its share of every epoch."""
    world = max(int(getattr(training_args, "world_size", 1) or 1), 1)
    per_step = int(training_args.per_device_train_batch_size) * int(training_args.gradient_accumulation_steps) * world
    if training_args.max_steps and training_args.max_steps > 0:
        return int(training_args.max_steps) * per_step
    steps_per_epoch = math.ceil(rows / max(per_step, 1))
    return int(math.ceil(float(training_args.num_train_epochs) * steps_per_epoch)) * per_step


def with_reference_columns(dataset, collator, reference_columns: Callable[[dict], dict[str, torch.Tensor]],
                           batch_size: int, device):
    """``dataset`` with the columns ``reference_columns(batch)`` returns (one value per row of the
    batch), without gradients. With several workers (each holds the whole dataset), each computes
    every world_size-th row and the columns are assembled from all of them."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = list(range(rank, len(dataset), world))
    values: dict[str, list[float]] = {}
    with torch.no_grad():
        for start in range(0, len(mine), batch_size):
            rows = [dataset[i] for i in mine[start : start + batch_size]]
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collator(rows).items()}
            for name, column in reference_columns(batch).items():
                values.setdefault(name, []).extend(column.float().cpu().tolist())
    if distributed:
        shares: list = [None] * world
        dist.all_gather_object(shares, (mine, values))
        columns: dict[str, list[float]] = {}
        for indices, share in shares:
            for name, column in share.items():
                columns.setdefault(name, [0.0] * len(dataset))
                for i, value in zip(indices, column):
                    columns[name][i] = value
        values = columns
    for name, column in values.items():
        dataset = dataset.add_column(name, column)
    return dataset


class PrecomputedReferenceMixin:
    """A preference Trainer whose reference log-probs may come from the data: put it before the
    Trainer. The stage's trainer defines ``reference_columns(model, batch) -> {column: (B,) tensor}``
    and has ``self.reference`` (stages/training/reference.py ``Reference``)."""

    precompute_setting: bool | None = None
    _reference_pass_s = 0.0

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # The Trainer starts its clock after get_train_dataloader, where the pass runs: its time is
        # added to train_runtime (and the rates scaled to match), so the throughput pays for it.
        if "train_runtime" in logs and self._reference_pass_s:
            old = float(logs["train_runtime"])
            new = old + self._reference_pass_s
            for key in [k for k in logs if k.startswith("train_") and k.endswith("_per_second")]:
                logs[key] = round(float(logs[key]) * old / new, 3)
            logs["train_runtime"] = round(new, 4)
            logs["reference_pass_runtime"] = round(self._reference_pass_s, 4)
        super().log(logs, start_time)

    def get_train_dataloader(self):
        self._precompute_reference()
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        self._precompute_reference()
        return super().get_eval_dataloader(eval_dataset)

    def _precompute_reference(self) -> None:
        if getattr(self, "_reference_planned", False):
            return
        self._reference_planned = True
        wanted, why = plan_precompute(self.precompute_setting, self.reference.kind, self.train_dataset, self.args)
        logger.info("reference log-probs %s: %s", "precomputed" if wanted else "computed per step", why)
        if not wanted:
            return
        started = time.perf_counter()
        model = self.model_wrapped if self.model_wrapped is not None else self.model
        was_training = model.training
        model.eval()
        batch_size = 2 * int(self.args.per_device_train_batch_size)  # no gradients: room for more rows
        try:
            self.train_dataset = self._add_reference_columns(self.train_dataset, batch_size)
            if isinstance(self.eval_dataset, dict):
                self.eval_dataset = {k: self._add_reference_columns(v, batch_size) for k, v in self.eval_dataset.items()}
            elif self.eval_dataset is not None:
                self.eval_dataset = self._add_reference_columns(self.eval_dataset, batch_size)
        finally:
            model.train(was_training)
        self._reference_pass_s = time.perf_counter() - started
        freed = self.reference.kind == "model"
        self.reference.model = None  # the recipe may still hold the Reference: the model must go from it
        self.reference = type(self.reference)("precomputed")
        if freed:
            import gc

            gc.collect()
        logger.info("reference log-probs precomputed for %d rows%s", len(self.train_dataset),
                    "; the reference model is freed" if freed else "")

    def _add_reference_columns(self, dataset, batch_size: int):
        model = self.accelerator.unwrap_model(self.model)
        return with_reference_columns(dataset, self.data_collator, lambda batch: self.reference_columns(model, batch),
                                      batch_size, self.args.device)
