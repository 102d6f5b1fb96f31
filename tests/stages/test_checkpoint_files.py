"""stages.training.checkpoints and stages.training.hf_checkpoints: a checkpoint counts once its manifest verifies;
auto-resume skips the ones that do not (with a warning); save_total_limit counts and deletes only
committed checkpoints and never the newest one. The last test trains a real HF Trainer (no Ray).
(The staged commit and the one resolver for every stage: test_checkpoint_protocol.py.)"""

from __future__ import annotations

import json
import logging
import os

import pytest
from transformers import TrainerCallback
from transformers.trainer_utils import rotate_checkpoints

from stages.training.checkpoints import (
    MANIFEST_NAME,
    checkpoint_folders,
    committed_checkpoints,
    has_manifest,
    latest_committed,
    prune_checkpoints,
    uncommit,
    verify_checkpoint,
    write_manifest,
)

# What a checkpoint folder holds, by name and size (a DeepSpeed-style subfolder too).
FILES = {"model.safetensors": 4960, "optimizer.pt": 1700, "trainer_state.json": 90, "global_step8/shard.pt": 33}


def make_checkpoint(output_dir, step: int, commit: bool = True) -> str:
    folder = os.path.join(str(output_dir), f"checkpoint-{step}")
    for relative, size in FILES.items():
        path = os.path.join(folder, *relative.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(bytes([step % 256]) * size)
    if commit:
        write_manifest(folder, step)
    return folder


def truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


# ----- the manifest -----

def test_the_manifest_lists_every_file_with_its_size_and_is_written_by_rename(tmp_path):
    folder = make_checkpoint(tmp_path, 8, commit=False)
    assert not has_manifest(folder)

    manifest = write_manifest(folder, 8, total_steps=24)

    assert manifest == {"format": 2, "step": 8, "total_steps": 24, "files": dict(sorted(FILES.items()))}
    with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
        assert json.load(f) == manifest
    assert sorted(os.listdir(folder)) == sorted(["global_step8", "model.safetensors", "optimizer.pt",
                                                 "trainer_state.json", MANIFEST_NAME])  # no .tmp left
    assert verify_checkpoint(folder) is None


def test_verify_names_the_first_file_that_does_not_match(tmp_path):
    folder = make_checkpoint(tmp_path, 8)
    truncate(os.path.join(folder, "model.safetensors"), 1200)
    assert verify_checkpoint(folder) == "model.safetensors is 1200 bytes, the manifest says 4960"

    folder = make_checkpoint(tmp_path, 9)
    os.remove(os.path.join(folder, "global_step8", "shard.pt"))
    assert verify_checkpoint(folder) == "global_step8/shard.pt is missing"

    folder = make_checkpoint(tmp_path, 10)
    with open(os.path.join(folder, "optimizer.pt"), "ab") as f:  # longer is as wrong as shorter
        f.write(b"x")
    assert verify_checkpoint(folder) == "optimizer.pt is 1701 bytes, the manifest says 1700"

    folder = make_checkpoint(tmp_path, 11)
    with open(os.path.join(folder, "extra.txt"), "w") as f:  # a file the manifest does not list is no harm
        f.write("note")
    assert verify_checkpoint(folder) is None


def test_verify_without_a_readable_manifest(tmp_path):
    half = make_checkpoint(tmp_path, 4, commit=False)
    assert verify_checkpoint(half) == (
        f"it has no {MANIFEST_NAME}, so it was never committed (the run stopped while writing it, or it was "
        "written before checkpoints had manifests)"
    )
    torn = make_checkpoint(tmp_path, 5)
    with open(os.path.join(torn, MANIFEST_NAME), "w") as f:
        f.write('{"files": {"model.safe')
    assert verify_checkpoint(torn).startswith(f"its {MANIFEST_NAME} cannot be read (JSONDecodeError: ")
    assert verify_checkpoint(str(tmp_path / "checkpoint-99")) == "the folder does not exist"


def test_uncommit_removes_only_the_manifest(tmp_path):
    folder = make_checkpoint(tmp_path, 3)
    assert uncommit(folder) is True
    assert not has_manifest(folder) and os.path.isfile(os.path.join(folder, "model.safetensors"))
    assert uncommit(folder) is False
    assert verify_checkpoint(folder).startswith(f"it has no {MANIFEST_NAME}")


# ----- resume: auto -----

def test_auto_takes_the_newest_committed_checkpoint_and_warns_about_each_newer_one(tmp_path, caplog):
    make_checkpoint(tmp_path, 8)
    good = make_checkpoint(tmp_path, 16)
    cut = make_checkpoint(tmp_path, 24)
    truncate(os.path.join(cut, "model.safetensors"), 2480)
    unfinished = make_checkpoint(tmp_path, 32, commit=False)
    os.makedirs(tmp_path / ".checkpoint-40.partial")  # an RL staging folder: not a checkpoint-N at all

    with caplog.at_level(logging.INFO, logger="stages.training.checkpoints"):
        assert latest_committed(str(tmp_path)) == good

    warnings = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        ("WARNING", f"resume_from_checkpoint auto: skipping {unfinished}: it has no {MANIFEST_NAME}, so it was "
                    "never committed (the run stopped while writing it, or it was written before checkpoints had "
                    "manifests)"),
        ("WARNING", f"resume_from_checkpoint auto: skipping {cut}: model.safetensors is 2480 bytes, the manifest "
                    "says 4960"),
    ]
    assert f"resume_from_checkpoint auto: resuming from {good}" in caplog.text


