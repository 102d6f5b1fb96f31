"""resume_from_checkpoint in a config: "auto" passes through untouched (resolved at launch), a folder
must exist and becomes absolute; the rerun check of a finished run resolves it as launch does, for
every stage."""

from __future__ import annotations

import os

import pytest

from cluster.config_types import ConfigError

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
    from tests.stages.test_checkpoint_protocol import rl_checkpoint

    os.makedirs("auto")
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint \S+/auto in .* is not a complete checkpoint"):
        load_config({**GRPO, "resume_from_checkpoint": "./auto"})  # the folder itself, checked like any
    os.rmdir("auto")
    os.rename(rl_checkpoint(tmp_path / "run", 3), "auto")
    run = load_config({**GRPO, "resume_from_checkpoint": "./auto"})
    assert run.training.resume_from_checkpoint == str(tmp_path / "auto")


def _writers():
    from tests.stages.test_checkpoint_protocol import rl_checkpoint, trainer_checkpoint

    return {"sft": trainer_checkpoint, "grpo": rl_checkpoint}


@pytest.mark.parametrize("config", [BASE, GRPO], ids=["sft", "grpo"])
def test_a_finished_run_is_found_by_the_one_resolver_for_every_stage(config):
    from cluster.finished_run import finished_run

    _writers()[config.get("stage", "sft")]("out", 4, total=4)
    finished = load_config({**config, "max_steps": 4, "resume_from_checkpoint": "auto"})
    assert finished_run(finished).startswith(f"{finished.training.output_dir} holds a finished run: checkpoint-4 is "
                                             "step 4 of 4, so resume_from_checkpoint: auto leaves nothing to train")
    assert finished_run(load_config({**config, "max_steps": 6, "resume_from_checkpoint": "auto"})) is None


def test_a_bad_rl_checkpoint_is_refused_before_anything_runs(tmp_path):
    os.makedirs("out/checkpoint-3/policy")  # half-written: the config checks RL checkpoints as it checks any
    with pytest.raises(ConfigError, match=f"^resume_from_checkpoint {tmp_path}/out/checkpoint-3 in the config dict "
                                          "is not a complete "):
        load_config({**GRPO, "resume_from_checkpoint": "out/checkpoint-3"})
