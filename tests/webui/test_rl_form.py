"""The Train tab's RL fields (stage grpo / ppo) and the run page's RL series (issue 38), without a browser:
the form offers the RL keys for an RL stage only, the YAML it builds is what the CLI's loader reads,
a bad value is a 4xx naming its field, and the run's charts carry reward and turns per trajectory."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict

import pytest

from cluster.config import load_config
from cluster.webui import form

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_URL = "http://127.0.0.1:7860"
RL_KEYS = ("reward_funcs", "reward_weights", "num_generations", "rollout_batch_size", "max_completion_length", "beta",
           "loss_type", "advantage_estimator", "rollout_backend", "async_rollout", "max_staleness", "num_iterations",
           "epsilon", "environment", "tools", "max_turns", "max_turn_tokens")
PPO_KEYS = ("reward_model", "reward_model_type")
# What a user types into the grpo form (text, as the page sends it) and what the YAML must then hold.
GRPO_TYPED = {
    "reward_funcs": "exact_match, digit_ratio", "reward_weights": "1.0, 0.5", "num_generations": "4",
    "rollout_batch_size": "2", "max_completion_length": "16", "beta": "0.02", "loss_type": "grpo",
    "advantage_estimator": "rloo", "rollout_backend": "hf", "async_rollout": "off", "num_iterations": "2",
    "epsilon": "0.3", "environment": "tools", "tools": "calculator,python", "max_turns": "3", "max_turn_tokens": "8",
}
GRPO_WRITTEN = {
    "reward_funcs": ["exact_match", "digit_ratio"], "reward_weights": [1.0, 0.5], "num_generations": 4,
    "rollout_batch_size": 2, "max_completion_length": 16, "beta": 0.02, "loss_type": "grpo",
    "advantage_estimator": "rloo", "rollout_backend": "hf", "async_rollout": "off", "num_iterations": 2,
    "epsilon": 0.3, "environment": "tools", "tools": ["calculator", "python"], "max_turns": 3, "max_turn_tokens": 8,
}


def new_form(**changes):
    values = {f.key: f.default for f in form.FIELDS}
    values.update(changes)
    return values


def tiny(**changes):
    """A new form for a tiny run on the repo's data (the API's folder is the repo root)."""
    return new_form(model_name_or_path="tiny:qwen2", template="qwen", dataset=["arith_train"], dataset_dir="data",
                    cutoff_len=64, output_dir="saves/webui-rl-test", **changes)


@pytest.fixture
def client(tmp_path):
    from fastapi.testclient import TestClient

    from cluster.webui.server import create_app

    return TestClient(create_app(str(tmp_path / "share"), cwd=REPO_ROOT), base_url=BASE_URL,
                      raise_server_exceptions=False)


# --- the form --------------------------------------------------------------------------------------

def test_rl_fields_follow_the_stage_table_and_the_rl_arguments():
    import dataclasses
    import typing

    from stages.rl.config.rl_args import RLArguments
    from stages.run_args import FinetuningArguments
    from stages.table import STAGES

    assert form.RL_STAGES == ("grpo", "ppo")  # from the stage table's rl entries
    assert all(STAGES[name].rl is not None for name in form.RL_STAGES)
    rl_fields = {f.name for f in dataclasses.fields(RLArguments)}
    spec = {f["key"]: f for f in form.form_spec()["fields"]}
    for key in RL_KEYS:
        assert key in rl_fields, key  # a real RLArguments key, not a new spelling
        assert list(spec[key]["when"]) == ["stage", *form.RL_STAGES] and spec[key]["section"] == "rl", key
        assert spec[key]["default"] == ""  # blank: the stage's own default (ppo's differ), not written
    for key in PPO_KEYS:
        assert list(spec[key]["when"]) == ["stage", "ppo"]
    for key in form.RL_LITERALS:  # a select offers exactly the Literal's values, and blank (not written)
        assert spec[key]["kind"] == "select"
        assert spec[key]["choices"] == ["", *typing.get_args(typing.get_type_hints(RLArguments)[key])], key
    hint = typing.get_type_hints(FinetuningArguments)["reward_model_type"]
    assert spec["reward_model_type"]["choices"] == ["", *typing.get_args(hint)]
    assert spec["reward_funcs"]["kind"] == spec["tools"]["kind"] == spec["reward_weights"]["kind"] == "list"
    assert spec["reward_weights"]["item"] == "number"
    assert spec["advantage_estimator"]["choices"][1:3] == ["gae", "group_norm"]


def test_grpo_form_builds_the_yaml_the_cli_loads_with_exactly_those_values(client):
    answer = client.post("/api/config", json={"values": tiny(stage="grpo", **GRPO_TYPED),
                                              "extra_text": form.extra_text(form.NEW_FORM_EXTRA)})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["error"] is None, body["error"]
    config = form.parse_yaml(body["yaml"])
    assert {k: config[k] for k in GRPO_WRITTEN} == GRPO_WRITTEN
    assert config == body["config"]
    assert not any(key in config for key in PPO_KEYS)  # ppo's options stay out of a grpo run
    text = body["yaml"]
    assert text.index("### method") < text.index("### rl") < text.index("### dataset")
    assert "reward_funcs:\n- exact_match\n- digit_ratio" in text
    run = load_config(dict(config))  # the command's own loader: the same run
    assert run.raw == config
    assert run.finetuning.stage == "grpo"
    assert (run.rl.reward_funcs, run.rl.reward_weights, run.rl.tools) == (
        ["exact_match", "digit_ratio"], [1.0, 0.5], ["calculator", "python"])
    for key in ("num_generations", "rollout_batch_size", "max_completion_length", "beta", "loss_type",
                "advantage_estimator", "rollout_backend", "async_rollout", "num_iterations", "epsilon", "environment",
                "max_turns", "max_turn_tokens"):
        assert getattr(run.rl, key) == GRPO_WRITTEN[key], key
    assert run.rl.multi_turn
    assert body["command"].startswith("rayfactory train ")


def test_blank_rl_fields_are_not_written_and_the_stage_defaults_apply():
    config = form.config_from_form(tiny(stage="grpo", reward_funcs="exact_match"), form.NEW_FORM_EXTRA)
    assert config["reward_funcs"] == ["exact_match"]
    assert not any(key in config for key in RL_KEYS if key != "reward_funcs")
    ppo = form.config_from_form(tiny(stage="ppo", reward_model="saves/rm", reward_model_type="full"))
    assert ppo["reward_model"] == "saves/rm" and ppo["reward_model_type"] == "full"
    assert "num_generations" not in ppo and "advantage_estimator" not in ppo  # ppo's own defaults: 1, gae
    run = load_config({**ppo, "rollout_backend": "hf"}, purpose="submit")  # the rm folder is on the job's machine
    assert (run.rl.num_generations, run.rl.advantage_estimator, run.rl.beta) == (1, "gae", 0.2)
    assert run.finetuning.reward_model_type == "full"


def test_async_keys_and_a_ppo_form():
    config = form.config_from_form(tiny(stage="grpo", reward_funcs="exact_match", async_rollout="bounded",
                                        max_staleness="3", rollout_backend="vllm"))
    assert (config["async_rollout"], config["max_staleness"], config["rollout_backend"]) == ("bounded", 3, "vllm")
    run = load_config(dict(config), purpose="submit")  # whether vllm is installed is the job machine's concern
    assert run.rl.async_rollout == "bounded" and run.rl.max_staleness == 3


def test_sft_form_has_no_rl_keys_even_when_the_fields_hold_values():
    filled = {**GRPO_TYPED, "reward_model": "saves/rm", "reward_model_type": "full"}
    for stage in ("sft", "pt", "dpo", "rm", "kto"):
        config = form.config_from_form(tiny(stage=stage, **filled), form.NEW_FORM_EXTRA)
        assert not any(key in config for key in (*RL_KEYS, *PPO_KEYS)), (stage, config)
        assert "### rl" not in form.to_yaml(config)
    grpo = form.config_from_form(tiny(stage="grpo", **filled))
    assert all(key in grpo for key in GRPO_TYPED) and not any(key in grpo for key in PPO_KEYS)


def test_rl_yaml_loads_into_the_fields_and_saves_unchanged():
    with open(os.path.join(REPO_ROOT, "configs", "grpo_lora.yaml"), encoding="utf-8") as f:
        original = form.parse_yaml(f.read())
    values, extra = form.form_from_config(original)
    assert values["reward_funcs"] == "exact_match, digit_ratio" and values["reward_weights"] == "1.0, 0.5"
    assert values["rollout_backend"] == "vllm" and "rollout_backend" not in extra
    assert form.config_from_form(values, extra) == original
    multi = {**original, "environment": "tools", "tools": ["calculator"], "max_turns": 2, "max_turn_tokens": 4}
    values, extra = form.form_from_config(multi)
    assert values["tools"] == "calculator" and values["max_turns"] == 2
    assert form.parse_yaml(form.to_yaml(form.config_from_form(values, extra))) == multi
    values["stage"] = "sft"  # the user switches the stage: the RL keys go
    assert not any(key in form.config_from_form(values, extra) for key in RL_KEYS)


# --- bad values: a 4xx naming the field, never a 5xx ----------------------------------------------

BAD_RL_VALUES = [  # (form changes, the field the error names, a word its message holds)
    ({"num_generations": "many"}, "num_generations", "integer"),
    ({"num_generations": "0"}, "num_generations", "at least 1"),
    ({"rollout_batch_size": "2.5"}, "rollout_batch_size", "integer"),
    ({"loss_type": "ppo2"}, "loss_type", "dapo"),
    ({"advantage_estimator": "gae"}, "advantage_estimator", "critic"),
    ({"async_rollout": "sometimes"}, "async_rollout", "one_step"),
    ({"rollout_backend": "hf", "async_rollout": "one_step"}, "async_rollout", "vllm"),
    ({"max_staleness": "3"}, "max_staleness", "bounded"),
    ({"beta": "-1"}, "beta", ">= 0"),
    ({"beta": "nan"}, "beta", "finite"),
    ({"epsilon": "-inf"}, "epsilon", "finite"),
    ({"epsilon": "0"}, "epsilon", "positive"),
    ({"reward_funcs": ""}, "reward_funcs", "needs reward_funcs"),
    ({"reward_funcs": "no_such_reward"}, "reward_funcs", "no_such_reward"),
    ({"reward_weights": "1, 2"}, "reward_weights", "one weight per function"),
    ({"reward_weights": "heavy"}, "reward_weights", "numbers"),
    ({"reward_weights": "nan"}, "reward_weights", "finite"),
    ({"reward_weights": "1e999"}, "reward_weights", "finite"),
    ({"tools": "no_such_tool"}, "tools", "no_such_tool"),
    ({"environment": "tools"}, "tools", "lists none"),
    ({"tools": "calculator", "max_turns": "0"}, "max_turns", "at least 1"),
    ({"tools": "calculator", "max_turn_tokens": "64", "max_completion_length": "16"}, "max_turn_tokens",
     "max_completion_length"),
]


@pytest.mark.parametrize("changes,key,word", BAD_RL_VALUES, ids=[k for _, k, _ in BAD_RL_VALUES])
def test_bad_rl_values_are_a_400_that_names_the_field(client, changes, key, word):
    values = tiny(stage="grpo", reward_funcs="exact_match", rollout_backend="hf")
    values.update(changes)
    shown = client.post("/api/config", json={"values": values})  # the page shows it next to the field
    assert shown.status_code == 200, shown.text
    error = shown.json()["error"]
    assert error and error["key"] == key and word in error["message"], error
    started = client.post("/api/runs", json={"values": values})  # and nothing starts
    assert started.status_code == 400, started.text
    assert started.json()["key"] == key and word in started.json()["error"]
    assert client.get("/api/runs").json()["runs"] == []


@pytest.mark.parametrize("value", [{"a": 1}, [[1]], [{"a": 1}], [1, None, "x" * 200_000], "x" * 200_000])
def test_malformed_rl_field_values_are_a_400(client, value):
    for route in ("/api/config", "/api/runs", "/api/yaml/save"):
        for key in ("reward_funcs", "reward_weights", "tools", "num_generations"):
            answer = client.post(route, json={"values": tiny(stage="grpo", **{key: value}), "path": "x.yaml"})
            assert answer.status_code == 400, (route, key, answer.status_code, answer.text[:200])
            assert key in answer.json()["error"]


def test_a_list_sent_as_json_and_non_finite_numbers_in_it(client):
    values = tiny(stage="grpo", reward_funcs=["exact_match", "digit_ratio"], reward_weights=[1, 0.5],
                  tools=["calculator"], rollout_backend="hf")
    answer = client.post("/api/config", json={"values": values})
    assert answer.status_code == 200 and answer.json()["error"] is None, answer.text
    assert answer.json()["config"]["reward_weights"] == [1, 0.5]
    raw = json.dumps({"values": {**values, "reward_weights": [1, float("nan")]}}).encode()  # NaN: not JSON, but sent
    answer = client.post("/api/config", content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "finite" in answer.json()["error"], answer.text


# --- the run page's series ------------------------------------------------------------------------

RL_LOG = [
    {"current_steps": 0, "total_steps": 4, "eval_reward": 0.1},
    {"current_steps": 1, "total_steps": 4, "loss": 0.5, "reward": 0.2, "kl": 0.0, "rollout/turns": 1.5,
     "rollout/tool_calls": 0.5, "rollout/truncated": 0.0},
    {"current_steps": 2, "total_steps": 4, "loss": 0.4, "reward": 0.4, "kl": 0.01, "rollout/turns": 2.0,
     "rollout/tool_calls": 1.0, "rollout/truncated": 0.25, "remaining_time": 3.0},
    {"current_steps": 2, "total_steps": 4, "eval_reward": 0.5},
]
SINGLE_TURN_LOG = [{"current_steps": s, "total_steps": 2, "loss": 1.0 / s, "reward": 0.1 * s} for s in (1, 2)]
SFT_LOG = [{"current_steps": s, "total_steps": 4, "loss": 2.0 - s / 4, "learning_rate": 1e-4} for s in (1, 2, 3)] + [
    {"current_steps": 3, "total_steps": 4, "eval_loss": 1.5}]


class FakeJobs:
    """Ray's JobSubmissionClient for a job that runs (no Ray here)."""

    def get_job_status(self, job_id):
        class Status:
            value = "RUNNING"

        return Status()

    def get_job_logs(self, job_id):
        return "step 2/4\n"