def test_auto_with_nothing_committed_starts_fresh(tmp_path, caplog):
    assert latest_committed(str(tmp_path / "not-yet")) is None
    make_checkpoint(tmp_path, 2, commit=False)
    with caplog.at_level(logging.WARNING, logger="stages.training.checkpoints"):
        assert latest_committed(str(tmp_path)) is None
    assert [r.getMessage().split(":")[1].strip() for r in caplog.records] == [f"skipping {tmp_path}/checkpoint-2"]


def test_folders_are_ordered_by_step_as_numbers(tmp_path):
    for step in (9, 10, 2):
        make_checkpoint(tmp_path, step)
    for name in ("checkpoint-100-old", "checkpoint-x", "checkpoint-", "old-checkpoint-200"):
        os.makedirs(tmp_path / name)
    (tmp_path / "checkpoint-300").write_text("a file, not a folder")
    assert [step for step, _ in checkpoint_folders(str(tmp_path))] == [2, 9, 10]
    assert latest_committed(str(tmp_path)) == str(tmp_path / "checkpoint-10")


# ----- save_total_limit -----

def test_pruning_never_deletes_the_newest_committed_checkpoint_for_a_half_written_newer_one(tmp_path):
    """The run died while writing checkpoint-8: only checkpoint-4 is good, and it must stay."""
    good = make_checkpoint(tmp_path, 4)
    make_checkpoint(tmp_path, 8, commit=False)

    assert prune_checkpoints(committed_checkpoints(str(tmp_path)), 1) == []
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-8"]
    assert verify_checkpoint(good) is None

    # The HF Trainer's own rotation (why it is switched off): it keeps the newest folder, whatever it holds.
    rotate_checkpoints(str(tmp_path), save_total_limit=1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-8"]


def test_pruning_deletes_the_oldest_committed_ones_and_keeps_the_protected(tmp_path):
    for step in (2, 4, 6, 8, 10):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 1, commit=False)  # half-written: not counted, not touched
    best, newest = str(tmp_path / "checkpoint-4"), str(tmp_path / "checkpoint-10")

    deleted = prune_checkpoints(committed_checkpoints(str(tmp_path)), 3, protected=[newest, best, None])

    assert deleted == [str(tmp_path / "checkpoint-2"), str(tmp_path / "checkpoint-6")]
    assert sorted(os.listdir(tmp_path), key=lambda n: int(n.split("-")[1])) == [
        "checkpoint-1", "checkpoint-4", "checkpoint-8", "checkpoint-10"]


