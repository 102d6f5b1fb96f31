"""Launch an RL stage: place its roles, start them, hand the recipe its roles and prompts.

    placement groups (policy bundles; rollout bundles or the policy's own) -> policy actor group
    (process group, model, optimizer) -> vLLM engines -> prompts from Ray Data -> the stage's
    recipe (stages/grpo.py) -> release everything, also on failure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from stages.job import JobSpec
from stages.rl.roles import PromptRow, RLRun

from .actor_group import ActorGroup
from .args import RayArguments
from .placement import RoleSpec, place_roles, release
from .rl_roles import PolicyActor, RayRoles

if TYPE_CHECKING:
    import ray

logger = logging.getLogger(__name__)

# An engine sharing the policy's GPUs may take this much of each (KV cache included) unless the
# config says vllm_gpu_memory_utilization: the policy, its optimizer and activations need the rest.
COLOCATED_GPU_SHARE = 0.4


@dataclass
class RLResult:
    """What the driver's summary reads (the same fields as a Ray Train result's)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint: Any = None
    error: Optional[BaseException] = None


def launch_rl(spec: JobSpec, ray_args: RayArguments, train_ds: "ray.data.Dataset",
              eval_ds: "ray.data.Dataset | None", tokenizer, template,
              progress: Callable[[dict], None] | None = None) -> RLResult:
    from stages.grpo import count_steps

    rl = spec.rl
    prompts = prompt_rows(train_ds, tokenizer)
    eval_prompts = prompt_rows(eval_ds, tokenizer) if eval_ds is not None else []
    total_updates = count_steps(len(prompts), rl.rollout_batch_size, spec.training) * rl.num_iterations
    placements = place_roles(role_specs(ray_args, rl.rollout_backend), strategy=ray_args.placement_strategy)
    policy = engines = None
    try:
        policy = ActorGroup(PolicyActor, placements["policy"], spec, name="policy")
        policy.init_process_group("nccl" if ray_args.uses_gpu else "gloo")
        policy.scatter(PolicyActor.setup, list(range(policy.size)), policy.size, total_updates)
        weight_sync = None
        if rl.rollout_backend == "vllm":
            engines, weight_sync = _start_engines(spec, ray_args, placements["rollout"])
        run = RLRun(spec, RayRoles(policy, engines, weight_sync), prompts, tokenizer, template,
                    eval_prompts=eval_prompts, on_log=_console_feed(progress))
        metrics = spec.stage.load_runner()(run)
        return RLResult(metrics=metrics)
    finally:
        for group in (engines, policy):
            if group is not None:
                group.kill()
        release(placements)


def role_specs(ray_args: RayArguments, rollout_backend: str) -> list[RoleSpec]:
    """The roles and their resources, as the config's placement keys say."""
    roles = [RoleSpec("policy", ray_args.ray_num_workers, dict(ray_args.resources_per_worker),
                      num_actors_key="ray_num_workers", resources_key="resources_per_worker")]
    if rollout_backend == "vllm":
        roles.append(RoleSpec(
            "rollout", ray_args.rollout_num_engines, dict(ray_args.rollout_resources),
            colocate_with="policy" if ray_args.colocate_rollout else None,
            num_actors_key="rollout_num_engines", resources_key="rollout_resources",
        ))
    return roles


def _start_engines(spec: JobSpec, ray_args: RayArguments, placement):
    from stages.loading import resolve_model_path

    from .rollout.vllm_engine import VLLMEngineConfig, engine_runtime_env
    from .rollout.actor import RolloutActor
    from .weight_sync import ObjectStoreSync

    rl = spec.rl
    config = VLLMEngineConfig(
        model_path=resolve_model_path(spec.model.model_name_or_path),
        dtype=spec.model.load_dtype(bool(spec.training.bf16), bool(spec.training.fp16)),  # the policy's
        kv_cache_bytes=int(rl.vllm_kv_cache_gib * 2**30),
        enforce_eager=rl.vllm_enforce_eager,
        max_model_len=rl.vllm_max_model_len or spec.data.cutoff_len + rl.max_completion_length,
        seed=spec.training.seed,
        tensor_parallel_size=ray_args.rollout_tensor_parallel_size,
        gpu_memory_utilization=rl.vllm_gpu_memory_utilization or (
            COLOCATED_GPU_SHARE if ray_args.colocate_rollout and ray_args.uses_gpu else None),
    )
    engines = ActorGroup(RolloutActor, placement, config, env_vars=engine_runtime_env()["env_vars"], name="rollout")
    return engines, ObjectStoreSync()


def prompt_rows(dataset: "ray.data.Dataset", tokenizer) -> list[PromptRow]:
    """The tokenized prompts in the driver: prompt datasets are small next to the models."""
    rows = []
    for row in dataset.iter_rows():
        input_ids = [int(t) for t in row["input_ids"]]
        labels = [int(t) for t in row.get("labels", []) if int(t) >= 0]
        rows.append(PromptRow(
            input_ids=input_ids,
            prompt_text=tokenizer.decode(input_ids, skip_special_tokens=False),
            reference=tokenizer.decode(labels, skip_special_tokens=True).strip(),
        ))
    return rows


def _console_feed(progress: Callable[[dict], None] | None) -> Callable[[dict], None] | None:
    """trainer_log records -> the console's progress records (a bar that opens on the first)."""
    if progress is None:
        return None
    started = []

    def feed(record: dict) -> None:
        if not started:
            progress({"event": "begin", "step": 0, "max_steps": record.get("total_steps")})
            started.append(True)
        progress({**record, "step": record.get("current_steps", 0)})

    return feed
