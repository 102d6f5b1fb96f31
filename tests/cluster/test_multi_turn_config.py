"""The multi-turn keys (environment, environment_kwargs, tools, max_turns, max_turn_tokens) and
dynamic sampling's max_num_gen_batches: what they imply, and each mistake's message."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, load_config
from tests.stages.test_rl_loss_variants import GRPO


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_tools_imply_the_built_in_tool_environment_and_single_turn_is_the_default():
    rl = load_config({**GRPO, "tools": ["calculator", "python"], "max_turns": 3, "max_turn_tokens": 16}).rl
    assert (rl.environment, rl.tools, rl.max_turns, rl.max_turn_tokens, rl.multi_turn) == (
        "tools", ["calculator", "python"], 3, 16, True)
    assert not load_config(GRPO).rl.multi_turn


def test_a_custom_environment_is_found_and_gets_its_kwargs(tmp_path):
    (tmp_path / "my_env.py").write_text("class Env:\n    def __init__(self, level):\n        self.level = level\n")
    rl = load_config({**GRPO, "environment": "my_env:Env", "environment_kwargs": {"level": 2}}).rl
    assert (rl.environment, rl.environment_kwargs) == ("my_env:Env", {"level": 2})


@pytest.mark.parametrize("bad, message", [
    ({"environment": "tools"}, "environment tools runs the tools the policy calls, but tools lists none"),
    ({"environment": "my_env:Env", "tools": ["calculator"]}, "which lists its own tools"),
    ({"environment_kwargs": {"level": 2}}, "environment_kwargs are the arguments of a custom environment"),
    ({"tools": ["calculator"], "max_turns": 0}, "max_turns must be at least 1"),
    ({"tools": ["calculator"], "max_turn_tokens": 64, "max_completion_length": 32},
     "max_turn_tokens 64 caps one policy turn, but max_completion_length 32"),
    ({"tools": ["calc"]}, r"tools in the config dict: Unknown tool 'calc'. Built-ins: \['calculator', 'python'\]"),
    ({"tools": ["nowhere:tool"]}, "Tool 'nowhere:tool': module 'nowhere' was not found"),
    ({"environment": "nowhere:Env"}, "environment in the config dict: Environment 'nowhere:Env': module 'nowhere' was "
                                     "not found"),
    ({"max_num_gen_batches": 3}, "max_num_gen_batches 3 refills the batches that dynamic_filtering shrinks"),
    ({"max_num_gen_batches": 0, "dynamic_filtering": True}, "max_num_gen_batches must be at least 1"),
])
def test_mistakes_are_refused_with_the_fix(bad, message):
    with pytest.raises(ConfigError, match=message):
        load_config({**GRPO, **bad})


def test_dynamic_sampling_is_a_grpo_key():
    rl = load_config({**GRPO, "dynamic_filtering": True, "max_num_gen_batches": 3}).rl
    assert rl.max_num_gen_batches == 3


def test_the_python_tool_isolation_is_tried_when_the_config_is_read(monkeypatch):
    """A run on this machine tries the python tool's sandbox before Ray starts: a missing piece (here
    the root the sandbox is built as) is the config's error, naming the piece and the opt-in; with
    sandbox: unisolated the config loads (warned), and a config only checked elsewhere is not tried."""
    from stages.rl.agents import sandbox

    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match=r"tools in the config dict: Tool 'python': .*runs as uid 1000.*unisolated"):
        load_config({**GRPO, "tools": ["python"], "max_turns": 2, "max_turn_tokens": 16})
    assert load_config({**GRPO, "tools": ["python"], "max_turns": 2, "max_turn_tokens": 16,
                        "sandbox": "unisolated"}).rl.sandbox == "unisolated"
    assert load_config({**GRPO, "tools": ["python"], "max_turns": 2, "max_turn_tokens": 16},
                       purpose="submit").rl.tools == ["python"]
