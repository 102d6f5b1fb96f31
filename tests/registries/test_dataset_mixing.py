"""Mixing (concat / interleave under and over sampling), validation splits, and the in-process loader."""

import json
from collections import Counter

import pytest

from registries.datasets import DataArguments, DataConfigError, DatasetRowError, load_aligned, mix, mix_plan, split_plan, train_val_split
from registries.datasets.mixing import val_count


# ---------------------------------------------------------------- mix plans
def test_concat():
    assert mix_plan([2, 3], "concat") == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert mix([["a1", "a2"], ["b1"]]) == ["a1", "a2", "b1"]


def test_interleave_under_round_robin_stops_at_the_first_exhausted():
    assert mix_plan([3, 5], "interleave_under") == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def test_interleave_over_round_robin_restarts_until_all_exhausted():
    assert mix_plan([3, 5], "interleave_over") == [
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 0), (1, 3), (0, 1), (1, 4),
    ]


def test_interleave_with_probabilities_is_seeded():
    plan = mix_plan([500, 500], "interleave_under", [0.8, 0.2], seed=3)
    assert plan == mix_plan([500, 500], "interleave_under", [0.8, 0.2], seed=3)
    assert plan != mix_plan([500, 500], "interleave_under", [0.8, 0.2], seed=4)
    counts = Counter(d for d, _ in plan)
    assert counts[0] == 500  # the likely dataset runs out first, which ends the mix
    assert 90 <= counts[1] <= 160  # ~125 expected at 0.2/0.8
    # each dataset is read in order
    assert [r for d, r in plan if d == 1] == list(range(counts[1]))


def test_interleave_over_with_probabilities_covers_every_row():
    plan = mix_plan([50, 5], "interleave_over", [0.5, 0.5], seed=0)
    rows_of = {d: {r for dd, r in plan if dd == d} for d in (0, 1)}
    assert rows_of == {0: set(range(50)), 1: set(range(5))}
    assert Counter(d for d, _ in plan)[1] > 5  # the small dataset was over-sampled


def test_single_dataset_is_kept_as_is():
    assert mix_plan([3], "interleave_over", [1.0]) == [(0, 0), (0, 1), (0, 2)]


def test_interleave_rejects_an_empty_dataset():
    with pytest.raises(DataConfigError, match=r"^Cannot interleave: dataset\(s\) at position \[1\] have no rows left after loading\.$"):
        mix_plan([3, 0], "interleave_under")


def test_interleave_rejects_wrong_number_of_probs():
    with pytest.raises(DataConfigError, match=r"^interleave_probs has 1 values for 2 datasets"):
        mix_plan([3, 3], "interleave_under", [1.0])


# ---------------------------------------------------------------- validation split
def test_val_count():
    assert [val_count(100, 0.1), val_count(10, 0.25), val_count(10, 3), val_count(10, 0)] == [10, 3, 3, 0]


def test_val_count_too_large():
    with pytest.raises(DataConfigError) as err:
        val_count(10, 10)
    assert str(err.value) == (
        "val_size 10 asks for 10 validation rows, but the training data has only 10; lower val_size so some rows remain for training."
    )


def test_split_plan_is_seeded_disjoint_and_complete():
    train, val = split_plan(100, 0.2, seed=42)
    assert (train, val) == split_plan(100, 0.2, seed=42)
    assert val != split_plan(100, 0.2, seed=43)[1]
    assert len(val) == 20 and sorted(train + val) == list(range(100)) and val == sorted(val)


def test_train_val_split_on_rows():
    rows = [f"r{i}" for i in range(10)]
    train, val = train_val_split(rows, 2, seed=1)
    assert len(train) == 8 and len(val) == 2 and set(train) | set(val) == set(rows)


# ---------------------------------------------------------------- load_aligned
@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.json").write_text(json.dumps([{"instruction": f"a{i}", "output": "x"} for i in range(6)]))
    (data / "b.jsonl").write_text("".join(json.dumps({"instruction": f"b{i}", "output": "y"}) + "\n" for i in range(3)))
    (data / "bad.json").write_text(json.dumps([{"instruction": "ok", "output": "z"}, {"instruction": 1, "output": "z"}]))
    info = {
        "a": {"file_name": "a.json"},
        "b": {"file_name": "b.jsonl"},
        "bad": {"file_name": "bad.json"},
        "pairs": {"file_name": "missing.json", "ranking": True, "columns": {"prompt": "instruction", "chosen": "c", "rejected": "r"}},
    }
    (data / "dataset_info.json").write_text(json.dumps(info))
    return data


def prompts(examples):
    return [e["_prompt"][0]["content"] for e in examples]


def test_load_concat_with_eval_dataset(data_dir):
    loaded = load_aligned(DataArguments(dataset="a,b", eval_dataset="b"), "sft")
    assert prompts(loaded.train) == ["a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1", "b2"]
    assert prompts(loaded.eval) == ["b0", "b1", "b2"]


def test_load_interleave_then_val_split(data_dir):
    args = DataArguments(dataset="a,b", mix_strategy="interleave_under", val_size=2)
    loaded = load_aligned(args, "sft", seed=5)
    # round-robin a, b, a, b, ... until the draw after b2 finds b exhausted
    assert sorted(prompts(loaded.train + loaded.eval)) == ["a0", "a1", "a2", "a3", "b0", "b1", "b2"]
    assert len(loaded.eval) == 2
    assert prompts(load_aligned(args, "sft", seed=5).eval) == prompts(loaded.eval)


def test_load_max_samples_per_dataset(data_dir):
    assert prompts(load_aligned(DataArguments(dataset="a,b", max_samples=2), "sft").train) == ["a0", "a1", "b0", "b1"]


def test_load_skip_bad_rows_collects_the_errors(data_dir):
    loaded = load_aligned(DataArguments(dataset="bad", skip_bad_rows=True), "sft")
    assert prompts(loaded.train) == ["ok"]
    assert [e.short for e in loaded.skipped] == [
        "row 2 of data/bad.json (dataset 'bad'): column 'instruction' is a number, expected a string"
    ]


def test_load_stops_at_a_bad_row_by_default(data_dir):
    with pytest.raises(DatasetRowError, match=r"^row 2 of data/bad.json \(dataset 'bad'\): column 'instruction' is a number"):
        load_aligned(DataArguments(dataset="bad"), "sft")


def test_load_checks_the_stage_before_reading(data_dir):
    # "pairs" points at a missing file; the stage mismatch is reported first, without reading.
    with pytest.raises(DataConfigError, match=r"^Stage 'sft' takes one answer per prompt, but dataset 'pairs'"):
        load_aligned(DataArguments(dataset="a,pairs"), "sft")


def test_load_fails_when_skipping_leaves_nothing(data_dir):
    (data_dir / "allbad.json").write_text(json.dumps([{"q": "x"}, {"q": "y"}]))
    info = json.loads((data_dir / "dataset_info.json").read_text())
    (data_dir / "dataset_info.json").write_text(json.dumps({**info, "allbad": {"file_name": "allbad.json"}}))
    with pytest.raises(DataConfigError) as err:
        load_aligned(DataArguments(dataset="allbad", skip_bad_rows=True), "sft")
    assert str(err.value) == (
        "Dataset 'allbad': all 2 rows were bad and skipped, e.g. row 1 of data/allbad.json (dataset 'allbad'): "
        "column 'instruction' is missing (the row has columns: 'q'). "
        "Check its entry in data/dataset_info.json (formatting, columns, tags)."
    )
