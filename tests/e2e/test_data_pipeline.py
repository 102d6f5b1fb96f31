"""The Ray Data pipeline equals the in-process library, row for row; the driver engine equals Ray
Data, block contents and types; and tokenized_path reuse works.

Reference side: ``registries.datasets.loading.load_aligned`` (read, align, mix, split) and then the
stage table's ``preprocess_fn`` over consecutive windows of ``BATCH_SIZE`` aligned rows. The window
is part of the contract: sft packing and pt blocks fill sequences within one window, so the
pipeline must cut the same windows however Ray happens to cut blocks. The tests run Ray Data
(``preprocessing_engine: ray_data``) unless they say otherwise: the demo data is small enough
that ``auto`` would tokenize it in the driver.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections import Counter

import pytest

from cluster.config import load_config
from fabric.data.common import BATCH_SIZE
from fabric.data.prepare import prepare_datasets
from registries.datasets.errors import DataConfigError
from registries.datasets.loading import load_aligned
from stages.loading import load_tokenizer_and_template
from tests.e2e.conftest import DATA_DIR, REPO_ROOT, tiny_sft_config

COLUMNS = ("input_ids", "attention_mask", "labels")


@pytest.fixture(scope="module")
def tokenizer_and_template():
    cfg = load_config(tiny_sft_config("unused"))
    return load_tokenizer_and_template(cfg.model, cfg.data)


@pytest.fixture
def prepare(ray_session, tokenizer_and_template, tmp_path):
    """config overrides -> (config, pipeline result) through real Ray Data (or the engine named)."""

    def run(**overrides):
        overrides.setdefault("preprocessing_engine", "ray_data")
        cfg = load_config(tiny_sft_config(tmp_path / "out", **overrides))
        return cfg, prepare_datasets(cfg.data, cfg.finetuning.spec, cfg.training.seed, *tokenizer_and_template)

    return run


def rows_of(dataset) -> list[dict]:
    return [{k: [int(v) for v in row[k]] for k in COLUMNS} for row in dataset.take_all()] if dataset else []


def tokenize_windows(aligned: list[dict], preprocess, window: int = BATCH_SIZE) -> list[dict]:
    out = []
    for start in range(0, len(aligned), window):
        part = aligned[start : start + window]
        columns = preprocess({k: [row[k] for row in part] for k in part[0]})
        out += [{k: list(columns[k][i]) for k in COLUMNS} for i in range(len(columns["input_ids"]))]
    return out


def in_process(cfg, tokenizer_and_template, window: int = BATCH_SIZE) -> tuple[list[dict], list[dict]]:
    spec = cfg.finetuning.spec
    loaded = load_aligned(cfg.data, spec.name, spec.dataset_need, cfg.training.seed)
    preprocess = spec.preprocess_fn(*tokenizer_and_template, cfg.data)
    return tokenize_windows(loaded.train, preprocess, window), tokenize_windows(loaded.eval, preprocess, window)


CASES = {
    "sft-alpaca": dict(dataset="arith_train"),
    "sft-sharegpt-multiturn": dict(dataset="tasks_sharegpt", cutoff_len=256),
    "sft-openai": dict(dataset="tasks_openai", cutoff_len=256),
    "sft-eval-dataset": dict(dataset="tasks_openai", eval_dataset="tasks_openai_eval", cutoff_len=128),
    "sft-val-fraction": dict(dataset="tasks_sharegpt", val_size=0.1, cutoff_len=128),
    "pt-packing-val-rows": dict(stage="pt", dataset="pretrain_txt,pretrain_jsonl", cutoff_len=32, val_size=25),
    "pt-unpacked": dict(stage="pt", dataset="pretrain_jsonl", packing=False, cutoff_len=32),
    "mix-interleave-under": dict(dataset="tasks_sharegpt,arith_train", mix_strategy="interleave_under", cutoff_len=128),
    "mix-interleave-over-probs": dict(
        dataset="arith_train,tasks_openai", mix_strategy="interleave_over", interleave_probs="0.7,0.3", cutoff_len=128
    ),
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_pipeline_equals_in_process_library(prepare, tokenizer_and_template, overrides):
    cfg, prepared = prepare(**overrides)
    train, evaluation = in_process(cfg, tokenizer_and_template)
    assert train and rows_of(prepared.train) == train
    assert rows_of(prepared.eval) == evaluation
    assert prepared.stats == {"train_examples": len(train), "eval_examples": len(evaluation)}
    if cfg.data.val_size or cfg.data.eval_dataset:
        assert evaluation


ENGINE_CASES = {
    **CASES,
    "sft-packing-3-datasets": dict(dataset="tasks_sharegpt,tasks_openai,arith_train", max_samples=300, packing=True,
                                   cutoff_len=256),
    "dpo-pairs-val-fraction": dict(stage="dpo", dataset="arith_pref", val_size=0.1),
    "kto-feedback": dict(stage="kto", dataset="arith_kto", eval_dataset="arith_kto_eval"),
    "sft-skip-bad-rows": dict(dataset="arith_train", skip_bad_rows=True),
}


@pytest.mark.parametrize("overrides", ENGINE_CASES.values(), ids=ENGINE_CASES.keys())
def test_driver_engine_gives_ray_datas_blocks(prepare, overrides):
    """The same tables (values, column types, order) from the driver as from Ray Data's tasks, so the
    workers cannot tell them apart; the driver's come with their metadata (no Ray task counts them)."""
    import pyarrow as pa
    import ray

    def tables(prepared):
        splits = [prepared.train] + ([prepared.eval] if prepared.eval is not None else [])
        return [pa.concat_tables(ray.get(split.to_arrow_refs())) for split in splits]

    _, by_ray_data = prepare(**overrides)
    _, by_driver = prepare(**overrides, preprocessing_engine="driver")
    expected, got = tables(by_ray_data), tables(by_driver)
    assert len(got) == len(expected) == (2 if "val_size" in overrides or "eval_dataset" in overrides else 1)
    for want, have in zip(expected, got):
        assert have.schema == want.schema and have.num_rows == want.num_rows > 0
        assert have.equals(want)
    assert by_driver.stats == by_ray_data.stats


