"""What runs inside each Ray Train worker: data shard in, stage recipe, checkpoints out."""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import ray.train

from stages.job import JobSpec
from stages.tracking import config_callback, driver_env, tracker_env

if TYPE_CHECKING:
    from transformers import TrainerCallback

# The HF checkpoint folder inside a Ray checkpoint (RayTrainReportCallback's layout).
RAY_CKPT_SUBDIR = "checkpoint"


@dataclass
class WorkerPayload:
    """What every worker of a run gets; pickled once by Ray Train."""

    spec: JobSpec
    # The ref of {"train": [...], "eval": [...]}: the tokenized datasets' blocks (object refs of
    # pyarrow Tables, in row order), which the driver may still be preparing when a worker starts
    # (fabric/launcher.py); a streamed "train" is not here but in Ray Train's ingest
    # (ray.train.get_dataset_shard).
    blocks: "ray.ObjectRef"
    use_cpu: bool = True  # CPU workers must say so, or accelerate treats each one as a lone process
    callbacks: list["TrainerCallback"] = field(default_factory=list)
    torch_threads: Optional[int] = None  # ray_threads_per_worker; None: the rule in fabric/threads.py
    whole_node: bool = False  # a lone CPU worker with no stream beside it: it may use every core
    in_driver: bool = False  # Ray Train's local mode: train_loop runs in the driver (fabric/train_in_driver.py)
    memory: Optional[float] = None  # in the driver: resources_per_worker's memory (bytes), which no Ray resource holds
    tracker_settings: dict = field(default_factory=driver_env)  # filled where the payload is made: the driver


def train_loop(config: dict) -> None:
    """Ray Train's train_loop_per_worker."""
    from ray.train.huggingface.transformers import prepare_trainer
    from transformers import set_seed

    from stages.job import StageJob

    from .ray_session import quiet_ray_data
    from .data.streamed_shard import feed_streamed_shards
    from .threads import set_torch_threads
    from stages.training.cpu_precision import bf16_note

    payload: WorkerPayload = config["payload"]  # put in the object store by launch_training; in the driver, itself
    if isinstance(payload, ray.ObjectRef):
        payload = ray.get(payload)
    spec = payload.spec
    quiet_ray_data()
    set_torch_threads(payload.torch_threads, payload.whole_node)  # fabric/threads.py has the rule and why

    if spec.training.values.get("deepspeed"):
        _join_deepspeed_comm(payload.use_cpu)
    elif ray.train.get_context().get_world_size() == 1:
        _train_as_one_process()
    training_args = spec.training_arguments(use_cpu=payload.use_cpu)
    # report_to: the Trainer's integrations skip logging on other ranks but still import their
    # libraries and (wandb) start processes there; rank 0 alone reports.
    reporting = bool(training_args.report_to) and ray.train.get_context().get_world_rank() == 0
    if not reporting:
        training_args.report_to = []
    set_seed(training_args.seed)  # the stage builds the model (LoRA init) before the Trainer seeds

    def receive_data():
        """The datasets, once the model has loaded: the driver tokenizes while the workers start."""
        blocks = ray.get(payload.blocks)
        train = streamed_train_shard(spec) if spec.data.streaming else hf_dataset("train", blocks["train"])
        return train, hf_dataset("eval", blocks["eval"]) if "eval" in blocks else None

    job = StageJob(
        spec=spec,
        training_args=training_args,
        train_dataset=None,
        receive_data=receive_data,
        callbacks=[_report_callback(in_place=payload.in_driver), *payload.callbacks,
                   *([config_callback(spec)] if reporting else [])],
        resume_from_checkpoint=_resume_point(training_args.resume_from_checkpoint, training_args.output_dir),
        prepare_trainer=lambda trainer: feed_streamed_shards(prepare_trainer(trainer)),
        memory_budget=_memory_budget(payload),
        notes=_console_notes(payload.callbacks),
    )
    note = bf16_note(bool(spec.training.values.get("bf16")), payload.use_cpu)
    if note:
        job.notes.append(note)
    with tracker_env(training_args.output_dir, payload.tracker_settings) if reporting else contextlib.nullcontext():
        metrics = spec.stage.load_runner()(job)
    if not payload.in_driver:  # local mode's result is the last report whole: it would lose the checkpoint's
        ray.train.report({k: v for k, v in metrics.items() if isinstance(v, (int, float))})


