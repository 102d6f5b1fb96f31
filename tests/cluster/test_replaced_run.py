"""Never lose a run (cluster/replaced_run.py): a run that would start from step 0 in an output_dir
holding another run is refused before anything is written, unless it resumes that run or sets
overwrite_output_dir: true, which replaces it so that auto can never resume the old one; and Ray
Train's checkpoint copies default to a folder inside output_dir."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import yaml

from cluster.cli import main
from cluster.config import load_config
from cluster.config_types import ConfigError
from cluster.replaced_run import LOG_FILE, clear_replaced_run, replaced_run, run_in
from stages.training.checkpoints import committed_checkpoints, resolve_resume
from tests.cluster.conftest import BASE
from tests.stages.test_checkpoint_protocol import rl_checkpoint, trainer_checkpoint

pytestmark = pytest.mark.usefixtures("in_tmp")

GRPO = {**BASE, "stage": "grpo", "reward_funcs": ["exact_match"]}


def finished_sft_run(output_dir="out", steps=(2, 4)) -> None:
    """What an sft run leaves: committed checkpoints, the final adapter, the jsonl log, Ray's copies."""
    for step in steps:
        trainer_checkpoint(output_dir, step, total=steps[-1])
    for name, text in (("adapter_model.safetensors", "weights"), ("adapter_config.json", "{}"),
                       (LOG_FILE, '{"current_steps": 1, "loss": 2.0}\n'), ("rayfactory.log", "...\n")):
        with open(os.path.join(output_dir, name), "w", encoding="utf-8") as f:
            f.write(text)
    os.makedirs(os.path.join(output_dir, "ray_results", "out-20260101-000000-abcdef", "checkpoint_0"))


def refusal(config) -> str:
    with pytest.raises(ConfigError) as info:
        replaced_run(load_config(config))
    return str(info.value)


def test_a_rerun_without_resume_or_overwrite_is_refused_in_one_paragraph(tmp_path):
    finished_sft_run(steps=(2, 4, 6))
    assert refusal(BASE) == (
        f"output_dir {tmp_path / 'out'} already holds a run (3 checkpoints, checkpoint-2 to checkpoint-6, "
        "adapter_model.safetensors, trainer_log.jsonl), and this run would start from step 0 and overwrite it. "
        "To continue that run, set resume_from_checkpoint: auto (it resumes from the newest complete checkpoint; a "
        "finished run then trains nothing); to replace it, set overwrite_output_dir: true (its checkpoints are "
        "deleted first); or choose another output_dir. On the command line: resume_from_checkpoint=auto or "
        "overwrite_output_dir=true.")


