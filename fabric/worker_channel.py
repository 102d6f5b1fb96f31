"""The actor through which the driver and the train workers pass things while ``fit()`` runs.

Down: the tokenized data. The driver starts the worker group first and tokenizes while the
workers import torch and Transformers (seconds each on any machine, minutes of model loading on
a large one); each worker asks for the data's block refs once it has nothing else to do, and the
answer comes when the driver delivers (fabric/launcher.py).
Up: rank 0's Trainer log records, held until the driver collects them (progress.py).

A module of its own, importing nothing but Ray: the actor's process imports the module that
defines its class, and importing Transformers there would cost seconds of CPU at every run's
start, next to the train workers loading theirs. One actor for both directions: every process
started beside the workers delays them (~1 CPU-second each to import Ray).
"""

from __future__ import annotations

import asyncio

import ray


@ray.remote(num_cpus=0)
class WorkerChannel:
    def __init__(self):
        self._records: list[dict] = []
        self._delivered = asyncio.Event()
        self._blocks: dict[str, list["ray.ObjectRef"]] | None = None

    async def blocks(self) -> dict[str, list["ray.ObjectRef"]]:
        """The tokenized datasets' block refs, once delivered. The driver calls this at once and
        hands the workers the ref of the answer: the driver owns it, so it outlives this actor."""
        await self._delivered.wait()
        return self._blocks

    async def deliver(self, blocks: dict[str, list["ray.ObjectRef"]]) -> None:
        self._blocks = blocks
        self._delivered.set()

    async def put(self, *records: dict) -> None:
        self._records.extend(records)

    async def take(self) -> list[dict]:
        records, self._records = self._records, []
        return records
