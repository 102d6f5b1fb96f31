"""A rerun of a run that has already finished: it trains nothing and leaves the outputs as they are.

``resume_from_checkpoint`` (``auto``, or a checkpoint folder) on an output_dir whose run reached
its last step would otherwise resume at that step and train on: the HF Trainer takes one more
step past ``max_steps`` and writes checkpoint-N+1, the RL loop evaluates and saves again. The
check runs before anything is written (the run's log and saved config included), for every stage.

The checkpoint is the one the run would resume from (stages/training/checkpoints.py ``resolve_resume``,
the resolver of every stage, so a bad explicit folder is refused here, before anything is written).
When is the run finished: the checkpoint's step has reached ``max_steps`` when the config sets
it; without ``max_steps``, the total the run planned (recorded in the checkpoint's manifest) when
nothing that decides that total (epochs, data, batch sizes, workers) differs from the saved config.
Raising ``max_steps`` or ``num_train_epochs`` trains on from the checkpoint, as before.
"""

from __future__ import annotations

import os
from typing import Optional

import yaml

from stages.training.checkpoints import checkpoint_progress, committed_checkpoints, resolve_resume

# The keys that decide how many steps an epoch-counted run has: equal to the saved config's, the
# checkpoint's recorded total is this config's too.
PLAN_KEYS = ("num_train_epochs", "dataset", "max_samples", "val_size", "per_device_train_batch_size",
             "gradient_accumulation_steps", "ray_num_workers", "rollout_batch_size")


def finished_run(cfg) -> Optional[str]:
    """One line saying the run in output_dir has already finished, or None when there is training to do."""
    requested = cfg.training.values.get("resume_from_checkpoint")
    output_dir = cfg.training.output_dir
    if not requested or not cfg.training.values.get("do_train", True):  # prediction alone trains nothing anyway
        return None
    kind = cfg.finetuning.spec.checkpoint_kind
    if requested == "auto":  # resolve_resume's choice, without its log lines: the run logs them as it resolves
        checkpoint = resume_point(output_dir, kind)
    else:
        checkpoint = resolve_resume(requested, output_dir, kind=kind)
    progress = checkpoint_progress(checkpoint) if checkpoint else None
    if progress is None:
        return None
    step, recorded_total = progress
    max_steps = cfg.training.values.get("max_steps")
    if max_steps is not None and max_steps > 0:
        planned = max_steps
    elif recorded_total is not None and _same_plan(cfg, output_dir):
        planned = recorded_total
    else:
        return None
    if step < planned:
        return None
    return (f"{output_dir} holds a finished run: {os.path.basename(checkpoint)} is step {step} of {planned}, so "
            f"resume_from_checkpoint: {requested} leaves nothing to train; nothing was trained and the outputs are as "
            "they were. Raise max_steps or num_train_epochs to train on. To start over, choose another output_dir, or "
            "replace this run: overwrite_output_dir: true without resume_from_checkpoint (on the command line: "
            "resume_from_checkpoint=null overwrite_output_dir=true).")


def resume_point(output_dir: str, kind: str) -> Optional[str]:
    """The checkpoint ``resume_from_checkpoint: auto`` resumes from (the newest committed one of the
    stage's kind in output_dir; Ray Train's copy in Ray storage serves restarts within a run only),
    or None. Quietly: ``latest_committed`` logs what it skips."""
    committed = committed_checkpoints(output_dir, kind)
    return committed[-1][1] if committed else None


def _same_plan(cfg, output_dir: str) -> bool:
    from .config import RESOLVED_CONFIG_NAME

    path = os.path.join(output_dir, RESOLVED_CONFIG_NAME)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        saved = yaml.safe_load(f) or {}
    now = cfg.resolved()
    return all(saved.get(key) == now.get(key) for key in PLAN_KEYS)
