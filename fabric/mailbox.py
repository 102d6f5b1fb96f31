"""The actor that holds rank 0's Trainer log records until the driver collects them (progress.py).

A module of its own, importing nothing but Ray: the actor's process imports the module that
defines its class, and importing Transformers there would cost seconds of CPU at every run's
start, next to the train workers loading theirs.
"""

from __future__ import annotations

import ray


@ray.remote(num_cpus=0)
class Mailbox:
    def __init__(self):
        self._records: list[dict] = []

    def put(self, *records: dict) -> None:
        self._records.extend(records)

    def take(self) -> list[dict]:
        records, self._records = self._records, []
        return records
