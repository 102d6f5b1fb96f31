"""Checkpoints on disk, for every stage: how one is committed, what its manifest says, which one a
run resumes from, which ones ``save_total_limit`` deletes.

A checkpoint is a folder ``output_dir/checkpoint-N`` (N: the optimizer step) with a manifest,
``rayfactory_checkpoint.json``: every file's name and size, the step, and the steps the run
planned. The manifest is written last, under a temporary name and renamed into place, after every
file in the folder has reached the disk. A ``checkpoint-N`` whose manifest verifies (every listed
file there, of the listed size) is *committed*; only committed checkpoints are resumed from,
counted by ``save_total_limit`` or deleted by it. Sizes catch what a crash or a full disk leaves
(files cut short or never written), not bit flips; hashing every file on every save would cost
more than it is worth here.

Two writers, one ``commit_checkpoint``:

- The HF Trainer (stages pt, sft, rm, dpo, kto, on Ray Train workers) writes ``checkpoint-N`` in
  place; once every rank has written, rank 0 commits it there (stages/training/hf_checkpoints.py).
- The RL loops (stages grpo, ppo, in the driver: stages/rl/controller/loop.py) have the roles write into a
  hidden ``staging_folder``; committing it writes the manifest there and renames the folder to
  ``checkpoint-N``, so no half-written ``checkpoint-N`` ever appears.

``resolve_resume`` turns ``resume_from_checkpoint`` into the folder to resume from (``auto``: the
newest committed one) for both; ``uncommit_after`` takes the checkpoints of a replaced run out of
``auto``'s reach when a run starts; ``checkpoint_progress`` reads a checkpoint's step and planned
total (cluster/finished_run.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Iterable

from registries.errors import UserError

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
MANIFEST_NAME = "rayfactory_checkpoint.json"  # written last, by rename: its presence commits the folder
MANIFEST_FORMAT = 2  # 2 added total_steps; a format-1 manifest (no total) still verifies
TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME, the file the HF Trainer writes last
RL_STATE_FILE = "rl_state.json"  # the RL loops' controller state (stages/rl/workers/checkpoint.py)
# Each kind of checkpoint's state file and the key of the run's planned total in it: what a checkpoint
# without a manifest, or with a format-1 one, is recognised and read by.
STATE_FILES = {TRAINER_STATE_FILE: "max_steps", RL_STATE_FILE: "total_steps"}
# The kinds of checkpoint, by the state file that says which loop wrote one: a run resumes only
# from its own kind (an sft run's output_dir may hold an RL run's checkpoints, and the other way).
KIND_FILES = {"trainer": TRAINER_STATE_FILE, "rl": RL_STATE_FILE}
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


# ----- commit: the manifest -----

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


def write_manifest(folder: str, step: int, total_steps: int | None = None) -> dict:
    """Flush every file in ``folder`` to disk, then write the manifest (file names and sizes, the
    step, the run's planned ``total_steps``) by rename. Returns the manifest."""
    files = _files_of(folder)
    for relative in files:  # so that a power cut after the commit cannot leave a committed folder short
        _fsync(os.path.join(folder, relative))
    manifest = {"format": MANIFEST_FORMAT, "step": step, "total_steps": total_steps, "files": files}
    write_json_atomically(os.path.join(folder, MANIFEST_NAME), manifest)
    _fsync(folder)  # the rename itself
    return manifest


def staging_folder(output_dir: str, step: int) -> str:
    """A fresh, empty folder to write step ``step``'s checkpoint into before ``commit_checkpoint``
    names it. Hidden and not matching ``checkpoint-N``, so nothing that lists checkpoints sees it; a
    leftover of a run that died while saving this step is removed first."""
    staging = os.path.join(output_dir, f".{CHECKPOINT_PREFIX}{step}.partial")
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    return staging


def checkpoint_kind(folder: str) -> str | None:
    """"trainer" or "rl": which loop wrote the checkpoint (its state file); None for neither."""
    return next((kind for kind, name in KIND_FILES.items() if os.path.isfile(os.path.join(folder, name))), None)


def commit_checkpoint(folder: str, step: int, total_steps: int | None = None, save_total_limit: int | None = None,
                      keep: Iterable[str | None] = ()) -> str:
    """Commit the checkpoint of step ``step`` written in ``folder`` and return its ``checkpoint-N`` path.

    ``folder`` is that path itself (written in place: the manifest's rename commits it) or a
    ``staging_folder`` (the manifest is written there, then the folder is renamed to
    ``checkpoint-N``, replacing an earlier attempt at the step, e.g. of a run this one replaced).
    Then committed checkpoints beyond ``save_total_limit`` are deleted, oldest first, never the
    one just committed nor those in ``keep`` (the best model's). Call it once every writer is done.
    """
    output_dir = os.path.dirname(os.path.abspath(folder))
    final = checkpoint_path(output_dir, step)
    write_manifest(folder, step, total_steps)
    if os.path.abspath(folder) != final:
        if os.path.exists(final):
            uncommit(final)  # so that a crash inside rmtree leaves nothing that looks committed
            shutil.rmtree(final)
        os.replace(folder, final)
        _fsync(output_dir)
    prune_checkpoints(committed_checkpoints(output_dir, checkpoint_kind(final)), save_total_limit, protected=(final, *keep))
    return final


def uncommit(folder: str) -> bool:
    """Remove ``folder``'s manifest (before the folder is written again); True if there was one."""
    try:
        os.remove(os.path.join(folder, MANIFEST_NAME))
    except FileNotFoundError:
        return False
    return True


def has_manifest(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST_NAME))


