"""resume_from_checkpoint in a config: "auto" passes through untouched (resolved at launch), a folder
must exist and becomes absolute."""

from __future__ import annotations

import os

import pytest

from cluster.config import load_config
from tests.cluster.conftest import BASE, error_of, write

pytestmark = pytest.mark.usefixtures("in_tmp")

GRPO = {**BASE, "stage": "grpo", "reward_funcs": ["exact_match"]}


@pytest.mark.parametrize("config", [BASE, GRPO], ids=["sft", "grpo"])
def test_auto_is_left_for_launch(config):
    assert not os.path.exists("out")  # no checkpoints yet: still accepted
    run = load_config({**config, "resume_from_checkpoint": "auto"})
    assert run.training.resume_from_checkpoint == "auto"


def test_auto_from_a_yaml_file():
    run = load_config(write("model_name_or_path: m\noutput_dir: o\nresume_from_checkpoint: auto\n"))
    assert run.training.resume_from_checkpoint == "auto"


def test_a_missing_folder_is_still_refused(tmp_path):
    assert error_of({**GRPO, "resume_from_checkpoint": "out/checkpoint-7"}) == (
        "resume_from_checkpoint 'out/checkpoint-7' in the config dict does not exist (looked for "
        f"{tmp_path / 'out/checkpoint-7'}). Point it at a checkpoint folder, or remove it."
    )


def test_a_folder_named_auto_needs_a_path_prefix(tmp_path):
    # "auto" always means the latest checkpoint; a folder of that name is reached as ./auto
    os.makedirs("auto")
    run = load_config({**GRPO, "resume_from_checkpoint": "./auto"})
    assert run.training.resume_from_checkpoint == str(tmp_path / "auto")
