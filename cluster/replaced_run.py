"""A run that would start from step 0 in an output_dir that already holds a run: refused, unless
the config resumes that run or says to replace it.

Rerunning a command without ``resume_from_checkpoint`` used to train from step 0 into the same
output_dir and overwrite the run there (its model, log and checkpoints), with only a line in
rayfactory.log. LLaMA-Factory refuses any non-empty output_dir unless ``overwrite_output_dir``; the
check here looks for what a run leaves, so that a failed start (rayfactory.log and the saved config
alone) or files of the user's own are no obstacle. output_dir holds a run when it has

- a ``checkpoint-N`` folder (any stage's, committed or not),
- a saved model or adapter (``WEIGHT_FILES``: every stage's final save), or
- a ``trainer_log.jsonl`` with records (the run got as far as its first logged step).

What a training run does with such an output_dir (checked before Ray starts and before anything is
written; the CLI checks before it opens the run's log):

- it resumes: ``resume_from_checkpoint`` names a folder, ``auto`` finds a committed checkpoint of
  this stage, or a reused ``ray_run_name`` names a run in Ray storage. It continues that run as
  before (a finished one trains nothing: cluster/finished_run.py). ``overwrite_output_dir`` is moot
  then, as in transformers, where an explicit resume wins: the web UI's Resume button adds ``auto``
  to a config that may carry it.
- ``overwrite_output_dir: true`` and nothing to resume: it starts from step 0 and replaces the old
  run. Before Ray starts, the old run's checkpoints (every stage's, and staging leftovers), its
  trainer_log.jsonl and Ray's copies in the default ray_storage_path (output_dir/ray_results) are
  deleted, so that ``auto`` can never resume the replaced run, not even after this one dies before
  its first save; its model and other outputs are overwritten as this run saves its own. A warning
  says so on the console and in the run's log. (LLaMA-Factory and transformers leave the old
  checkpoints, and their own resume could pick one of the replaced run.)
- otherwise it is refused, in one paragraph that offers both keys. ``auto`` with nothing of this
  stage to resume starts from step 0 over the log of a run that stopped before its first checkpoint,
  and is refused where it would overwrite a saved model or another stage's checkpoints.
"""

from __future__ import annotations

import logging
import os
import shutil

from fabric.ray_args import default_storage
from stages.training.checkpoints import CHECKPOINT_PREFIX, checkpoint_folders, committed_checkpoints

from .config_types import ConfigError
from .output_checks import local_storage_path

logger = logging.getLogger(__name__)

LOG_FILE = "trainer_log.jsonl"  # stages/training/callbacks.py LOG_FILE (not imported: that imports transformers)
# What a stage's final save writes (the HF Trainer's and PEFT's names; the RL loops save the same way).
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")


def run_in(output_dir: str) -> list[str]:
    """The names in ``output_dir`` that show a run trained there (checkpoints, saved weights, the
    training log); empty when it holds none, or does not exist."""
    if not os.path.isdir(output_dir):
        return []
    found = [os.path.basename(path) for _, path in checkpoint_folders(output_dir)]
    found += [name for name in WEIGHT_FILES if os.path.isfile(os.path.join(output_dir, name))]
    log = os.path.join(output_dir, LOG_FILE)
    if os.path.isfile(log) and os.path.getsize(log) > 0:
        found.append(LOG_FILE)
    return found