def _load_manifest(folder: str) -> dict:
    with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
        return json.load(f)


def verify_checkpoint(folder: str) -> str | None:
    """None when ``folder`` holds every file its manifest lists, each of the listed size; otherwise
    the reason in one line, e.g. "model.safetensors is 1200 bytes, the manifest says 4960"."""
    if not os.path.isdir(folder):
        return "the folder does not exist"
    if not has_manifest(folder):
        return (f"it has no {MANIFEST_NAME}, so it was never committed (the run stopped while writing it, "
                "or it was written before checkpoints had manifests)")
    try:
        files = _load_manifest(folder)["files"]
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


def uncommit_after(output_dir: str, step: int, kind: str | None = None) -> list[str]:
    """Uncommit every ``checkpoint-N`` in ``output_dir`` with N beyond ``step``, where a run starts
    (0: fresh); return them. They belong to a run this one replaces (it resumed from an earlier
    checkpoint, or started over in the same output_dir): ``auto`` must not resume the old run from
    them after this one dies, and an old manifest must not vouch for a folder of the same step that
    this run writes in place. Only checkpoints of ``kind`` (None: any) count. The files stay, for
    whoever wants to look at them."""
    replaced = [path for n, path in checkpoint_folders(output_dir)
                if n > step and (kind is None or checkpoint_kind(path) == kind) and uncommit(path)]
    if replaced:
        logger.warning(
            "%d checkpoint(s) in %s lie beyond step %d, where this run starts, so they belong to the run it replaces: "
            "uncommitted (auto no longer resumes from them; a save of the same step overwrites them): %s",
            len(replaced), output_dir, step, ", ".join(os.path.basename(path) for path in replaced))
    return replaced


def committed_checkpoints(output_dir: str, kind: str | None = None) -> list[tuple[int, str]]:
    """(step, path) of every ``checkpoint-N`` in ``output_dir`` whose manifest verifies, by step;
    only those of ``kind`` unless it is None."""
    return [(step, path) for step, path in checkpoint_folders(output_dir)
            if verify_checkpoint(path) is None and (kind is None or checkpoint_kind(path) == kind)]


def latest_committed(output_dir: str, kind: str | None = None) -> str | None:
    """The newest checkpoint of ``kind`` (None: any) in ``output_dir`` whose manifest verifies, or
    None (a fresh start). Every newer folder that fails is skipped with a warning that names it and
    says why; another kind's checkpoints are not this run's and are passed over."""
    for _, path in reversed(checkpoint_folders(output_dir)):
        found = checkpoint_kind(path)
        if kind is not None and found is not None and found != kind:
            logger.info("resume_from_checkpoint auto: passing over %s, a checkpoint of another kind of stage", path)
            continue
        reason = verify_checkpoint(path)
        if reason is None:
            logger.info("resume_from_checkpoint auto: resuming from %s", path)
            return path
        logger.warning("resume_from_checkpoint auto: skipping %s: %s", path, reason)
    logger.info("resume_from_checkpoint auto: no committed checkpoint in %s; starting fresh", output_dir)
    return None


# ----- resume -----

class ResumeError(UserError):
    """A checkpoint that cannot be resumed from: missing, half-written, or from another setup."""


_warned_unverifiable: set[str] = set()  # each such folder's warning once per process, not once per check


