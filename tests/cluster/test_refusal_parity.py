"""One resolve step: every entry path refuses a bad config with load_config's very paragraph, and
the config load_config returns is never changed afterwards.

The paths: ``rayfactory train cfg.yaml`` (the CLI), the web UI's validation of the same keys,
``rayfactory submit cfg.yaml --dry-run`` and ``run_exp("cfg.yaml")``. The web UI validates the
form's keys as a dict, not a file, so its paragraph names "the config dict" where the others name
cfg.yaml; apart from that one name the four paragraphs are equal.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from types import SimpleNamespace

import pytest
import yaml

from cluster.cli import main as cli_main
from cluster.config import ConfigError, load_config
from cluster.driver import run_exp
from cluster.webui.form import validate

BASE = {"model_name_or_path": "m", "dataset": "demo", "output_dir": "out"}
GRPO = {**BASE, "stage": "grpo", "dataset": "prompts", "reward_funcs": ["exact_match"]}
PREDICT = {"do_predict": True, "predict_with_generate": True, "eval_dataset": "arith_eval"}

BAD_CONFIGS = {
    "unknown stage": ({**BASE, "stage": "sfft"}, "unknown stage 'sfft'"),
    "predict on a stage that does not predict": ({**BASE, "stage": "dpo", **PREDICT}, "built for stage sft only"),
    "predict without predict_with_generate": ({**BASE, **PREDICT, "predict_with_generate": False},
                                              "Set predict_with_generate: true"),
    "nothing to do": ({**BASE, "do_train": False}, "nothing to do"),
    "unknown template": ({**BASE, "template": "qwen9"}, "template: Unknown template 'qwen9'"),
    "pref_loss on a stage without one": ({**BASE, "pref_loss": "orpo"}, "selects a preference objective"),
    "gae without a critic": ({**GRPO, "advantage_estimator": "gae", "num_generations": 1}, "needs a critic"),
    "grpo without reward functions": ({**GRPO, "reward_funcs": []}, "stage grpo needs reward_funcs"),
    "an unknown reward function": ({**GRPO, "reward_funcs": ["nosuch_module:score"]}, "was not found"),
    "a reward model for grpo": ({**GRPO, "reward_model": "saves/rm"}, "a reward model is read by stage ppo"),
    "ppo without a scorer (its table entry's check)": ({**BASE, "stage": "ppo", "dataset": "prompts"},
                                                      "needs something to score completions"),
    "greedy rollouts": ({**GRPO, "temperature": 0}, "greedy rollouts"),
}


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def write(config: dict) -> str:
        with open("cfg.yaml", "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        return "cfg.yaml"

    return write


def _refusals(path: str, config: dict, capsys) -> dict[str, str]:
    """Each entry path's paragraph for the config in ``path`` (``config``: the same keys)."""
    said = {}
    assert cli_main(["train", path]) == 2
    said["cli"] = _only_line(capsys.readouterr().err, "rayfactory: error: ")
    assert cli_main(["submit", path, "--dry-run", "--address", "http://head:8265"]) == 2
    said["submit --dry-run"] = _only_line(capsys.readouterr().err, "rayfactory submit: error: ")
    with pytest.raises(ConfigError) as refused:
        run_exp(path)
    said["run_exp"] = str(refused.value)
    error = validate(dict(config))
    assert error is not None
    said["web UI"] = error["message"].replace("the config dict", path)
    return said


def _only_line(stderr: str, prefix: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    return lines[0][len(prefix):]


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_every_entry_path_refuses_with_the_same_paragraph(name, config_file, capsys):
    config, expected = BAD_CONFIGS[name]
    said = _refusals(config_file(config), config, capsys)
    assert expected in said["cli"], said["cli"]
    assert set(said.values()) == {said["cli"]}, said


def _snapshot(cfg) -> dict:
    return copy.deepcopy({field.name: getattr(cfg, field.name) for field in dataclasses.fields(cfg)})


def test_load_config_resolves_rl_defaults_without_touching_sys_path(config_file, tmp_path):
    (tmp_path / "my_rewards.py").write_text("def score(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n")
    sys.modules.pop("my_rewards", None)
    path_before = list(sys.path)
    cfg = load_config(config_file({**BASE, "stage": "ppo", "dataset": "prompts", "reward_funcs": ["my_rewards:score"],
                                   "max_new_tokens": 48, "top_p": 0.9}))
    assert sys.path == path_before
    sys.modules.pop("my_rewards", None)
    # The stage table's defaults, for the keys the config leaves out: ppo's RL keys, RL sampling.
    assert (cfg.rl.advantage_estimator, cfg.rl.num_generations, cfg.rl.beta) == ("gae", 1, 0.2)
    assert (cfg.rl.max_completion_length, cfg.rl.rollout_batch_size) == (48, 8)
    assert (cfg.generating.temperature, cfg.generating.top_p, cfg.generating.top_k) == (1.0, 0.9, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rl = None


def test_nothing_changes_the_config_after_load_config(config_file, monkeypatch):
    """The driver used to pin ``template: auto`` into the config it was given; now the run reads a
    pinned copy, and the config load_config returned stays as it was."""
    import fabric.data.prepare
    import stages.loading
    from cluster import driver

    class Stop(Exception):
        pass

    seen = {}

    def stop(cfg, train):
        seen["template"] = cfg.data.template
        raise Stop

    monkeypatch.setattr(driver, "tokenizer_and_template", lambda cfg: (None, SimpleNamespace(name="qwen")))
    monkeypatch.setattr(stages.loading, "check_model_fits", lambda *args: None)
    monkeypatch.setattr(fabric.data.prepare, "check_data", lambda *args: None)
    monkeypatch.setattr(driver, "check_output_dirs", stop)
    cfg = load_config(config_file({**GRPO, "template": "auto"}))
    before = _snapshot(cfg)
    with pytest.raises(Stop):
        run_exp(cfg)
    assert seen["template"] == "qwen"  # the run got the pinned name ...
    assert _snapshot(cfg) == before  # ... and the config it was handed is unchanged


DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")
BAD_DATA = {
    "an unknown eval dataset": ({"eval_dataset": "no_such_eval"}, "Dataset 'no_such_eval' is not defined"),
    "an unknown dataset": ({"dataset": "no_such_data"}, "Dataset 'no_such_data' is not defined"),
}


@pytest.mark.parametrize("name", list(BAD_DATA))
def test_the_data_checks_refuse_with_the_same_paragraph_in_the_cli_run_exp_and_the_web_ui(name, config_file, capsys):
    """What the driver checks before Ray starts (datasets, files): `submit` leaves it to the job,
    whose machine has the data; every path that runs here says the same paragraph."""
    extra, expected = BAD_DATA[name]
    config = {"model_name_or_path": "tiny:qwen2", "template": "qwen", "dataset": "arith_train",
              "dataset_dir": DATA_DIR, "output_dir": "out", **extra}
    path = config_file(config)
    assert cli_main(["train", path]) == 2
    cli = _only_line(capsys.readouterr().err, "rayfactory: error: ")
    with pytest.raises(Exception) as refused:
        run_exp(path)
    assert expected in cli and str(refused.value) == cli
    assert validate(dict(config))["message"] == cli
