"""The calculator tool demo on a real model (slow, opt-in: ~15 min here): benchmarks/tool_demo.py's
``--model smollm2`` run for one seed.

SmolLM2-135M-Instruct gets multi-digit sums and products wrong on its own (1 of calc_eval's 100
held-out problems by the last number of its reply). A warm start of 8 LoRA steps on our calculator
demonstrations leaves it writing the call in about half of its greedy replies; multi-turn GRPO with
the built-in calculator (results come back as observation turns) then raises both the call rate and
the exact-match accuracy of the final answer on the held-out problems. The seeds' figures are in
benchmarks/README.md ("tool_demo.py"); the tiny-model CI version is tests/e2e/test_tool_rl.py.
"""

from __future__ import annotations

import pytest

from tests.bench import load_benchmark

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _benchmark():
    return load_benchmark("tool_demo")


def test_rl_with_the_calculator_adds_held_out_accuracy_to_a_short_warm_start(ray_session, tmp_path):
    bench = _benchmark()
    sft, grpo = bench.MODELS["smollm2"]
    row = bench.run_seed(42, {**sft, "max_steps": 8}, 20, {**grpo, "learning_rate": 2e-4}, str(tmp_path))
    print(row)
    assert row["acc_before"] <= 0.6, row  # the warm start alone leaves room
    assert row["acc_after"] >= row["acc_before"] + 0.3, row
    assert row["tool_after"] >= row["tool_before"] + 0.2, row
    assert row["reward_last5"] > row["reward_first5"] + 0.5, row
