"""A lone local CPU worker's training, run in the driver process (Ray Train's local mode).

On one machine with one CPU worker, a Ray Train worker group does nothing the driver could not
do itself, and it costs start-up: the worker's process boots (1.6 s on 2 cores), imports torch
and Transformers a second time (3.0 s; the driver has them already, for the tokenizer), and Ray
Train starts a synchronization actor and our progress channel beside it. On a tiny LoRA run that
was 7 of 16 seconds (benchmarks/README.md, "Training in the driver"). Ray Train's local mode
(``ScalingConfig(num_workers=0)``) runs the same ``train_loop`` in this process, with the same
``ray.train`` calls (context, report, checkpoint); Ray Data still tokenizes on Ray first.

What local mode leaves to us: its ``report`` keeps only the last Checkpoint object, so the
checkpoint reported is the committed ``output_dir/checkpoint-N`` itself, not a staged copy for
Ray storage (there is no worker group to restart from one); and progress records go straight
to the console, with no channel in between. Runs that need a worker group keep it
(RayArguments.worker_group_reasons); ``train_in_driver: false`` keeps it always.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from stages.job import JobSpec

from fabric.ray_args import RayArguments
from .progress import RelayCallback
from .ray_session import started_local_ray
from .worker import WorkerPayload, train_loop

if TYPE_CHECKING:
    from transformers import TrainerCallback

logger = logging.getLogger(__name__)


def trains_in_driver(spec: JobSpec, ray_args: RayArguments) -> bool:
    """Whether this run trains in the driver: see the module's docstring and RayArguments.train_in_driver.
    Asked before Ray starts (the plan) and at launch; a Ray this process did not start (a cluster
    joined with ray.init by the caller) keeps the worker group unless train_in_driver says otherwise."""
    if ray_args.train_in_driver is not None:
        return ray_args.train_in_driver
    if ray.is_initialized() and not started_local_ray():
        return False
    return not ray_args.worker_group_reasons(
        streaming=spec.data.streaming, deepspeed=bool(spec.training.values.get("deepspeed")),
        rl=spec.stage.launch == "rl_controller",
    )


def train_here(
    spec: JobSpec, ray_args: RayArguments, blocks: dict[str, list["ray.ObjectRef"]], run_name: str,
    callbacks: Iterable["TrainerCallback"] = (), progress: Callable[[dict], None] | None = None,
) -> "ray.train.Result":
    """launch_training's way for a run that trains in the driver, on the tokenized data's blocks."""
    relayed = [RelayCallback(None, on_record=progress)] if progress is not None else []
    payload = WorkerPayload(
        spec, blocks=ray.put(blocks), use_cpu=True, callbacks=[*callbacks, *relayed],
        torch_threads=ray_args.ray_threads_per_worker, whole_node=True, in_driver=True,
        memory=ray_args.resources_per_worker.get("memory"),
    )
    trainer = DataParallelTrainer(
        train_loop_per_worker=train_loop,
        train_loop_config={"payload": payload},  # not pickled: its progress callback holds the console
        scaling_config=ScalingConfig(num_workers=0),
        run_config=RunConfig(name=run_name, storage_path=ray_args.ray_storage_path),
    )
    logger.info("training in this process (one CPU worker on this run's local Ray; train_in_driver: false "
                "starts a Ray Train worker instead)")
    return trainer.fit()