def test_auto_engine_tokenizes_small_files_in_the_driver(tmp_path):
    from fabric.data.prepare import DRIVER_MAX_BYTES, tokenizes_in_driver
    from registries.datasets.data_args import DataArguments

    demo = DataArguments(dataset="arith_train,tasks_sharegpt", eval_dataset="arith_eval", dataset_dir=DATA_DIR)
    assert tokenizes_in_driver(demo)
    assert not tokenizes_in_driver(dataclasses.replace(demo, preprocessing_engine="ray_data"))
    (tmp_path / "big.jsonl").write_text((json.dumps({"text": "x" * 1000}) + "\n") * (DRIVER_MAX_BYTES // 1000))
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "big": {"file_name": "big.jsonl", "columns": {"prompt": "text"}},
        "hub": {"hf_hub_url": "someone/some-data"},
    }))
    big = DataArguments(dataset="big", dataset_dir=str(tmp_path))
    assert not tokenizes_in_driver(big)  # over DRIVER_MAX_BYTES
    assert tokenizes_in_driver(dataclasses.replace(big, preprocessing_engine="driver"))
    assert not tokenizes_in_driver(DataArguments(dataset="hub", dataset_dir=str(tmp_path)))  # size unknown


def test_sft_packing_fills_windows_of_batch_size_rows_across_dataset_boundaries(prepare, tokenizer_and_template):
    # 3 x 300 aligned rows: Ray gets three blocks of 300; windows are rows [0, 512) and [512, 900).
    cfg, prepared = prepare(
        dataset="tasks_sharegpt,tasks_openai,arith_train", max_samples=300, packing=True, cutoff_len=256
    )
    train, _ = in_process(cfg, tokenizer_and_template)
    assert rows_of(prepared.train) == train
    # The rule matters here: packing the 900 rows in other windows gives other sequences.
    assert train != in_process(cfg, tokenizer_and_template, window=300)[0]
    assert train != in_process(cfg, tokenizer_and_template, window=900)[0]
    assert sum(1 for row in train for label in row["labels"] if label != -100) > 0
    assert max(len(row["input_ids"]) for row in train) <= 256 < sum(len(row["input_ids"]) for row in train[:2])


def test_concat_keeps_every_row_of_each_dataset_in_order(prepare, tokenizer_and_template):
    _, alone_a = prepare(dataset="arith_train")
    _, alone_b = prepare(dataset="tasks_openai", cutoff_len=64)
    _, mixed = prepare(dataset="arith_train,tasks_openai", cutoff_len=64)
    assert rows_of(mixed.train) == rows_of(alone_a.train) + rows_of(alone_b.train)
    assert mixed.stats["train_examples"] == 320 + 400


