"""The calculator-tool chain as shipped (configs/sft_calculator.yaml, then configs/grpo_calculator.yaml),
shortened for CI: a brief warm start leaves the tiny model writing a well-formed calculator call in
a minority of its sampled replies; multi-turn GRPO with the built-in tools environment runs the
calls it makes (their results come back as observation turns) and rewards the episodes in which a
tool result came back.

Both tests are ``slow`` (the warm start alone is ~40 s). The default suite's tools-environment runs
are test_rl_page.py's (a tiny grpo run with the calculator started from the web UI) and
test_grpo_multi_turn.py's (a forced python call whose output comes back as an observation); the call
parser is tests/stages' test_rl_tools.py. The mechanics run is SHORT_RL_STEPS of GRPO: the calls the
policy itself writes are parsed and run, each step's tool reward is the share of episodes that got a
result back (one call, then the answer), and the observations are in the trajectories. It generates
with rollout_backend hf (the policy worker's own generate: the same tools environment without
starting a vLLM engine; these 6 steps took 38 s against 179 s through vLLM here, from the same warm
start, on a busy machine; multi-turn episodes through vLLM are test_grpo_multi_turn.py's). The warm
start is most of the test's time, and it cannot be much shorter: after 80 steps the policy writes no
call at all. The learning test runs grpo_calculator.yaml as shipped (vLLM) for RL_STEPS and checks
that the share rises. The longer figures (and the exact-match accuracy this model cannot reach: it
does not learn to copy digits) are benchmarks/tool_demo.py's."""

from __future__ import annotations

import os
import statistics

import pytest

from cluster.driver import run_exp
from tests.e2e.test_example_configs import _load
from tests.e2e.test_rl_resume import _steps

# ~0.3 of sampled replies call the tool after it (all of them after the full 384; none after 80)
WARM_START_STEPS = 150
RL_STEPS = 30  # the learning run (slow)
SHORT_RL_STEPS = 6  # the mechanics run (default suite)


def calculator_grpo(tmp_path, monkeypatch, rl_steps: int, *overrides: str) -> tuple[list[float], dict[int, dict]]:
    """The warm start, then ``rl_steps`` of grpo_calculator.yaml rewarded by tool_use alone; the
    share of episodes that used the tool per step, and the steps' records, after the checks every
    such run must pass."""
    sft_out, rl_out = tmp_path / "sft", tmp_path / "grpo"
    sft = _load(os.path.join("configs", "sft_calculator.yaml"), monkeypatch, [
        f"output_dir={sft_out}", f"ray_storage_path={tmp_path / 'ray'}", f"max_steps={WARM_START_STEPS}",
        "save_steps=1000", "plot_loss=false"])
    run_exp(sft)
    config = _load(os.path.join("configs", "grpo_calculator.yaml"), monkeypatch, [
        f"model_name_or_path={sft_out}", f"output_dir={rl_out}", f"ray_storage_path={tmp_path / 'ray'}",
        f"max_steps={rl_steps}", "logging_steps=1", "reward_funcs=[tool_use]",
        "reward_weights=null", "eval_dataset=null", "plot_loss=false", *overrides])
    assert config.rl.tools == ["calculator"] and config.rl.environment == "tools"
    result = run_exp(config)

    steps = _steps(result.output_dir)
    assert sorted(steps) == list(range(1, rl_steps + 1))
    used = [steps[s]["rewards/tool_use"] for s in range(1, rl_steps + 1)]
    assert all(steps[s]["rollout/tool_calls"] == used[s - 1] for s in steps)  # one call, then the answer
    assert all(steps[s]["rollout/turns"] == 1 + used[s - 1] for s in steps)
    assert max(steps[s]["rollout/observation_token_fraction"] for s in steps) > 0.1
    return used, steps


@pytest.mark.slow
def test_grpo_with_the_calculator_runs_the_calls_the_policy_writes(ray_session, tmp_path, monkeypatch):
    used, steps = calculator_grpo(tmp_path, monkeypatch, SHORT_RL_STEPS, "rollout_backend=hf")
    assert 0.02 < statistics.mean(used) < 0.7, used  # the policy's own calls ran: a share, not none or all
    assert all(steps[s]["reward"] == pytest.approx(used[s - 1], abs=1e-5) for s in steps)  # tool_use: the whole reward


@pytest.mark.slow
def test_grpo_with_the_calculator_raises_the_share_of_episodes_that_use_it(ray_session, tmp_path, monkeypatch):
    used, _ = calculator_grpo(tmp_path, monkeypatch, RL_STEPS)
    assert 0.02 < statistics.mean(used[:5]) < 0.7  # the warm start left room, and a signal
    assert statistics.mean(used[-5:]) > statistics.mean(used[:5]) + 0.15, used
