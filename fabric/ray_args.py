"""RayArguments: where a run's workers live and how many there are.

Ray's own names where it has them (placement strategies, resources), ``ray_`` prefixes where a
bare name would clash with a trainer option. cluster/config.py checks types and ranges.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from registries.errors import ArgumentError

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# ray_storage_path's default, a folder inside output_dir (cluster/paths.py sets it where the config is
# read): every copy of a run's checkpoints lies under its own output_dir.
DEFAULT_STORAGE_DIR = "ray_results"


@dataclass
class RayArguments:
    # None: connect to the cluster in RAY_ADDRESS (``ray job submit`` sets it), else start a local one.
    ray_address: str | None = None
    ray_num_workers: int = 1  # Ray Train workers (data-parallel ranks); RL: the policy's ranks
    # each worker's Ray resources, e.g. {CPU: 4, GPU: 1}
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    # how the workers' bundles are placed on nodes (Ray placement groups)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # Where Ray Train copies each checkpoint (a worker group's restarts after a failure restore it);
    # None: output_dir/ray_results. Ray needs an absolute path (or a URI such as s3://...); relative
    # paths resolve against the directory the run is started from, here on the driver, so workers agree on it.
    ray_storage_path: str | None = None
    ray_run_name: str | None = None  # Ray Train's run name; None: made from output_dir and the time
    # extra ray.init arguments for a local Ray (e.g. object_store_memory)
    ray_init_kwargs: dict[str, Any] = field(default_factory=dict)
    max_failures: int = 0  # worker-group restarts (Ray Train FailureConfig); -1 retries forever
    # torch threads in each CPU train worker (RL: each policy rank). None: a lone worker
    # (ray_num_workers: 1, not streaming; RL: no critic) uses every CPU Ray has on its node;
    # several workers use their CPU share each (resources_per_worker's CPU, Ray's own rule).
    # fabric/threads.py says why.
    ray_threads_per_worker: int | None = None
    # Where a lone worker trains. None: in the driver process (Ray Train's local mode: no worker
    # process to start, torch imported once) when worker_group_reasons() finds nothing that needs
    # a worker group and the driver runs on a local Ray it started itself; false: always a Ray
    # Train worker group; true: in the driver, refused where a worker group is needed.
    # fabric/train_in_driver.py says why.
    train_in_driver: bool | None = None
    # Logical CPUs for a local ray.init; None lets Ray count them. Declaring more than the
    # machine has lets a streaming Ray Data pipeline run next to CPU-holding train workers.
    ray_num_cpus: int | None = None
    # RL stages: the policy is ray_num_workers x resources_per_worker (a reference policy lives in
    # the same processes); the rollout engines are placed as these keys say.
    rollout_num_engines: int = 1
    rollout_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})  # each engine's Ray resources
    rollout_tensor_parallel_size: int = 1  # GPUs per engine (vLLM tensor parallel); CPU engines: 1
    colocate_rollout: bool = False  # engines share the policy workers' bundles instead of their own
    # Stage ppo: the critic's ranks (DDP, like the policy's) and the reward model's actors.
    critic_num_workers: int | None = None  # None: ray_num_workers
    critic_resources: dict[str, float] | None = None  # None: resources_per_worker
    reward_num_workers: int = 1  # actors of a ppo reward model
    reward_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})  # each reward actor's Ray resources
    colocate_critic_reward: bool = False  # the reward model sits on the critic's bundles (OpenRLHF's option)
    colocate_all: bool = False  # every role (critic, reward, rollout) shares the policy workers' bundles

    def __post_init__(self) -> None:
        if self.ray_num_workers < 1:
            raise ArgumentError(
                "ray_num_workers",
                f"ray_num_workers must be at least 1, got {self.ray_num_workers}. It is the number of "
                "Ray Train workers (one per GPU when resources_per_worker has GPU: 1).",
            )
        if self.max_failures < -1:
            raise ArgumentError(
                "max_failures", f"max_failures must be >= 0 (or -1: retry forever), got {self.max_failures}."
            )
        if self.ray_num_cpus is not None and self.ray_num_cpus < 1:
            raise ArgumentError(
                "ray_num_cpus", f"ray_num_cpus must be at least 1, got {self.ray_num_cpus} (or remove it)."
            )
        if self.ray_threads_per_worker is not None and self.ray_threads_per_worker < 1:
            raise ArgumentError(
                "ray_threads_per_worker",
                f"ray_threads_per_worker must be at least 1, got {self.ray_threads_per_worker} (or remove it "
                "for the default: every core for a lone worker, its CPU share for each of several).",
            )
        if self.ray_num_cpus is not None and self.ray_address:
            raise ArgumentError(
                "ray_num_cpus",
                "ray_num_cpus sizes a local Ray, but ray_address joins an existing cluster, whose CPUs are "
                "fixed when it starts. Remove one of them.",
            )
        if self.critic_num_workers is None:
            self.critic_num_workers = self.ray_num_workers
        if self.critic_resources is None:
            self.critic_resources = dict(self.resources_per_worker)
        for key in ("resources_per_worker", "rollout_resources", "critic_resources", "reward_resources"):
            _check_resources(key, getattr(self, key))
        for key in ("rollout_num_engines", "rollout_tensor_parallel_size", "critic_num_workers", "reward_num_workers"):
            if getattr(self, key) < 1:
                raise ArgumentError(key, f"{key} must be at least 1, got {getattr(self, key)}.")
        path = self.ray_storage_path or None  # None: default_storage(output_dir), set where the config is read
        if path and "://" not in path:
            path = os.path.abspath(os.path.expanduser(path))
        self.ray_storage_path = path

    def resolved_address(self) -> str | None:
        """The cluster to join, or None to start a local Ray. Read when called: the env may change."""
        return self.ray_address or os.environ.get("RAY_ADDRESS") or None

    def worker_group_reasons(self, *, streaming: bool, deepspeed: bool, rl: bool) -> list[str]:
        """What in this run needs a Ray Train worker group (empty: the driver may train)."""
        address = self.resolved_address()
        needs = [
            (self.ray_num_workers != 1, f"ray_num_workers is {self.ray_num_workers}"),
            (self.uses_gpu, "resources_per_worker asks for a GPU (Ray places GPU workers)"),
            (streaming, "streaming is true (Ray Train's ingest splits the stream)"),
            (deepspeed, "deepspeed is set (it joins a process group of workers)"),
            (self.max_failures != 0, f"max_failures is {self.max_failures} (restarts are of a worker group)"),
            (rl, "an RL stage runs its roles as actor groups"),
            (address is not None, f"the run joins the Ray cluster at {address}"),
            ("://" in (self.ray_storage_path or ""),
             f"ray_storage_path is {self.ray_storage_path} (Ray Train copies checkpoints there)"),
            (self.ray_run_name is not None, "ray_run_name names a run in Ray storage"),
        ]
        return [reason for needed, reason in needs if needed]

    @property
    def uses_gpu(self) -> bool:
        return float(self.resources_per_worker.get("GPU", 0) or 0) > 0


def default_storage(output_dir: str) -> str:
    """ray_storage_path when the config leaves it out: a folder inside output_dir."""
    return os.path.join(output_dir, DEFAULT_STORAGE_DIR)


def _check_resources(key: str, resources: dict[str, float]) -> None:
    for name, amount in resources.items():
        if name.upper() in ("CPU", "GPU") and name != name.upper():
            raise ArgumentError(
                key,
                f"{key} names {name!r}; Ray's resource names are case-sensitive, so this "
                f"would ask for a custom resource no node has. Write {name.upper()!r}.",
            )
        if amount < 0:
            raise ArgumentError(key, f"{key}[{name!r}] is {amount}; it cannot be negative.")
