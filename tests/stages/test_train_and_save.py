"""StageJob.train_and_save: what holds while the Trainer trains."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

from stages.job import StageJob


class _Seen(Exception):
    pass


class _RecordingTrainer:
    """Stands in for a Trainer only to see the process state that train() is called in."""

    def train(self, resume_from_checkpoint=None):
        raise _Seen(gc.get_freeze_count(), resume_from_checkpoint)


def test_training_starts_with_everything_made_so_far_frozen_for_the_collector():
    gc.unfreeze()
    job = SimpleNamespace(resume_from_checkpoint="ckpt-7", spec=None)
    try:
        with pytest.raises(_Seen) as seen:
            StageJob.train_and_save(job, _RecordingTrainer(), tokenizer=None, template=None)
    finally:
        gc.unfreeze()  # the test process's own objects go back to the collector
    frozen, resume = seen.value.args
    assert frozen > 1000, "accelerate's gc.collect() as training starts would re-scan every library object"
    assert resume == "ckpt-7"
