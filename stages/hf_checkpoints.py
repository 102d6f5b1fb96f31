"""The HF Trainer's checkpoints made atomic: committed by a manifest, rotated among committed ones.

The Trainer writes ``checkpoint-N`` in place and then deletes old ones by ``save_total_limit``,
counting any folder of that name. A run killed while saving N, or a disk that fills up during the
save, would leave a half-written N that the Trainer's rotation (which keeps the newest folder)
may already have paid for with the last good checkpoint. So the Trainer's own rotation is off
(``JobSpec.training_arguments`` passes it ``save_total_limit=None``) and ``CommitCheckpoints``,
which ``StageJob.build_trainer`` puts before the fabric's callbacks (Ray's report copies the
folder to Ray storage, so it must find the manifest there), does both in ``on_save``:

1. wait until every rank has written its part of the folder (rank 1 writes its RNG file);
2. rank 0 commits it (stages/checkpoint_files.py ``write_manifest``: the manifest is renamed
   into place last);
3. rank 0 deletes committed checkpoints beyond ``save_total_limit``, oldest first, never the one
   just committed nor the best model's; half-written folders are not counted;
4. wait again, so that no rank reads the folder before it is committed.

At the start of training it uncommits the checkpoints of a run this one replaces (``on_train_begin``).
"""

from __future__ import annotations

import logging
import os

from transformers import TrainerCallback

from .checkpoint_files import (
    checkpoint_folders,
    checkpoint_path,
    committed_checkpoints,
    prune_checkpoints,
    uncommit,
    write_manifest,
)

logger = logging.getLogger(__name__)


def wait_for_all_ranks() -> None:
    """A barrier over the training processes (none when not distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CommitCheckpoints(TrainerCallback):
    """Commit each checkpoint the Trainer saves and apply ``save_total_limit`` to committed ones."""

    def __init__(self, save_total_limit: int | None):
        self.save_total_limit = save_total_limit  # the user's; the Trainer itself gets None

    def on_train_begin(self, args, state, control, **kwargs):
        # A checkpoint-N with N beyond the step this run starts from belongs to a run this one
        # replaces (it resumed from an earlier checkpoint, or started fresh in the same output_dir).
        # Uncommitted now, before any rank writes: auto must not resume the old run from it after
        # this one dies, and the Trainer writes into a folder of the same step in place, which the
        # old manifest must not vouch for. The files stay, for whoever wants to look at them.
        if args.should_save:
            replaced = [path for step, path in checkpoint_folders(args.output_dir)
                        if step > state.global_step and uncommit(path)]
            if replaced:
                logger.warning(
                    "%d checkpoint(s) in %s lie beyond step %d, where this run starts, so they belong to the run it "
                    "replaces: uncommitted (auto no longer resumes from them; a save of the same step overwrites "
                    "them): %s", len(replaced), args.output_dir, state.global_step,
                    ", ".join(os.path.basename(path) for path in replaced))
        wait_for_all_ranks()

    def on_save(self, args, state, control, **kwargs):
        wait_for_all_ranks()
        if args.should_save:  # the process that writes trainer_state.json (rank 0, or each node's first)
            folder = checkpoint_path(args.output_dir, state.global_step)
            write_manifest(folder, state.global_step)
            prune_checkpoints(committed_checkpoints(args.output_dir), self.save_total_limit,
                              protected=(folder, state.best_model_checkpoint))
        wait_for_all_ranks()


__all__ = ["CommitCheckpoints", "wait_for_all_ranks"]
