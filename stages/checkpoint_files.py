"""Checkpoint folders on disk: which ones are complete, which one to resume from, which to delete.

A checkpoint is a folder ``output_dir/checkpoint-N`` (N: the optimizer step). Two writers fill them:

- The HF Trainer (stages pt, sft, rm, dpo, kto) writes model, optimizer, scheduler, every rank's
  RNG file and trainer_state.json into the folder in place, so a run killed mid-save, or a disk
  that filled up, leaves a folder that looks like a checkpoint but is not one. Once every rank has
  written, rank 0 commits it (stages/hf_checkpoints.py): ``write_manifest`` records every file's
  name and size in ``rayfactory_checkpoint.json``, written under a temporary name and renamed into
  place. That rename is the commit point; ``verify_checkpoint`` compares a folder with its
  manifest, and a folder that fails (no manifest, a file missing, a file of another size) is never
  resumed from. Sizes catch what a crash or a full disk leaves (files cut short or never written),
  not bit flips; hashing every file on every save would cost more than it is worth here.
- The RL stages (stages/rl/checkpoint.py) build the folder under a staging name and rename it
  whole; its marker file ``rl_state.json`` is what they look for.

Both use this module's listing by step, atomic JSON write and ``save_total_limit`` pruning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Iterable

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
MANIFEST_NAME = "rayfactory_checkpoint.json"  # written last, by rename: its presence commits the folder
MANIFEST_FORMAT = 1
TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME, the file the HF Trainer writes last
RL_STATE_FILE = "rl_state.json"  # the RL stages' controller state, written last (stages/rl/checkpoint.py)
_CHECKPOINT_NAME = re.compile(re.escape(CHECKPOINT_PREFIX) + r"(\d+)")
_TEMPORARY_SUFFIX = ".tmp"


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{CHECKPOINT_PREFIX}{step}")


def checkpoint_folders(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every ``checkpoint-N`` folder in ``output_dir``, complete or not, by step
    (numerically: 9 before 10). Names such as ``checkpoint-8-old`` and plain files do not count."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_NAME.fullmatch(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def write_json_atomically(path: str, value) -> None:
    """Readers see the old file or the whole new one, never a torn one."""
    temporary = path + _TEMPORARY_SUFFIX
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.flush()
        os.fsync(f.fileno())  # the data reaches the disk before the rename makes it visible
    os.replace(temporary, path)


# ----- the manifest of an HF Trainer checkpoint -----

def _files_of(folder: str) -> dict[str, int]:
    """Every file under ``folder`` (DeepSpeed writes a global_stepN/ subfolder) as relative POSIX
    path -> size in bytes, without the manifest and its temporary file."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder).replace(os.sep, "/")
            if relative not in (MANIFEST_NAME, MANIFEST_NAME + _TEMPORARY_SUFFIX):
                files[relative] = os.path.getsize(path)
    return dict(sorted(files.items()))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: str, step: int) -> dict:
    """Commit ``folder``: flush every file in it to disk, then write the manifest (file names and
    sizes) by rename. Call it once every rank has finished writing the folder. Returns the manifest."""
    files = _files_of(folder)
    for relative in files:  # so that a power cut after the commit cannot leave a committed folder short
        _fsync(os.path.join(folder, relative))
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    write_json_atomically(os.path.join(folder, MANIFEST_NAME), manifest)
    _fsync(folder)  # the rename itself
    return manifest


def uncommit(folder: str) -> bool:
    """Remove ``folder``'s manifest (before the folder is written again); True if there was one."""
    try:
        os.remove(os.path.join(folder, MANIFEST_NAME))
    except FileNotFoundError:
        return False
    return True


def has_manifest(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST_NAME))


def verify_checkpoint(folder: str) -> str | None:
    """None when ``folder`` holds every file its manifest lists, each of the listed size; otherwise
    the reason in one line, e.g. "model.safetensors is 1200 bytes, the manifest says 4960"."""
    if not os.path.isdir(folder):
        return "the folder does not exist"
    if not has_manifest(folder):
        return (f"it has no {MANIFEST_NAME}, so it was never committed (the run stopped while writing it, "
                "or it was written before checkpoints had manifests)")
    try:
        with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {MANIFEST_NAME} cannot be read ({type(exc).__name__}: {exc})"
    for relative, size in files.items():
        path = os.path.join(folder, *relative.split("/"))
        if not os.path.isfile(path):
            return f"{relative} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return f"{relative} is {actual} bytes, the manifest says {size}"
    return None


def committed_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every ``checkpoint-N`` in ``output_dir`` whose manifest verifies, by step."""
    return [(step, path) for step, path in checkpoint_folders(output_dir) if verify_checkpoint(path) is None]


def latest_committed(output_dir: str) -> str | None:
    """The newest checkpoint in ``output_dir`` whose manifest verifies, or None (a fresh start).
    Every newer folder that fails is skipped with a warning that names it and says why."""
    for _, path in reversed(checkpoint_folders(output_dir)):
        reason = verify_checkpoint(path)
        if reason is None:
            logger.info("resume_from_checkpoint auto: resuming from %s", path)
            return path
        logger.warning("resume_from_checkpoint auto: skipping %s: %s", path, reason)
    logger.info("resume_from_checkpoint auto: no committed checkpoint in %s; starting fresh", output_dir)
    return None


def checkpoint_progress(folder: str) -> tuple[int, int | None] | None:
    """(the step a checkpoint was taken at, the total steps its run planned), from the state file
    either kind of checkpoint carries (trainer_state.json: global_step, max_steps; rl_state.json:
    global_step, total_steps); None for a folder with neither."""
    for name, total_key in ((TRAINER_STATE_FILE, "max_steps"), (RL_STATE_FILE, "total_steps")):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
            total = state.get(total_key)
            return int(state.get("global_step", 0)), int(total) if total else None
    return None


# ----- save_total_limit -----

def prune_checkpoints(complete: list[tuple[int, str]], save_total_limit: int | None,
                      protected: Iterable[str | None] = ()) -> list[str]:
    """Delete complete checkpoints, oldest step first, until ``save_total_limit`` are left; return
    the deleted paths. ``complete`` is (step, path) by step and holds only complete checkpoints: a
    half-written folder is neither counted nor touched, so it never pushes out a good one.
    ``protected`` folders (the checkpoint just committed, the best model's) are never deleted and
    stay even when they alone exceed the limit. None or <= 0 keeps everything (the HF meaning)."""
    if save_total_limit is None or save_total_limit <= 0:
        return []
    keep = {os.path.abspath(path) for path in protected if path}
    kept_anyway = sum(os.path.abspath(path) in keep for _, path in complete)
    remaining, deleted = len(complete), []
    for _, path in complete:
        if remaining <= max(save_total_limit, kept_anyway):
            break
        if os.path.abspath(path) in keep:
            continue
        logger.info("Deleting %s (save_total_limit %d)", path, save_total_limit)
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
        remaining -= 1
    return deleted


__all__ = [
    "CHECKPOINT_PREFIX", "MANIFEST_NAME", "TRAINER_STATE_FILE", "checkpoint_folders", "checkpoint_path", "committed_checkpoints",
    "has_manifest", "latest_committed", "prune_checkpoints", "uncommit", "verify_checkpoint", "write_json_atomically",
    "write_manifest",
]