def test_protected_checkpoints_stay_even_beyond_the_limit(tmp_path):
    for step in (3, 6, 9):
        make_checkpoint(tmp_path, step)
    protected = [str(tmp_path / "checkpoint-3"), str(tmp_path / "checkpoint-9")]
    assert prune_checkpoints(committed_checkpoints(str(tmp_path)), 1, protected) == [str(tmp_path / "checkpoint-6")]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-9"]


@pytest.mark.parametrize("limit", [None, 0, -1])
def test_no_limit_keeps_everything(tmp_path, limit):
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)
    assert prune_checkpoints(committed_checkpoints(str(tmp_path)), limit) == []
    assert len(os.listdir(tmp_path)) == 3


# ----- the HF Trainer, for real (CPU, no Ray) -----

class ManifestsAtTrainBegin(TrainerCallback):
    """Records, right after CommitCheckpoints' on_train_begin, which checkpoint folders still have a manifest."""

    def __init__(self):
        self.seen = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.seen = {os.path.basename(path): has_manifest(path) for _, path in checkpoint_folders(args.output_dir)}


def test_the_trainer_commits_every_checkpoint_and_rotates_committed_ones(tmp_path, caplog):
    import datasets
    from transformers import AutoModelForCausalLM, Trainer

    from cluster.config import load_config
    from stages.training.hf_checkpoints import CommitCheckpoints
    from stages.loading import resolve_model_path
    from tests.e2e.conftest import tiny_sft_config

    out = tmp_path / "out"
    spec = load_config(tiny_sft_config(out, max_steps=6, save_steps=2, save_total_limit=2)).job_spec()
    args = spec.training_arguments(use_cpu=True)
    assert (args.save_total_limit, spec.training.save_total_limit) == (None, 2)  # the Trainer's rotation is off

    # Left by an earlier run in the same output_dir: a half-written checkpoint-1 and committed
    # checkpoints 4 (this run writes step 4 again, in place) and 40 (beyond this run's end).
    make_checkpoint(out, 1, commit=False)
    make_checkpoint(out, 4)
    make_checkpoint(out, 40)
    probe = ManifestsAtTrainBegin()
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:qwen2"))
    rows = datasets.Dataset.from_dict({"input_ids": [[2, 3, 4, 5, 6, 7]] * 32, "labels": [[2, 3, 4, 5, 6, 7]] * 32})
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      callbacks=[CommitCheckpoints(spec.training.save_total_limit), probe])
    with caplog.at_level(logging.WARNING, logger="stages.training.checkpoints"):
        trainer.train()

    # This run starts at step 0, so the earlier run's checkpoints were uncommitted before any step.
    assert probe.seen == {"checkpoint-1": False, "checkpoint-4": False, "checkpoint-40": False}
    assert caplog.messages == [
        f"2 checkpoint(s) in {out} lie beyond step 0, where this run starts, so they belong to the run it replaces: "
        "uncommitted (auto no longer resumes from them; a save of the same step overwrites them): "
        "checkpoint-4, checkpoint-40"]
    # Committed: 2, 4, 6; limit 2 keeps 4 and 6. The folders without a manifest were neither counted nor touched.
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-4", "checkpoint-40", "checkpoint-6"]
    assert [os.path.basename(path) for _, path in committed_checkpoints(str(out))] == ["checkpoint-4", "checkpoint-6"]
    for step in (4, 6):
        folder = str(out / f"checkpoint-{step}")
        with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
            manifest = json.load(f)
        on_disk = {os.path.relpath(os.path.join(root, name), folder): os.path.getsize(os.path.join(root, name))
                   for root, _, names in os.walk(folder) for name in names if name != MANIFEST_NAME}
        assert (manifest["step"], manifest["total_steps"], manifest["files"]) == (step, 6, on_disk)
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(on_disk)
    with open(out / "checkpoint-4" / "trainer_state.json", encoding="utf-8") as f:
        assert json.load(f)["global_step"] == 4  # this run's, written over the earlier run's file
