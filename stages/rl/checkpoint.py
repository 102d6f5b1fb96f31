"""Checkpoints of the RL stages (grpo, ppo): folders on disk, and what each trainable role puts in them.

The RL stages train in their own loop, not in an HF Trainer, so they keep their own checkpoints.
One checkpoint is ``output_dir/checkpoint-{step}``, filled in two steps so that a run killed at any
moment never leaves something that looks complete:

1. ``begin_checkpoint`` makes a staging folder ``.checkpoint-{step}.partial``; every trainable role
   (policy, critic) writes its part into a subfolder with ``save_role_state``.
2. ``commit_checkpoint`` writes the controller's state as ``rl_state.json`` (last, so its presence
   marks a complete checkpoint) and renames the staging folder to ``checkpoint-{step}`` in one
   ``rename``, then prunes old checkpoints.

``resolve_resume`` turns ``resume_from_checkpoint`` (a folder, or ``auto``) into the folder to
resume from, and ``load_role_state`` puts a role's part back into its model, optimizer, scheduler
and random number generators. The listing of checkpoint folders by step, the atomic JSON write
and the ``save_total_limit`` pruning are shared with the HF Trainer stages (stages/checkpoint_files.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil

import numpy as np
import torch

from registries.errors import UserError

from ..callbacks import LOG_FILE
from ..checkpoint_files import (
    CHECKPOINT_PREFIX,
    RL_STATE_FILE,
    checkpoint_folders,
    checkpoint_path,
    prune_checkpoints,
    write_json_atomically,
)

logger = logging.getLogger(__name__)

STATE_FILE = RL_STATE_FILE  # the controller's state; written last: its presence marks a complete checkpoint

TRAINABLE_FILE = "trainable.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
EXTRA_FILE = "extra.json"


class ResumeError(UserError):
    """A checkpoint that cannot be resumed from: not an RL checkpoint, half-written, or from another setup."""


def _staging_path(output_dir: str, step: int) -> str:
    # Hidden and without the bare prefix, so that nothing looking for checkpoint-N ever takes it.
    return os.path.join(output_dir, f".{CHECKPOINT_PREFIX}{step}.partial")


def begin_checkpoint(output_dir: str, step: int) -> str:
    """A fresh, empty staging folder for step ``step``'s checkpoint; the role actors write their parts
    into it. A staging folder left over from a run that died while saving this step is removed first."""
    staging = _staging_path(output_dir, step)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    return staging


def commit_checkpoint(staging: str, state: dict, save_total_limit: int | None = None) -> str:
    """Seal ``staging`` as ``checkpoint-{state['global_step']}`` next to it and return that folder.

    ``state`` is written as ``rl_state.json`` first, then the folder is renamed in one step. A
    ``checkpoint-{step}`` already there (an earlier attempt at this step, e.g. a run resumed from
    an earlier checkpoint) is replaced. Then complete checkpoints beyond ``save_total_limit``
    (None or <= 0: keep all) are deleted, oldest step first; the one just committed always stays,
    even if checkpoints with larger steps exist (they belong to a run this one has replaced).
    """
    write_json_atomically(os.path.join(staging, STATE_FILE), state)
    output_dir = os.path.dirname(os.path.abspath(staging))
    final = checkpoint_path(output_dir, int(state["global_step"]))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(staging, final)
    prune_checkpoints(_complete_checkpoints(output_dir), save_total_limit, protected=[final])
    return final


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, STATE_FILE))


def _complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint-N in ``output_dir``, by step; complete means it
    holds ``rl_state.json``, which commit_checkpoint writes before the folder gets its name."""
    return [(step, path) for step, path in checkpoint_folders(output_dir) if is_complete(path)]


def latest_checkpoint(output_dir: str) -> str | None:
    """The complete checkpoint-N with the largest N, or None. Staging folders and checkpoint-N
    folders without ``rl_state.json`` (half-written, or an HF Trainer stage's) do not count. (The HF
    Trainer stages find theirs with stages/checkpoint_files.py ``latest_committed``.)"""
    found = _complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def read_state(path: str) -> dict:
    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
        return json.load(f)


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """The checkpoint folder to resume from, or None for a fresh start.

    ``value`` is ``resume_from_checkpoint``: None or "" (fresh start), "auto" (the latest complete
    checkpoint in ``output_dir``, if any), or a folder, which must be a complete RL checkpoint.
    """
    if not value:
        return None
    if value == "auto":
        latest = latest_checkpoint(output_dir)
        if latest is None:
            logger.info("resume_from_checkpoint auto: no complete checkpoint in %s yet; starting fresh", output_dir)
        else:
            logger.info("resume_from_checkpoint auto: resuming from %s", latest)
        return latest
    if is_complete(value):
        return value
    found = "does not exist" if not os.path.isdir(value) else f"has no {STATE_FILE}"
    raise ResumeError(
        f"resume_from_checkpoint {value} {found}. An RL checkpoint (stages grpo and ppo) is a "
        f"{CHECKPOINT_PREFIX}N folder whose {STATE_FILE} is written last, so this folder is either not "
        "an RL checkpoint (e.g. one of another stage) or was only half-written when the run stopped. "
        f"Point resume_from_checkpoint at another {CHECKPOINT_PREFIX}N folder that has {STATE_FILE}, "
        "or set resume_from_checkpoint: auto to resume from the latest complete checkpoint in output_dir."
    )


