"""User mistakes through the real console script: exit code 2 and one paragraph on stderr.

Each case runs ``.venv/bin/rayfactory train cfg.yaml`` as a subprocess in a fresh folder with its
own small dataset_dir. Mistakes that need no cluster (unknown names, a missing model, a dataset
that cannot serve the stage) must fail before Ray starts (those cases are
tests/cluster/test_cli_refusals_before_ray.py's, with these helpers): those runs get ``RAY_ADDRESS=""``, so a
regression would start a local Ray, which logs "Started a local Ray instance" (to the run's
rayfactory.log). Mistakes found by Ray (a bad row inside a Ray Data task, too few CPUs) join the
test session's Ray instead of starting one per case (~15 s each on 2 cores). A bad row reads the
same whether the driver or a Ray Data task tokenized it (``preprocessing_engine``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stages.training.callbacks import read_log
from tests.e2e.conftest import own_lines

RAYFACTORY = os.path.join(os.path.dirname(sys.executable), "rayfactory")
LOCAL_RAY_STARTED = "Started a local Ray instance"
ROWS = 12
BAD_ROW = 7  # 1-based, as the error names it


def write_dataset(folder) -> str:
    """An alpaca dataset of 12 additions whose row 7 has a list where the answer text belongs."""
    data = folder / "data"
    data.mkdir()
    rows = [{"instruction": f"What is {i}+1?", "input": "", "output": str(i + 1)} for i in range(ROWS)]
    rows[BAD_ROW - 1]["output"] = ["7", "seven"]
    (data / "mine.json").write_text(json.dumps(rows, indent=1))
    (data / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "mine.json"}}))
    return str(data / "mine.json")


def write_config(folder, **overrides) -> None:
    config = {
        "model_name_or_path": "tiny:qwen2",
        "template": "qwen",
        "stage": "sft",
        "finetuning_type": "full",
        "dataset": "mine",
        "dataset_dir": "data",
        "cutoff_len": 64,
        "output_dir": "out",
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "logging_steps": 1,
        "save_steps": 1000,
        "report_to": "none",
        "ray_num_workers": 1,
        "ray_storage_path": "ray",
    }
    config.update(overrides)
    (folder / "cfg.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))


def rayfactory_train(folder, ray_address: str = "", timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    env.pop("PYTHONPATH", None)  # the console script must work as installed
    return subprocess.run(
        [RAYFACTORY, "train", "cfg.yaml"], cwd=str(folder), env=env, capture_output=True, text=True, timeout=timeout
    )


def started_local_ray(folder, done: subprocess.CompletedProcess) -> bool:
    """Ray says so in the run's log file (on the console only with --verbose)."""
    log = folder / "out" / "rayfactory.log"
    return LOCAL_RAY_STARTED in done.stdout + done.stderr + (log.read_text() if log.exists() else "")


def error_paragraph(done: subprocess.CompletedProcess) -> str:
    """The one error line, after checking the rest of the contract (exit 2, no traceback)."""
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("rayfactory: error: ")]
    assert len(errors) == 1, done.stderr[-3000:]
    # The last thing rayfactory prints (Ray may still forward a worker's log line after it).
    assert own_lines(done.stderr.rstrip("\n"))[-1] == errors[0], done.stderr[-3000:]
    return errors[0][len("rayfactory: error: "):]


@pytest.fixture
def session_address(ray_session):
    return ray_session.get_runtime_context().gcs_address


@pytest.mark.parametrize("engine", ["driver", "ray_data"])
def test_bad_row_names_dataset_file_row_and_field(tmp_path, session_address, engine):
    source = write_dataset(tmp_path)
    write_config(tmp_path, preprocessing_engine=engine)
    message = error_paragraph(rayfactory_train(tmp_path, session_address))
    assert message == (
        f"row {BAD_ROW} of {source} (dataset 'mine'): column 'output' is a list, expected a string. "
        "Fix the row, or set skip_bad_rows: true to drop such rows and report them."
    )


