"""Config checks of single RL stages, named by their entry in the stage table (``RLSpec.checks``)
and run by load_config with the whole config and ``where(key)`` (the file or override a key came
from). The checks every RL stage shares are cluster/rl_checks.py's."""

from __future__ import annotations

import os
from typing import Callable

from registries.errors import UserError


class RLConfigError(UserError):
    """A config an RL stage cannot run; the message is one paragraph that says how to fix it."""


def check_ppo(run, where: Callable[[str], str]) -> None:
    """Stage ppo's scorers (reward model and/or reward functions), critic and mini-batches."""
    tuning, rl = run.finetuning, run.rl
    if not tuning.reward_model and not rl.reward_funcs:
        raise RLConfigError(
            f"stage ppo in {where('stage')} needs something to score completions: reward_model (the output_dir of a "
            "stage rm run) or reward_funcs (e.g. [exact_match] or [my_rewards:score]), or both."
        )
    if tuning.reward_model_type == "api":
        raise RLConfigError(
            f"reward_model_type api in {where('reward_model_type')}: scoring through a remote reward API is not built "
            "yet. Use a reward model trained by stage rm (reward_model_type lora or full), or reward_funcs with a "
            "function of your own that calls the API: a module with score = "
            "stages.rl.remote_reward.RemoteReward(url) (or JudgeReward(url)) does it, with timeouts and retries "
            "(docs/rl.md, 'Tools, sandbox and remote rewards')."
        )
    if tuning.reward_model_adapters:
        raise RLConfigError(
            f"reward_model_adapters in {where('reward_model_adapters')}: adapters on top of a reward model are not "
            "supported; merge them with `rayfactory export` and point reward_model at the export."
        )
    if rl.critic_init == "reward" and not tuning.reward_model:
        raise RLConfigError(
            f"critic_init reward in {where('critic_init')} starts the critic from the reward model, but no "
            "reward_model is set. Use critic_init: policy, or set reward_model."
        )
    mini_batch = rl.completions_per_step // rl.ppo_buffer_size
    ranks = max(run.ray.ray_num_workers, run.ray.critic_num_workers if rl.uses_critic else 1)
    if mini_batch < ranks:
        raise RLConfigError(
            f"a PPO step's {rl.completions_per_step} completions in ppo_buffer_size {rl.ppo_buffer_size} mini-batches "
            f"leave {mini_batch} per mini-batch, fewer than the {ranks} policy/critic workers that each need one. "
            f"Lower ppo_buffer_size (in {where('ppo_buffer_size')}) or raise rollout_batch_size."
        )


def check_ppo_reward_model(run, where: Callable[[str], str]) -> None:
    """The reward model folder is the output of a stage rm run, of the configured type."""
    from stages.training.value_head import VALUE_HEAD_FILE, is_adapter_folder

    tuning = run.finetuning
    folder = tuning.reward_model
    if folder:
        if not os.path.isdir(folder):
            raise RLConfigError(
                f"reward_model {folder!r} in {where('reward_model')} does not exist (looked for "
                f"{os.path.abspath(folder)}). Point it at the output_dir of a stage rm run."
            )
        if not os.path.isfile(os.path.join(folder, VALUE_HEAD_FILE)):
            raise RLConfigError(
                f"reward_model {folder!r} in {where('reward_model')} holds no {VALUE_HEAD_FILE}, so it is not a reward "
                "model saved by stage rm. Point it at the output_dir (or a checkpoint) of an rm run."
            )
        adapter = is_adapter_folder(folder)
        if adapter != (tuning.reward_model_type == "lora"):
            kind = "a LoRA adapter" if adapter else "a full model"
            raise RLConfigError(
                f"reward_model {folder!r} is {kind}, but reward_model_type is {tuning.reward_model_type!r} "
                f"(in {where('reward_model_type')}). Set reward_model_type: {'lora' if adapter else 'full'}."
            )
