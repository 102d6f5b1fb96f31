"""Ray Train wiring: one TorchTrainer whose workers run a stage's recipe."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable

import ray
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from stages.job import JobSpec

from .args import RayArguments
from .progress import ProgressRelay
from .worker import WorkerPayload, train_loop

if TYPE_CHECKING:
    from transformers import TrainerCallback

logger = logging.getLogger(__name__)


def launch_training(
    spec: JobSpec, ray_args: RayArguments, train_ds: "ray.data.Dataset", eval_ds: "ray.data.Dataset | None" = None,
    callbacks: Iterable["TrainerCallback"] = (), progress: Callable[[dict], None] | None = None,
) -> "ray.train.Result":
    """Fit on ``ray_num_workers`` workers; the result carries the final metrics and checkpoint.
    ``progress``, if given, is called on the driver with each of rank 0's Trainer log records."""
    training = spec.training
    relay = ProgressRelay(progress)
    payload = WorkerPayload(
        spec, has_eval=eval_ds is not None, use_cpu=not ray_args.uses_gpu, callbacks=[*callbacks, *relay.callbacks],
        torch_threads=ray_args.ray_threads_per_worker,
        whole_node=ray_args.ray_num_workers == 1 and not ray_args.uses_gpu and not spec.data.streaming,
    )
    datasets = {"train": train_ds} | ({"eval": eval_ds} if eval_ds is not None else {})
    trainer = TorchTrainer(
        train_loop_per_worker=train_loop,
        # In the object store, so that Ray Train's controller, which holds the config, never
        # unpickles it: the spec and the callbacks would import transformers and peft there, on
        # the path to starting the workers (11.7 s of a quickstart's start-up on 2 cores).
        train_loop_config={"payload": ray.put(payload)},
        torch_config=TorchConfig(backend="nccl" if ray_args.uses_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=ray_args.ray_num_workers,
            use_gpu=ray_args.uses_gpu,
            resources_per_worker=dict(ray_args.resources_per_worker),
            placement_strategy=ray_args.placement_strategy,
        ),
        datasets=datasets,
        # Not split by Ray: the Trainer's sampler shards (see worker.shard_to_hf_dataset); rows
        # arrive in the tokenized order, which exact resume and worker-count parity rely on.
        # A stream is split by Ray: each worker pulls its own share (fabric/streamed_shard.py).
        dataset_config=DataConfig(
            datasets_to_split=["train"] if spec.data.streaming else [], execution_options=_ordered_ingest()
        ),
        run_config=RunConfig(
            name=ray_args.ray_run_name or default_run_name(training.output_dir),
            storage_path=ray_args.ray_storage_path,
            failure_config=FailureConfig(max_failures=ray_args.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=training.save_total_limit),
        ),
    )
    logger.info("starting %d Ray Train workers", ray_args.ray_num_workers)  # they load the model: seconds
    with relay:
        return trainer.fit()


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
