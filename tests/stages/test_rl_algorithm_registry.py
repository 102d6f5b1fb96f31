"""The RL algorithm registries (stages/rl/algorithms/registry.py, issue 58): one register_* call per
entry, duplicates refused, and the config checks, the web UI's selects and docs/rl.md's table all
read the registered names and facts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cluster.config import ConfigError, load_config
from stages.rl.algorithms import registry as reg
from tests.stages.test_rl_loss_variants import GRPO

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_every_builtin_is_registered_once_with_its_facts():
    assert reg.ADVANTAGE_ESTIMATORS.names()[:4] == ("gae", "group_norm", "dr_grpo", "rloo")
    assert {"grpo", "dapo", "dr_grpo", "cispo"} <= set(reg.POLICY_LOSSES.names())
    assert reg.KL_ESTIMATORS.names() == ("k1", "k2", "k3")
    gae, rpp = reg.ADVANTAGE_ESTIMATORS.get("gae"), reg.ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")
    assert gae.needs_critic and gae.fn is None and gae.min_generations == 1
    assert (rpp.kind, rpp.min_generations, rpp.fixed_gamma) == ("per_token", 1, None)
    assert reg.ADVANTAGE_ESTIMATORS.get("reinforce_baseline").fixed_gamma == 1.0
    assert reg.POLICY_LOSSES.get("grpo").aggregation == "sequence_mean"
    assert reg.POLICY_LOSSES.get("cispo").clip_bounds(0.2, 5.0) == (None, 5.0)


def test_a_second_registration_of_a_name_is_refused():
    with pytest.raises(reg.DuplicateAlgorithm, match="policy loss 'dapo' is already registered"):
        reg.register_policy_loss("dapo", "again", lambda *a: None, aggregation="token_mean",
                                 clip_bounds=lambda lo, hi: (None, None))
    with pytest.raises(reg.DuplicateAlgorithm, match="advantage estimator 'rloo'"):
        reg.register_adv_est("rloo", "group", "again", lambda *a: None)
    with pytest.raises(reg.DuplicateAlgorithm, match="KL estimator 'k3'"):
        reg.register_kl_estimator("k3", "again", lambda *a: None)
    assert reg.POLICY_LOSSES.get("dapo").summary != "again"
    fresh = reg.Registry("loss_type", "policy loss")
    fresh.register(reg.POLICY_LOSSES.get("grpo"))
    with pytest.raises(ValueError, match="aggregation 'sum'"):
        reg.register_policy_loss("mine", "x", lambda *a: None, aggregation="sum", clip_bounds=lambda lo, hi: (lo, hi))


@pytest.mark.parametrize("key, bad", [("loss_type", "bnpo"), ("kl_estimator", "k4"),
                                      ("advantage_estimator", "grpo")])
def test_an_unregistered_name_is_refused_listing_the_registered_ones(key, bad):
    with pytest.raises(ConfigError) as info:
        load_config({**GRPO, key: bad})
    names = ", ".join(repr(n) for n in reg.REGISTRY_BY_KEY[key].names())
    assert str(info.value).startswith(f"wrong value for {key!r} in the config dict: got {bad!r} (a string), "
                                      f"expected one of {names}")
    from registries.errors import ArgumentError
    from stages.rl.config.rl_args import RLArguments

    with pytest.raises(ArgumentError, match=f"expected one of {names}"):  # built directly, not loaded
        RLArguments(**{key: bad})


def test_reinforce_baseline_forces_gamma_one():
    assert load_config({**GRPO, "advantage_estimator": "reinforce_baseline", "gamma": 1.0}).rl.gamma == 1.0
    with pytest.raises(ConfigError) as info:
        load_config({**GRPO, "advantage_estimator": "reinforce_baseline", "gamma": 0.9})
    message = str(info.value)
    assert message.startswith("invalid gamma in the config dict: advantage_estimator reinforce_baseline discounts "
                              "with gamma 1 only")
    assert "got gamma 0.9" in message and "Remove gamma (or set gamma: 1)" in message and "\n" not in message
    # reinforce_plus_plus discounts with gamma: another value is fine there
    assert load_config({**GRPO, "advantage_estimator": "reinforce_plus_plus", "gamma": 0.9}).rl.gamma == 0.9


def test_estimator_facts_drive_the_stage_checks():
    with pytest.raises(ConfigError, match="needs a critic, which only stage ppo trains"):
        load_config({**GRPO, "advantage_estimator": "gae"})
    with pytest.raises(ConfigError, match="num_generations must be at least 2 \\(got 1\\)"):
        load_config({**GRPO, "advantage_estimator": "rloo", "num_generations": 1})
    assert not load_config({**GRPO, "advantage_estimator": "rloo"}).rl.uses_critic


def test_web_ui_selects_offer_the_registered_names():
    from cluster.webui import form

    spec = {f["key"]: f for f in form.form_spec()["fields"]}
    for key in form.RL_REGISTERED:
        assert spec[key]["kind"] == "select"
        assert spec[key]["choices"] == ["", *reg.REGISTRY_BY_KEY[key].names()], key


def test_docs_table_is_the_registries():
    with open(os.path.join(REPO, "docs", "rl.md"), encoding="utf-8") as f:
        text = f.read()
    begin, end = "<!-- registered algorithms: begin -->\n", "\n<!-- registered algorithms: end -->"
    table = text[text.index(begin) + len(begin):text.index(end)]
    assert table == reg.markdown_table(), "docs/rl.md's table is stale: paste registry.markdown_table()"


def test_a_loss_type_typo_is_named_without_importing_torch():
    probe = ("import sys\nfrom cluster.config import ConfigError, load_config\n"
             f"try:\n    load_config({{**{GRPO!r}, 'loss_type': 'dapoo'}})\n"
             "except ConfigError as exc:\n    print(exc)\n"
             "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=os.getcwd(), capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "False", done.stdout + done.stderr
    assert lines[0].startswith("wrong value for 'loss_type' in the config dict: got 'dapoo' (a string), expected "
                               "one of 'grpo', 'dapo'") and lines[0].endswith("did you mean 'dapo'?")
