"""Preference learning on a real model, without crutches: LoRA dpo, kto and orpo on
SmolLM2-135M-Instruct (``demo:smollm2-135m-instruct``) with the preference loss alone (pref_ftx 0),
judged on held-out pairs the base model gets right at chance (arith_pref_eval: unseen "What is
a+b?" prompts, the right sum against a near miss; SmolLM2 gives the right sum the higher log-prob
on 0.49 of them), and a reward model judged on the held-out half of our ranking data.

Every test here is ``slow`` (learning claims on a real model): 8 dpo steps, after which the loss
falls and the saved adapter, loaded on its base, already prefers the right sums on held-out prompts
(~1 min); the example configs as they are (one epoch, ~4-6 min each here), with clear held-out gains;
benchmarks/preference_learning.py reports the same figures over several seeds (benchmarks/README.md).
"""

from __future__ import annotations

import os

import pytest
import yaml

from cluster.driver import run_exp
from registries.datasets import DataArguments
from stages.run_args import ModelArguments
from stages.training.callbacks import read_log
from stages.loading import load_tokenizer_and_template
from stages.recipes.preference import judge_adapter
from stages.training.value_head import reward_accuracy
from stages.loading import load_reward_model
from tests.e2e.conftest import DATA_DIR, REPO_ROOT, tokenized_pairs


def example_config(name: str, tmp_path, evaluate: bool = False, **overrides) -> dict:
    """configs/<name> writing under tmp_path; without ``evaluate`` no evaluation inside the run
    (the policies are judged on the saved adapter instead, by held_out_report)."""
    with open(os.path.join(REPO_ROOT, "configs", name), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    if not evaluate:
        config.pop("eval_dataset")
        config["eval_strategy"] = "no"
    return {**config, "dataset_dir": DATA_DIR, "output_dir": str(tmp_path / "out"),
            "ray_storage_path": str(tmp_path / "ray"), "plot_loss": False, **overrides}


def held_out_report(adapter_dir: str, beta: float | None) -> dict:
    """stages.recipes.preference.judge_adapter on arith_pref_eval; ``beta`` None: no implied reward."""
    return judge_adapter(adapter_dir, "arith_pref_eval", DATA_DIR, beta)


@pytest.mark.slow  # a learning claim (held-out gains); dpo's mechanics are test_dpo.py's, the real model's test_demo_model.py's
def test_a_few_dpo_steps_alone_on_the_real_model_move_held_out_rewards(ray_session, tmp_path):
    config = example_config("smollm2_lora_dpo.yaml", tmp_path, max_steps=8, logging_steps=1, warmup_steps=1,
                            learning_rate=1.0e-3)
    assert config["pref_ftx"] == 0
    result = run_exp(config)

    train = [r for r in read_log(result.output_dir) if "loss" in r]
    assert len(train) == 8
    assert sum(r["loss"] for r in train[-3:]) / 3 < train[0]["loss"] - 0.05, [r["loss"] for r in train]
    report = held_out_report(result.output_dir, config["pref_beta"])
    print(f"held-out after 8 steps: {report}")
    # Measured: base 0.49, after 8 steps 0.74 (log-prob accuracy), implied reward 0.68 / +0.28.
    assert report["base_accuracy"] <= 0.6, report  # the base is at chance on these pairs
    assert report["trained_accuracy"] >= report["base_accuracy"] + 0.1, report
    assert report["reward_accuracy"] > 0.55 and report["reward_margin"] > 0, report


# The example configs as shipped (one epoch, seed 42), and the held-out accuracy each must reach: log-prob,
# and implied reward (orpo has no reference model, so none). Measured with seed 42: dpo 0.94 / 0.95,
# kto 0.76 / 0.80, orpo 0.94; kto varies most with the seed (benchmarks/README.md has seeds 42, 1, 2).
LEARNS = {"smollm2_lora_dpo.yaml": (0.85, 0.85), "smollm2_lora_kto.yaml": (0.7, 0.7),
          "smollm2_lora_orpo.yaml": (0.85, None)}


@pytest.mark.slow
@pytest.mark.parametrize("example", list(LEARNS))
def test_the_preference_loss_alone_learns_held_out_preferences_on_the_real_model(ray_session, tmp_path, example):
    config = example_config(example, tmp_path)
    assert config.get("pref_ftx", 0) == 0  # orpo's NLL term is part of orpo, not an added SFT term
    result = run_exp(config)

    log_prob_target, reward_target = LEARNS[example]
    report = held_out_report(result.output_dir, None if reward_target is None else config["pref_beta"])
    print(f"{example}: {report}")
    assert report["base_accuracy"] <= 0.6, report
    assert report["trained_accuracy"] >= log_prob_target, report
    if reward_target is not None:
        assert report["reward_accuracy"] >= reward_target and report["reward_margin"] > 0, report


@pytest.mark.slow
def test_the_reward_model_learns_held_out_pairs_of_the_shipped_ranking_data(ray_session, tmp_path):
    """configs/smollm2_lora_rm.yaml as shipped: its own evaluation on arith_format_pref_eval (unseen
    prompts) before step 1 (the untrained value head) and after, and the saved model reloaded."""
    config = example_config("smollm2_lora_rm.yaml", tmp_path, evaluate=True)
    assert config["eval_dataset"] == "arith_format_pref_eval" and config["eval_on_start"]
    result = run_exp(config)

    evals = [r for r in read_log(result.output_dir) if "eval_accuracy" in r]
    assert evals[0]["current_steps"] == 0 and evals[0]["eval_accuracy"] <= 0.7, evals
    model, tokenizer = load_reward_model(result.output_dir)
    pairs = tokenized_pairs("arith_format_pref_eval", "rm", tokenizer, load_tokenizer_and_template(
        ModelArguments(model_name_or_path=result.output_dir), DataArguments(template="smollm2"))[1])
    assert reward_accuracy(model, pairs, tokenizer.pad_token_id) >= 0.9
