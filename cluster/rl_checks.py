"""Config rules every RL stage (stage table launch rl_controller) shares, checked by load_config
before Ray starts; a stage's own rules are the checks its table entry names (``RLSpec.checks``).

Their policy trains in RayFactory's own loop, not an HF Trainer, so some trainer options do not
apply, and sampling and reward functions are part of the config."""

from __future__ import annotations

import json
import os
from typing import Callable

from registries.errors import ArgumentError, UserError

from stages.rl.config.checks import RLConfigError, check_judge_keys

from .config_types import ConfigError


def check_rl(run, where: Callable[[str], str], local: bool = True, run_modules: bool | None = None) -> None:
    """Rules of the RL stages, whose policy trains in RayFactory's own loop (no HF Trainer).
    ``local``: the run starts on this machine, so its reward modules and files can be checked here.
    ``run_modules`` (default: ``local``) False finds user modules on disk without importing them."""
    run_modules = local if run_modules is None else run_modules
    from stages.rl.controller.rewards import RewardFunctionError, importable_from, load_reward_funcs
    from stages.table import STAGES

    stage = run.finetuning.spec
    try:
        run.rl.check_for_stage(stage)
    except ArgumentError as exc:
        raise ConfigError(f"invalid {exc.key} in {where(exc.key)}: {exc}", key=exc.key) from None
    # The reward functions run in this process (the RL controller's), so loading them now fails a
    # typo before Ray starts; the module then stays imported for the run.
    try:
        if run.rl.reward_funcs:  # on another machine (submit) user modules are found, not run
            with importable_from(os.getcwd()):
                load_reward_funcs(run.rl.reward_funcs, run.rl.reward_weights, run_modules=run_modules)
    except RewardFunctionError as exc:
        raise ConfigError(f"reward_funcs in {where('reward_funcs')}: {exc}") from None
    _check_environment(run, where, run_modules)
    if run.finetuning.reward_model and not stage.rl.reward_model:
        readers = ", ".join(s.name for s in STAGES.values() if s.rl is not None and s.rl.reward_model)
        raise ConfigError(
            f"reward_model in {where('reward_model')}: stage {stage.name} scores completions with "
            f"reward_funcs only; a reward model is read by stage {readers}. Remove reward_model, or use stage: "
            f"{readers}."
        )
    for check in stage.rl.load_checks(local):
        try:
            check(run, where)
        except ConfigError:
            raise
        except UserError as exc:  # a stage's own check (stages/), as the config's paragraph
            raise ConfigError(str(exc)) from None
    if run.training.values.get("deepspeed"):
        _check_deepspeed(run, where)
    if run.model.quantization_bit:
        raise ConfigError(
            f"quantization_bit in {where('quantization_bit')}: QLoRA policies cannot yet be synced into the "
            f"rollout engines of stage {run.finetuning.stage}. Remove quantization_bit."
        )
    options = run.training.values
    if options.get("fp16"):
        raise ConfigError(
            f"fp16 in {where('fp16')}: the RL policy trains without a loss scaler, and Adam on float16 weights "
            "turns untouched weights into NaN. Use bf16: true (GPUs from Ampere on) or float32 (remove fp16)."
        )
    if options.get("lr_scheduler_type") == "reduce_lr_on_plateau":
        raise ConfigError(
            f"lr_scheduler_type reduce_lr_on_plateau in {where('lr_scheduler_type')} needs an eval loss, which "
            f"stage {run.finetuning.stage} does not have. Use constant, linear or cosine."
        )
    if run.generating.temperature <= 0:
        raise ConfigError(
            f"temperature {run.generating.temperature} in {where('temperature')}: greedy rollouts make every "
            "completion of a prompt the same, so no group has anything to compare. Use temperature: 1.0 "
            "(or 0.6-1.0)."
        )
    if run.rl.vllm_importance_sampling_correction and run.generating.temperature != 1.0 and run.rl.correction_by_default:
        raise ConfigError(
            f"async_rollout {run.rl.async_rollout} in {where('async_rollout')} turns rollout correction on by default "
            "(importance weights for samples drawn from older weights), but it needs temperature 1.0: the engines "
            f"report raw log-probs while the trainer's are of the temperature-{run.generating.temperature} "
            "distribution. Use temperature: 1.0, or set vllm_importance_sampling_correction: false to train on "
            "stale samples uncorrected."
        )
    if run.rl.vllm_importance_sampling_correction and run.generating.temperature != 1.0:
        raise ConfigError(
            f"vllm_importance_sampling_correction in {where('vllm_importance_sampling_correction')} with "
            f"temperature {run.generating.temperature}: the engines report raw log-probs (of temperature 1), while "
            "the trainer's are of the temperature-scaled distribution, so their ratio is not the sampling "
            "mismatch and the weights would be wrong. Use temperature: 1.0, or vllm_importance_sampling_correction: "
            "false."
        )
    _check_truncated_sampling(run, where)
    if run.rl.rollout_lora_sync == "adapter":
        _check_adapter_sync(run, where)
    if run.rl.rollout_weight_sync == "collective":
        _check_collective_sync(run, where)
    if run.rl.partial_rollout and run.rl.rollout_lora_sync == "adapter":
        raise ConfigError(
            f"partial_rollout in {where('partial_rollout')} with rollout_lora_sync adapter: an in-flight push loads "
            "the new weights under the requests being generated, but an adapter push swaps the LoRA those "
            "requests were started with, which vLLM cannot do mid-request. Use rollout_lora_sync: merged, or "
            "remove partial_rollout."
        )
    try:
        check_judge_keys(run, where)
    except RLConfigError as exc:
        raise ConfigError(str(exc)) from None
    completions, ranks = run.rl.completions_per_step, run.ray.ray_num_workers
    if completions < ranks:
        raise ConfigError(
            f"rollout_batch_size {run.rl.rollout_batch_size} x num_generations {run.rl.num_generations} = "
            f"{completions} completions a step cannot be shared by ray_num_workers {ranks} policy workers "
            f"(each needs at least one). Raise rollout_batch_size (in {where('rollout_batch_size')}) or lower "
            "ray_num_workers."
        )