def started_run(share, output_dir, records, tail=""):
    """A run record as Start leaves it, and its output_dir's trainer_log.jsonl."""
    from cluster.webui.runs import Run

    job_id = f"rayfactory-webui-test-{len(os.listdir(share / 'runs')) if (share / 'runs').exists() else 0}"
    os.makedirs(share / "runs", exist_ok=True)
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "trainer_log.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)
    run = Run(job_id, "http://127.0.0.1:8265", str(share / "configs" / "x.yaml"), str(output_dir), time.time())
    (share / "runs" / f"{job_id}.json").write_text(json.dumps(asdict(run)))
    return job_id


def series(answer):
    return {chart["id"]: {s["key"]: s["points"] for s in chart["series"]} for chart in answer["charts"]}


def test_run_status_serves_reward_and_turns_series_for_an_rl_log(client, tmp_path, monkeypatch):
    from cluster.webui.runs import Runs

    monkeypatch.setattr(Runs, "_client", lambda self, address=None: FakeJobs())
    share = tmp_path / "share"
    rl = started_run(share, tmp_path / "out-rl", RL_LOG, tail='{"current_steps": 3, "loss"')  # a line being written
    answer = client.get(f"/api/runs/{rl}")
    assert answer.status_code == 200, answer.text
    status = answer.json()
    assert (status["step"], status["total"], status["status"]) == (2, 4, "RUNNING")
    assert "records" not in status  # the browser draws the series, it does not pick them
    charts = series(status)
    assert charts["loss"] == {"loss": [[1, 0.5], [2, 0.4]]}
    assert charts["metric"] == {"reward": [[1, 0.2], [2, 0.4]], "eval_reward": [[0, 0.1], [2, 0.5]]}
    assert charts["turns"] == {"rollout/turns": [[1, 1.5], [2, 2.0]], "rollout/tool_calls": [[1, 0.5], [2, 1.0]]}

    single = started_run(share, tmp_path / "out-single", SINGLE_TURN_LOG)  # no turns logged: no turns series
    charts = series(client.get(f"/api/runs/{single}").json())
    assert charts["metric"] == {"reward": [[1, 0.1], [2, 0.2]]} and charts["turns"] == {}

    sft = started_run(share, tmp_path / "out-sft", SFT_LOG)
    charts = series(client.get(f"/api/runs/{sft}").json())
    assert charts["loss"] == {"loss": [[1, 1.75], [2, 1.5], [3, 1.25]], "eval_loss": [[3, 1.5]]}
    assert charts["metric"] == {} and charts["turns"] == {}

    empty = started_run(share, tmp_path / "out-empty", [], tail="\x00\xff not json\n[1, 2]\n")
    status = client.get(f"/api/runs/{empty}").json()
    assert status["step"] == 0 and all(not chart["series"] for chart in status["charts"])


