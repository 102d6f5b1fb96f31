"""Config rules of the RL stages (stage table launch rl_controller), checked on the driver before Ray starts.

Their policy trains in RayFactory's own loop, not an HF Trainer, so some trainer options do not
apply, and sampling and reward functions are part of the config."""

from __future__ import annotations

import os
import sys
from typing import Callable

from registries.errors import ArgumentError

from .config_types import ConfigError


def check_rl(run, where: Callable[[str], str]) -> None:
    """Rules of the RL stages, whose policy trains in RayFactory's own loop (no HF Trainer)."""
    from stages.rl.rewards import RewardFunctionError, load_reward_funcs

    if run.finetuning.stage == "ppo":
        _ppo_defaults(run)
    try:
        run.rl.check_for_stage(run.finetuning.stage)
    except ArgumentError as exc:
        raise ConfigError(f"invalid {exc.key} in {where(exc.key)}: {exc}") from None
    # "my_rewards:score" names a module in the directory the run starts from, as `python -m` would
    # find it (the rayfactory script's own sys.path lacks that directory). The reward functions
    # run in this process, the controller's: loading them now fails a typo before Ray starts.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        if run.rl.reward_funcs or run.finetuning.stage == "grpo":
            load_reward_funcs(run.rl.reward_funcs, run.rl.reward_weights)
    except RewardFunctionError as exc:
        raise ConfigError(f"reward_funcs in {where('reward_funcs')}: {exc}") from None
    if run.finetuning.stage == "ppo":
        _check_ppo(run, where)
    elif run.finetuning.reward_model:
        raise ConfigError(
            f"reward_model in {where('reward_model')}: stage {run.finetuning.stage} scores completions with "
            "reward_funcs only; a reward model is read by stage ppo. Remove reward_model, or use stage: ppo."
        )
    if run.training.values.get("deepspeed"):
        raise ConfigError(
            f"deepspeed in {where('deepspeed')}: stage {run.finetuning.stage} trains its policy with DDP across "
            "ray_num_workers; DeepSpeed ZeRO for RL policies is not built yet. Remove deepspeed (use LoRA or "
            "more workers to fit the model)."
        )
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
    # Sampling: LLaMA-Factory's chat defaults (temperature 0.95, top_p 0.7, top_k 50) would make the
    # policy learn from a truncated distribution; RL samples from the model itself unless told otherwise.
    for key, value in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0)):
        if key not in run.raw:
            setattr(run.generating, key, value)
    if run.generating.temperature <= 0:
        raise ConfigError(
            f"temperature {run.generating.temperature} in {where('temperature')}: greedy rollouts make every "
            "completion of a prompt the same, so no group has anything to compare. Use temperature: 1.0 "
            "(or 0.6-1.0)."
        )
    completions, ranks = run.rl.completions_per_step, run.ray.ray_num_workers
    if completions < ranks:
        raise ConfigError(
            f"rollout_batch_size {run.rl.rollout_batch_size} x num_generations {run.rl.num_generations} = "
            f"{completions} completions a step cannot be shared by ray_num_workers {ranks} policy workers "
            f"(each needs at least one). Raise rollout_batch_size (in {where('rollout_batch_size')}) or lower "
            "ray_num_workers."
        )


def _ppo_defaults(run) -> None:
    """Stage ppo's own defaults for keys the config leaves out (grpo's differ), and LLaMA-Factory's
    way of sizing a PPO step: per_device_train_batch_size x gradient_accumulation_steps x
    ppo_buffer_size prompts per worker, answered max_new_tokens long."""
    from stages.rl.args import PPO_DEFAULTS

    for key, value in PPO_DEFAULTS.items():
        if key not in run.raw:
            setattr(run.rl, key, value)
    rl, options = run.rl, run.training
    if "rollout_batch_size" not in run.raw:
        per_worker = int(options.per_device_train_batch_size) * int(options.gradient_accumulation_steps)
        rl.rollout_batch_size = per_worker * rl.ppo_buffer_size * run.ray.ray_num_workers
    if "max_completion_length" not in run.raw and "max_new_tokens" in run.raw:
        rl.max_completion_length = int(run.generating.max_new_tokens)


def _check_ppo(run, where: Callable[[str], str]) -> None:
    from stages.value_head import VALUE_HEAD_FILE, is_adapter_folder

    tuning, rl = run.finetuning, run.rl
    if not tuning.reward_model and not rl.reward_funcs:
        raise ConfigError(
            f"stage ppo in {where('stage')} needs something to score completions: reward_model (the output_dir of a "
            "stage rm run) or reward_funcs (e.g. [exact_match] or [my_rewards:score]), or both."
        )
    if tuning.reward_model_type == "api":
        raise ConfigError(
            f"reward_model_type api in {where('reward_model_type')}: scoring through a remote reward API is not built "
            "yet. Use a reward model trained by stage rm (reward_model_type lora or full), or reward_funcs with a "
            "function of your own that calls the API."
        )
    if tuning.reward_model_adapters:
        raise ConfigError(
            f"reward_model_adapters in {where('reward_model_adapters')}: adapters on top of a reward model are not "
            "supported; merge them with `rayfactory export` and point reward_model at the export."
        )
    folder = tuning.reward_model
    if folder:
        if not os.path.isdir(folder):
            raise ConfigError(
                f"reward_model {folder!r} in {where('reward_model')} does not exist (looked for "
                f"{os.path.abspath(folder)}). Point it at the output_dir of a stage rm run."
            )
        if not os.path.isfile(os.path.join(folder, VALUE_HEAD_FILE)):
            raise ConfigError(
                f"reward_model {folder!r} in {where('reward_model')} holds no {VALUE_HEAD_FILE}, so it is not a reward "
                "model saved by stage rm. Point it at the output_dir (or a checkpoint) of an rm run."
            )
        adapter = is_adapter_folder(folder)
        if adapter != (tuning.reward_model_type == "lora"):
            kind = "a LoRA adapter" if adapter else "a full model"
            raise ConfigError(
                f"reward_model {folder!r} is {kind}, but reward_model_type is {tuning.reward_model_type!r} "
                f"(in {where('reward_model_type')}). Set reward_model_type: {'lora' if adapter else 'full'}."
            )
    if rl.critic_init == "reward" and not folder:
        raise ConfigError(
            f"critic_init reward in {where('critic_init')} starts the critic from the reward model, but no "
            "reward_model is set. Use critic_init: policy, or set reward_model."
        )
    mini_batch = rl.completions_per_step // rl.ppo_buffer_size
    ranks = max(run.ray.ray_num_workers, run.ray.critic_num_workers if rl.uses_critic else 1)
    if mini_batch < ranks:
        raise ConfigError(
            f"a PPO step's {rl.completions_per_step} completions in ppo_buffer_size {rl.ppo_buffer_size} mini-batches "
            f"leave {mini_batch} per mini-batch, fewer than the {ranks} policy/critic workers that each need one. "
            f"Lower ppo_buffer_size (in {where('ppo_buffer_size')}) or raise rollout_batch_size."
        )