def _check_truncated_sampling(run, where: Callable[[str], str]) -> None:
    """Rollout correction reads the engines' raw log-probs (of the whole distribution at temperature
    1), so top_k / top_p, which sample from a cut distribution, would make its weights wrong."""
    rl, generating = run.rl, run.generating
    cut = "top_k" if generating.top_k > 0 else "top_p" if generating.top_p < 1.0 else None
    if not rl.vllm_importance_sampling_correction or cut is None:
        return
    given = f"{cut} {getattr(generating, cut)} (in {where(cut)})"
    why = ("the engines report raw log-probs, of the whole distribution, while top_k / top_p sample from a cut and "
           "renormalised one, so the trainer / sampler ratio is not the sampling mismatch")
    fix = "Set top_k: 0 and top_p: 1.0, or vllm_importance_sampling_correction: false"
    if rl.correction_by_default:
        raise ConfigError(
            f"async_rollout {rl.async_rollout} in {where('async_rollout')} turns rollout correction on by default "
            f"(importance weights for samples drawn from older weights), but with {given} its weights would be "
            f"wrong: {why}. {fix} to train on stale samples uncorrected."
        )
    raise ConfigError(
        f"vllm_importance_sampling_correction in {where('vllm_importance_sampling_correction')} with {given}: "
        f"{why} and the importance weights would be wrong. {fix}."
    )


def _check_environment(run, where: Callable[[str], str], run_modules: bool) -> None:
    """A multi-turn run's environment and tools load (found, not run, when submitted elsewhere)."""
    from stages.rl.agents.environments import EnvironmentSpecError, load_environment
    from stages.rl.controller.rewards import importable_from
    from stages.rl.agents.tools import ToolError, load_tools

    rl = run.rl
    try:
        with importable_from(os.getcwd()):
            if rl.tools:
                # Run here, the python tool's isolation is tried now: a missing piece is named before Ray starts.
                load_tools(rl.tools, run_modules=run_modules, sandbox=rl.sandbox if run_modules else None)
            if rl.environment not in (None, "tools"):
                load_environment(rl.environment, run_module=run_modules)
    except ToolError as exc:
        raise ConfigError(f"tools in {where('tools')}: {exc}") from None
    except EnvironmentSpecError as exc:
        raise ConfigError(f"environment in {where('environment')}: {exc}") from None