def test_the_tasks_chart_draws_eval_tasks_scores_but_not_perplexities():
    from cluster.webui.runs import charts

    records = [{"current_steps": 2, "eval_loss": 3.0, "eval_tasks/rf_arith_mc/acc": 0.25,
                "eval_tasks/rf_arith_text/word_perplexity": 900.0, "eval_runtime": 1.5},
               {"current_steps": 4, "eval_tasks/rf_arith_mc/acc": 0.5, "eval_tasks/rf_arith_gen/exact_match": 0.0}]
    tasks = {c["id"]: c["series"] for c in charts(records)}["tasks"]
    assert tasks == [{"key": "eval_tasks/rf_arith_mc/acc", "points": [[2, 0.25], [4, 0.5]]},
                     {"key": "eval_tasks/rf_arith_gen/exact_match", "points": [[4, 0.0]]}]
    assert {c["id"]: c["series"] for c in charts(records[:0])}["tasks"] == []


def test_charts_skip_values_that_are_not_finite_numbers():
    from cluster.webui.runs import charts

    records = [{"current_steps": 1, "reward": True}, {"current_steps": "2", "reward": 1.0},
               {"current_steps": 3, "reward": "0.5"}, {"reward": 0.7}, {"current_steps": 4, "reward": 0.9}]
    assert {c["id"]: c["series"] for c in charts(records)}["metric"] == [{"key": "reward", "points": [[4, 0.9]]}]