def test_bad_row_aborts_the_workers_started_beside_tokenizing(tmp_path, ray_session, monkeypatch):
    """From Python, where the driver lives on after the error (a notebook): the worker group started
    before tokenizing (fabric/launcher.py) is aborted, so its CPU is free again. A group left
    waiting for its data would hold it until the driver ends."""
    from cluster.driver import run_exp
    from registries.errors import find_user_error

    write_dataset(tmp_path)
    write_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as raised:
        run_exp(str(tmp_path / "cfg.yaml"))
    assert f"row {BAD_ROW} of" in str(find_user_error(raised.value))
    assert cpus_stay_free(ray_session), ray_session.available_resources()


def cpus_stay_free(ray, seconds: float = 15, release_s: float = 3) -> bool:
    """Every CPU free within ``release_s`` (Ray releases a removed placement group's bundles
    asynchronously), and then for ``seconds``: long enough for a controller left running to have
    placed its worker group (5-10 s after the error on 2 cores)."""
    import time

    released = time.time() + release_s
    while ray.available_resources().get("CPU", 0) != ray.cluster_resources().get("CPU") and time.time() < released:
        time.sleep(0.05)
    deadline = time.time() + seconds
    while time.time() < deadline:
        if ray.available_resources().get("CPU", 0) != ray.cluster_resources().get("CPU"):
            return False
        time.sleep(0.25)
    return True


def test_skip_bad_rows_trains_and_reports_the_skipped_row(tmp_path, session_address):
    """Skipped in Ray Data's tasks, whose counts and first errors the driver gathers. The driver
    engine prints the aligner's own report (test_dataset_aligner.py) and gives Ray Data's tables
    (test_data_pipeline.py's engine parity), so a second run here would add start-up time only."""
    source = write_dataset(tmp_path)
    write_config(tmp_path, skip_bad_rows=True, max_steps=2, preprocessing_engine="ray_data")
    done = rayfactory_train(tmp_path, session_address)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        f"[rayfactory] dataset 'mine': skipped 1 of {ROWS} rows (skip_bad_rows is on): row {BAD_ROW} of {source} "
        "(dataset 'mine'): column 'output' is a list, expected a string." in done.stdout
    )
    assert f"'train_examples': {ROWS - 1}, 'eval_examples': 0" in done.stdout
    assert [r["current_steps"] for r in read_log(str(tmp_path / "out")) if "loss" in r] == [1, 2]


def test_more_workers_than_cluster_cpus_fails_fast(tmp_path, ray_session, session_address):
    have = ray_session.cluster_resources()["CPU"]
    workers = int(have) + 4
    write_dataset(tmp_path)
    write_config(tmp_path, ray_num_workers=workers)
    done = rayfactory_train(tmp_path, session_address, timeout=180)
    message = error_paragraph(done)
    assert message == (
        f"ray_num_workers={workers} with resources_per_worker CPU=1 needs {workers} CPU but the Ray cluster has "
        f"{have:g}. Lower ray_num_workers or resources_per_worker, or add nodes."
    )
    assert "data ready" not in done.stdout  # nothing was tokenized for a run that cannot start


def test_changed_setting_on_reused_tokenized_path_exits_2(tmp_path, session_address, monkeypatch):
    """The tokenized_path mismatch (tested in depth in test_data_pipeline) is a user error too."""
    from cluster.config import load_config
    from fabric.data.prepare import prepare_datasets
    from stages.loading import load_tokenizer_and_template

    write_dataset(tmp_path)
    write_config(tmp_path, tokenized_path="tok", skip_bad_rows=True)
    monkeypatch.chdir(tmp_path)  # the config's relative paths, as the CLI resolves them
    cfg = load_config("cfg.yaml")
    tokenizer, template = load_tokenizer_and_template(cfg.model, cfg.data)
    prepare_datasets(cfg.data, cfg.finetuning.spec, cfg.training.seed, tokenizer, template)  # the first run's tokenizing
    write_config(tmp_path, tokenized_path="tok", skip_bad_rows=True, cutoff_len=32)
    message = error_paragraph(rayfactory_train(tmp_path, session_address))
    assert message == (
        f"tokenized_path {tmp_path / 'tok'} was made with different settings (cutoff_len: 64 -> 32). Set "
        "overwrite_cache: true to tokenize again into it, or point tokenized_path at a new folder."
    )
