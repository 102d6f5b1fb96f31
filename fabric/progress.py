"""Rank 0's Trainer log records, carried to the driver while ``trainer.fit()`` blocks it.

Ray Train hands the driver nothing until the run ends (``ray.train.report`` goes to its
controller, and only at checkpoints). So a small actor keeps the records: rank 0's callback
sends each one without waiting for an answer, and a driver thread collects them twice a second
for whatever shows progress there (the CLI's progress bar). A run that trains in the driver
(fabric/train_in_driver.py) has its callback call the console directly instead.
"""

from __future__ import annotations

import logging
import threading
import time

import ray
from transformers import TrainerCallback

from fabric.worker_channel import WorkerChannel

logger = logging.getLogger(__name__)


class RelayCallback(TrainerCallback):
    """On every rank (shipped in the worker payload); only the world's rank 0 sends.

    Plain loss records are sent at most every ``SEND_INTERVAL_S`` (with logging_steps 1 an actor
    call per step cost a 9M model 7% of its training speed on 2 cores); the others (start, first
    step, evaluation, the closing record) go at once, with whatever waited before them."""

    SEND_INTERVAL_S = 0.5

    def __init__(self, channel, on_record=None):
        self.channel = channel
        self.on_record = on_record  # training in the driver: records go here, with no channel between
        self._stepped = False
        self._pending: list[dict] = []
        self._last_sent = 0.0
        self.notes: list[str] = []  # lines for the console (the worker's StageJob.notes), sent with "begin"

    def on_train_begin(self, args, state, control, **kwargs):
        self._stepped = False
        record = {"event": "begin", "time": time.time()}  # when, for the start-up split
        self._send(state, record | ({"notes": list(self.notes)} if self.notes else {}))

    def on_step_end(self, args, state, control, **kwargs):
        if not self._stepped:  # the first optimizer step of this worker group: start-up is over
            self._stepped = True
            self._send(state, {"event": "first_step", "time": time.time()})

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        routine = "loss" in logs and not any(k.startswith("eval_") or k == "train_runtime" for k in logs)
        self._send(state, {"event": "log", **logs}, now=not routine)

    def on_train_end(self, args, state, control, **kwargs):
        self._flush()

    def _send(self, state, record: dict, now: bool = True) -> None:
        if not state.is_world_process_zero:
            return
        self._pending.append({"step": state.global_step, "max_steps": state.max_steps, **record})
        if now or time.monotonic() - self._last_sent >= self.SEND_INTERVAL_S:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._last_sent = self._pending, [], time.monotonic()
        if self.on_record is None:
            # Fire and forget: calls from one caller run in order, and training never waits on the driver.
            self.channel.put.remote(*pending)
            return
        for record in pending:
            try:
                self.on_record(record)
            except Exception:  # noqa: BLE001 (showing progress must never stop a run)
                logger.debug("progress display failed", exc_info=True)


class ProgressRelay:
    """``with ProgressRelay(on_record) as relay:`` around ``fit()``; ship ``relay.callbacks`` to the
    workers. ``on_record=None`` relays nothing (no actor, no thread)."""

    def __init__(self, on_record=None, interval_s: float = 0.5):
        self.on_record = on_record
        self.interval_s = interval_s
        self.channel = WorkerChannel.remote() if on_record is not None else None  # the launcher hands data through it too
        self.callbacks = [RelayCallback(self.channel)] if on_record is not None else []
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> "ProgressRelay":
        if self.channel is not None:
            self._thread = threading.Thread(target=self._pump, name="rayfactory-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.channel is None:
            return
        self._stop.set()
        self._thread.join()
        self._deliver()  # what arrived since the last collection
        ray.kill(self.channel)

    def _pump(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._deliver()

    def _deliver(self) -> None:
        try:
            for record in ray.get(self.channel.take.remote()):
                self.on_record(record)
        except Exception:  # noqa: BLE001 (showing progress must never stop a run)
            logger.debug("progress relay failed", exc_info=True)