def _check_deepspeed(run, where: Callable[[str], str]) -> None:
    """deepspeed: the policy and critic train in a DeepSpeed engine (stages/rl/workers/zero.py). What the
    RL roles cannot do with it is named here; the file itself was read by read_deepspeed_config."""
    config = run.training.values.get("deepspeed")
    if isinstance(config, str) and os.path.isfile(config):  # read_deepspeed_config reads it later, and says
        try:                                                # what is wrong with a path or its JSON
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        except ValueError:
            return
    if not isinstance(config, dict):
        return
    from stages.rl.workers.zero import ZeroConfigError, check_autos

    try:
        check_autos(config, place=f"deepspeed in {where('deepspeed')}")
    except ZeroConfigError as exc:
        raise ConfigError(str(exc)) from None
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage == 3 and run.rl.rollout_backend == "hf" and run.ray.ray_num_workers > 1:
        raise ConfigError(
            f"deepspeed in {where('deepspeed')} is a ZeRO-3 config and rollout_backend is hf with ray_num_workers "
            f"{run.ray.ray_num_workers}: each policy rank would generate its own prompts with transformers, and "
            "under ZeRO-3 every generated token's forward gathers parameters from all ranks, which generations of "
            "different lengths cannot keep in step. Use rollout_backend: vllm, a ZeRO-2 config "
            "(configs/deepspeed/ds_z2_config.json), or ray_num_workers: 1."
        )
    if (config.get("fp16") or {}).get("enabled") is True:
        raise ConfigError(
            f"fp16.enabled is true in the deepspeed config from {where('deepspeed')}: the RL roles train without "
            "a loss scaler (as without DeepSpeed), so fp16 is not offered. Set it to \"auto\" or false, and use "
            "bf16 (bf16.enabled: \"auto\" follows the model's dtype)."
        )


def _check_adapter_sync(run, where: Callable[[str], str]) -> None:
    """rollout_lora_sync adapter: the engines serve the policy's adapter through vLLM's LoRA
    support, which takes plain LoRA on linear layers only."""
    finetuning = run.finetuning
    problem = None
    if finetuning.finetuning_type != "lora":
        problem = f"finetuning_type is {finetuning.finetuning_type}, so there is no adapter to push"
    elif run.rl.rollout_backend != "vllm":
        problem = "rollout_backend is hf, whose policy workers sample from their own weights (nothing is pushed)"
    elif finetuning.use_dora:
        problem = "use_dora is set, and vLLM serves plain LoRA adapters only"
    elif finetuning.additional_target:
        problem = "additional_target trains whole modules beside the adapter, which vLLM's LoRA cannot serve"
    if problem:
        raise ConfigError(
            f"rollout_lora_sync adapter in {where('rollout_lora_sync')}: {problem}. Use rollout_lora_sync: merged "
            "(the adapter merged into a full copy of the weights, which works for every policy)."
        )


def _check_collective_sync(run, where: Callable[[str], str]) -> None:
    """rollout_weight_sync collective: the policy's rank 0 broadcasts full weights to the engines."""
    problem = None
    if run.rl.rollout_backend != "vllm":
        problem = "rollout_backend is hf, whose policy workers sample from their own weights (nothing is pushed)"
    elif run.rl.rollout_lora_sync == "adapter":
        problem = ("rollout_lora_sync is adapter, whose pushes (the adapter alone, a few MB) go through the object "
                   "store, where vLLM's LoRA support loads them")
    if problem:
        raise ConfigError(
            f"rollout_weight_sync collective in {where('rollout_weight_sync')}: {problem}. Use rollout_weight_sync: "
            "object_store, or drop the setting that conflicts."
        )