def replaced_run(cfg) -> list[str]:
    """What of the run in output_dir this run replaces (``run_in``'s names): empty when output_dir
    holds no run, when this run resumes it or trains nothing. Raises ConfigError, one paragraph,
    where replacing it is not what the config says (see the module's docstring)."""
    values, output_dir = cfg.training.values, cfg.training.output_dir
    if not values.get("do_train", True):  # prediction alone writes its own files only
        return []
    requested = values.get("resume_from_checkpoint")
    kind = cfg.finetuning.spec.checkpoint_kind
    if (requested and requested != "auto") or _ray_restores(cfg):
        return []
    if requested == "auto" and committed_checkpoints(output_dir, kind):
        return []
    found = run_in(output_dir)
    if not found or cfg.finetuning.overwrite_output_dir:
        return found
    if requested == "auto":
        # saved weights, and another stage's committed checkpoints (auto passed them over)
        kept = [name for name in found if name in WEIGHT_FILES]
        kept += [os.path.basename(path) for _, path in committed_checkpoints(output_dir)]
        if not kept:  # a run that stopped before its first checkpoint: its log is cut back as this run starts
            return []
        raise ConfigError(
            f"output_dir {output_dir} holds a run ({_names(kept)}) that resume_from_checkpoint: auto cannot "
            f"continue: it has no complete checkpoint of stage {cfg.finetuning.stage}, so this run would start "
            "from step 0 and overwrite it. To replace that run, set overwrite_output_dir: true (its checkpoints "
            "are deleted first; on the command line: overwrite_output_dir=true); to keep it, choose another "
            "output_dir.")
    raise ConfigError(
        f"output_dir {output_dir} already holds a run ({_names(found)}), and this run would start from step 0 "
        "and overwrite it. To continue that run, set resume_from_checkpoint: auto (it resumes from the newest "
        "complete checkpoint; a finished run then trains nothing); to replace it, set overwrite_output_dir: true "
        "(its checkpoints are deleted first); or choose another output_dir. On the command line: "
        "resume_from_checkpoint=auto or overwrite_output_dir=true.")


def clear_replaced_run(cfg, found: list[str]) -> list[str]:
    """Delete what of the replaced run a later ``auto`` could resume (``found`` from ``replaced_run``),
    say so in a warning, and return the deleted paths. Call it once every check has passed."""
    output_dir = cfg.training.output_dir
    doomed = [path for _, path in checkpoint_folders(output_dir)]
    doomed += [os.path.join(output_dir, name) for name in sorted(os.listdir(output_dir))
               if name.startswith(f".{CHECKPOINT_PREFIX}") and name.endswith(".partial")]  # staging leftovers
    doomed += [os.path.join(output_dir, LOG_FILE)] if LOG_FILE in found else []
    storage = local_storage_path(cfg.ray.ray_storage_path)
    if storage == default_storage(output_dir) and os.path.isdir(storage):  # never a storage path the user named
        doomed.append(storage)
    for path in doomed:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    deleted = [os.path.basename(path) for path in doomed]
    logger.warning(
        "overwrite_output_dir: true: this run starts from step 0 and replaces the run in %s; deleted %s. Its "
        "model and other outputs are overwritten as this run saves its own.",
        output_dir, ", ".join(deleted) if deleted else "nothing (it had no checkpoints)")
    return doomed


def _ray_restores(cfg) -> bool:
    """A reused ray_run_name: Ray Train restores that run from its last checkpoint in Ray storage
    (a remote storage is taken at its word: whether the run is there is not looked up)."""
    name = cfg.ray.ray_run_name
    if not name or cfg.finetuning.spec.checkpoint_kind != "trainer":
        return False
    storage = local_storage_path(cfg.ray.ray_storage_path)
    return storage is None or os.path.isdir(os.path.join(storage, name))


def _names(names: list[str]) -> str:
    """``run_in``'s names for a message: three checkpoints or more as their count and range."""
    checkpoints = [name for name in names if name.startswith(CHECKPOINT_PREFIX)]
    if len(checkpoints) > 2:
        checkpoints = [f"{len(checkpoints)} checkpoints, {checkpoints[0]} to {checkpoints[-1]}"]
    return ", ".join(checkpoints + [name for name in names if not name.startswith(CHECKPOINT_PREFIX)])


__all__ = ["LOG_FILE", "WEIGHT_FILES", "clear_replaced_run", "replaced_run", "run_in"]
