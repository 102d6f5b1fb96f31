"""Multi-turn rollouts in the RL loop (stages/rl/controller/episodes.py) end to end: the config names an
environment, every prompt becomes a two-turn conversation (the policy, the environment's
observation, the policy again), the observation's tokens are masked out of the update, reward
functions score the final turn and see the episode's columns, and the run learns.

The environment here asks for a second answer after the first, so a trajectory is reply,
observation, reply; the reward (the share of the final reply's characters that are a to m) is one
the random-init tiny model can learn in a few dozen steps of untruncated sampling (async correction
refuses top_k), which lets the slow test see learning through the multi-turn path. Learning to call
tools needs a model that can write a call first (benchmarks/tool_demo.py warm-starts one).
"""

from __future__ import annotations

import functools
import json

import pytest

from cluster.driver import run_exp
from registries.templates.tools import FunctionCall
from stages.rl.agents.environments import Environment, StepResult, ToolEnvironment
from stages.rl.agents.sandbox import SandboxUnavailable, check_isolation
from stages.rl.agents.tools import load_tools
from tests.ci import skip_or_fail_in_ci
from tests.e2e.conftest import example_config
from tests.e2e.test_grpo import _rewards, _rises
from tests.e2e.test_rl_resume import _steps, ppo_config

class AskTwice(Environment):
    """First reply -> "Again." (no reward); second reply -> done. Writes each row it is reset with
    to ``log`` (a JSON line), so the test sees what reached it."""

    def __init__(self, log: str):
        self.log = log
        self.replies = 0

    def reset(self, row):
        with open(self.log, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row["prompt"]

    def step(self, action):
        self.replies += 1
        if self.replies == 1:
            return StepResult("Again.", 0.0, False)
        return StepResult(None, 0.0, True)


def final_turn_early_letters(prompts, completions, turns, tool_calls, trajectory, a, b, reference, **columns):
    """The share of the last policy turn's non-space characters that are a to m: 0.47 under
    near-uniform sampling of the tiny vocabulary (digits: 0.003, nothing to reinforce). It checks
    what it is called with, so a wrong call fails the run: the final turn is the completion, the
    trajectory holds the observation, the dataset's extra columns (a, b) arrive with the row's
    reference."""
    for text, whole, n, calls, x, y, ref in zip(completions, trajectory, turns, tool_calls, a, b, reference):
        assert whole.endswith(text) and n in (1, 2) and calls == n - 1, (text, whole, n, calls)
        assert ("Again." in whole) == (n == 2) and str(x + y) == ref, (whole, n, x, y, ref)
    out = []
    for text in completions:
        chars = [c for c in text if not c.isspace()]
        out.append(sum("a" <= c <= "m" for c in chars) / len(chars) if chars else 0.0)
    return out


def sums_dataset(folder) -> str:
    """A prompt dataset whose rows carry two columns no role maps (the operands)."""
    folder.mkdir()
    rows = [{"instruction": f"What is {x}+{y}?", "output": str(x + y), "a": x, "b": y}
            for x in range(8) for y in range(5)]
    (folder / "sums.json").write_text(json.dumps(rows))
    (folder / "dataset_info.json").write_text(json.dumps({"sums": {"file_name": "sums.json"}}))
    return str(folder)


def multi_turn(tmp_path) -> dict:
    return dict(environment="tests.e2e.test_grpo_multi_turn:AskTwice",
                environment_kwargs={"log": str(tmp_path / "resets.jsonl")}, max_turns=2, max_completion_length=64,
                max_turn_tokens=8, reward_funcs=["tests.e2e.test_grpo_multi_turn:final_turn_early_letters"],
                reward_weights=None, dataset="sums", dataset_dir=sums_dataset(tmp_path / "data"))


def _resets(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "resets.jsonl").read_text().splitlines()]


def _two_turn_async_run(tmp_path, max_steps: int, **overrides) -> str:
    """grpo, vLLM engine, one_step async: episodes are played on the controller's rollout thread
    while the policy trains; two policy turns per trajectory with the observation between them."""
    config = example_config("grpo_full.yaml", tmp_path, max_steps=max_steps, logging_steps=1, eval_dataset=None,
                            async_rollout="one_step", top_k=0, **multi_turn(tmp_path), **overrides)
    result = run_exp(config)

    steps = _steps(result.output_dir)
    assert sorted(steps) == list(range(1, max_steps + 1))
    staleness = [steps[s]["async/staleness"] for s in range(1, max_steps + 1)]
    # A batch's episodes start when the rollout thread is free (right after the last batch's, as the
    # policy starts training) and are stamped then: one version old, or fresh when a push beat them.
    assert staleness[0] == 0 and set(staleness) <= {0, 1} and staleness.count(1) >= 2 * max_steps // 3, staleness
    assert all(1.0 < steps[s]["rollout/turns"] <= 2.0 for s in steps)
    assert all(0.3 < steps[s]["rollout/observation_token_fraction"] < 0.8 for s in steps)
    resets = _resets(tmp_path)
    assert len(resets) == max_steps * 8 * 8  # steps x prompts x num_generations, one environment each
    row = resets[0]
    assert row["prompt"] == [{"role": "user", "content": f"What is {row['a']}+{row['b']}?"}]
    assert row["reference"] == str(row["a"] + row["b"]) and row["system"] == ""
    return result.output_dir


