"""report_to: one sft run (the HF Trainer's integrations, rank 0) and one grpo run (the RL loop's
reporter, in the driver) with tensorboard, mlflow and wandb on at once, offline; each tracker's
files are read back and hold, at every logged step, the values trainer_log.jsonl has there, plus
the run name and the resolved config."""

from __future__ import annotations

import glob
import json
import os
import struct

import pytest

from cluster.config import ConfigError, load_config
from cluster.driver import run_exp
from stages.training.callbacks import read_log
from tests.e2e.conftest import DATA_DIR, tiny_sft_config

ALL = ["tensorboard", "mlflow", "wandb"]


@pytest.fixture
def offline(monkeypatch):
    for key in ("WANDB_DIR", "MLFLOW_TRACKING_URI", "TENSORBOARD_LOGGING_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def tensorboard_scalars(output_dir, config_file: bool = False) -> dict[str, dict[int, float]]:
    """The scalars of the run's one TensorBoard event file, one value per (tag, step). Exactly one file
    holds scalars: a second writer (another rank, a writer per step) would leave more, and merging
    them would hide it. ``config_file``: the Trainer-based stages also leave a second file holding
    only the resolved config's text (stages/tracking.py), and nothing else."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    paths = sorted(glob.glob(os.path.join(output_dir, "runs", "events.out.tfevents.*")))
    assert len(paths) == 1 + config_file, paths
    files = []
    for path in paths:
        events = EventAccumulator(path)
        events.Reload()
        files.append(events)
    with_scalars = [events for events in files if events.Tags()["scalars"]]
    assert len(with_scalars) == 1, f"{len(with_scalars)} event files hold scalars: {paths}"
    if config_file:
        (other,) = [events for events in files if not events.Tags()["scalars"]]
        assert other.Tags()["tensors"] == ["rayfactory_config/text_summary"], other.Tags()
    scalars: dict[str, dict[int, float]] = {}
    for tag in with_scalars[0].Tags()["scalars"]:
        for event in with_scalars[0].Scalars(tag):  # the Trainer's last record repeats train/epoch, unchanged
            value = scalars.setdefault(tag, {}).setdefault(event.step, event.value)
            assert value == event.value, f"{tag} has two values at step {event.step}: {value}, {event.value}"
    return scalars


def mlflow_run(output_dir):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient("file://" + os.path.join(output_dir, "mlruns"))
    (run,) = client.search_runs(["0"])
    history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in run.data.metrics}
    return run, history


def wandb_records(output_dir):
    """The offline run's .wandb file: LevelDB-log blocks of protobuf Records after a 7-byte W&B header
    (wandb 0.31 ships no reader of its own)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data, pos, chunks, block = open(path, "rb").read(), 7, [], 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):  # a block's padding
            pos += left
            continue
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a record's last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def wandb_history(output_dir) -> tuple[str, dict, list[dict]]:
    name, config, rows = "", {}, []
    for record in wandb_records(output_dir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.display_name
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return name, config, rows


def test_sft_reports_every_logged_step_to_each_tracker_from_rank_0_offline(ray_session, tmp_path, offline):
    out = tmp_path / "out"
    # Two workers: a Ray Train worker group (not the driver), and rank 1 must report nothing: one run
    # per tracker (the unpacking in mlflow_run and wandb_records).
    run_exp(tiny_sft_config(out, max_steps=4, logging_steps=2, report_to=ALL, ray_num_workers=2,
                            per_device_train_batch_size=8))
    steps = {r["current_steps"]: r for r in read_log(str(out)) if "loss" in r}
    assert sorted(steps) == [2, 4]

    tb = tensorboard_scalars(str(out), config_file=True)  # the Trainer's TensorBoardCallback: train/<key>
    assert {s: pytest.approx(r["loss"], rel=1e-6) for s, r in steps.items()} == tb["train/loss"]
    _, history = mlflow_run(str(out))
    assert history["loss"] == {s: pytest.approx(r["loss"], rel=1e-9) for s, r in steps.items()}
    assert history["learning_rate"] == {s: pytest.approx(r["lr"]) for s, r in steps.items()}
    name, config, rows = wandb_history(str(out))
    logged = {row["train/global_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    assert logged == {s: pytest.approx(r["loss"], rel=1e-9) for s, r in steps.items()}

    assert name == "out"  # run_name's default: output_dir's last part
    run, _ = mlflow_run(str(out))
    assert run.info.run_name == "out" and run.data.params["rayfactory.dataset"] == "['arith_train']"
    assert config["rayfactory"]["template"] == "qwen"


def test_grpo_reports_every_step_record_to_each_tracker_offline(ray_session, tmp_path, offline):
    out = tmp_path / "out"
    run_exp({
        "model_name_or_path": "tiny:qwen2,num_heads=2", "template": "qwen", "stage": "grpo", "dataset": "arith_train",
        "dataset_dir": DATA_DIR, "output_dir": str(out), "reward_funcs": ["exact_match"], "rollout_backend": "hf",
        "num_generations": 4, "rollout_batch_size": 4, "max_completion_length": 4, "max_steps": 2,
        "logging_steps": 1, "ray_num_workers": 1, "report_to": ALL, "run_name": "grpo-tracked",
    })
    steps = {r["current_steps"]: r for r in read_log(str(out)) if "reward" in r}
    assert sorted(steps) == [1, 2] and steps[1]["time/generate"] > 0

    tb = tensorboard_scalars(str(out))
    _, history = mlflow_run(str(out))
    name, config, rows = wandb_history(str(out))
    wandb_steps = {row["_step"]: row for row in rows}
    # every number of every record: reward, loss, lr, grad_norm, time/<phase>, elapsed_time...
    for step, record in steps.items():
        numbers = {k: v for k, v in record.items() if k not in ("current_steps", "total_steps")
                   and isinstance(v, (int, float))}
        assert {"reward", "loss", "time/generate", "time/update"} <= set(numbers)
        for key, value in numbers.items():
            assert tb[key][step] == pytest.approx(value, rel=1e-6, abs=1e-7), key
            assert history[key][step] == pytest.approx(value), key
            assert wandb_steps[step][key] == pytest.approx(value), key
    run, _ = mlflow_run(str(out))
    assert name == run.info.run_name == "grpo-tracked"
    assert config["stage"] == "grpo" and run.data.params["reward_funcs"] == "['exact_match']"


@pytest.mark.parametrize("report_to, words", [
    ("swanlab", "protobuf below 7"),
    ("comet_ml", "is not a tracker RayFactory reports to"),
])
def test_report_to_mistakes_are_one_paragraph(tmp_path, report_to, words):
    with pytest.raises(ConfigError, match=words):
        load_config(tiny_sft_config(tmp_path / "out", report_to=report_to))


def test_a_missing_tracker_package_names_the_extra(tmp_path, monkeypatch):
    import cluster.extras

    monkeypatch.setattr(cluster.extras, "installed", lambda module: module != "wandb")
    with pytest.raises(ConfigError, match=r"'tracking' extra"):
        load_config(tiny_sft_config(tmp_path / "out", report_to="tensorboard,wandb"))


def test_report_to_spellings_resolve_to_a_list_and_a_run_name(tmp_path):
    training = load_config(tiny_sft_config(tmp_path / "out", report_to="all")).training
    assert training.report_to == ALL and training.run_name == "out"
    training = load_config(tiny_sft_config(tmp_path / "out", report_to=["none"])).training
    assert training.report_to == "none" and training.run_name is None
