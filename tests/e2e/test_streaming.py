"""streaming: true: each Ray Train worker pulls its own share of a lazy pipeline as it trains.

The recorder drains one pass of each worker's stream before training starts (both ranks do, so the
split's epochs stay in step) and writes the rows it got: together the two shares must be the whole
tokenized dataset, each row once, and the shares equal in size. Training then runs on later passes.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest
from ray import cloudpickle
from transformers import TrainerCallback

from cluster.driver import run_exp
from registries.datasets import DataArguments, load_aligned
from registries.datasets.errors import DataConfigError
from stages.training.callbacks import read_log
from stages.loading import load_tokenizer_and_template
from stages.run_args import ModelArguments
from stages.table import STAGES

from tests.e2e.conftest import DATA_DIR, assert_rerun_of_a_finished_run_trains_nothing

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRAIN_ROWS = 320  # data/arith_train.json
MAX_STEPS, BATCH = 12, 16  # 160 rows a worker: an epoch is 10 steps, so step 11 starts a second pass


class RecordStreamShare(TrainerCallback):
    """Writes the input_ids of one full pass over this rank's stream."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        rows = [row["input_ids"] for row in train_dataloader.dataset]
        with open(os.path.join(self.folder, f"rank{args.process_index}.json"), "w", encoding="utf-8") as f:
            json.dump(rows, f)


def _expected_rows(config: dict) -> Counter:
    data_args = DataArguments(dataset="arith_train", dataset_dir=DATA_DIR, cutoff_len=config["cutoff_len"],
                              template=config["template"])
    tokenizer, template = load_tokenizer_and_template(ModelArguments(config["model_name_or_path"]), data_args)
    rows = load_aligned(data_args, "sft", STAGES["sft"].dataset_need).train
    columns = STAGES["sft"].preprocess_fn(tokenizer, template, data_args)({k: [r[k] for r in rows] for k in rows[0]})
    return Counter(tuple(ids) for ids in columns["input_ids"])


def test_each_worker_streams_its_own_share_and_the_model_learns(ray_session, sft_config, tmp_path):
    config = sft_config(streaming=True, buffer_size=64, max_steps=MAX_STEPS, ray_num_workers=2,
                        per_device_train_batch_size=BATCH)
    result = run_exp(config, callbacks=[RecordStreamShare(str(tmp_path))])
    assert_rerun_of_a_finished_run_trains_nothing(config)

    assert result.data_stats["train_examples"] is None  # never counted, so never run whole on the driver
    shares = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json", encoding="utf-8") as f:
            shares.append(Counter(tuple(ids) for ids in json.load(f)))
    assert [sum(s.values()) for s in shares] == [TRAIN_ROWS // 2] * 2
    assert shares[0] + shares[1] == _expected_rows(config)  # every row once, in one share or the other

    log = [r for r in read_log(result.output_dir) if "loss" in r]
    assert [r["current_steps"] for r in log] == list(range(1, MAX_STEPS + 1))
    # A pass is 10 steps of this worker's 160 rows (with the whole dataset it would be 20): the Trainer's
    # epoch counter turns over after step 10.
    assert [int(r["epoch"]) for r in log] == [0] * 10 + [1] * 2
    assert log[-1]["loss"] < 0.6 * log[0]["loss"], [r["loss"] for r in log]


def test_num_samples_cannot_stream(ray_session, sft_config, tmp_path):
    info = {"sampled": {"file_name": os.path.join(DATA_DIR, "arith_train.json"), "num_samples": 50}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    config = sft_config(streaming=True, max_steps=2, dataset="sampled", dataset_dir=str(tmp_path))
    with pytest.raises(DataConfigError) as error:
        run_exp(config)
    assert str(error.value).startswith(
        f"Dataset 'sampled' sets num_samples in {tmp_path / 'dataset_info.json'}, which resamples from all of its rows")