def test_the_cli_refuses_before_it_writes_anything(tmp_path, capsys):
    finished_sft_run()
    before = sorted(os.listdir("out"))
    with open("out/rayfactory.log", encoding="utf-8") as f:
        log = f.read()
    with open("cfg.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump(BASE, f)
    assert main(["train", "cfg.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rayfactory: error: output_dir {tmp_path / 'out'} already holds a run (")
    assert err.count("\n") == 1  # one paragraph
    assert sorted(os.listdir("out")) == before
    with open("out/rayfactory.log", encoding="utf-8") as f:
        assert f.read() == log  # the console never opened it


@pytest.mark.parametrize("leftover", [[], ["rayfactory.log", "rayfactory_config.yaml"], ["notes.txt"]],
                         ids=["no output_dir", "a failed start", "files of the user's own"])
def test_an_output_dir_without_a_run_is_no_obstacle(leftover):
    for name in leftover:
        os.makedirs("out", exist_ok=True)
        with open(os.path.join("out", name), "w", encoding="utf-8") as f:
            f.write("x\n")
    assert run_in("out") == [] and replaced_run(load_config(BASE)) == []


@pytest.mark.parametrize("config", [BASE, GRPO], ids=["sft", "grpo"])
def test_auto_continues_the_run_and_an_explicit_checkpoint_too(config):
    writer = trainer_checkpoint if config is BASE else rl_checkpoint
    writer("out", 2, total=8)
    with open(os.path.join("out", LOG_FILE), "w", encoding="utf-8") as f:
        f.write('{"current_steps": 1}\n')
    assert replaced_run(load_config({**config, "resume_from_checkpoint": "auto"})) == []
    # overwrite_output_dir is moot once the run resumes (the web UI's Resume adds auto to its config)
    assert replaced_run(load_config({**config, "resume_from_checkpoint": "auto", "overwrite_output_dir": True})) == []
    assert replaced_run(load_config({**config, "resume_from_checkpoint": "out/checkpoint-2"})) == []
    assert os.path.isdir("out/checkpoint-2")


def test_auto_with_nothing_of_its_stage_to_resume_never_overwrites_a_trained_model(tmp_path):
    rl_checkpoint("out", 3, total=3)  # a grpo run's; an sft run cannot resume from it
    with open("out/model.safetensors", "w", encoding="utf-8") as f:
        f.write("weights")
    assert refusal({**BASE, "resume_from_checkpoint": "auto"}) == (
        f"output_dir {tmp_path / 'out'} holds a run (checkpoint-3, model.safetensors) that resume_from_checkpoint: "
        "auto cannot continue: it has no complete checkpoint of stage sft, so this run would start from step 0 and "
        "overwrite it. To replace that run, set overwrite_output_dir: true (its checkpoints are deleted first; on the "
        "command line: overwrite_output_dir=true); to keep it, choose another output_dir.")


def test_auto_starts_over_a_run_that_stopped_before_its_first_checkpoint():
    os.makedirs("out/checkpoint-10")  # never committed: the run died while writing it
    with open(os.path.join("out", LOG_FILE), "w", encoding="utf-8") as f:
        f.write('{"current_steps": 5, "loss": 1.0}\n')
    assert run_in("out") == ["checkpoint-10", LOG_FILE]
    assert replaced_run(load_config({**BASE, "resume_from_checkpoint": "auto"})) == []  # nothing to keep
    with pytest.raises(ConfigError, match="already holds a run"):
        replaced_run(load_config(BASE))  # without auto it still asks


def test_a_reused_ray_run_name_resumes_from_ray_storage():
    finished_sft_run()
    assert replaced_run(load_config({**BASE, "ray_run_name": "out-20260101-000000-abcdef"})) == []
    with pytest.raises(ConfigError, match="already holds a run"):
        replaced_run(load_config({**BASE, "ray_run_name": "never-ran"}))


def test_prediction_alone_is_no_rerun():
    finished_sft_run()
    config = {**BASE, "do_train": False, "do_predict": True, "predict_with_generate": True, "eval_dataset": "demo"}
    assert replaced_run(load_config(config)) == []


def test_overwrite_output_dir_replaces_the_run_and_auto_can_never_resume_it_again(caplog):
    finished_sft_run()
    rl_checkpoint("out", 6, total=6)  # another stage's too
    os.makedirs("out/.checkpoint-8.partial")  # a staging leftover
    cfg = load_config({**BASE, "overwrite_output_dir": True})
    assert cfg.finetuning.overwrite_output_dir is True and not any("overwrite_output_dir" in n for n in cfg.notes)
    found = replaced_run(cfg)
    assert found == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "adapter_model.safetensors", LOG_FILE]
    with caplog.at_level("WARNING", logger="cluster.replaced_run"):
        clear_replaced_run(cfg, found)
    assert sorted(os.listdir("out")) == ["adapter_config.json", "adapter_model.safetensors", "rayfactory.log"]
    assert committed_checkpoints("out") == [] and resolve_resume("auto", "out", kind="trainer") is None
    (message,) = [record.getMessage() for record in caplog.records]
    assert message == (
        f"overwrite_output_dir: true: this run starts from step 0 and replaces the run in {cfg.training.output_dir}; "
        "deleted checkpoint-2, checkpoint-4, checkpoint-6, .checkpoint-8.partial, trainer_log.jsonl, ray_results. "
        "Its model and other outputs are overwritten as this run saves its own.")


def test_overwrite_leaves_a_ray_storage_path_the_user_named(tmp_path):
    finished_sft_run()
    os.makedirs("shared/ray/old-run")
    for storage in ("shared/ray", "s3://bucket/ray"):
        cfg = load_config({**BASE, "overwrite_output_dir": True, "ray_storage_path": storage})
        clear_replaced_run(cfg, replaced_run(cfg))
    assert os.path.isdir("shared/ray/old-run") and os.path.isdir("out/ray_results")


def test_overwrite_output_dir_is_a_typed_key_and_never_saved(tmp_path):
    with pytest.raises(ConfigError, match="overwrite_output_dir"):
        load_config({**BASE, "overwrite_output_dir": "sometimes"})
    with open("cfg.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump(BASE, f)
    cfg = load_config("cfg.yaml", ["overwrite_output_dir=true"])
    assert cfg.finetuning.overwrite_output_dir is True
    saved = cfg.resolved()
    assert "overwrite_output_dir" not in saved  # repeating the saved config must not replace the run unasked
    assert load_config(saved).finetuning.overwrite_output_dir is False


# ----- Ray Train's copies: inside output_dir by default -----

def test_ray_storage_defaults_to_a_folder_inside_output_dir(tmp_path):
    cfg = load_config({**BASE, "output_dir": "elsewhere/run"})
    assert cfg.ray.ray_storage_path == str(tmp_path / "elsewhere/run/ray_results")
    assert cfg.resolved()["ray_storage_path"] is None  # a repeat into another output_dir keeps its copies there
    moved = load_config({**cfg.resolved(), "output_dir": "other"})
    assert moved.ray.ray_storage_path == str(tmp_path / "other/ray_results")


@pytest.mark.parametrize("given", ["runs/ray", "s3://bucket/ray", "file:///data/ray"])
def test_an_explicit_ray_storage_path_stays_and_is_saved(tmp_path, given):
    cfg = load_config({**BASE, "ray_storage_path": given})
    expected = str(tmp_path / given) if "://" not in given else given
    assert cfg.ray.ray_storage_path == expected and cfg.resolved()["ray_storage_path"] == expected


def test_the_summary_says_which_checkpoint_resumes(capsys):
    from cluster.console import Console

    ray_copy = SimpleNamespace(path="/runs/out/ray_results/out-1/checkpoint_2026")
    Console(verbose=True).summary(SimpleNamespace(metrics={}, checkpoint=ray_copy), "/runs/out",
                                  "/runs/out/checkpoint-4")
    lines = capsys.readouterr().out.splitlines()
    assert "  checkpoint  /runs/out/checkpoint-4 (resume_from_checkpoint: auto resumes from it)" in lines
    assert ("  ray copy    /runs/out/ray_results/out-1/checkpoint_2026 (Ray Train's: what a restart after a worker "
            "failure loads, max_failures)") in lines
    # trained in the driver: Ray's checkpoint is the committed folder itself, shown once
    in_place = SimpleNamespace(metrics={}, checkpoint=SimpleNamespace(path="/runs/out/checkpoint-4"))
    Console(verbose=True).summary(in_place, "/runs/out", "/runs/out/checkpoint-4")
    assert [line for line in capsys.readouterr().out.splitlines() if "checkpoint" in line] == [
        "  checkpoint  /runs/out/checkpoint-4 (resume_from_checkpoint: auto resumes from it)"]


def test_the_log_file_name_is_the_trainers():
    from stages.training.callbacks import LOG_FILE as WRITTEN

    assert LOG_FILE == WRITTEN
