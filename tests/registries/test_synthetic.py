"""Synthetic tasks (solvers, checkers, near-miss answers) and the demo data generator."""

import json
import random
from pathlib import Path

import pytest

from registries.synthetic import (
    TASKS,
    SyntheticTask,
    build,
    check_answer,
    exact_match_accuracy,
    get_task,
    register_task,
    split_prompts,
    task_for_prompt,
    write,
)
from registries.synthetic.__main__ import main as cli_main
from registries.synthetic.words import WORDS

DATA = Path(__file__).resolve().parents[2] / "data"


# ---------------------------------------------------------------- tasks
def test_registered_tasks():
    assert list(TASKS) == ["addition", "reversal", "copying", "tool_add", "tool_reverse"]


@pytest.mark.parametrize(
    "prompt,answer",
    [
        ("What is 12+7?", "19"),
        ("What is 0+0?", "0"),
        ("Reverse the word: lamp", "pmal"),
        ("Copy: red fox runs", "red fox runs"),
        ("Use a tool to add 12 and 7.", '{"name": "add", "arguments": {"a": 12, "b": 7}}'),
        ("Use a tool to reverse the word lamp.", '{"name": "reverse_word", "arguments": {"word": "lamp"}}'),
    ],
)
def test_solve(prompt, answer):
    assert task_for_prompt(prompt).solve(prompt) == answer


def test_check_is_exact_match_ignoring_surrounding_whitespace():
    assert check_answer("What is 12+7?", " 19\n")
    assert not check_answer("What is 12+7?", "19.")
    assert not check_answer("What is 12+7?", "The answer is 19")
    assert check_answer("Reverse the word: lamp", "pmal")
    assert not check_answer("Reverse the word: lamp", "Pmal")


def test_tool_call_check_compares_json():
    prompt = "Use a tool to add 3 and 4."
    assert check_answer(prompt, '{"arguments": {"b": 4, "a": 3}, "name": "add"}')
    assert check_answer(prompt, '[{"name": "add", "arguments": {"a": 3, "b": 4}}]')
    assert not check_answer(prompt, '{"name": "add", "arguments": {"a": 4, "b": 3}}')
    assert not check_answer(prompt, "add(3, 4)")


def test_exact_match_accuracy():
    prompts = ["What is 1+1?", "What is 2+2?", "Reverse the word: cat", "Copy: a b"]
    assert exact_match_accuracy(prompts, ["2", "5", "tac", "a b"]) == 0.75
    with pytest.raises(ValueError, match="2 prompts but 1 replies"):
        exact_match_accuracy(prompts[:2], ["2"])


def test_unknown_prompt_and_task():
    with pytest.raises(ValueError, match=r"^No synthetic task matches the prompt 'What is 1\*2\?'\.$"):
        check_answer("What is 1*2?", "2")
    with pytest.raises(ValueError, match=r"^Unknown synthetic task 'division'; known: addition, reversal"):
        get_task("division")


def test_duplicate_task_rejected():
    with pytest.raises(ValueError, match=r"^Synthetic task 'addition' is already registered\.$"):
        register_task(SyntheticTask("addition", "", get_task("addition").pattern, str, list, str))


@pytest.mark.parametrize("name", list(TASKS))
def test_wrong_answers_are_never_right(name):
    task, rng = get_task(name), random.Random(0)
    for prompt in task.pool():
        assert not task.check(prompt, task.wrong(prompt, rng)), prompt


@pytest.mark.parametrize("name", list(TASKS))
def test_pools_are_distinct_and_match_their_task(name):
    pool = get_task(name).pool()
    assert len(pool) == len(set(pool))
    assert all(task_for_prompt(p).name == name for p in pool)


def test_word_list_has_no_duplicates_or_palindromes():
    assert len(WORDS) == len(set(WORDS)) == 130
    assert not [w for w in WORDS if w == w[::-1]]


def test_splits_are_disjoint_and_parallel_for_related_tasks():
    add_train, add_eval = split_prompts(get_task("addition"), "addition")
    tool_train, tool_eval = split_prompts(get_task("tool_add"), "addition")
    assert (len(add_train), len(add_eval)) == (320, 80) and not set(add_train) & set(add_eval)
    pairs = lambda prompts: {tuple(task_for_prompt(p).match(p).groups()) for p in prompts}  # noqa: E731
    assert pairs(add_eval) == pairs(tool_eval) and pairs(add_train) == pairs(tool_train)


# ---------------------------------------------------------------- generator
def test_generator_reproduces_committed_files_byte_for_byte(tmp_path):
    written = write(str(tmp_path))
    for name in written:
        if name != "dataset_info.json":
            assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"data/{name} is stale: run python -m registries.synthetic"
    committed = json.loads((DATA / "dataset_info.json").read_text())
    for f in build():
        assert committed.get(f.name) == f.entry, f"data/dataset_info.json entry {f.name!r} differs from the generator's"


def test_cli_check_reports_up_to_date_and_stale(tmp_path, capsys):
    assert cli_main(["--check", "--out", str(DATA)]) == 0
    assert capsys.readouterr().out.strip() == "demo data is up to date"
    write(str(tmp_path))
    (tmp_path / "arith_eval.json").write_text("[]\n")
    assert cli_main(["--check", "--out", str(tmp_path)]) == 1
    assert f"differs: {tmp_path / 'arith_eval.json'}" in capsys.readouterr().out


def test_write_keeps_entries_it_does_not_own(tmp_path):
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "mine.json"}, "arith_train": {"file_name": "old.json"}}))
    write(str(tmp_path))
    info = json.loads((tmp_path / "dataset_info.json").read_text())
    assert info["mine"] == {"file_name": "mine.json"}
    assert info["arith_train"] == {"file_name": "arith_train.json"}


def test_generation_is_seeded():
    assert [f.text for f in build(seed=1)] == [f.text for f in build(seed=1)]
    assert [f.text for f in build(seed=1)] != [f.text for f in build(seed=2)]