def truncate_log(output_dir: str, step: int) -> int:
    """Keep only the records of ``trainer_log.jsonl`` up to ``step`` (a resumed run writes the later
    steps again) and return how many were dropped. A line that is not JSON, torn by the crash that
    ended the run, is dropped too. The file is rewritten atomically; no file: 0."""
    path = os.path.join(output_dir, LOG_FILE)
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if record.get("current_steps", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(temporary, path)
    return dropped


# ----- worker side: one trainable role (policy or critic) of one data-parallel rank -----

def _trainable_parameters(model) -> dict[str, torch.nn.Parameter]:
    # named_parameters covers full, frozen-part and LoRA/PEFT models and wrappers (a value-head
    # model around a causal LM) alike, and names a tied parameter once.
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _rng_state() -> dict:
    # numpy's state goes in as a tensor, so that the file loads with weights_only=True.
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {**numpy_state, "state": {"key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                                          "pos": int(numpy_state["state"]["pos"])}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state({**numpy_state, "state": {"key": numpy_state["state"]["key"].numpy().astype(np.uint32),
                                                  "pos": numpy_state["state"]["pos"]}})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for device, device_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)


def save_role_state(folder: str, rank: int, model, optimizer, scheduler, extra: dict | None = None) -> None:
    """Write one role's part of a checkpoint into ``folder``.

    Rank 0 writes the trainable parameters only (``trainable.pt``, {name: tensor}; the frozen
    ones come back from the base model on resume), ``optimizer.pt``, ``scheduler.pt`` and
    ``extra`` as ``extra.json``; the data-parallel ranks hold the same copies. Every rank writes
    its own random number generators as ``rng_state_{rank}.pt``. Parameters partitioned by
    DeepSpeed ZeRO-3 must be gathered by the caller.
    """
    os.makedirs(folder, exist_ok=True)  # every rank calls this at once
    if rank == 0:
        trainable = {name: p.detach().to("cpu", copy=True) for name, p in _trainable_parameters(model).items()}
        torch.save(trainable, os.path.join(folder, TRAINABLE_FILE))
        torch.save(optimizer.state_dict(), os.path.join(folder, OPTIMIZER_FILE))
        torch.save(scheduler.state_dict(), os.path.join(folder, SCHEDULER_FILE))
        with open(os.path.join(folder, EXTRA_FILE), "w", encoding="utf-8") as f:
            json.dump(extra or {}, f, indent=2)
    torch.save(_rng_state(), os.path.join(folder, f"rng_state_{rank}.pt"))


def _check_names(folder: str, saved: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter]) -> None:
    missing = sorted(set(params) - set(saved))
    unexpected = sorted(set(saved) - set(params))
    wrong_shape = sorted(n for n in set(saved) & set(params) if saved[n].shape != params[n].shape)
    if not (missing or unexpected or wrong_shape):
        return

    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    problems = []
    if missing:
        problems.append(f"{len(missing)} trainable parameter(s) of the model are not in it ({few(missing)})")
    if unexpected:
        problems.append(f"it has {len(unexpected)} the model does not train ({few(unexpected)})")
    if wrong_shape:
        shapes = [f"{n} {tuple(saved[n].shape)} vs {tuple(params[n].shape)}" for n in wrong_shape]
        problems.append(f"{len(wrong_shape)} have another shape ({few(shapes)})")
    raise ResumeError(
        f"The checkpoint part {folder} does not fit the model being trained: {'; '.join(problems)}. "
        "The checkpoint came from a different model or finetuning setup (model_name_or_path, "
        "finetuning_type, lora_rank, lora_target, freeze options...). Resume with the settings the "
        "checkpoint was trained with, or start fresh without resume_from_checkpoint."
    )


def load_role_state(folder: str, rank: int, model, optimizer, scheduler) -> dict:
    """Put what ``save_role_state`` wrote back into ``model`` (in place, on each parameter's device),
    ``optimizer``, ``scheduler`` and this rank's random number generators; returns ``extra``."""
    saved = torch.load(os.path.join(folder, TRAINABLE_FILE), map_location="cpu", weights_only=True)
    params = _trainable_parameters(model)
    _check_names(folder, saved, params)
    with torch.no_grad():
        for name, param in params.items():
            param.data.copy_(saved[name].to(param.device))
    # The optimizer moves its state onto its parameters' devices itself.
    optimizer.load_state_dict(torch.load(os.path.join(folder, OPTIMIZER_FILE), map_location="cpu", weights_only=True))
    scheduler.load_state_dict(torch.load(os.path.join(folder, SCHEDULER_FILE), weights_only=True))
    rng_file = os.path.join(folder, f"rng_state_{rank}.pt")
    if os.path.exists(rng_file):  # absent when resuming with more ranks than saved
        _set_rng_state(torch.load(rng_file, weights_only=True))
    extra_file = os.path.join(folder, EXTRA_FILE)
    if not os.path.exists(extra_file):
        return {}
    with open(extra_file, encoding="utf-8") as f:
        return json.load(f)


__all__ = [
    "CHECKPOINT_PREFIX", "STATE_FILE", "ResumeError", "begin_checkpoint", "checkpoint_path", "commit_checkpoint",
    "is_complete", "latest_checkpoint", "load_role_state", "read_state", "resolve_resume", "save_role_state",
    "truncate_log",
]
