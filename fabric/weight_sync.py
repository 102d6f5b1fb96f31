"""Pushing the policy's weights into the rollout engines after an update.

Two transports behind one call, ``push(weights, engines) -> SyncStats``:

- ``ObjectStoreSync`` (any machine, CPU included): the policy exports a full HF-named state dict
  once, as safetensors bytes, puts it in the Ray object store, and every engine loads it in
  parallel. Cost: a host copy of the model per push plus one object-store read per engine.
- ``NcclBroadcastSync`` (GPUs): policy rank 0 broadcasts each tensor over NCCL straight into the
  engines' GPU workers, no host copy at all.

After a push every engine samples from the new weights (its prefix cache dropped).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence, Union

import ray
import torch

from stages.rl.weights import export_adapter, export_state_dict, state_dict_to_bytes

Weights = Union[torch.nn.Module, Mapping[str, torch.Tensor], bytes, "ray.ObjectRef"]


@dataclass
class SyncStats:
    bytes: Optional[int]  # payload size; None when handed an ObjectRef of unknown size
    seconds: float  # the whole push: export, serialisation, transfer, every engine's load
    load_seconds: float  # the slowest engine's own share (receiving and loading)


class WeightSync(Protocol):
    def push(self, weights: Weights, engines: Sequence) -> SyncStats:
        """Make every engine (a ``VLLMEngine`` actor handle) serve ``weights``; return when all do."""


class ObjectStoreSync:
    """Export once, ``ray.put`` once, every engine's ``load_weights`` in parallel.

    ``weights``: the policy model (exported with ``export_state_dict``: a LoRA adapter is merged
    in), a state dict, its ``state_dict_to_bytes`` bytes, or an ObjectRef of those bytes (e.g.
    made by the policy worker, so the driver never holds them). ``dtype`` casts on export
    (ship bf16 to bf16 engines: half the bytes of fp32). ``payload="adapter"``: a LoRA policy's
    adapter alone (``export_adapter``), which engines built with ``rollout_lora_rank`` serve beside
    their base (``load_adapter``): bytes per push scale with the adapter, not the model.
    """

    def __init__(self, dtype: Optional[torch.dtype] = None, payload: str = "full"):
        if payload not in ("full", "adapter"):
            raise ValueError(f"payload must be 'full' or 'adapter', got {payload!r}")
        self.dtype = dtype
        self.payload = payload  # adapter: a LoRA adapter alone, served beside the engines' untouched base

    def push(self, weights: Weights, engines: Sequence) -> SyncStats:
        start = time.perf_counter()
        size, loads = self._send(weights, engines)
        return SyncStats(size, time.perf_counter() - start, max(ray.get(loads), default=0.0))

    def start(self, weights: Weights, engines: Sequence) -> list:
        """``push`` without waiting: the engines' ``load_weights`` calls (ObjectRefs of their seconds),
        queued behind whatever each engine was already sent."""
        return self._send(weights, engines)[1]

    def _send(self, weights: Weights, engines: Sequence) -> tuple[Optional[int], list]:
        if isinstance(weights, torch.nn.Module):
            weights = (export_adapter(weights, dtype=self.dtype) if self.payload == "adapter"
                       else export_state_dict(weights, dtype=self.dtype))
        if isinstance(weights, Mapping):
            weights = state_dict_to_bytes(weights)
        size = None
        if isinstance(weights, (bytes, bytearray, memoryview)):
            size = len(weights)
            weights = ray.put(bytes(weights))
        elif not isinstance(weights, ray.ObjectRef):
            raise TypeError(f"cannot push {type(weights).__name__}: give a model, a state dict, bytes or an ObjectRef")
        load = "load_adapter" if self.payload == "adapter" else "load_weights"
        return size, [getattr(engine, load).remote(weights) for engine in engines]


class NcclBroadcastSync:
    """Policy rank 0 broadcasts every tensor to the engines' workers over a dedicated NCCL group.

    UNTESTED on the machine it was written on (no GPU there): written against vLLM 0.32's own
    NCCL weight-transfer engine, which the engines run on their side (``VLLMEngineConfig(
    weight_transfer="nccl")``; it joins with vLLM's ``StatelessProcessGroup`` +
    ``PyNcclCommunicator`` and loads each received tensor through the model's ``load_weights``
    inside vLLM's layer-wise reload). Group: rank 0 is the sender, engine i's tensor-parallel
    workers are ranks ``1 + i * engine_tp ...``.

    Build it and call ``push`` on EVERY policy rank, in the same order (``is_sender`` on rank 0
    only): ZeRO-3 partitions are gathered one parameter at a time, a collective all ranks join;
    the other ranks send nothing. Tensors go in the engines' ``dtype``. A LoRA policy is merged
    (``export_state_dict``) on the GPU first, under ZeRO-3 with the whole model gathered.
    """

    def __init__(self, engines: Sequence, *, dtype: torch.dtype, engine_tp: int = 1, is_sender: bool = True,
                 master_address: Optional[str] = None, master_port: Optional[int] = None):
        if not torch.cuda.is_available():
            raise RuntimeError("NcclBroadcastSync needs CUDA GPUs on the policy and the engines; on CPU use "
                               "ObjectStoreSync (weight sync through the Ray object store).")
        self.engines, self.dtype, self.is_sender = list(engines), dtype, is_sender
        self.group = None
        if not is_sender:
            return
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        address = master_address or ray.util.get_node_ip_address()
        port = master_port or _free_port()
        world_size = 1 + len(self.engines) * engine_tp
        joined = [engine.init_weight_group.remote(address, port, 1 + i * engine_tp, world_size)
                  for i, engine in enumerate(self.engines)]
        # rank 0 hosts the rendezvous store; returns once every engine worker has joined
        self.group = trainer_init(dict(master_address=address, master_port=port, world_size=world_size))
        ray.get(joined)

    def push(self, weights: torch.nn.Module, engines: Optional[Sequence] = None) -> SyncStats:
        if engines is not None and list(engines) != self.engines:
            raise ValueError("NcclBroadcastSync pushes to the engines it was built with (their NCCL ranks)")
        start = time.perf_counter()
        tensors = _sources(weights, self.dtype, self.is_sender)
        size = sum(_numel(shape) for _, shape, _ in tensors) * torch.empty(0, dtype=self.dtype).element_size()
        receiving = []
        if self.is_sender:
            dtype_name = str(self.dtype).removeprefix("torch.")
            receiving = [e.receive_broadcast.remote([n for n, _, _ in tensors], [dtype_name] * len(tensors),
                                                    [list(s) for _, s, _ in tensors]) for e in self.engines]
        stream = torch.cuda.current_stream()
        for _, _, materialise in tensors:
            with materialise() as tensor:  # all ranks: a ZeRO-3 gather is a collective
                if self.is_sender:
                    send = tensor.to(device="cuda", dtype=self.dtype).contiguous()
                    self.group.broadcast(send, src=0, stream=stream)
                    stream.synchronize()  # before a gathered ZeRO-3 buffer is released
        loads = ray.get(receiving)
        return SyncStats(size, time.perf_counter() - start, max(loads, default=0.0))

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


def _sources(model: torch.nn.Module, dtype: torch.dtype, is_sender: bool) -> list:
    """``(name, shape, context manager yielding the full tensor)`` per tensor to send, in order
    (for a LoRA policy, empty on the ranks that send nothing)."""
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        with _gathered(list(model.parameters())):  # merging needs every (ZeRO-3) weight whole
            state = export_state_dict(model, dtype=dtype, device=torch.cuda.current_device()) if is_sender else {}
        return [(n, tuple(t.shape), lambda t=t: contextlib.nullcontext(t)) for n, t in state.items()]
    # named_parameters() lists a tied parameter once, under its first (source) name, as the
    # engines expect; buffers (rotary tables) are not weights vLLM loads.
    return [(name, tuple(getattr(p, "ds_shape", p.shape)), lambda p=p: _gathered([p], yield_=p))
            for name, p in model.named_parameters()]


@contextlib.contextmanager
def _gathered(params: list, yield_=None):
    """DeepSpeed ZeRO-3's ``GatheredParameters`` for partitioned ``params`` (read-only); else nothing."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield None if yield_ is None else yield_.data
    else:
        yield None if yield_ is None else yield_.data


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
