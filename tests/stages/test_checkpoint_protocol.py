"""The one checkpoint protocol of every stage (stages/training/checkpoints.py): a staged commit appears
whole or not at all, ``save_total_limit`` keeps the newest committed ones, and one resolver serves
an RL checkpoint and an HF Trainer checkpoint alike; explicit folders that cannot be resumed from
are refused with a paragraph that names them. Plus the log cut back to a checkpoint's step."""

from __future__ import annotations

import json
import logging
import os

import pytest

from stages.training.callbacks import truncate_log
from stages.training.checkpoints import (
    MANIFEST_NAME,
    ResumeError,
    checkpoint_path,
    checkpoint_progress,
    commit_checkpoint,
    has_manifest,
    latest_committed,
    resolve_resume,
    staging_folder,
    uncommit_after,
    verify_checkpoint,
    write_manifest,
)
from stages.rl.workers.checkpoint import STATE_FILE, read_state, write_state


def rl_checkpoint(output_dir, step: int, total: int = 10, limit: int | None = None) -> str:
    """What the RL loop writes: the roles' parts in a staging folder, rl_state.json, then the commit."""
    staging = staging_folder(str(output_dir), step)
    os.makedirs(os.path.join(staging, "policy"))
    with open(os.path.join(staging, "policy", "trainable.pt"), "wb") as f:
        f.write(b"w" * 64)
    write_state(staging, {"global_step": step, "total_steps": total})
    return commit_checkpoint(staging, step, total, save_total_limit=limit)


def trainer_checkpoint(output_dir, step: int, total: int = 10, limit: int | None = None) -> str:
    """What the HF Trainer path writes: checkpoint-N in place, then the commit there."""
    folder = checkpoint_path(str(output_dir), step)
    os.makedirs(folder)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(b"m" * 128)
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step, "max_steps": total}, f)
    return commit_checkpoint(folder, step, total, save_total_limit=limit)


WRITERS = {"rl": rl_checkpoint, "trainer": trainer_checkpoint}


# ----- commit -----

def test_a_staged_commit_appears_whole(tmp_path):
    staging = staging_folder(str(tmp_path), 5)
    assert staging == str(tmp_path / ".checkpoint-5.partial")
    assert latest_committed(str(tmp_path)) is None  # a staging folder is no checkpoint-N

    final = rl_checkpoint(tmp_path, 5, total=8)

    assert final == str(tmp_path / "checkpoint-5")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-5"]  # the staging folder became it
    assert sorted(os.listdir(final)) == sorted([MANIFEST_NAME, "policy", STATE_FILE])  # no temporary file left
    with open(os.path.join(final, MANIFEST_NAME), encoding="utf-8") as f:
        manifest = json.load(f)
    assert manifest["step"] == 5 and manifest["total_steps"] == 8
    assert set(manifest["files"]) == {"policy/trainable.pt", STATE_FILE}
    assert verify_checkpoint(final) is None
    assert read_state(final) == {"global_step": 5, "total_steps": 8}


def test_a_crash_before_the_commit_leaves_nothing_auto_picks(tmp_path):
    earlier = rl_checkpoint(tmp_path, 3)
    staging = staging_folder(str(tmp_path), 6)
    os.makedirs(os.path.join(staging, "policy"))  # the run dies here: no commit
    in_place = checkpoint_path(str(tmp_path), 7)
    os.makedirs(in_place)  # the HF Trainer died while writing checkpoint-7
    with open(os.path.join(in_place, "trainer_state.json"), "w") as f:
        f.write("{}")

    assert resolve_resume("auto", str(tmp_path)) == earlier
    assert staging_folder(str(tmp_path), 6) == staging and os.listdir(staging) == []  # the rerun starts it clean


def test_a_staged_commit_replaces_an_earlier_attempt_at_the_same_step(tmp_path):
    old = rl_checkpoint(tmp_path, 4)
    with open(os.path.join(old, "stale.txt"), "w") as f:
        f.write("from the replaced run")
    staging = staging_folder(str(tmp_path), 4)
    write_state(staging, {"global_step": 4, "run": 2})
    assert commit_checkpoint(staging, 4, 10) == old
    assert sorted(os.listdir(old)) == [MANIFEST_NAME, STATE_FILE]
    assert read_state(old) == {"global_step": 4, "run": 2}
    assert latest_committed(str(tmp_path)) == old


# ----- save_total_limit -----

