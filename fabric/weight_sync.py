"""Pushing the policy's weights into the rollout engines after an update.

Two transports; each ``start``s a push as the engines' next call (ObjectRefs of their load
seconds), and ``ObjectStoreSync.push`` also does it whole, for callers that hold the weights:

- ``ObjectStoreSync`` (any machine, CPU included): the policy exports a full HF-named state dict
  once, as safetensors bytes, puts it in the Ray object store, and every engine loads it in
  parallel. Cost: a host copy of the model per push plus one object-store read per engine.
- ``CollectiveSync`` (gloo on CPU, NCCL on GPU): policy rank 0 broadcasts the weights, in
  buckets, straight into the engines' workers over a process group of their own; no
  serialisation, no object store, no trip through host memory on GPUs.

After a push every engine samples from the new weights (its prefix cache dropped).

``in_flight=True`` (partial rollouts): either transport's pushes go to the engines' ``weights``
thread (``load_in_flight``) instead of their queue of calls, and are loaded between two decoding
steps of a generation in flight; ``loads_sent`` counts them, for the batches sent after to wait for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence, Union

import ray
import torch

from stages.engines.weight_buckets import DEFAULT_BUCKET_BYTES, Bucket, pack
from stages.engines.weight_group import buffer_device
from stages.rl.workers.weights import export_adapter, export_state_dict, state_dict_to_bytes
from stages.rl.workers.zero import gathered

Weights = Union[torch.nn.Module, Mapping[str, torch.Tensor], bytes, "ray.ObjectRef"]


@dataclass
class SyncStats:
    bytes: Optional[int]  # payload size; None when handed an ObjectRef of unknown size
    seconds: float  # the whole push: export, serialisation, transfer, every engine's load
    load_seconds: float  # the slowest engine's own share (receiving and loading)


class WeightSync(Protocol):
    def start(self, exported: "ray.ObjectRef", engines: Sequence) -> list:
        """Have every engine (a ``VLLMEngine`` actor handle) load what the policy's rank 0 exported
        (``exported``, an ObjectRef) as its next call; ObjectRefs of each engine's load seconds."""


class _Transport:
    """What both transports share: where the engines' loads go, and the count of in-flight pushes."""

    def __init__(self, in_flight: bool):
        self.in_flight = in_flight
        self.loads_sent = 0  # in-flight pushes sent so far

    def _loads(self, engines: Sequence, method: str, kind: str, payload) -> list:
        """Each engine's ``method(payload)`` as its next call, or with ``in_flight`` its
        ``load_in_flight(kind, payload)`` on its weights thread."""
        if not self.in_flight:
            return [getattr(engine, method).remote(payload) for engine in engines]
        from .rollout import WEIGHTS_GROUP

        self.loads_sent += 1
        return [engine.load_in_flight.options(concurrency_group=WEIGHTS_GROUP).remote(kind, payload)
                for engine in engines]


class ObjectStoreSync(_Transport):
    """Export once, ``ray.put`` once, every engine's ``load_weights`` in parallel.

    ``weights``: the policy model (exported with ``export_state_dict``: a LoRA adapter is merged
    in), a state dict, its ``state_dict_to_bytes`` bytes, or an ObjectRef of those bytes (e.g.
    made by the policy worker, so the driver never holds them). ``dtype`` casts on export
    (ship bf16 to bf16 engines: half the bytes of fp32). ``payload="adapter"``: a LoRA policy's
    adapter alone (``export_adapter``), which engines built with ``rollout_lora_rank`` serve beside
    their base (``load_adapter``): bytes per push scale with the adapter, not the model.
    """

    def __init__(self, dtype: Optional[torch.dtype] = None, payload: str = "full", in_flight: bool = False):
        if payload not in ("full", "adapter"):
            raise ValueError(f"payload must be 'full' or 'adapter', got {payload!r}")
        if in_flight and payload == "adapter":
            raise ValueError("in-flight pushes take full weights only (an adapter swap would change the LoRA of "
                             "requests mid-generation)")
        super().__init__(in_flight)
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
            with gathered(weights):  # ZeRO-3 shards whole first (every rank of the model must call this)
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
        return size, self._loads(engines, load, "blob", weights)


