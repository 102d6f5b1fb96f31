"""Trainer callbacks every stage uses: the jsonl training log (resume-aware)."""

from __future__ import annotations

import json
import os
import time

from transformers import TrainerCallback

LOG_FILE = "trainer_log.jsonl"


class JsonlLogCallback(TrainerCallback):
    """Append one JSON line per logging step to ``output_dir/trainer_log.jsonl`` (main process only).

    On resume the lines after the checkpoint's step are dropped first, so a run that died and
    restarted shows every step exactly once, and elapsed_time goes on from the checkpoint's last
    line (speed and remaining time are measured on this session's steps only).
    """

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOG_FILE)
        self.start_time = 0.0
        self.start_step = 0
        self.elapsed_before = 0.0  # seconds the run had trained before this session resumed it

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_time = time.time()
        self.start_step = state.global_step
        if not state.is_world_process_zero:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        kept = []
        if state.global_step > 0 and os.path.exists(self.path):
            # The end-of-run summary of a run that stopped at the checkpoint goes too: the resumed
            # run writes its own, and the log should read like one uninterrupted run.
            with open(self.path, encoding="utf-8") as f:
                kept = [
                    line for line in f
                    if (record := json.loads(line)).get("current_steps", 0) <= state.global_step
                    and "train_runtime" not in record
                ]
        with open(self.path, "w", encoding="utf-8") as f:
            f.writelines(kept)
        self.elapsed_before = json.loads(kept[-1]).get("elapsed_time", 0.0) if kept else 0.0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        elapsed = time.time() - self.start_time  # this session's
        done = state.global_step - self.start_step
        remaining = (state.max_steps - state.global_step) * elapsed / done if done else None
        record = {
            "current_steps": state.global_step,
            "total_steps": state.max_steps,
            "epoch": round(state.epoch or 0.0, 4),
            "elapsed_time": round(self.elapsed_before + elapsed, 3),
            "remaining_time": None if remaining is None else round(remaining, 3),
            "steps_per_second": round(done / elapsed, 4) if elapsed > 0 and done else None,
        }
        for key, value in logs.items():
            if key in ("loss", "learning_rate", "grad_norm", "kl") or key.startswith(("eval_", "rewards/", "train_")):
                record[{"learning_rate": "lr"}.get(key, key)] = value
        if "loss" in record or any(k.startswith(("eval_", "train_")) for k in record):
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def read_log(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, LOG_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