@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_pruning_keeps_the_newest_n_committed(tmp_path, kind):
    for step in range(1, 6):
        WRITERS[kind](tmp_path, step, limit=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-5"]


@pytest.mark.parametrize("limit", [None, 0, -1])
def test_no_save_total_limit_keeps_all(tmp_path, limit):
    for step in range(1, 4):
        rl_checkpoint(tmp_path, step, limit=limit)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_pruning_ignores_half_written_folders_and_keeps_the_new_checkpoint(tmp_path):
    # A run resumed from checkpoint-10 while checkpoint-20 of the replaced run is still committed.
    for step in (10, 20):
        rl_checkpoint(tmp_path, step)
    os.makedirs(tmp_path / "checkpoint-5")  # half-written: not counted, not touched
    final = rl_checkpoint(tmp_path, 15, limit=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-15", "checkpoint-20", "checkpoint-5"]
    rl_checkpoint(tmp_path, 16, limit=1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-16", "checkpoint-5"]
    assert not os.path.exists(final)


# ----- resume: one resolver -----

@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_an_rl_and_a_trainer_checkpoint_are_resolved_by_the_same_function(tmp_path, kind):
    assert resolve_resume(None, str(tmp_path)) is None
    assert resolve_resume("", str(tmp_path)) is None
    assert resolve_resume("auto", str(tmp_path)) is None  # nothing yet: a fresh start
    named = WRITERS[kind](tmp_path, 2, total=7)
    latest = WRITERS[kind](tmp_path, 7, total=7)
    half = checkpoint_path(str(tmp_path), 9)
    os.makedirs(half)

    assert resolve_resume("auto", str(tmp_path)) == latest
    assert resolve_resume(named, str(tmp_path)) == named
    assert checkpoint_progress(latest) == (7, 7)  # from the manifest, whichever kind wrote it
    assert checkpoint_progress(named) == (2, 7)


def test_auto_takes_the_newest_committed_checkpoint_of_the_runs_own_kind(tmp_path):
    """An output_dir holding both kinds (an sft run, then a grpo run in the same folder): each run
    resumes from its own; the other's is refused by name, and neither prunes or uncommits the other's."""
    rl = rl_checkpoint(tmp_path, 3)
    trainer = trainer_checkpoint(tmp_path, 10)
    assert resolve_resume("auto", str(tmp_path), kind="rl") == rl
    assert resolve_resume("auto", str(tmp_path), kind="trainer") == trainer
    with pytest.raises(ResumeError, match=r"is a checkpoint of a Ray Train stage .* but this run is an RL stage"):
        resolve_resume(trainer, str(tmp_path), kind="rl")
    with pytest.raises(ResumeError, match=r"is a checkpoint of an RL stage .* but this run is a Ray Train stage"):
        resolve_resume(rl, str(tmp_path), kind="trainer")
    assert uncommit_after(str(tmp_path), 0, kind="trainer") == [trainer]
    assert resolve_resume("auto", str(tmp_path), kind="rl") == rl  # the RL checkpoint is still committed
    rl_checkpoint(tmp_path, 5, limit=1)  # pruning keeps one RL checkpoint: the trainer's is not counted
    assert os.path.isdir(trainer) and not os.path.isdir(rl)


def test_a_missing_folder_is_refused_by_name(tmp_path):
    missing = str(tmp_path / "checkpoint-99")
    with pytest.raises(ResumeError) as info:
        resolve_resume(missing, str(tmp_path))
    assert str(info.value) == (
        f"resume_from_checkpoint {missing} does not exist. Point resume_from_checkpoint at a checkpoint-N folder, "
        "or set resume_from_checkpoint: auto to resume from the newest committed checkpoint in output_dir.")


def test_a_folder_that_is_no_checkpoint_is_refused_by_name(tmp_path):
    half = checkpoint_path(str(tmp_path), 8)
    os.makedirs(os.path.join(half, "policy"))  # half-written under the old RL protocol, or not a checkpoint
    with pytest.raises(ResumeError) as info:
        resolve_resume(half, str(tmp_path))
    assert str(info.value) == (
        f"resume_from_checkpoint {half} is not a complete checkpoint: it has neither {MANIFEST_NAME} nor a state "
        "file (trainer_state.json or rl_state.json), so either it is not a checkpoint-N folder of a training run or "
        "that run stopped while writing it. Point resume_from_checkpoint at a checkpoint-N folder that has "
        f"{MANIFEST_NAME}, or set resume_from_checkpoint: auto to resume from the newest committed checkpoint in "
        "output_dir.")


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_a_committed_checkpoint_cut_short_is_refused_by_name(tmp_path, kind):
    folder = WRITERS[kind](tmp_path, 4)
    cut = "policy/trainable.pt" if kind == "rl" else "model.safetensors"
    with open(os.path.join(folder, *cut.split("/")), "r+b") as f:
        f.truncate(10)
    with pytest.raises(ResumeError) as info:
        resolve_resume(folder, str(tmp_path))
    assert str(info.value).startswith(f"resume_from_checkpoint {folder} is a half-written checkpoint: {cut} is 10 "
                                      "bytes, the manifest says ")
    assert resolve_resume("auto", str(tmp_path)) is None


@pytest.mark.parametrize("state_file", ["trainer_state.json", STATE_FILE])
def test_a_checkpoint_from_before_manifests_is_taken_by_name_with_one_warning_but_never_by_auto(
        tmp_path, caplog, state_file):
    folder = checkpoint_path(str(tmp_path), 6)
    os.makedirs(folder)
    with open(os.path.join(folder, state_file), "w") as f:
        json.dump({"global_step": 6, "max_steps": 9, "total_steps": 9}, f)
    with caplog.at_level(logging.WARNING, logger="stages.training.checkpoints"):
        assert resolve_resume(folder, str(tmp_path)) == folder
        assert resolve_resume(folder, str(tmp_path)) == folder
        assert resolve_resume("auto", str(tmp_path)) is None
    unchecked = [m for m in caplog.messages if f"{folder} has no {MANIFEST_NAME}" in m]
    assert len(unchecked) == 1 and "cannot be checked" in unchecked[0]
    assert checkpoint_progress(folder) == (6, 9)  # read from the state file


def test_progress_of_a_format_1_manifest_comes_from_the_state_file(tmp_path):
    folder = checkpoint_path(str(tmp_path), 3)
    os.makedirs(folder)
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 3, "max_steps": 12}, f)
    write_manifest(folder, 3)  # no total, as a format-1 manifest
    assert checkpoint_progress(folder) == (3, 12)
    assert checkpoint_progress(str(tmp_path)) is None  # neither manifest nor state file


def test_an_rl_run_refuses_a_trainer_checkpoint(tmp_path):
    folder = trainer_checkpoint(tmp_path, 2)
    with pytest.raises(ResumeError, match=rf"^resume_from_checkpoint {folder} has no rl_state.json, so it is not a "
                                          r"checkpoint of an RL stage \(grpo, ppo\)"):
        read_state(folder)


# ----- a run's start: the replaced run's checkpoints -----

def test_a_run_uncommits_the_checkpoints_beyond_its_start(tmp_path, caplog):
    kept = rl_checkpoint(tmp_path, 2)
    for step in (4, 6):
        trainer_checkpoint(tmp_path, step)
    with caplog.at_level(logging.WARNING, logger="stages.training.checkpoints"):
        replaced = uncommit_after(str(tmp_path), 2)
    assert replaced == [str(tmp_path / "checkpoint-4"), str(tmp_path / "checkpoint-6")]
    assert caplog.messages == [
        f"2 checkpoint(s) in {tmp_path} lie beyond step 2, where this run starts, so they belong to the run it "
        "replaces: uncommitted (auto no longer resumes from them; a save of the same step overwrites them): "
        "checkpoint-4, checkpoint-6"]
    assert not any(has_manifest(path) for path in replaced) and all(os.path.isdir(path) for path in replaced)
    assert resolve_resume("auto", str(tmp_path)) == kept
    assert uncommit_after(str(tmp_path), 2) == []


# ----- the log, cut back to the checkpoint's step -----

def test_truncate_log(tmp_path):
    lines = [json.dumps({"current_steps": s, "loss": s / 10}) + "\n" for s in range(1, 6)]
    with open(tmp_path / "trainer_log.jsonl", "w") as f:
        f.writelines(lines)
        f.write(json.dumps({"current_steps": 3, "train_runtime": 9.5}) + "\n")  # the end-of-run summary
        f.write('{"current_steps": 6, "lo')  # torn by the crash
    assert truncate_log(str(tmp_path), 3) == 4  # steps 4, 5, the summary and the torn line
    with open(tmp_path / "trainer_log.jsonl") as f:
        assert f.read() == "".join(lines[:3])
    assert truncate_log(str(tmp_path), 3) == 0
    assert truncate_log(str(tmp_path), 0) == 3
    with open(tmp_path / "trainer_log.jsonl") as f:
        assert f.read() == ""
    assert sorted(os.listdir(tmp_path)) == ["trainer_log.jsonl"]


def test_truncate_log_without_a_log(tmp_path):
    assert truncate_log(str(tmp_path), 3) == 0
    assert os.listdir(tmp_path) == []
