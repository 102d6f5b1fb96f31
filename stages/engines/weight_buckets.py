"""Weights laid out in flat byte buckets, for a collective weight push (fabric/weight_sync.py).

A broadcast per tensor costs a round trip per tensor (hundreds of them for a small model, each
tiny); one broadcast of the whole model needs a second copy of it on both ends. Buckets are the
middle way verl and OpenRLHF take: tensors packed end to end into buffers of about
``bucket_bytes``, one broadcast per buffer. The sender builds the ``plan`` (names, dtypes,
shapes, byte offsets) while packing and sends it ahead as plain data; the receiver allocates each
bucket from the plan, receives it, and hands out views of it. The same code for gloo (CPU) and
NCCL (GPU): only the buffers' device differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch

DEFAULT_BUCKET_BYTES = 64 << 20
ALIGN = 16  # every tensor starts at a multiple of the largest element size, so views of it are legal


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]
    offset: int  # bytes into its bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    slots: tuple[TensorSlot, ...]


def pack(state: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
         device: torch.device | str = "cpu") -> tuple[list[Bucket], list[torch.Tensor]]:
    """``state`` copied into uint8 buffers on ``device`` of at most ``bucket_bytes`` each (a tensor
    larger than that gets a bucket of its own), in ``state``'s order; the plan and the buffers.
    The buffers are a snapshot: the caller may go on changing the tensors at once."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[list[tuple[str, torch.Tensor, int]]] = [[]]
    used = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        start = _aligned(used)
        if groups[-1] and start + nbytes > bucket_bytes:
            groups.append([])
            start = 0
        groups[-1].append((name, tensor, start))
        used = start + nbytes
    plan, buffers = [], []
    for group in groups:
        if not group:
            continue
        last_name, last, last_start = group[-1]
        size = last_start + last.numel() * last.element_size()
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        slots = []
        for name, tensor, start in group:
            nbytes = tensor.numel() * tensor.element_size()
            buffer[start:start + nbytes].copy_(_bytes_of(tensor))
            slots.append(TensorSlot(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), start, nbytes))
        plan.append(Bucket(size, tuple(slots)))
        buffers.append(buffer)
    return plan, buffers


def unpack(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into a received ``buffer`` laid out as ``bucket`` says."""
    if buffer.numel() != bucket.nbytes:
        raise ValueError(f"a bucket of {buffer.numel()} bytes does not match its plan's {bucket.nbytes}")
    for slot in bucket.slots:
        raw = buffer[slot.offset:slot.offset + slot.nbytes]
        yield slot.name, raw.view(getattr(torch, slot.dtype)).view(slot.shape)


def receive(plan: Iterable[Bucket], fill: Callable[[torch.Tensor], None],
            device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """The receiving side, lazily: per bucket, allocate it, ``fill(buffer)`` (the broadcast that
    writes the sender's bytes into it), then yield its tensors. A loader consuming this holds one
    bucket at a time."""
    for bucket in plan:
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        fill(buffer)
        yield from unpack(bucket, buffer)


def plan_bytes(plan: Iterable[Bucket]) -> int:
    return sum(slot.nbytes for bucket in plan for slot in bucket.slots)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)  # reshape: 0-d tensors cannot be viewed as bytes
    return flat.view(torch.uint8)