def check_resumable(path: str, place: str | None = None, kind: str | None = None) -> None:
    """Raise ResumeError, a paragraph naming ``path`` (and ``place``, where the config set it),
    unless ``path`` is a committed checkpoint. One written before checkpoints had manifests (or by
    another tool) but with its stage's state file is taken as it is, with a warning, since it
    cannot be checked; ``auto`` never picks such a folder. With ``kind``, a checkpoint another kind
    of stage wrote is refused too."""
    named = f"resume_from_checkpoint {path}" + (f" in {place}" if place else "")
    found = checkpoint_kind(path) if os.path.isdir(path) else None
    if kind is not None and found is not None and found != kind:
        writers = {"trainer": "a Ray Train stage (pt, sft, rm, dpo, kto: trainer_state.json)",
                   "rl": "an RL stage (grpo, ppo: rl_state.json)"}
        raise ResumeError(
            f"{named} is a checkpoint of {writers[found]}, but this run is {writers[kind].split(' (')[0]}, which "
            "cannot resume from it. Point resume_from_checkpoint at a checkpoint of this stage, or give this run "
            "an output_dir of its own.")
    reason = verify_checkpoint(path)
    if reason is None:
        return
    also = "or set resume_from_checkpoint: auto to resume from the newest committed checkpoint in output_dir."
    if not os.path.isdir(path):
        raise ResumeError(f"{named} does not exist. Point resume_from_checkpoint at a {CHECKPOINT_PREFIX}N folder, "
                          + also)
    if not has_manifest(path):
        if any(os.path.isfile(os.path.join(path, name)) for name in STATE_FILES):
            if path not in _warned_unverifiable:
                _warned_unverifiable.add(path)
                logger.warning(
                    "resume_from_checkpoint %s has no %s (it was written before checkpoints had manifests, or by "
                    "another tool), so whether every file in it is complete cannot be checked; resuming from it as "
                    "it is.", path, MANIFEST_NAME)
            return
        raise ResumeError(
            f"{named} is not a complete checkpoint: it has neither {MANIFEST_NAME} nor a state file "
            f"({' or '.join(STATE_FILES)}), so either it is not a {CHECKPOINT_PREFIX}N folder of a training run or "
            f"that run stopped while writing it. Point resume_from_checkpoint at a {CHECKPOINT_PREFIX}N folder that "
            f"has {MANIFEST_NAME}, {also}")
    raise ResumeError(
        f"{named} is a half-written checkpoint: {reason}. A file was cut short or lost after the checkpoint was "
        "committed (a full disk, a copy or a crash), so resuming from it would load broken state. Point "
        f"resume_from_checkpoint at an earlier {CHECKPOINT_PREFIX}N folder, {also}")


def resolve_resume(requested: str | None, output_dir: str, kind: str | None = None) -> str | None:
    """The checkpoint folder a run resumes from, or None for a fresh start; the one resolver of
    every stage. ``requested`` is ``resume_from_checkpoint``: None or "" (fresh), ``auto`` (the
    newest committed checkpoint in ``output_dir``, if any), or a folder, which must pass
    ``check_resumable``. ``kind``: the run's own kind of checkpoint ("trainer" or "rl")."""
    if not requested:
        return None
    if requested == "auto":
        return latest_committed(output_dir, kind)
    check_resumable(requested, kind=kind)
    return requested


def checkpoint_progress(folder: str) -> tuple[int, int | None] | None:
    """(the step a checkpoint was taken at, the total steps its run planned) from its manifest, or
    from its state file where the manifest has no total (written before format 2, or none at all);
    None for a folder with neither."""
    try:
        manifest = _load_manifest(folder)
        return int(manifest["step"]), int(manifest["total_steps"])
    except (OSError, ValueError, KeyError, TypeError):  # none, format 1 (no total), or unreadable
        pass
    for name, total_key in STATE_FILES.items():
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
    "CHECKPOINT_PREFIX", "MANIFEST_NAME", "RL_STATE_FILE", "ResumeError", "TRAINER_STATE_FILE", "check_resumable",
    "checkpoint_folders", "checkpoint_path", "checkpoint_progress", "commit_checkpoint", "committed_checkpoints",
    "has_manifest", "latest_committed", "prune_checkpoints", "resolve_resume", "staging_folder", "uncommit",
    "uncommit_after", "verify_checkpoint", "write_json_atomically", "write_manifest",
]
