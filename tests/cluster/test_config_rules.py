"""The rule registry load_config runs (cluster/config_rules.py): each rule's keys and purposes,
submit skipping what reads this machine, and refusals that carry their key to every front door."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, key_owners, load_config
from cluster.config_rules import EVERY_PURPOSE, RULES, register_rule


def base(tmp_path, **overrides) -> dict:
    return {"model_name_or_path": "tiny:qwen2", "template": "qwen", "stage": "sft", "finetuning_type": "lora",
            "dataset": "alpaca_en_demo", "output_dir": str(tmp_path / "out"), **overrides}


def refusal(config: dict, purpose: str = "train") -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        load_config(config, purpose=purpose)
    return raised.value


def test_every_rule_reads_config_keys_and_runs_for_known_purposes():
    owners = key_owners()
    assert len(RULES) >= 15
    for rule in RULES.values():
        assert rule.keys and all(key in owners for key in rule.keys), rule
        assert rule.purposes and set(rule.purposes) <= set(EVERY_PURPOSE), rule


def test_a_second_rule_of_one_name_is_refused():
    with pytest.raises(ValueError, match="Rule 'output_dir_set' is already registered"):
        register_rule("output_dir_set", ("output_dir",))(lambda run, where, purpose: None)
    with pytest.raises(ValueError, match="purposes must be among"):
        register_rule("new_rule", ("output_dir",), ("deploy",))


def test_a_missing_model_folder_is_refused_where_the_job_runs_here_and_left_to_the_job_on_submit(tmp_path):
    config = base(tmp_path, model_name_or_path="./models/not-there")
    for purpose in ("train", "infer"):  # the CLI's train, run_exp, chat, serve, export, webchat, cluster.api
        error = refusal(config, purpose)
        assert error.key == "model_name_or_path"
        assert str(error).startswith("model_name_or_path './models/not-there' does not exist (looked for ")
    load_config(config, purpose="submit")  # another machine: its own folders
    load_config(config, purpose="check")  # the web UI looking at a form reads no model folder
    adapter = refusal(base(tmp_path, adapter_name_or_path="./adapters/gone"), "infer")
    assert adapter.key == "adapter_name_or_path" and "adapter_config.json" in str(adapter)


def test_an_inference_config_needs_no_output_dir_and_a_training_one_does(tmp_path):
    config = base(tmp_path)
    del config["output_dir"]
    load_config(config, purpose="infer")
    error = refusal(config)
    assert error.key == "output_dir" and str(error).startswith("output_dir is missing in the config dict.")


@pytest.mark.parametrize("overrides, key", [
    ({"learning_rate": -1.0}, "learning_rate"),  # a refusal that names its key itself
    ({"bf16": True, "fp16": True}, "fp16"),  # the key whose source the text cites
    ({"eval_strategy": "steps"}, "eval_strategy"),
    ({"quantization_bit": 4, "finetuning_type": "full"}, "quantization_bit"),
    ({"stage": "ppo", "dynamic_filtering": True, "reward_funcs": ["exact_match"]}, "dynamic_filtering"),  # an RL rule
])
def test_a_refusal_carries_the_key_it_is_about(tmp_path, overrides, key):
    assert refusal(base(tmp_path, **overrides)).key == key


@pytest.fixture
def planted_rule():
    """A rule whose text names learning_rate (a field) first but whose refusal is about lora_rank."""
    @register_rule("planted_for_a_test", ("lora_rank",), ("check",))
    def planted(run, where, purpose):
        if run.finetuning.lora_rank == 3:
            raise ConfigError(f"learning_rate is fine; lora_rank in {where('lora_rank')} must not be 3.")

    yield
    del RULES["planted_for_a_test"]


def test_the_web_ui_marks_the_field_of_the_refusals_key_not_the_first_it_names(tmp_path, planted_rule):
    from cluster.webui.form import validate

    found = validate(base(tmp_path, lora_rank=3))
    assert found == {"key": "lora_rank", "message": "learning_rate is fine; lora_rank in the config dict must not be 3."}
