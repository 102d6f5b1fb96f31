"""The calculator-tool chain as shipped (configs/sft_calculator.yaml, then configs/grpo_calculator.yaml),
shortened for CI: a brief warm start leaves the tiny model writing a well-formed calculator call in
a minority of its sampled replies; multi-turn GRPO with the built-in tools environment runs the
calls it makes (their results come back as observation turns) and rewards the episodes in which a
tool result came back, and that share rises. The longer figures (and the exact-match accuracy
this model cannot reach: it does not learn to copy digits) are benchmarks/tool_demo.py's."""

from __future__ import annotations

import os
import statistics

from cluster.driver import run_exp
from tests.e2e.test_example_configs import _load
from tests.e2e.test_rl_resume import _steps

WARM_START_STEPS = 150  # ~0.3 of sampled replies call the tool after it (all of them after the full 384)
RL_STEPS = 30


def test_grpo_with_the_calculator_raises_the_share_of_episodes_that_use_it(ray_session, tmp_path, monkeypatch):
    sft_out, rl_out = tmp_path / "sft", tmp_path / "grpo"
    sft = _load(os.path.join("configs", "sft_calculator.yaml"), monkeypatch, [
        f"output_dir={sft_out}", f"ray_storage_path={tmp_path / 'ray'}", f"max_steps={WARM_START_STEPS}",
        "save_steps=1000", "plot_loss=false"])
    run_exp(sft)
    config = _load(os.path.join("configs", "grpo_calculator.yaml"), monkeypatch, [
        f"model_name_or_path={sft_out}", f"output_dir={rl_out}", f"ray_storage_path={tmp_path / 'ray'}",
        f"max_steps={RL_STEPS}", "logging_steps=1", "reward_funcs=[tool_use]",
        "reward_weights=null", "eval_dataset=null", "plot_loss=false"])
    assert config.rl.tools == ["calculator"] and config.rl.environment == "tools"
    result = run_exp(config)

    steps = _steps(result.output_dir)
    assert sorted(steps) == list(range(1, RL_STEPS + 1))
    used = [steps[s]["rewards/tool_use"] for s in range(1, RL_STEPS + 1)]
    assert all(steps[s]["rollout/tool_calls"] == used[s - 1] for s in steps)  # one call, then the answer
    assert all(steps[s]["rollout/turns"] == 1 + used[s - 1] for s in steps)
    assert 0.02 < statistics.mean(used[:5]) < 0.7  # the warm start left room, and a signal
    assert statistics.mean(used[-5:]) > statistics.mean(used[:5]) + 0.15, used
    assert max(steps[s]["rollout/observation_token_fraction"] for s in steps) > 0.1
