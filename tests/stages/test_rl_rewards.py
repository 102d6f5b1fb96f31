"""Reward functions: built-ins, weights, loading module:function specs, and every error's message."""

import math
import sys
import textwrap

import pytest

from registries.errors import UserError
from stages.rl.controller.rewards import (
    REWARDS,
    RewardFunctionError,
    exact_match,
    final_number,
    load_reward_funcs,
    digit_ratio,
    number_format,
    register_reward,
    short_answer,
    starts_with_answer,
)

USER_MODULE = "rf_test_user_rewards"
USER_SOURCE = '''
import math

def contains_answer(prompts, completions, reference, **kwargs):
    return [1.0 if r and r in c else 0.0 for c, r in zip(completions, reference)]

def by_difficulty(completions, difficulty):  # no **kwargs: gets only the columns it names
    return [float(d) for d in difficulty]

def only_odd(prompts, completions, **kwargs):
    return [None if i % 2 == 0 else 1.0 for i in range(len(completions))]

def needs_missing(completions, answer):
    return [0.0] * len(completions)

def boom(prompts, completions, **kwargs):
    raise KeyError("solution")

def too_few(prompts, completions, **kwargs):
    return [1.0]

def not_a_list(prompts, completions, **kwargs):
    return 1.0

def gives_text(prompts, completions, **kwargs):
    return ["1.0"] * len(completions)

def gives_nan(prompts, completions, **kwargs):
    return [math.nan] * len(completions)

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / f"{USER_MODULE}.py").write_text(textwrap.dedent(USER_SOURCE))
    (tmp_path / "rf_test_broken.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield USER_MODULE
    for name in (USER_MODULE, "rf_test_broken"):
        sys.modules.pop(name, None)


PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
COMPLETIONS = [" 2 ", "4 is the answer", "six", "-8"]
COLUMNS = {
    "reference": ["2", "4", "6", ""],
    "completion_ids": [[1], [1, 2, 3, 4], [1] * 40, [7, 8]],
    "difficulty": [1, 2, 3, 4],
}


def test_builtins():
    assert {"exact_match", "starts_with_answer", "final_number", "number_format", "short_answer"} <= set(REWARDS)
    assert exact_match(PROMPTS, COMPLETIONS, COLUMNS["reference"]) == [1.0, 0.0, 0.0, None]
    assert starts_with_answer(PROMPTS, COMPLETIONS, COLUMNS["reference"]) == [1.0, 1.0, 0.0, None]
    assert final_number(PROMPTS, COMPLETIONS, COLUMNS["reference"]) == [1.0, 1.0, 0.0, None]
    chatty = ["1 + 7 = 8", "1 + 7 = 8, not 9", "8 is 1 + 7", "The answer is 08.", "-8", "x"]
    assert final_number(PROMPTS[:1] * 6, chatty, ["8", "8", "8", "8", "-8", "8"]) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert number_format(PROMPTS, COMPLETIONS) == [1.0, 0.0, 0.0, 1.0]
    assert number_format(PROMPTS, ["+3", "3.5", "", "1 2"]) == [1.0, 0.0, 0.0, 0.0]
    assert digit_ratio(PROMPTS, ["42", "a1", " 1 2 ", "", "x"]) == [1.0, 0.5, 1.0, 0.0, 0.0]
    assert short_answer(PROMPTS, COMPLETIONS, COLUMNS["completion_ids"]) == [1 - 1 / 32, 1 - 4 / 32, 0.0, 1 - 2 / 32]


def test_reference_rewards_need_some_reference():
    rewards = load_reward_funcs(["exact_match"])
    with pytest.raises(RewardFunctionError, match=r"'exact_match' raised ValueError: .*no row of this batch"):
        rewards.score(["p"], ["2"], {"reference": [""], "completion_ids": [[1]]})


def test_weighted_total_and_per_function_means():
    rewards = load_reward_funcs(["exact_match", "number_format"], [2.0, 0.5])
    scores = rewards.score(PROMPTS, COMPLETIONS, COLUMNS)
    assert scores.names == ["exact_match", "number_format"]
    # exact_match [1, 0, 0, None] * 2 + number_format [1, 0, 0, 1] * 0.5; None adds nothing
    assert scores.total == [2.5, 0.0, 0.0, 0.5]
    assert scores.per_function["number_format"] == [1.0, 0.0, 0.0, 1.0]
    assert math.isnan(scores.per_function["exact_match"][3])
    assert scores.means() == {"exact_match": pytest.approx(1 / 3), "number_format": 0.5}


def test_default_weights_are_one():
    scores = load_reward_funcs(["number_format", "short_answer"]).score(PROMPTS, COMPLETIONS, COLUMNS)
    assert scores.total == pytest.approx([1 + 31 / 32, 28 / 32, 0.0, 1 + 30 / 32])


def test_user_functions_from_a_module(user_module):
    rewards = load_reward_funcs([f"{user_module}:contains_answer", f"{user_module}:by_difficulty",
                                 f"{user_module}:only_odd"], [1.0, 0.1, 1.0])
    scores = rewards.score(PROMPTS, COMPLETIONS, COLUMNS)
    assert scores.per_function[f"{user_module}:contains_answer"] == [1.0, 1.0, 0.0, 0.0]
    assert scores.total == pytest.approx([1.1, 1.2 + 1.0, 0.3, 0.4 + 1.0])
    assert scores.means()[f"{user_module}:only_odd"] == 1.0
    all_none = load_reward_funcs([f"{user_module}:only_odd"]).score(["p"], ["c"], {"reference": ["r"]})
    assert all_none.total == [0.0] and math.isnan(all_none.means()[f"{user_module}:only_odd"])


def test_register_reward_rejects_duplicates_and_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("exact_match", exact_match)
    with pytest.raises(ValueError, match="':'"):
        register_reward("a:b", exact_match)
    name = "rf_test_registered_reward"
    try:
        register_reward(name, lambda prompts, completions, **kw: [0.25] * len(completions))
        assert load_reward_funcs([name]).score(["p"], ["c"], {"reference": [""]}).total == [0.25]
    finally:
        REWARDS.pop(name, None)


@pytest.mark.parametrize("spec, message", [
    ("no_such_reward", r"Unknown reward function 'no_such_reward'\. Built-ins: .*exact_match"),
    ("rf_missing_module_xyz:score", r"'rf_missing_module_xyz:score': module 'rf_missing_module_xyz' was not found"),
    ("rf_test_broken:score", r"'rf_test_broken:score': importing module 'rf_test_broken' failed with "
                             r"ModuleNotFoundError"),
    (f"{USER_MODULE}:nope", rf"'{USER_MODULE}:nope': module '{USER_MODULE}' has no attribute 'nope'"),
    (f"{USER_MODULE}:", rf"module '{USER_MODULE}' has no attribute ''"),
    (f"{USER_MODULE}:NOT_CALLABLE", r"'NOT_CALLABLE' in .* is a int, not callable"),
])
def test_load_errors_name_the_spec(user_module, spec, message):
    with pytest.raises(RewardFunctionError, match=message) as info:
        load_reward_funcs([spec])
    assert isinstance(info.value, UserError)


def test_list_errors():
    with pytest.raises(RewardFunctionError, match="No reward functions"):
        load_reward_funcs([])
    with pytest.raises(RewardFunctionError, match=r"\['exact_match'\] more than once"):
        load_reward_funcs(["exact_match", "exact_match"])
    with pytest.raises(RewardFunctionError, match="1 reward_weights for 2 reward_funcs"):
        load_reward_funcs(["exact_match", "number_format"], [1.0])


@pytest.mark.parametrize("func, message", [
    ("boom", r"'{m}:boom' raised KeyError: 'solution'"),
    ("too_few", r"'{m}:too_few' returned 1 values for 4 completions"),
    ("not_a_list", r"'{m}:not_a_list' returned a float for 4 completions"),
    ("gives_text", r"'{m}:gives_text' returned '1\.0' for completion 0; each value must be a finite number"),
    ("gives_nan", r"'{m}:gives_nan' returned nan for completion 0"),
    ("needs_missing", r"'{m}:needs_missing' needs \['answer'\], which this data does not provide"),
])
def test_call_errors_name_the_function(user_module, func, message):
    rewards = load_reward_funcs([f"{user_module}:{func}"])
    with pytest.raises(RewardFunctionError, match=message.format(m=user_module)):
        rewards.score(PROMPTS, COMPLETIONS, COLUMNS)


def test_misaligned_columns_are_a_caller_bug():
    with pytest.raises(ValueError, match="'reference' has 1 entries for 4 completions"):
        load_reward_funcs(["number_format"]).score(PROMPTS, COMPLETIONS, {"reference": ["x"]})


def test_reward_set_pickles_for_workers(user_module):
    import pickle

    rewards = load_reward_funcs(["exact_match", f"{user_module}:contains_answer"])
    again = pickle.loads(pickle.dumps(rewards))
    assert again.score(PROMPTS, COMPLETIONS, COLUMNS).total == rewards.score(PROMPTS, COMPLETIONS, COLUMNS).total


def test_tool_use_reads_the_episodes_tool_calls_and_names_what_a_single_turn_run_lacks():
    from stages.rl.controller.rewards import RewardFunctionError

    scores = load_reward_funcs(["tool_use"]).score(PROMPTS, COMPLETIONS, {**COLUMNS, "tool_calls": [0, 1, 3, 0]})
    assert scores.total == [0.0, 1.0, 1.0, 0.0]
    with pytest.raises(RewardFunctionError, match=r"'tool_use' needs \['tool_calls'\]"):
        load_reward_funcs(["tool_use"]).score(PROMPTS, COMPLETIONS, COLUMNS)
