"""Per-step bookkeeping of RL recipes: phase timings and trainer_log.jsonl records.

The log has the same shape as the other stages' (``current_steps``, ``total_steps``,
``elapsed_time``, ``remaining_time``, ``loss``, ``lr``...), so plots, the console and the web UI
read RL runs like any other.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from stages.training.callbacks import LOG_FILE, read_log


class PhaseTimer:
    """``with timer("generate"): ...`` adds the block's seconds under ``time/generate`` and keeps
    its wall-clock span (``time.time``, comparable with other processes') in ``spans``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            key = f"time/{phase}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
            self.spans.append((phase, wall, time.time()))


def write_results(output_dir: str, metrics: dict) -> str:
    """all_results.json, as the Trainer-based stages write it."""
    path = os.path.join(output_dir, "all_results.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=2)
    return path


class StepLog:
    """Appends one JSON line per logged step to output_dir/trainer_log.jsonl (a new run starts it
    empty; a resumed one appends to what its checkpoint kept)."""

    def __init__(self, output_dir: str, total_steps: int, append: bool = False):
        self.path = os.path.join(output_dir, LOG_FILE)
        self.total_steps = total_steps
        self.start = time.time()
        os.makedirs(output_dir, exist_ok=True)
        if not append:
            open(self.path, "w").close()
        else:  # elapsed_time goes on from the last kept record, as the Trainer-based stages' does
            last = [r for r in read_log(output_dir) if r.get("elapsed_time") is not None][-1:]
            self.start -= last[0]["elapsed_time"] if last else 0.0

    def write(self, step: int, values: dict) -> dict:
        elapsed = time.time() - self.start
        record = {
            "current_steps": step,
            "total_steps": self.total_steps,
            "elapsed_time": round(elapsed, 3),
            "remaining_time": round((self.total_steps - step) * elapsed / step, 3) if step else None,
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in values.items()},
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        return record
