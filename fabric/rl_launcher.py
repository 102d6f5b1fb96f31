"""Launch an RL stage: place its roles, start them, hand the recipe its roles and prompts.

    placement groups (policy bundles; rollout, critic and reward bundles or the policy's own)
    -> policy and critic actor groups (process group, model, optimizer each) and reward actors
    -> vLLM engines -> the stage's recipe (its stage table entry's runner) -> release everything,
    also on failure. Which roles start, and how many optimizer updates a step makes, is the stage
    table's ``RLSpec``.

Fault tolerance, as Ray Train's ``max_failures`` for the other stages: when an attempt fails
(a role actor died, a collective broke), every role is torn down and started again from the
latest complete checkpoint in output_dir, up to max_failures times (-1: always). A user error
(a bad reward function, a missing file) is not retried.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from stages.job import JobSpec
from stages.rl.controller.rewards import importable_from
from stages.rl.controller.roles import PromptRow, RLRun

from .actor_group import ActorGroup, gather
from .ray_args import RayArguments
from .placement import RoleSpec, place_roles, release
from .rl_roles import CriticActor, PolicyActor, RayRoles, RewardActor
from .weight_sync import CollectiveSync

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
    from registries.errors import UserError
    from stages.training.checkpoints import latest_committed, resolve_resume

    prompts = prompt_rows(train_ds, tokenizer)
    eval_prompts = prompt_rows(eval_ds, tokenizer) if eval_ds is not None else []
    output_dir = spec.training.output_dir
    resume = resolve_resume(spec.training.resume_from_checkpoint, output_dir, kind="rl")
    failures = 0
    while True:
        run = RLRun(spec, None, prompts, tokenizer, template, eval_prompts=eval_prompts,
                    on_log=_console_feed(progress), resume_from=resume)
        try:
            return RLResult(metrics=_attempt(run, ray_args))
        except (UserError, KeyboardInterrupt):
            raise
        except Exception as exc:
            if ray_args.max_failures != -1 and failures >= ray_args.max_failures:
                raise
            failures += 1
            resume = latest_committed(output_dir, kind="rl")
            logger.warning("RL attempt failed (%s: %s); restarting every role from %s (failure %d of %s)",
                           type(exc).__name__, exc, resume or "the start", failures,
                           "unlimited" if ray_args.max_failures == -1 else ray_args.max_failures)


def _attempt(run: RLRun, ray_args: RayArguments) -> dict:
    """One try: place and start the roles, run the recipe, release everything."""
    from stages.rl.controller.loop import count_steps

    spec, rl = run.spec, run.spec.rl
    steps = count_steps(len(run.prompts), rl.rollout_batch_size, spec.training)
    total_updates = steps * spec.stage.rl.updates_per_step(rl)
    roles = role_specs(ray_args, spec)
    placements = place_roles(roles, strategy=ray_args.placement_strategy)
    groups: list[ActorGroup] = []
    try:
        policy = _trainable_group(PolicyActor, placements["policy"], spec, ray_args, groups)
        critic = _trainable_group(CriticActor, placements["critic"], spec, ray_args, groups) if "critic" in placements else None
        # The roles take turns (sample, score, update): a lone CPU policy beside no critic computes
        # alone while it updates, so it takes the node's cores (a GRPO step on SmolLM2: see
        # benchmarks/README.md); with a critic the two update side by side and keep their share,
        # and so do asynchronous rollouts, where the engines generate while the policy updates.
        policy.call_all(PolicyActor.set_threads, ray_args.ray_threads_per_worker,
                        whole_node=(not ray_args.uses_gpu and policy.size == 1 and critic is None
                                    and not spec.rl.asynchronous))
        reward = None
        if "reward" in placements:
            reward = ActorGroup(RewardActor, placements["reward"], spec, name="reward")
            groups.append(reward)
        # The roles load their models at the same time.
        refs = policy.scatter_async(PolicyActor.setup, list(range(policy.size)), policy.size, total_updates)
        if critic is not None:
            refs += critic.scatter_async(CriticActor.setup, list(range(critic.size)), critic.size, total_updates)
        if reward is not None:
            refs += reward.call_all_async(RewardActor.setup)
        gather(refs)
        engines = weight_sync = None
        if "rollout" in placements:  # vLLM rollouts; hf ones generate inside the policy workers
            engines, weight_sync = _start_engines(spec, ray_args, placements["rollout"])
            groups.append(engines)
            if isinstance(weight_sync, CollectiveSync):  # policy rank 0 and every engine worker form its group
                weight_sync.connect(lambda *group: policy.call_rank0_async(PolicyActor.join_weight_group, *group),
                                    policy.call_rank0(PolicyActor.address_and_free_port), engines.actors,
                                    engine_tp=ray_args.rollout_tensor_parallel_size)
        run.roles = RayRoles(policy, engines, weight_sync, critic=critic, reward=reward)
        # "my_rewards:score" and what it imports as it runs come from the directory the run started
        # in, for the run's length only
        with importable_from(os.getcwd()):
            return spec.stage.load_runner()(run)
    finally:
        for group in reversed(groups):
            group.kill()
        release(placements)


def _trainable_group(actor_cls, placement, spec: JobSpec, ray_args: RayArguments, groups: list) -> ActorGroup:
    group = ActorGroup(actor_cls, placement, spec, name=placement.role)
    groups.append(group)
    group.init_process_group("nccl" if ray_args.uses_gpu else "gloo")
    return group


def role_specs(ray_args: RayArguments, spec: JobSpec) -> list[RoleSpec]:
    """The roles and their resources, as the config's placement keys say."""
    rl = spec.rl
    needed = spec.finetuning.spec.rl.roles(spec.finetuning, rl)  # a JobSpec or a RunConfig
    everything = "policy" if ray_args.colocate_all else None
    roles = [RoleSpec("policy", ray_args.ray_num_workers, dict(ray_args.resources_per_worker),
                      num_actors_key="ray_num_workers", resources_key="resources_per_worker")]
    if "rollout" in needed:
        shares_all = ray_args.colocate_all and not ray_args.colocate_rollout  # the whole bundle, GPU included
        roles.append(RoleSpec(
            "rollout", ray_args.rollout_num_engines, {} if shares_all else dict(ray_args.rollout_resources),
            colocate_with="policy" if ray_args.colocate_rollout else everything,
            num_actors_key="rollout_num_engines", resources_key="rollout_resources",
        ))
    critic = "critic" in needed
    if critic:
        roles.append(RoleSpec(
            "critic", ray_args.critic_num_workers, {} if everything else dict(ray_args.critic_resources),
            colocate_with=everything, num_actors_key="critic_num_workers", resources_key="critic_resources",
        ))
    if "reward" in needed:
        host = everything or (("critic" if critic else "policy") if ray_args.colocate_critic_reward else None)
        roles.append(RoleSpec(
            "reward", ray_args.reward_num_workers, {} if host else dict(ray_args.reward_resources),
            colocate_with=host, num_actors_key="reward_num_workers", resources_key="reward_resources",
        ))
    return roles