def test_val_split_partitions_rows_and_is_seeded(prepare):
    _, whole = prepare(dataset="arith_train")
    _, split = prepare(dataset="arith_train", val_size=0.1)
    _, again = prepare(dataset="arith_train", val_size=0.1)
    _, other_seed = prepare(dataset="arith_train", val_size=0.1, seed=7)
    train, evaluation = rows_of(split.train), rows_of(split.eval)
    assert (len(train), len(evaluation)) == (288, 32)  # ceil(0.1 * 320) rows held out
    key = lambda row: tuple(row["input_ids"])  # noqa: E731
    # A partition: together they are exactly the unsplit rows (as a multiset), each row once.
    assert Counter(map(key, train)) + Counter(map(key, evaluation)) == Counter(map(key, rows_of(whole.train)))
    # Rows keep their file order within each part.
    order = {key(row): i for i, row in enumerate(rows_of(whole.train))}
    assert [order[key(r)] for r in train] == sorted(order[key(r)] for r in train)
    assert (rows_of(again.train), rows_of(again.eval)) == (train, evaluation)
    assert rows_of(other_seed.eval) != evaluation and len(rows_of(other_seed.eval)) == 32


@pytest.mark.parametrize("engine", ["ray_data", "driver"])
def test_val_size_leaving_no_training_rows_is_a_clear_error(prepare, engine):
    with pytest.raises(DataConfigError) as err:
        prepare(dataset="identity", val_size=24, preprocessing_engine=engine)
    assert str(err.value) == (
        "val_size 24 asks for 24 validation rows, but the training data has only 24; "
        "lower val_size so some rows remain for training."
    )


# ------------------------------------------------------------------ tokenized_path


@pytest.fixture
def own_data(tmp_path):
    """A copy of the demo data the test may rename files in."""
    folder = tmp_path / "data"
    shutil.copytree(os.path.join(REPO_ROOT, "data"), folder)
    return folder


def test_tokenized_path_is_reused_without_the_source_data(prepare, own_data, tmp_path, sft_config, caplog):
    from cluster.driver import run_exp
    from stages.training.callbacks import read_log

    caplog.set_level(logging.INFO, logger="fabric")  # what the CLI's console shows
    cache = tmp_path / "tokenized"
    settings = dict(dataset="arith_train", dataset_dir=str(own_data), tokenized_path=str(cache), val_size=16)
    _, first = prepare(**settings)
    assert "tokenized data saved to" in caplog.text
    assert (cache / "rayfactory_tokenized.json").is_file() and list((cache / "train").glob("*.parquet"))

    (own_data / "arith_train.json").rename(own_data / "arith_train.json.moved")  # tokenizing would now fail
    caplog.clear()
    _, second = prepare(**settings)
    out = caplog.text
    assert f"the source data is not here; reusing {cache} as it was saved" in out
    assert f"reusing tokenized data from {cache}: {{'train_examples': 304, 'eval_examples': 16}}" in out
    assert "data ready" not in out  # nothing was tokenized
    assert (rows_of(second.train), rows_of(second.eval)) == (rows_of(first.train), rows_of(first.eval))

    # The driver takes the same path (its early data checks skip a reusable cache) and trains from it.
    result = run_exp(sft_config(**settings, max_steps=2))
    assert result.data_stats == {"train_examples": 304, "eval_examples": 16}
    assert [r["current_steps"] for r in read_log(result.output_dir) if "loss" in r] == [1, 2]


