"""The bucket layout of a collective weight push (stages/engines/weight_buckets.py) and its
process group (weight_group.py): what goes in comes out, byte for byte, across real processes."""

from __future__ import annotations

import io
import multiprocessing
import socket

import pytest
import torch

from stages.engines.weight_buckets import ALIGN, pack, plan_bytes, receive, unpack
from stages.engines.weight_group import broadcast, join


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(37, 5, generator=generator),
        "norm": torch.randn(5, generator=generator).to(torch.bfloat16),
        "scale": torch.tensor(3.5),  # 0-d
        "steps": torch.arange(7, dtype=torch.int64),
        "big": torch.randn(300, generator=generator),  # larger than the small buckets below
        "half": torch.randn(3, 3, generator=generator).to(torch.float16),
    }


@pytest.mark.parametrize("bucket_bytes", [64, 256, 1 << 20])
def test_pack_then_unpack_gives_every_tensor_back_exactly(bucket_bytes):
    state = weights()
    plan, buffers = pack(state, bucket_bytes)
    out = {name: t for bucket, buffer in zip(plan, buffers) for name, t in unpack(bucket, buffer)}
    assert list(out) == list(state)  # the order the loader sees is the state's
    for name, tensor in state.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor), name
    assert plan_bytes(plan) == sum(t.numel() * t.element_size() for t in state.values())
    for bucket in plan:
        assert all(slot.offset % ALIGN == 0 for slot in bucket.slots)
        # a bucket over the limit holds one tensor, larger than the limit on its own
        assert bucket.nbytes <= bucket_bytes or len(bucket.slots) == 1
    if bucket_bytes == 1 << 20:
        assert len(plan) == 1
    else:
        assert len(plan) > 2


def test_buckets_are_a_snapshot():
    state = weights()
    plan, buffers = pack(state, 128)
    expected = state["embed"].clone()
    state["embed"].add_(1.0)  # the policy trains on after the push was queued
    out = {name: t for bucket, buffer in zip(plan, buffers) for name, t in unpack(bucket, buffer)}
    assert torch.equal(out["embed"], expected)


def test_a_buffer_of_the_wrong_size_is_refused():
    plan, buffers = pack(weights(), 1 << 20)
    with pytest.raises(ValueError, match="does not match"):
        list(unpack(plan[0], buffers[0][:-1]))


def _receiver(port: int, plan, queue) -> None:
    group = join("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
    got = {name: t.clone() for name, t in receive(plan, lambda buffer: broadcast(group, buffer))}
    # Serialised bytes, not tensors: a queued tensor travels as a shared-memory fd that this
    # process must still be alive to hand over, and it exits right after the put.
    payload = io.BytesIO()
    torch.save(got, payload)
    queue.put(payload.getvalue())


def test_buckets_broadcast_over_a_gloo_weight_group_arrive_byte_for_byte():
    """Rank 0 here, rank 1 in another process: the same two calls the policy and an engine make."""
    state = weights()
    plan, buffers = pack(state, 256)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    other = context.Process(target=_receiver, args=(port, plan, queue))
    other.start()
    try:
        group = join("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
        for buffer in buffers:
            broadcast(group, buffer)
        got = torch.load(io.BytesIO(queue.get(timeout=60)))
    finally:
        other.join(timeout=60)
    assert other.exitcode == 0
    assert list(got) == list(state)
    assert all(torch.equal(got[name], tensor) for name, tensor in state.items())


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="gloo"):
        join("127.0.0.1", 1, 0, 1, "mpi")