def _start_engines(spec: JobSpec, ray_args: RayArguments, placement):
    from stages.loading import resolve_model_path

    from stages.engines.vllm_backend import VLLMEngineConfig

    from .rollout import RolloutActor, engine_runtime_env, rollout_class_options
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
            COLOCATED_GPU_SHARE if (ray_args.colocate_rollout or ray_args.colocate_all) and ray_args.uses_gpu else None),
        rollout_lora_rank=spec.finetuning.lora_rank if rl.rollout_lora_sync == "adapter" else None,
    )
    engines = ActorGroup(RolloutActor, placement, config, env_vars=engine_runtime_env()["env_vars"], name="rollout",
                         class_options=rollout_class_options(rl.partial_rollout))
    if rl.rollout_weight_sync == "collective":
        sync = CollectiveSync("nccl" if ray_args.uses_gpu else "gloo", in_flight=rl.partial_rollout)
    else:
        sync = ObjectStoreSync(payload="full" if rl.rollout_lora_sync == "merged" else "adapter",
                               in_flight=rl.partial_rollout)
    return engines, sync


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
            columns=json.loads(row.get("columns") or "{}"),
            messages=json.loads(row.get("messages") or "[]"),
            system=row.get("system") or "",
            tools=row.get("tools") or "",
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