class WeightSender:
    """The sending end of a collective push, in the policy's rank-0 process (``PolicyActor``).

    ``send`` snapshots the weights into buckets (``weight_buckets.pack``: the one copy a push
    makes, on the group's device) and returns their plan at once; a thread of its own then
    broadcasts the buckets, one push after another in the order they were sent, while the policy
    goes on training. Each engine's ``receive_weights(plan)`` waits for its turn in the engine's
    queue (an asynchronous run's engine may still be generating), then takes the buckets.
    """

    def __init__(self):
        self.group = None
        self.backend = None
        self._thread = None
        self._last = None

    def join(self, host: str, port: int, world_size: int, backend: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from stages.engines.weight_group import join

        self.group = join(host, port, 0, world_size, backend)
        self.backend = backend
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-push")

    def send(self, model: torch.nn.Module, dtype: Optional[torch.dtype] = None,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
        """Snapshot ``model`` (``export_state_dict``: HF names, a LoRA adapter merged in) into
        buckets and queue their broadcast; the plan the engines receive them by."""
        if self.group is None:
            raise RuntimeError("WeightSender.send before join: the engines are in no weight group with this process")
        if self._last is not None and self._last.done():
            self._last.result()  # an earlier push that failed (e.g. an engine died) fails this one
        device = buffer_device(self.backend)
        # ZeRO-3: the shards gathered for the packing copy only (the other ranks gather with this one
        # in PolicyActor.send_weights); the buffers are the snapshot that is broadcast after.
        with torch.no_grad(), gathered(model):
            plan, buffers = pack(export_state_dict(model, dtype=dtype, device=device, copy=False), bucket_bytes, device)
        self._last = self._thread.submit(self._broadcast, buffers)
        return plan

    def flush(self) -> None:
        """Wait until every queued push has gone out (e.g. before the group is closed)."""
        if self._last is not None:
            self._last.result()

    def _broadcast(self, buffers: list[torch.Tensor]) -> None:
        from stages.engines.weight_group import broadcast

        for buffer in buffers:
            broadcast(self.group, buffer)


class CollectiveSync(_Transport):
    """Policy rank 0 broadcasts the weights into the engines' workers over a process group of
    their own (``stages/engines/weight_group.py``): gloo on CPU, NCCL on GPU, the same code path
    (bucketed, ``weight_buckets``) on both. No serialisation and no object store: one packing copy
    on the sender, one bucket at a time on each receiver, loaded through the model's own
    ``load_weights`` as the object-store path is.

    The driver holds this object; the policy's rank 0 holds the ``WeightSender``. ``connect`` once
    (rank 0 hosts the group's store), then per push the policy's ``send_weights`` returns the plan
    and ``start(plan, engines)`` has each engine receive by it (``fabric/rl_roles.py``).
    Not run on a GPU here: NCCL differs from the CPU tests in the backend name and the buffers'
    device only. A DeepSpeed ZeRO-3 policy's shards are gathered (``stages.rl.workers.zero.gathered``, on
    every policy rank at once) for the packing copy; that gather has run on CPU (gloo) only.
    """

    def __init__(self, backend: str, in_flight: bool = False):
        from stages.engines.weight_group import BACKENDS

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        super().__init__(in_flight)
        self.backend = backend

    def connect(self, join_sender, address: tuple[str, int], engines: Sequence, engine_tp: int = 1) -> None:
        """Form the group: ``join_sender(host, port, world_size, backend)`` (an ObjectRef: the
        policy rank 0's ``join_weight_group``) and every engine worker at once; returns when all
        have joined. ``address``: a host and free port on the sender's node."""
        host, port = address
        world_size = 1 + len(engines) * engine_tp
        refs = [engine.join_weight_group.remote(host, port, 1 + i * engine_tp, world_size, self.backend)
                for i, engine in enumerate(engines)]
        ray.get([join_sender(host, port, world_size, self.backend)] + refs)

    def start(self, plan: "ray.ObjectRef", engines: Sequence) -> list:
        """Each engine's ``receive_weights`` (ObjectRefs of their seconds), queued behind whatever
        it was already sent; Ray hands them the plan once the sender has packed the buckets."""
        return self._loads(engines, "receive_weights", "plan", plan)
