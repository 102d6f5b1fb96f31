"""Config checks of single RL stages, named by their entry in the stage table (``RLSpec.checks``)
and run by load_config with the whole config and ``where(key)`` (the file or override a key came
from). The checks every RL stage shares are cluster/rl_checks.py's."""

from __future__ import annotations

import os
from typing import Callable

from registries.errors import UserError


def is_judge_url(url) -> bool:
    """An OpenAI-style chat URL, which ``reward_model_type: api`` asks as an LLM judge."""
    return bool(url) and str(url).rstrip("/").endswith("/chat/completions")


class RLConfigError(UserError):
    """A config an RL stage cannot run; the message is one paragraph that says how to fix it."""


def check_ppo(run, where: Callable[[str], str]) -> None:
    """Stage ppo's scorers (reward model and/or reward functions), critic and mini-batches."""
    tuning, rl = run.finetuning, run.rl
    if not tuning.reward_model and not rl.reward_funcs and rl.environment in (None, "tools"):  # tools: no rewards
        raise RLConfigError(
            f"stage ppo in {where('stage')} needs something to score completions: reward_model (the output_dir of a "
            "stage rm run) or reward_funcs (e.g. [exact_match] or [my_rewards:score]), or both."
        )
    if tuning.reward_model_type == "api":
        check_reward_api(tuning.reward_model, where)
    if tuning.reward_model_adapters:
        raise RLConfigError(
            f"reward_model_adapters in {where('reward_model_adapters')}: adapters on top of a reward model are not "
            "supported; merge them with `rayfactory export` and point reward_model at the export."
        )
    if rl.critic_init == "reward" and not tuning.reward_model_folder:
        why = ("reward_model is a URL (reward_model_type api), with no weights to start from"
               if tuning.reward_model else "no reward_model is set")
        raise RLConfigError(
            f"critic_init reward in {where('critic_init')} starts the critic from the reward model, but {why}. "
            "Use critic_init: policy, or set reward_model to a stage rm output."
        )
    mini_batch = rl.completions_per_step // rl.ppo_buffer_size
    ranks = max(run.ray.ray_num_workers, run.ray.critic_num_workers if rl.uses_critic else 1)
    if mini_batch < ranks:
        raise RLConfigError(
            f"a PPO step's {rl.completions_per_step} completions in ppo_buffer_size {rl.ppo_buffer_size} mini-batches "
            f"leave {mini_batch} per mini-batch, fewer than the {ranks} policy/critic workers that each need one. "
            f"Lower ppo_buffer_size (in {where('ppo_buffer_size')}) or raise rollout_batch_size."
        )


def check_judge_keys(run, where: Callable[[str], str]) -> None:
    """The reward_judge_* keys configure an LLM judge, which only stage ppo's reward_model can be."""
    tuning, rl = run.finetuning, run.rl
    keys = [k for k in ("reward_judge_rubric", "reward_judge_model") if getattr(rl, k) is not None]
    if rl.reward_judge_max_score != 10.0:
        keys.append("reward_judge_max_score")
    judged = tuning.reward_model_type == "api" and is_judge_url(tuning.reward_model)  # only ppo reads reward_model
    if keys and not judged:
        raise RLConfigError(
            f"{keys[0]} in {where(keys[0])} configures an LLM judge, but this run has none: the judge is stage ppo's "
            "reward_model with reward_model_type api and an OpenAI-style chat URL ending in /chat/completions (e.g. "
            "http://host:8000/v1/chat/completions). Set those, or remove the reward_judge_* keys."
        )


def check_reward_api(url, where: Callable[[str], str]) -> None:
    """reward_model_type api: reward_model is the http(s) URL of a reward server or an LLM judge."""
    from urllib.parse import urlsplit

    problem = None
    if not url:
        problem = "reward_model is not set"
    else:
        try:
            parts = urlsplit(str(url))
            parts.port  # noqa: B018  (raises ValueError for a port that is not a number)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                problem = f"reward_model {url!r} is not an http:// or https:// URL with a host"
        except ValueError as exc:
            problem = f"reward_model {url!r} is not a valid URL ({exc})"
    if problem:
        raise RLConfigError(
            f"reward_model_type api in {where('reward_model_type')} scores completions through a remote API, so "
            f"reward_model (in {where('reward_model')}) must be its URL, but {problem}. Set reward_model to e.g. "
            "http://rm-host:8000/v1/score (`rayfactory serve` of a stage rm output), a server speaking OpenRLHF's "
            "remote reward JSON (http://host:5000/get_reward), or an LLM judge's "
            "http://host:8000/v1/chat/completions; or, for a reward model folder, set reward_model_type lora or full."
        )


def check_ppo_reward_model(run, where: Callable[[str], str]) -> None:
    """The reward model folder is the output of a stage rm run, of the configured type."""
    from stages.training.value_head import VALUE_HEAD_FILE, is_adapter_folder

    tuning = run.finetuning
    folder = tuning.reward_model_folder  # None for reward_model_type api (a URL)
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
