"""Never lose a run, with a real tiny run: rerunning it into its output_dir is refused and touches
nothing; with resume_from_checkpoint: auto it trains nothing; with overwrite_output_dir: true it
trains again from step 0 with the old checkpoints and Ray's copies gone before training starts.
Ray Train's copies land inside output_dir when the config names no ray_storage_path."""

from __future__ import annotations

import os
import sys

import pytest
import ray.cloudpickle
from transformers import TrainerCallback

from cluster.config import ConfigError
from cluster.driver import run_exp
from stages.training.callbacks import read_log
from tests.e2e.conftest import assert_rerun_of_a_finished_run_trains_nothing, output_files, tiny_sft_config

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the callback, for a worker that cannot import us


class SeenAtBegin(TrainerCallback):
    """Writes what output_dir holds when training begins: the step, then its entries (a file with its size)."""

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        entries = [name if os.path.isdir(os.path.join(args.output_dir, name))
                   else f"{name}:{os.path.getsize(os.path.join(args.output_dir, name))}"
                   for name in sorted(os.listdir(args.output_dir))]
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(" ".join([str(state.global_step), *entries]))


def test_a_finished_run_is_refused_resumed_or_replaced_and_ray_copies_stay_inside_output_dir(ray_session, tmp_path):
    config = tiny_sft_config(tmp_path / "out", max_steps=4, save_steps=2, train_in_driver=False)
    config.pop("ray_storage_path")  # the default
    first = run_exp(config)
    out = first.output_dir
    assert first.checkpoint_path.startswith(os.path.join(out, "ray_results") + os.sep)  # Ray's copy, inside output_dir
    before = output_files(out)

    with pytest.raises(ConfigError, match=f"^output_dir {out} already holds a run "):
        run_exp(config)
    assert output_files(out) == before
    assert_rerun_of_a_finished_run_trains_nothing(config)  # with auto

    seen = str(tmp_path / "seen.txt")
    again = run_exp({**config, "overwrite_output_dir": True, "train_in_driver": True}, callbacks=[SeenAtBegin(seen)])
    with open(seen, encoding="utf-8") as f:
        step, *entries = f.read().split()
    assert step == "0" and not any(e.startswith("checkpoint-") or e == "ray_results" for e in entries), entries
    assert not any(e.startswith("trainer_log.jsonl:") and e != "trainer_log.jsonl:0" for e in entries), entries
    assert [r["current_steps"] for r in read_log(out) if "loss" in r] == [1, 2, 3, 4]
    assert again.checkpoint_path == os.path.join(out, "checkpoint-4")  # trained in the driver: no Ray copy
    assert sorted(e for e in os.listdir(out) if e.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