def hf_dataset(name: str, blocks: list["ray.ObjectRef"]):
    """Every worker receives the whole tokenized dataset; the Trainer's distributed sampler picks
    this rank's share. That keeps batches identical for any worker count and lets a resumed run
    skip exactly the batches it already saw."""
    import datasets
    import pyarrow as pa

    tables = [table for table in ray.get(blocks) if table.num_rows]
    if not tables:
        return datasets.Dataset.from_dict({})
    # Our own fingerprint: without one, datasets hashes the whole table, pickling every column
    # with dill (slow for large data; dill also disassembles the reducer it pickles, printing
    # under a swapped stdout).
    table = pa.concat_tables(tables, promote_options="default")
    return datasets.Dataset(table, fingerprint=f"ray-{name}-{uuid.uuid4().hex}")


def streamed_train_shard(spec: JobSpec):
    """This worker's share of a streamed training set (``streaming: true``; Ray Train split it)."""
    from .data.streamed_shard import StreamedShard

    return StreamedShard(ray.train.get_dataset_shard("train"), spec.data.buffer_size, spec.training.seed)


def _readable_copy(checkpoint) -> str:
    """A local folder holding ``checkpoint``, for this process alone to read.

    Not Ray's ``to_directory()``: it downloads into one temporary folder per checkpoint, shared by
    every process on the machine, and a process that comes after another has finished downloading
    downloads again into the same folder, over the files the first one is loading (seen with two
    restarted ranks on one machine: safetensors' "incomplete metadata" on model.safetensors). A
    checkpoint on a filesystem mounted here (a local or NFS ray_storage_path) is read in place; a
    remote one (s3://...) is downloaded into a folder of this process's own.
    """
    import tempfile

    import pyarrow.fs

    if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
        return checkpoint.path
    return checkpoint.to_directory(tempfile.mkdtemp(prefix="rayfactory-resume-"))


def _report_callback(in_place: bool = False):
    """Ray's RayTrainReportCallback, but it copies this step's committed checkpoint, after every rank wrote it.

    Each rank copies ``output_dir/checkpoint-N`` and uploads it into one shared Ray checkpoint
    folder. Without the barrier rank 1, which writes only its RNG file, copies the folder while
    rank 0 is still writing the model and optimizer there (seen: a copy holding only
    rng_state_1.pth, 20-40 ms ahead of rank 0), and a half-written file it uploads last wins.
    (stages/training/hf_checkpoints.py's CommitCheckpoints, which runs before this callback, has already
    written the folder's manifest, so the Ray copy carries it too.)

    Ray's own on_save copies the checkpoint-N with the largest N in output_dir. After a resume from
    an earlier checkpoint that can be a folder of the replaced run (or one skipped as half-written),
    which a worker-group restart would then load from Ray storage; so the folder copied here is
    the one of the step just saved.

    ``in_place``: training in the driver (Ray Train's local mode), whose report keeps the last
    Checkpoint object only and copies nothing to Ray storage; the committed folder in output_dir
    is reported as it is (the newest one, which save_total_limit never deletes).
    """
    import shutil
    import tempfile

    from ray.train import Checkpoint
    from ray.train.huggingface.transformers import RayTrainReportCallback

    from stages.training.checkpoints import checkpoint_path
    from stages.training.hf_checkpoints import wait_for_all_ranks

    class ReportAfterAllRanksSaved(RayTrainReportCallback):
        def on_save(self, args, state, control, **kwargs):
            wait_for_all_ranks()
            metrics = {}
            for record in state.log_history:  # the latest value of every metric, as Ray's callback reports
                metrics.update(record)
            if in_place:
                path = checkpoint_path(args.output_dir, state.global_step)
                ray.train.report(metrics=metrics, checkpoint=Checkpoint.from_directory(path))
                return
            with tempfile.TemporaryDirectory() as staging:
                shutil.copytree(checkpoint_path(args.output_dir, state.global_step),
                                os.path.join(staging, self.CHECKPOINT_NAME))
                ray.train.report(metrics=metrics, checkpoint=Checkpoint.from_directory(staging))

    return ReportAfterAllRanksSaved()