def test_async_grpo_runs_two_turn_episodes_with_masked_observations(ray_session, tmp_path):
    """The mechanics in 6 steps: turns, observation share, staleness, one environment per episode."""
    _two_turn_async_run(tmp_path, max_steps=6)


@pytest.mark.slow
def test_async_grpo_learns_through_two_turn_episodes_with_masked_observations(ray_session, tmp_path):
    """The same run for 30 steps: the final turn's reward rises. At the example's learning rate
    (3e-3) the untruncated sampler's letters reward rose 0.47 -> 0.63; 1e-2 learns it in 30 steps."""
    assert _rises(_rewards(_two_turn_async_run(tmp_path, max_steps=30, learning_rate=1e-2)))


def test_ppo_with_the_hf_backend_trains_on_two_turn_episodes(ray_session, tmp_path):
    """Stage ppo (critic, GAE over the policy's tokens only) with transformers generate in the policy
    worker: the same episodes, synchronously; the critic's loss falls."""
    config = ppo_config(tmp_path / "out", max_steps=4, max_samples=None, **{**multi_turn(tmp_path),
                                                                            "max_completion_length": 56,
                                                                            "max_turn_tokens": 6})
    result = run_exp(config)

    steps = _steps(result.output_dir)
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(steps[s]["rollout/turns"] > 1.0 and steps[s]["rollout/observation_token_fraction"] > 0 for s in steps)
    assert steps[4]["value_loss"] < steps[1]["value_loss"]


PROGRAM = "import os; print(6 * 7, os.getuid(), os.path.exists('/etc/shadow'))"
SANDBOX_SAYS = "42 65534 False"  # the answer, the sandbox user, and no host file in sight


@functools.lru_cache(maxsize=1)
def _python_tool() -> list:
    return load_tools(["python"], sandbox="isolated")  # once per process: this proves the isolation holds


class ForcedPythonCall(ToolEnvironment):
    """The built-in tools environment with the python tool, except that the first reply is read as
    a call running PROGRAM whatever the policy wrote (a random-init model rarely writes a call), so
    every episode runs code in the sandbox and gets its output back as the observation."""

    def __init__(self):
        super().__init__(_python_tool(), self.first_reply_calls_python)
        self.replies = 0

    def first_reply_calls_python(self, reply: str) -> list[FunctionCall]:
        self.replies += 1
        return [FunctionCall("python", json.dumps({"code": PROGRAM}))] if self.replies == 1 else []


def sandbox_answered(prompts, completions, trajectory, tool_calls, **columns):
    """1.0 per trajectory; it fails the run unless the sandbox's output is in the observation."""
    for whole, calls in zip(trajectory, tool_calls):
        assert calls == 1 and SANDBOX_SAYS in whole, (calls, whole)
    return [1.0] * len(completions)


ANSWERED = "tests.e2e.test_grpo_multi_turn:sandbox_answered"


def test_the_python_tool_example_runs_its_episodes_through_the_sandbox(ray_session, tmp_path):
    """configs/grpo_python_tool.yaml, 3 steps, with every episode's first reply taken as a call to
    the sandboxed python tool: the program runs isolated (as uid 65534, /etc/shadow out of sight)
    and what it printed comes back as the observation the policy answers. The policy samples with
    transformers (rollout_backend hf): the sandbox is the subject here, and a vLLM engine's start
    would be most of the test's time."""
    try:
        check_isolation()
    except SandboxUnavailable as exc:
        skip_or_fail_in_ci(f"this machine cannot isolate a sandboxed run ({exc.piece})")
    config = example_config("grpo_python_tool.yaml", tmp_path, max_steps=3, logging_steps=1, tools=[],
                            environment="tests.e2e.test_grpo_multi_turn:ForcedPythonCall",
                            reward_funcs=["final_number", ANSWERED], rollout_backend="hf")
    result = run_exp(config)

    steps = _steps(result.output_dir)
    assert sorted(steps) == [1, 2, 3]
    for r in steps.values():
        assert r["rollout/turns"] == 2.0 and r["rollout/tool_calls"] == 1.0, r
        assert r[f"rewards/{ANSWERED}"] == 1.0 and "rewards/final_number" in r
