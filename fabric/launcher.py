"""Ray Train wiring: one data-parallel trainer whose workers run a stage's recipe."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable

import ray
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.backend import BackendConfig

from stages.job import JobSpec

from fabric.ray_args import RayArguments
from fabric.train_in_driver import train_here
from fabric.worker_channel import WorkerChannel
from fabric.ray_trainer import LeanTrainer
from .progress import ProgressRelay
from .worker import WorkerPayload, train_loop

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from .data.prepare import PreparedData

logger = logging.getLogger(__name__)


def launch_training(
    spec: JobSpec, ray_args: RayArguments, prepare_data: Callable[[], "PreparedData"],
    callbacks: Iterable["TrainerCallback"] = (), progress: Callable[[dict], None] | None = None,
    in_driver: bool = False,
) -> tuple["ray.train.Result", "PreparedData"]:
    """Fit on ``ray_num_workers`` workers, or in this process (``in_driver``: fabric/train_in_driver.py
    says when); the result carries the final metrics and checkpoint.
    ``prepare_data`` tokenizes (fabric/data/prepare.py): called here while the workers start.
    ``progress``, if given, is called on the driver with each of rank 0's Trainer log records."""
    training = spec.training
    run_name = ray_args.ray_run_name or default_run_name(training.output_dir)
    if in_driver:  # nothing to overlap tokenizing with: the model loads in this process next
        data = prepare_data()
        return train_here(spec, ray_args, _block_refs(data, with_train=True), run_name, callbacks, progress), data
    relay = ProgressRelay(progress)
    streaming = spec.data.streaming
    if streaming:
        # Only a stream goes through Ray Train's ingest, which splits it: each worker pulls its own
        # share (fabric/data/streamed_shard.py). Preparing one is lazy (nothing is read until then), and
        # Ray Train needs it before it starts.
        data, handoff = prepare_data(), None
        blocks = ray.put(_block_refs(data, with_train=False))
    else:
        # A tokenized dataset goes to every worker whole, as its blocks' object refs: the Trainer's
        # sampler shards (see worker.hf_dataset). Rows arrive in the tokenized order, which exact
        # resume and worker-count parity rely on.
        handoff = DataHandoff(prepare_data, relay.channel)
        blocks = handoff.blocks
    payload = WorkerPayload(
        spec, blocks=blocks, use_cpu=not ray_args.uses_gpu, callbacks=[*callbacks, *relay.callbacks],
        torch_threads=ray_args.ray_threads_per_worker,
        whole_node=ray_args.ray_num_workers == 1 and not ray_args.uses_gpu and not streaming,
    )
    datasets = {"train": data.train} if streaming else {}
    trainer = LeanTrainer(
        train_loop_per_worker=train_loop,
        # In the object store, so that Ray Train's controller, which holds the config, never
        # unpickles it: the spec and the callbacks would import transformers and peft there, on
        # the path to starting the workers (11.7 s of a quickstart's start-up on 2 cores).
        train_loop_config={"payload": ray.put(payload)},
        backend_config=_backend_config(spec, ray_args),
        scaling_config=ScalingConfig(
            num_workers=ray_args.ray_num_workers,
            use_gpu=ray_args.uses_gpu,
            resources_per_worker=dict(ray_args.resources_per_worker),
            placement_strategy=ray_args.placement_strategy,
        ),
        datasets=datasets,
        dataset_config=DataConfig(datasets_to_split=list(datasets), execution_options=_ordered_ingest()),
        run_config=RunConfig(
            name=run_name,
            storage_path=ray_args.ray_storage_path,
            failure_config=FailureConfig(max_failures=ray_args.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=training.save_total_limit),
        ),
    )
    logger.info("starting %d Ray Train workers", ray_args.ray_num_workers)  # they load the model: seconds
    try:
        with relay:
            result = trainer.fit(while_starting=handoff and handoff.deliver)
    finally:
        if handoff is not None:
            handoff.close()
    return result, data if streaming else handoff.data


class DataHandoff:
    """The tokenized data's way to workers that start before it is ready: the driver tokenizes
    while they import their libraries and load the model. ``blocks`` is the ref every worker
    waits on (fabric/worker.py); ``deliver()``, called once the worker group is starting,
    tokenizes and answers it."""

    def __init__(self, prepare_data: Callable[[], "PreparedData"], channel=None):
        self._prepare_data = prepare_data
        self._own_channel = channel is None
        # The progress relay's channel when there is one: a process fewer beside the starting workers.
        self._channel = channel if channel is not None else WorkerChannel.remote()
        self.blocks = self._channel.blocks.remote()
        self.data: "PreparedData | None" = None

    def deliver(self) -> None:
        self.data = self._prepare_data()
        self._channel.deliver.remote(_block_refs(self.data, with_train=True))
        if self._own_channel:
            ray.get(self.blocks)  # stored in this process (the owner) before the actor goes
            self.close()

    def close(self) -> None:
        """A channel of its own goes once the data is delivered (or tokenizing failed): it is a
        process that would wake 100 times a second beside the training. Closing twice is harmless."""
        if self._own_channel:
            ray.kill(self._channel)


def _block_refs(data: "PreparedData", with_train: bool) -> dict[str, list["ray.ObjectRef"]]:
    """What WorkerPayload.blocks resolves to: the tokenized datasets as their blocks' object refs."""
    blocks = {"train": data.train.to_arrow_refs()} if with_train else {}
    if data.eval is not None:
        blocks["eval"] = data.eval.to_arrow_refs()
    return blocks


def _backend_config(spec: JobSpec, ray_args: RayArguments) -> BackendConfig:
    """torch.distributed for the workers only where they talk to each other. A lone CPU worker
    trains as one plain process (fabric/worker.py), so its process group would serve nobody,
    and Ray's torch backend is what imports torch into a Train controller actor (on a cluster;
    fabric/controller_in_driver.py): ~2 CPU-seconds on the path to starting the worker. DeepSpeed joins the
    group even alone; a GPU worker keeps Ray's CUDA device set-up."""
    if ray_args.ray_num_workers == 1 and not ray_args.uses_gpu and not spec.training.values.get("deepspeed"):
        return BackendConfig()
    from ray.train.torch import TorchConfig

    return TorchConfig(backend="nccl" if ray_args.uses_gpu else "gloo")


def _ordered_ingest():
    options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return options


def default_run_name(output_dir: str) -> str:
    """A fresh name per run: Ray Train restores a run that reuses a name, which must be opt-in.

    The random suffix keeps it fresh for runs started in the same second whose output_dirs share
    a last part (LLaMA-Factory's saves/<model>/lora/sft layout) in one storage path.
    """
    import os
    import uuid

    base = os.path.basename(os.path.normpath(output_dir)) or "run"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