def _resume_point(requested: Optional[str], output_dir: str) -> Optional[str]:
    """A restarted worker group resumes from Ray's last reported checkpoint; otherwise the user's
    ``resume_from_checkpoint`` as every stage resolves it (stages/training/checkpoints.py
    ``resolve_resume``: ``auto`` is the newest committed checkpoint-N in output_dir, or a fresh start)."""
    from stages.training.checkpoints import resolve_resume

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        local = _readable_copy(checkpoint)
        nested = os.path.join(local, RAY_CKPT_SUBDIR)
        return nested if os.path.isdir(nested) else local
    return resolve_resume(requested, output_dir, kind="trainer")


def _memory_budget(payload: WorkerPayload):
    """What this worker's training step may fill (stages/training/memory_plan.py): its GPU's free memory; on CPU
    the ``memory`` resource of resources_per_worker, else the node's available memory shared by the
    run's workers on this node. Training in the driver, which holds no Ray resources: that
    ``memory`` too, as the payload carries it, else the machine's available memory."""
    import ray.train.torch

    from stages.training.memory_plan import MemoryBudget, available_system_memory, local_budget

    if not payload.use_cpu:  # Ray Train may show a worker all its node's GPUs; get_device() is this worker's own
        return local_budget(use_cpu=False, device=ray.train.torch.get_device())
    if payload.in_driver:
        reserved = payload.memory
    else:
        reserved = ray.get_runtime_context().get_assigned_resources().get("memory")
    if reserved:
        return MemoryBudget(int(reserved), "resources_per_worker's memory" if payload.in_driver
                            else "the worker's Ray memory resource")
    workers = max(1, ray.train.get_context().get_local_world_size())
    share = "available memory" + (f" / {workers} workers on the node" if workers > 1 else "")
    return MemoryBudget(available_system_memory() // workers, share)


def _console_notes(callbacks) -> list[str]:
    """The list whose lines the progress relay shows on the driver's console (rank 0's, once); a
    list of its own where nothing relays (``run_exp`` from Python: the lines reach the log only)."""
    from .progress import RelayCallback

    return next((cb.notes for cb in callbacks if isinstance(cb, RelayCallback)), [])


def _join_deepspeed_comm(use_cpu: bool) -> None:
    """Hand DeepSpeed the process group Ray Train already set up. Without this, ZeRO-3's
    zero.Init (inside from_pretrained, before the Trainer exists) sees no DeepSpeed comm, takes
    world_size 1 and rejects the train_batch_size that HF computed for all workers."""
    import deepspeed.comm

    deepspeed.comm.init_distributed(dist_backend="gloo" if use_cpu else "nccl", auto_mpi_discovery=False)


def _train_as_one_process() -> None:
    """A lone worker trains its model unwrapped. Ray's torch backend sets LOCAL_RANK in every worker, and
    accelerate then wraps even a world of one in DistributedDataParallel: an all-reduce with
    nobody after every backward, and for full fine-tuning (find_unused_parameters) another walk
    of the autograd graph each step. Without the rank variables the Trainer sees one plain
    process. A lone CPU worker has no process group either (fabric/launcher.py); a GPU one keeps
    Ray's (its checkpoint barrier is a no-op for one rank). DeepSpeed keeps the variables: it
    reads its rank from there."""
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
