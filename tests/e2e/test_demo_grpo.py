"""GRPO on a real model (slow, opt-in: ~30 min here): configs/smollm2_lora_grpo.yaml as shipped.

SmolLM2-135M-Instruct answers "What is a+b?" at length and gets the sum right about half the
time, so each group of 8 samples holds better and worse answers and the rule rewards
(final_number: the last number in the answer is the sum; short_answer) give a signal from step 1.
The run's own evaluation scores greedy answers to the 80 held-out questions of arith_eval before
training, every 10 steps and at the end. The tiny-model GRPO tests (tests/e2e/test_grpo.py) cover
the pipeline in the default suite; benchmarks/README.md has this run's figures.
"""

from __future__ import annotations

import pytest

from cluster.driver import run_exp
from stages.training.callbacks import read_log
from tests.e2e.conftest import example_config


@pytest.mark.slow
def test_grpo_example_on_the_real_model_gets_more_held_out_sums_right_in_fewer_words(ray_session, tmp_path):
    config = example_config("smollm2_lora_grpo.yaml", tmp_path, plot_loss=False)
    result = run_exp(config)

    evals = [r for r in read_log(result.output_dir) if "eval_reward" in r]
    first, last = evals[0], evals[-1]
    print("held-out greedy:", [(r["current_steps"], r["eval_rewards/final_number"], r["eval_rewards/short_answer"])
                               for r in evals])
    assert first["current_steps"] == 0 and last["current_steps"] == config["max_steps"]
    assert first["eval_rewards/final_number"] <= 0.6, first  # the base model is right about half the time
    assert last["eval_rewards/final_number"] >= first["eval_rewards/final_number"] + 0.1, evals
    assert last["eval_rewards/short_answer"] >= first["eval_rewards/short_answer"] + 0.25, evals  # and says less
    steps = [r for r in read_log(result.output_dir) if r.get("current_steps", 0) > 0 and "reward" in r]
    assert sum(r["reward"] for r in steps[-10:]) / 10 > sum(r["reward"] for r in steps[:10]) / 10 + 0.4
