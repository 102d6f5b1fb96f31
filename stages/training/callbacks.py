"""The jsonl training log every stage writes (the HF Trainer's through a callback, the RL loops'
through stages/rl/controller/steplog.py), and its cut back to a checkpoint's step on resume."""

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
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOG_FILE)
        self.start_time = 0.0
        self.start_step = 0
        self.elapsed_before = 0.0  # seconds the run had trained before this session resumed it

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_time = time.time()
        self.start_step = state.global_step
        if not state.is_world_process_zero:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        if state.global_step > 0:
            truncate_log(self.output_dir, state.global_step)
        else:
            open(self.path, "w").close()
        kept = read_log(self.output_dir)
        self.elapsed_before = kept[-1].get("elapsed_time", 0.0) if kept else 0.0

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


def truncate_log(output_dir: str, step: int) -> int:
    """Keep only the records of ``trainer_log.jsonl`` up to ``step`` (a resumed run writes the later
    steps again) and return how many were dropped. The end-of-run summary of a run that stopped at
    the checkpoint goes too (the resumed run writes its own: the log reads like one unbroken run),
    and so does a line that is not JSON, torn by the crash that ended the run. The file is
    rewritten atomically; no file: 0."""
    path = os.path.join(output_dir, LOG_FILE)
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if record.get("current_steps", 0) <= step and "train_runtime" not in record:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(temporary, path)
    return dropped


def read_log(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, LOG_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
