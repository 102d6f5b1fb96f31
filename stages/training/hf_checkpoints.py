"""The HF Trainer's checkpoints made atomic: committed by a manifest, rotated among committed ones.

The Trainer writes ``checkpoint-N`` in place and then deletes old ones by ``save_total_limit``,
counting any folder of that name. A run killed while saving N, or a disk that fills up during the
save, would leave a half-written N that the Trainer's rotation (which keeps the newest folder)
may already have paid for with the last good checkpoint. So the Trainer's own rotation is off
(``JobSpec.training_arguments`` passes it ``save_total_limit=None``) and ``CommitCheckpoints``,
which ``StageJob.build_trainer`` puts before the fabric's callbacks (Ray's report copies the
folder to Ray storage, so it must find the manifest there), does both in ``on_save``:

1. wait until every rank has written its part of the folder (rank 1 writes its RNG file);
2. rank 0 commits it and deletes committed checkpoints beyond ``save_total_limit``, never the one
   just committed nor the best model's (stages/training/checkpoints.py ``commit_checkpoint``, the
   commit the RL loops use too);
3. wait again, so that no rank reads the folder before it is committed.

At the start of training it uncommits the checkpoints of a run this one replaces (``on_train_begin``).
"""

from __future__ import annotations

from transformers import TrainerCallback

from stages.training.checkpoints import checkpoint_path, commit_checkpoint, uncommit_after


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
        # Before any rank writes: the Trainer writes a folder of the same step in place.
        if args.should_save:
            uncommit_after(args.output_dir, state.global_step, kind="trainer")
        wait_for_all_ranks()

    def on_save(self, args, state, control, **kwargs):
        wait_for_all_ranks()
        if args.should_save:  # the process that writes trainer_state.json (rank 0, or each node's first)
            commit_checkpoint(checkpoint_path(args.output_dir, state.global_step), state.global_step, state.max_steps,
                              self.save_total_limit, keep=(state.best_model_checkpoint,))
        wait_for_all_ranks()


__all__ = ["CommitCheckpoints", "wait_for_all_ranks"]
