"""The process group a collective weight push travels over: the policy's rank 0 (rank 0 here)
and every rollout engine's worker(s), apart from any group either side already belongs to.

Plain torch, no global state: a ``TCPStore`` hosted by rank 0 and a gloo (CPU) or NCCL (GPU)
process group built on it directly, so the policy's own DDP group and vLLM's internal groups
are untouched and the same code runs on both sides of the push and on both backends.
"""

from __future__ import annotations

from datetime import timedelta

import torch

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 600  # a push waits at most this long for the other side (e.g. an engine mid-generation)


def join(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float = DEFAULT_TIMEOUT_S):
    """This process's member of the weight group; returns once ``world_size`` members have joined.
    Rank 0 hosts the store at ``host:port``."""
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"weight group backend must be one of {BACKENDS}, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore("rayfactory-weights", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def broadcast(group, buffer: torch.Tensor) -> None:
    """Rank 0's ``buffer`` into everybody's; blocks until this member's part is done."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()
    if buffer.is_cuda:
        torch.cuda.current_stream().synchronize()  # before the buffer is read or released


def buffer_device(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"
