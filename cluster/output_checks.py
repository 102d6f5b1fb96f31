"""Preflight of the folders a run writes to, before Ray starts.

A read-only, forbidden or full output_dir would otherwise show up only at the first checkpoint,
minutes or hours into training, as a traceback from a Ray Train worker (or, worse, as a checkpoint
cut short by a full disk). So the driver checks up front:

1. ``output_dir`` (and a local ``ray_storage_path``, where Ray Train copies every checkpoint) can
   be created and written: a probe file is written, fsynced and deleted. The OS error, if any
   (read-only filesystem, permission denied, no space left, quota exceeded), becomes a
   ``ConfigError`` that names the folder, the reason and the fix.
2. Each of them has room for at least one checkpoint (both together when they share a
   filesystem), by ``estimate_checkpoint``.

The estimate is deliberately simple and on the low side, so that it never refuses a run that
would fit: the saved weights (the whole model for full and freeze, the adapter alone for lora,
the trainable part for the RL stages) at the dtype they train in, plus two optimizer states per
trainable parameter for Adam-style optimizers (AdamW's exp_avg and exp_avg_sq, in the parameters'
dtype). Left out: scheduler, RNG and trainer state files (kilobytes), DeepSpeed's fp32 master
weights, the critic of ppo, and the final save of the model next to the checkpoints.

The driver is where these folders are checked; on a multi-node cluster output_dir should be
shared storage that every node mounts at the same path (docs/cluster.md), so the same answer holds there.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
from dataclasses import dataclass

from .config_types import ConfigError

_PROBE_BYTES = 4096
# Bytes per parameter of each load dtype (ModelArguments.load_dtype names).
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ADAPTER_BYTES = 4  # peft keeps LoRA weights in float32 (autocast_adapter_dtype) whatever the base's dtype

_NOT_PERMITTED = ("This user may not write there: point {key} at a folder you can write to, or grant write "
                  "permission on it.")
_FIXES = {
    errno.EROFS: "Its filesystem is mounted read-only: point {key} at a folder on a writable filesystem, or "
                 "remount that one read-write.",
    errno.EACCES: _NOT_PERMITTED,
    errno.EPERM: _NOT_PERMITTED,
    errno.ENOSPC: "Its filesystem is full: free space there, or point {key} at a filesystem with room for the "
                  "run's checkpoints.",
    errno.EDQUOT: "Your disk quota there is used up: free space within the quota, or point {key} at another "
                  "filesystem.",
}
_OTHER_FIX = "Point {key} at a folder this user can create and write files in."


@dataclass(frozen=True)
class CheckpointEstimate:
    """What one checkpoint of a run holds, at the least (see the module's docstring)."""

    saved_params: int  # parameters whose weights the checkpoint holds
    weight_bytes: int  # bytes per saved parameter
    trainable_params: int
    optimizer_states: int  # per trainable parameter: 2 for Adam-style optimizers, 0 when none is saved
    state_bytes: int  # bytes per optimizer state value (the trainable parameters' dtype)

    @property
    def weights(self) -> int:
        return self.saved_params * self.weight_bytes

    @property
    def optimizer(self) -> int:
        return self.optimizer_states * self.trainable_params * self.state_bytes

    @property
    def total(self) -> int:
        return self.weights + self.optimizer

    def describe(self) -> str:
        text = (f"{human_bytes(self.weights)} of weights ({self.saved_params:,} parameters x {self.weight_bytes} "
                "bytes)")
        if self.optimizer:
            text += (f" + {human_bytes(self.optimizer)} of optimizer state ({self.optimizer_states} x "
                     f"{self.trainable_params:,} trainable parameters x {self.state_bytes} bytes)")
        return text


def human_bytes(count: int) -> str:
    """``2.35 MiB (2467584 bytes)``: readable, with the exact number for comparison."""
    value, unit = float(count), "bytes"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{count} bytes" if unit == "bytes" else f"{value:.2f} {unit} ({count} bytes)"


def estimate_checkpoint(cfg) -> CheckpointEstimate:
    """One checkpoint of ``cfg``'s run, counted on a meta-device skeleton of the model with the run's
    finetuning applied (no weights are loaded). A LoRA adapter to continue (adapter_name_or_path)
    is counted as a fresh one of the config's lora_rank."""
    import torch

    from stages.training.adapters import apply_finetuning, count_parameters
    from stages.loading import model_skeleton

    model_args, tuning, training = cfg.model, cfg.finetuning, cfg.training
    fresh = dataclasses.replace(model_args, adapter_name_or_path=None)
    with torch.device("meta"):  # LoRA layers made here are meta tensors too
        model = apply_finetuning(model_skeleton(model_args), tuning, fresh)
    trainable, total = count_parameters(model)
    dtype_bytes = _DTYPE_BYTES[model_args.load_dtype(bool(training.bf16), bool(training.fp16))]
    is_lora = tuning.finetuning_type == "lora"
    trainable_bytes = _ADAPTER_BYTES if is_lora else dtype_bytes
    # The Trainer saves the whole model unless it is an adapter; the RL stages save trainable parameters only.
    saves_trainable_only = is_lora or tuning.spec.launch == "rl_controller"
    optimizer = str(getattr(training.optim, "value", training.optim)).lower()  # an OptimizerNames or its name
    adam_style = "adam" in optimizer and not training.save_only_model
    return CheckpointEstimate(
        saved_params=trainable if saves_trainable_only else total,
        weight_bytes=trainable_bytes if saves_trainable_only else dtype_bytes,
        trainable_params=trainable,
        optimizer_states=2 if adam_style else 0,
        state_bytes=trainable_bytes,
    )


def check_writable(path: str, key: str) -> None:
    """Create ``path`` if needed, then write, fsync and delete a probe file in it; a ConfigError
    naming ``key``, the folder, the OS's reason and the fix if any step fails."""
    probe = os.path.join(path, f".rayfactory-write-probe-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * _PROBE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        finally:
            if os.path.lexists(probe):
                os.remove(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
        where = f", at {exc.filename}" if exc.filename and exc.filename != path else ""
        fix = _FIXES.get(exc.errno, _OTHER_FIX).format(key=key)
        raise ConfigError(
            f"{key} {path} cannot be written: {reason} ({code}{where}). {fix} Nothing was trained: this was "
            "checked before Ray started."
        ) from None


def check_free_space(folders: list[tuple[str, str]], checkpoint: CheckpointEstimate) -> None:
    """Every filesystem among ``folders`` ((key, path), existing folders) has room for one checkpoint
    per folder on it: Ray storage gets a copy of every checkpoint output_dir gets."""
    by_filesystem: dict[int, list[tuple[str, str]]] = {}
    for key, path in folders:
        by_filesystem.setdefault(os.stat(path).st_dev, []).append((key, path))
    for sharing in by_filesystem.values():
        free = shutil.disk_usage(sharing[0][1]).free
        needed = checkpoint.total * len(sharing)
        if free >= needed:
            continue
        names = " and ".join(f"{key} {path}" for key, path in sharing)
        copies = f"{len(sharing)} x " if len(sharing) > 1 else ""
        each = " (each gets a copy of every checkpoint)" if len(sharing) > 1 else ""
        raise ConfigError(
            f"{names} {'share a filesystem' if len(sharing) > 1 else 'is on a filesystem'} with "
            f"{human_bytes(free)} free, but one checkpoint of this run needs at least {copies}"
            f"{human_bytes(checkpoint.total)}{each}: {checkpoint.describe()}. Free space there, point "
            f"{sharing[0][0]} at a filesystem with more room, or make checkpoints smaller (finetuning_type: lora "
            "saves only the adapter; save_only_model: true leaves out the optimizer state). Nothing was trained: "
            "this was checked before Ray started."
        )


def local_storage_path(ray_storage_path: str | None) -> str | None:
    """The local folder behind ``ray_storage_path``, or None for remote storage (s3://, gs://...)."""
    if not ray_storage_path:
        return None
    if ray_storage_path.startswith("file://"):
        return ray_storage_path[len("file://"):]
    return None if "://" in ray_storage_path else ray_storage_path


def check_output_dirs(cfg, train: bool = True) -> None:
    """The preflight of ``cfg``'s output folders (see the module's docstring); creates output_dir.
    Prediction alone (``train`` false) writes no checkpoints: only output_dir's writability counts."""
    folders = [("output_dir", cfg.training.output_dir)]
    storage = local_storage_path(cfg.ray.ray_storage_path)
    if train and storage and cfg.finetuning.spec.launch != "rl_controller":  # RL stages keep no Ray checkpoints
        folders.append(("ray_storage_path", storage))
    for key, path in folders:
        check_writable(path, key)
    if train and cfg.training.save_strategy != "no":
        check_free_space(folders, estimate_checkpoint(cfg))


__all__ = ["CheckpointEstimate", "check_free_space", "check_output_dirs", "check_writable", "estimate_checkpoint",
           "human_bytes", "local_storage_path"]
