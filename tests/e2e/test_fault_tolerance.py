"""A worker that dies hard mid-run: Ray Train restarts the group, which resumes exactly: every step
logged once, and the final weights of the same run without the fault.

Two workers; rank 0 is the one killed, because it is the rank that writes trainer_log.jsonl and
the checkpoints: its death is the case that can lose or repeat logged steps. (Rank 1 then sits in
a gloo all-reduce for the next step and must be torn down by Ray, not hang.)
"""

from __future__ import annotations

import filecmp
import glob
import json
import os
import sys
import time

import ray.cloudpickle
from ray.train.v2._internal.constants import DEFAULT_HEALTH_CHECK_INTERVAL_S as HEALTH_CHECK_INTERVAL_S
from transformers import TrainerCallback

from cluster.driver import run_exp
from stages.training.callbacks import read_log
from tests.e2e.weights import WEIGHT_TOL, final_weights_gap

# Ray pickles the callbacks to the workers, which cannot import this test module by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MAX_STEPS, SAVE_STEPS, KILL_STEP = 10, 3, 8  # checkpoints at 3, 6, 9; the kill lands between 6 and 9


class DieOnceAt(TrainerCallback):
    """Kills this worker process at the end of ``step`` on ``rank``, only while ``marker`` is absent.

    ``on_step_end`` runs before that step is logged or saved, so the log then holds steps past the
    last checkpoint (7 here), which the restarted attempt must drop and redo.
    """

    def __init__(self, step: int, rank: int, marker: str, attempts: str):
        self.step, self.rank, self.marker, self.attempts = step, rank, marker, attempts

    def on_train_begin(self, args, state, control, **kwargs):
        with open(self.attempts, "a", encoding="utf-8") as f:
            f.write(json.dumps({"rank": args.process_index, "global_step": state.global_step}) + "\n")

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == self.rank and not os.path.exists(self.marker):
            open(self.marker, "w").close()  # first, so the restarted attempt does not die again
            # Ray Train's controller takes in reported checkpoints when it next polls the workers
            # (every 2 s, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S); a worker that dies before that poll
            # loses its last report and the group resumes from the one before. Two steps of this
            # tiny model take well under 2 s on a busy machine (seen in CI: a resume from step 3),
            # so the death waits out two polls: the case under test is "the last checkpoint Ray has".
            time.sleep(2 * HEALTH_CHECK_INTERVAL_S + 1)
            os._exit(1)


def test_worker_killed_mid_run_resumes_from_last_checkpoint(ray_session, sft_config, tmp_path):
    marker, attempts = str(tmp_path / "killed"), str(tmp_path / "attempts.jsonl")
    config = sft_config(max_steps=MAX_STEPS, save_steps=SAVE_STEPS, max_failures=1, ray_num_workers=2)

    result = run_exp(config, callbacks=[DieOnceAt(KILL_STEP, rank=0, marker=marker, attempts=attempts)])

    assert os.path.exists(marker), "the injected failure never fired"
    with open(attempts, encoding="utf-8") as f:
        begins = sorted((r["global_step"], r["rank"]) for r in map(json.loads, f))
    last_checkpoint = (KILL_STEP // SAVE_STEPS) * SAVE_STEPS
    # Attempt 1 starts both ranks at 0; attempt 2 starts both at the last checkpoint, not at 0.
    assert begins == [(0, 0), (0, 1), (last_checkpoint, 0), (last_checkpoint, 1)]

    steps = [r["current_steps"] for r in read_log(result.output_dir) if "loss" in r]
    assert steps == list(range(1, MAX_STEPS + 1))  # none lost, none repeated
    with open(os.path.join(result.output_dir, "trainer_state.json"), encoding="utf-8") as f:
        assert json.load(f)["global_step"] == MAX_STEPS
    assert os.path.exists(os.path.join(result.output_dir, "model.safetensors"))

    # Every checkpoint Ray kept (and resumed from) is a complete, byte-identical copy of the HF one:
    # both ranks upload into the same Ray folder, so a copy taken mid-write would show here.
    ray_copies = glob.glob(os.path.join(config["ray_storage_path"], "*", "checkpoint_*", "checkpoint"))
    saved_steps = []
    for copy in ray_copies:
        with open(os.path.join(copy, "trainer_state.json"), encoding="utf-8") as f:
            step = json.load(f)["global_step"]
        saved_steps.append(step)
        original = os.path.join(result.output_dir, f"checkpoint-{step}")
        assert sorted(os.listdir(copy)) == sorted(os.listdir(original))
        _, mismatch, errors = filecmp.cmpfiles(original, copy, os.listdir(original), shallow=False)
        assert not mismatch and not errors, (step, mismatch, errors)
    assert sorted(saved_steps) == [3, 6, 9, MAX_STEPS]  # 10: the final save at max_steps

    # The same run without the kill, in folders of its own: the recovered run ends on its weights
    # (a restart that lost optimizer, scheduler, RNG or data position state would not).
    reference_dir = tmp_path / "uninterrupted"
    reference = run_exp({**config, "output_dir": str(reference_dir), "ray_storage_path": str(reference_dir / "ray")})
    worst = final_weights_gap(result.output_dir, reference.output_dir)
    assert worst <= WEIGHT_TOL, f"final weights differ from the uninterrupted run's by up to {worst}"
