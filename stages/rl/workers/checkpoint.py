"""What the RL stages (grpo, ppo) put into a checkpoint: the controller's state and each trainable role's part.

Committing, listing, resolving ``resume_from_checkpoint`` and pruning are every stage's
(stages/training/checkpoints.py): the RL loop (stages/rl/controller/loop.py) has the roles write into a
``staging_folder``, writes the controller's state there as ``rl_state.json`` (``write_state``),
and ``commit_checkpoint`` names it ``checkpoint-{step}``. This module holds what is RL's own: that
state file, and what a trainable role (policy, critic) saves with ``save_role_state`` and puts back
into its model, optimizer, scheduler and random number generators with ``load_role_state``.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch

from stages.training.checkpoints import RL_STATE_FILE, ResumeError, write_json_atomically

STATE_FILE = RL_STATE_FILE  # the controller's state: the step, the planned total, the recipe's counters

TRAINABLE_FILE = "trainable.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
EXTRA_FILE = "extra.json"

def write_state(folder: str, state: dict) -> None:
    write_json_atomically(os.path.join(folder, STATE_FILE), state)


def read_state(path: str) -> dict:
    """The controller's state of the checkpoint ``path``; a committed checkpoint without one is
    another stage's (an HF Trainer checkpoint), which an RL run cannot continue."""
    try:
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ResumeError(
            f"resume_from_checkpoint {path} has no {STATE_FILE}, so it is not a checkpoint of an RL stage (grpo, "
            "ppo) but of another stage, which an RL run cannot continue. Point resume_from_checkpoint at a "
            "checkpoint-N folder of an RL run, or set resume_from_checkpoint: auto in that run's output_dir."
        ) from None


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


# ----- the same under DeepSpeed: the engine writes each rank's shards -----

ZERO_TAG = "zero"  # DeepSpeed's checkpoint folder inside a role's part (its files: DeepSpeed's own layout)


def save_zero_state(folder: str, rank: int, engine) -> None:
    """A DeepSpeed role's part of a checkpoint: ``engine.save_checkpoint`` into ``folder/zero``
    (a collective: every rank writes its optimizer shard, rank 0 the module's state; under ZeRO-3
    the weights are in the shards as fp32 partitions), the schedule with it, and every rank's
    random number generators as on the DDP path. Frozen parameters are left out as there (a LoRA
    base comes back from the base model on resume)."""
    os.makedirs(folder, exist_ok=True)
    engine.save_checkpoint(folder, tag=ZERO_TAG, save_latest=False, exclude_frozen_parameters=True)
    torch.save(_rng_state(), os.path.join(folder, f"rng_state_{rank}.pt"))


def load_zero_state(folder: str, rank: int, engine) -> None:
    """Put what ``save_zero_state`` wrote back: weights, optimizer shards and schedule through
    ``engine.load_checkpoint`` (a collective; DeepSpeed needs the same number of ranks and ZeRO
    stage as the run that saved), then this rank's random number generators."""
    path, _ = engine.load_checkpoint(folder, tag=ZERO_TAG, load_module_strict=False, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise ResumeError(
            f"DeepSpeed could not load the checkpoint part {folder}/{ZERO_TAG}. Resume with the deepspeed config "
            "and ray_num_workers the checkpoint was written with, or start fresh without resume_from_checkpoint."
        )
    rng_file = os.path.join(folder, f"rng_state_{rank}.pt")
    if os.path.exists(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=True))


def check_zero_layout(folder: str, zero: bool) -> None:
    """A role's checkpoint part written with DeepSpeed cannot be read without it, nor the reverse."""
    has_zero = os.path.isdir(os.path.join(folder, ZERO_TAG))
    has_plain = os.path.exists(os.path.join(folder, TRAINABLE_FILE))
    if zero and not has_zero and has_plain:
        written, now = "without deepspeed", "with"
    elif not zero and has_zero and not has_plain:
        written, now = "by a DeepSpeed (deepspeed key) run", "without"
    else:
        return
    raise ResumeError(
        f"The checkpoint part {folder} was written {written}, and this run trains {now} DeepSpeed: the two keep "
        "weights and optimizer state in different layouts. Resume with the deepspeed setting the checkpoint was "
        "trained with, or start fresh without resume_from_checkpoint."
    )


__all__ = [
    "STATE_FILE", "ZERO_TAG", "check_zero_layout", "load_role_state", "load_zero_state", "read_state",
    "save_role_state", "save_zero_state", "write_state",
]
