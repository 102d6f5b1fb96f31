"""A Ray Train worker's own share of a streamed training set, fed to the HF Trainer.

With ``streaming: true`` Ray Train splits the lazy tokenized dataset between the workers
(``streaming_split``, equal row counts), and each worker iterates its share as it trains:
no worker ever holds the whole dataset. The Trainer gets the share as a torch IterableDataset
and builds its DataLoader *without* accelerate's wrapping: accelerate would shard an iterable
again (every rank reading the full stream and keeping 1/N) or dispatch rank 0's batches to all,
while here the sharding is already done by Ray.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch.utils.data

ROWS_PER_FETCH = 256  # rows pulled from the Ray iterator at once; batches are formed by the DataLoader


class StreamedShard(torch.utils.data.IterableDataset):
    """Rows of this worker's share, shuffled in a local buffer of ``buffer_size`` rows (LLaMA-Factory's
    ``buffer_size``). Each pass (a Trainer epoch) reshuffles with the next seed."""

    def __init__(self, shard, buffer_size: int, seed: int):
        self.shard, self.buffer_size, self.seed = shard, buffer_size, seed
        self.passes = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        seed = self.seed + self.passes
        self.passes += 1
        batches = self.shard.iter_batches(
            batch_size=ROWS_PER_FETCH,
            batch_format="pyarrow",
            local_shuffle_buffer_size=self.buffer_size,
            local_shuffle_seed=seed,
        )
        for table in batches:
            yield from table.to_pylist()


def feed_streamed_shards(trainer):
    """Make ``trainer`` batch a StreamedShard train set itself (see the module docstring); any other
    train set goes through the Trainer's own DataLoader unchanged."""
    from torch.utils.data import DataLoader

    base = trainer.__class__

    class StreamedShardTrainer(base):
        def get_train_dataloader(self):
            if not isinstance(self.train_dataset, StreamedShard):
                return super().get_train_dataloader()
            collate = self._get_collator_with_removed_columns(self.data_collator, description="training")
            return DataLoader(self.train_dataset, batch_size=self._train_batch_size, collate_fn=collate, num_workers=0)

    StreamedShardTrainer.__name__ = StreamedShardTrainer.__qualname__ = base.__name__
    trainer.__class__ = StreamedShardTrainer
    return trainer