def test_changed_setting_needs_overwrite_cache_which_tokenizes_again(prepare, own_data, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fabric")
    cache = tmp_path / "tokenized"
    # 800 rows: two blocks, so the cache holds two parquet files that must be read back in order.
    settings = dict(dataset="tasks_openai,tasks_sharegpt", dataset_dir=str(own_data), tokenized_path=str(cache))
    _, first = prepare(**settings, cutoff_len=256)
    assert max(len(r["input_ids"]) for r in rows_of(first.train)) > 64
    assert len(list((cache / "train").glob("*.parquet"))) == 2
    _, reused = prepare(**settings, cutoff_len=256)
    assert rows_of(reused.train) == rows_of(first.train)

    with pytest.raises(DataConfigError) as err:
        prepare(**settings, cutoff_len=64)
    assert str(err.value) == (
        f"tokenized_path {cache} was made with different settings (cutoff_len: 256 -> 64). Set "
        "overwrite_cache: true to tokenize again into it, or point tokenized_path at a new folder."
    )

    caplog.clear()
    _, fresh = prepare(**settings, cutoff_len=64, overwrite_cache=True)
    assert "data ready" in caplog.text  # tokenized again
    assert max(len(r["input_ids"]) for r in rows_of(fresh.train)) <= 64
    # The folder now holds only the new rows (Ray's write_parquet would append to the old files).
    _, reused = prepare(**settings, cutoff_len=64)
    assert rows_of(reused.train) == rows_of(fresh.train)
    assert reused.stats == fresh.stats == {"train_examples": 800, "eval_examples": 0}
    assert len(list((cache / "train").glob("*.parquet"))) == 2


def test_cache_made_from_other_data_is_not_reused(prepare, own_data, tmp_path):
    """Same dataset names, other rows: another dataset_dir, an edited file, or skip_bad_rows."""
    cache = tmp_path / "tokenized"
    settings = dict(dataset="arith_train", dataset_dir=str(own_data), tokenized_path=str(cache))
    prepare(**settings)

    elsewhere = tmp_path / "other_data"
    shutil.copytree(own_data, elsewhere)
    with pytest.raises(DataConfigError, match=rf"made with different settings \(dataset_dir: '{own_data}' -> '{elsewhere}'\)"):
        prepare(**{**settings, "dataset_dir": str(elsewhere)})
    with pytest.raises(DataConfigError, match=r"different settings \(skip_bad_rows: False -> True\)"):
        prepare(**settings, skip_bad_rows=True)

    source = own_data / "arith_train.json"
    rows = json.loads(source.read_text())
    source.write_text(json.dumps(rows[:100]))  # edited in place: same name, same settings
    with pytest.raises(DataConfigError) as err:
        prepare(**settings)
    assert str(err.value) == (
        f"tokenized_path {cache} was made from other data: {source} changed since (size or modification time). "
        "Set overwrite_cache: true to tokenize the current data into it, or point tokenized_path at a new folder."
    )
    _, fresh = prepare(**settings, overwrite_cache=True)
    assert fresh.stats["train_examples"] == 100


def test_row_order_does_not_depend_on_a_global_ray_data_setting(prepare, tokenizer_and_template):
    """The pipeline sets preserve_order for its own datasets; a process whose global DataContext
    says otherwise (another library, a notebook) still gets the rows in file order."""
    import ray

    context = ray.data.DataContext.get_current()
    saved = context.execution_options.preserve_order
    context.execution_options.preserve_order = False
    try:
        # Five datasets concatenated: without ordering, Ray's union hands on their blocks as they
        # come (seen: the rows of the old pipeline came out in another order here).
        cfg, prepared = prepare(dataset="tasks_openai,tasks_sharegpt,arith_train,identity,tasks_openai", cutoff_len=256)
        assert context.execution_options.preserve_order is False  # and no side effect on it
    finally:
        context.execution_options.preserve_order = saved
    train, _ = in_process(cfg, tokenizer_and_template)
    assert rows_of(prepared.train) == train


@pytest.mark.parametrize("engine", ["ray_data", "driver"])
def test_empty_dataset_file_fails_before_training_naming_it(prepare, own_data, engine):
    info = json.loads((own_data / "dataset_info.json").read_text())
    info["empty_one"] = {"file_name": "empty.json"}
    (own_data / "dataset_info.json").write_text(json.dumps(info))
    (own_data / "empty.json").write_text("[]")
    with pytest.raises(DataConfigError) as err:
        prepare(dataset="arith_train,empty_one", dataset_dir=str(own_data), preprocessing_engine=engine)
    assert str(err.value) == (
        f"Dataset 'empty_one' is empty: {own_data / 'empty.json'} (file_name in {own_data / 'dataset_info.json'}) "
        "holds no rows. Fill it, or remove the dataset from the config."
    )


@pytest.mark.parametrize("engine", ["ray_data", "driver"])
def test_no_rows_left_after_tokenizing_fails_in_the_driver_with_the_reason(prepare, own_data, engine):
    """Every row aligned fine, but pt can use none of them (multi-turn chats are not one text):
    the driver says so instead of Ray Train failing with "No columns in the dataset match the
    model's forward method signature"."""
    info = json.loads((own_data / "dataset_info.json").read_text())
    info["chats"] = {"file_name": "chats.json", "formatting": "sharegpt"}
    (own_data / "dataset_info.json").write_text(json.dumps(info))
    turns = [("human", "hi"), ("gpt", "hello"), ("human", "and?"), ("gpt", "bye")]
    chats = [{"conversations": [{"from": who, "value": f"{text} {i}"} for who, text in turns]} for i in range(6)]
    (own_data / "chats.json").write_text(json.dumps(chats))
    with pytest.raises(DataConfigError) as err:
        prepare(stage="pt", dataset="chats", dataset_dir=str(own_data), preprocessing_engine=engine)
    assert str(err.value) == (
        "No training examples are left for stage 'pt' from dataset chats: all 6 aligned rows were dropped "
        "when tokenizing (rows skipped, by reason, in the first 6: not text: 6). Stage 'pt' trains on one answer "
        "per prompt (or plain text): use a dataset of such rows."
    )
