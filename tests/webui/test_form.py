"""The board's form <-> config <-> YAML, its data preview and its API guard, without a browser."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from cluster.config import load_config
from cluster.webui import form
from cluster.webui.preview import histogram, preview

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.path.join(REPO_ROOT, "data")
CONFIGS = sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "*.yaml")))


def new_form(**changes):
    values = {f.key: f.default for f in form.FIELDS}
    values.update(changes)
    return values


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_example_config_loads_into_the_form_and_saves_unchanged(path):
    with open(path, encoding="utf-8") as f:
        original = form.parse_yaml(f.read())
    values, extra = form.form_from_config(original)
    again = form.config_from_form(values, extra)
    assert again == original
    assert form.parse_yaml(form.to_yaml(again)) == original  # and through the YAML text


def test_new_form_writes_typed_values_and_only_the_shown_options():
    config = form.config_from_form(new_form(dataset=["arith_train", "copy_train"], learning_rate="5e-3",
                                            max_samples="", lora_alpha=" "), form.NEW_FORM_EXTRA)
    assert config["learning_rate"] == 0.005 and isinstance(config["lora_rank"], int)
    assert config["dataset"] == "arith_train,copy_train"  # LLaMA-Factory's spelling of a list
    assert "max_samples" not in config and "lora_alpha" not in config  # blank: the default applies
    assert config["do_train"] is True and config["resources_per_worker"] == {"CPU": 1}
    assert "pref_beta" not in config and "freeze_trainable_layers" not in config  # sft with LoRA
    dpo_full = form.config_from_form(new_form(stage="dpo", finetuning_type="full"))
    assert dpo_full["pref_beta"] == 0.1 and dpo_full["pref_loss"] == "sigmoid"
    assert "lora_rank" not in dpo_full and "lora_target" not in dpo_full


def test_loaded_yaml_keeps_what_the_form_cannot_show():
    original = {"model_name_or_path": "m", "finetuning_type": "full", "lora_rank": 32, "deepspeed": "ds.json",
                "resources_per_worker": {"CPU": 2, "GPU": 1}, "stage": "sft"}
    values, extra = form.form_from_config(original)
    assert extra == {"lora_rank": 32, "deepspeed": "ds.json", "resources_per_worker": {"CPU": 2, "GPU": 1}}
    assert values["resources_per_worker"] == 2
    values["resources_per_worker"] = "4"  # the user edits the CPU count; the GPU stays
    assert form.config_from_form(values, extra)["resources_per_worker"] == {"CPU": 4, "GPU": 1}


def test_yaml_text_is_sectioned_and_parses_back():
    config = form.config_from_form(new_form(dataset=["arith_train"]), form.NEW_FORM_EXTRA)
    text = form.to_yaml(config)
    assert text.index("### model") < text.index("### method") < text.index("### ray")
    assert "resources_per_worker:\n  CPU: 1" in text
    assert form.parse_yaml(text) == config
    with pytest.raises(Exception, match="mapping"):
        form.parse_yaml("- a\n- b\n")
    with pytest.raises(Exception, match="dataset"):  # the CLI reader's duplicate-key refusal
        form.parse_yaml("dataset: a\ndataset: b\n")


def test_validation_is_the_clis_and_names_the_field():
    good = form.config_from_form(new_form(dataset=["arith_train"], dataset_dir=DATA_DIR), form.NEW_FORM_EXTRA)
    assert form.validate(good) is None
    bad = {**good, "lora_rank": -3}
    error = form.validate(bad)
    assert error["key"] == "lora_rank"
    with pytest.raises(Exception) as cli:
        load_config(dict(bad))
    assert error["message"] == str(cli.value)
    assert form.validate({**good, "eval_dataset": "nope"})["key"] == "eval_dataset"
    assert form.validate({**good, "lora_rnk": 4})["key"] == "extra"  # only the "more keys" box holds such a key
    missing = form.validate({k: v for k, v in good.items() if k != "dataset"})
    assert missing["key"] == "dataset" and "dataset is not set" in missing["message"]
    wrong_stage = form.validate({**good, "stage": "dpo"})  # single answers cannot train dpo
    assert wrong_stage["key"] == "dataset" and "arith_train" in wrong_stage["message"]


def test_more_keys_box_and_model_suggestions():
    extra = {"deepspeed": "ds.json", "resources_per_worker": {"CPU": 2, "GPU": 1}}
    assert form.parse_yaml(form.extra_text(extra)) == extra and form.extra_text({}) == ""
    spec = form.form_spec()
    assert "tiny:qwen2" in spec["models"] and "demo:smollm2-135m-instruct" in spec["models"]
    assert form.parse_yaml(spec["extra_text"]) == form.NEW_FORM_EXTRA
    assert [f for f in spec["fields"] if f["key"] == "template"][0]["choices"][:2] == ["", "auto"]


def test_command_line():
    assert form.command_line("/a b/c.yaml") == "rayfactory train '/a b/c.yaml'"
    assert form.command_line("c.yaml", "http://h:8265") == "rayfactory submit c.yaml --address http://h:8265"


def test_histogram_bins_hold_every_length_and_the_cutoff():
    h = histogram([1, 5, 10, 99, 100], cutoff=40, bins=10)
    assert h["width"] == 10 and sum(h["counts"]) == 5
    assert h["counts"][0] == 2 and h["counts"][1] == 1 and h["counts"][9] == 2
    assert histogram([], cutoff=8, bins=4) == {"width": 2, "counts": [0, 0, 0, 0]}


def test_pairwise_preview_shows_chosen_and_rejected_with_the_registries_masks():
    config = {"model_name_or_path": "tiny:qwen2", "template": "qwen", "stage": "dpo", "dataset": "arith_pref",
              "dataset_dir": DATA_DIR, "cutoff_len": 48, "output_dir": "x"}
    shown = preview(config, "arith_pref", rows=2)
    assert [s["name"] for s in shown["rows"][0]] == ["chosen", "rejected"]

    from cluster.driver import tokenizer_and_template

    cfg = load_config(dict(config))
    tokenizer, template = tokenizer_and_template(cfg)
    examples = cfg.job_spec().stage.tokenize_here(tokenizer, template, dataclasses.replace(cfg.data, max_samples=2))
    for row, example in zip(shown["rows"], examples):
        for seq, side in zip(row, ("chosen", "rejected")):
            assert [t["id"] for t in seq["tokens"]] == example[f"{side}_input_ids"]
            assert [t["trained"] for t in seq["tokens"]] == [x != -100 for x in example[f"{side}_labels"]]
    assert shown["count"] == len(cfg.job_spec().stage.tokenize_here(tokenizer, template, cfg.data))


def test_api_wants_the_token_and_answers_user_errors_with_the_paragraph(tmp_path):
    from fastapi.testclient import TestClient

    from cluster.webui.server import TOKEN_HEADER, create_app

    client = TestClient(create_app(str(tmp_path / "share"), token="s3cret", cwd=REPO_ROOT),
                        base_url="http://127.0.0.1:7860")  # a Host the UI answers to
    assert client.get("/api/spec").status_code == 401
    assert client.get("/").status_code == 200  # the page itself; it sends the token from ?token=
    headers = {TOKEN_HEADER: "s3cret"}
    assert "fields" in client.get("/api/spec", headers=headers).json()
    answer = client.post("/api/runs", json={"values": new_form(learning_rate="fast"), "extra_text": ""}, headers=headers)
    assert answer.status_code == 400 and answer.json()["key"] == "learning_rate"
    missing = client.post("/api/yaml/load", json={"path": "no/such.yaml"}, headers=headers)
    assert missing.status_code == 400 and "no/such.yaml" in missing.json()["error"]


def test_webui_refuses_an_open_host_without_a_token():
    from cluster.cli import main

    assert main(["webui", "--host", "0.0.0.0", "--port", "1"]) == 2


def test_chat_and_export_mistakes_come_back_as_the_clis_paragraphs(tmp_path):
    from fastapi.testclient import TestClient

    from cluster.webui.server import create_app

    client = TestClient(create_app(str(tmp_path / "share"), cwd=str(tmp_path)), base_url="http://127.0.0.1:7860")
    chat = client.post("/api/chat", json={"model_name_or_path": "tiny:qwen2", "adapter_name_or_path": "./saves/none",
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "saves/none" in chat.json()["error"], chat.text
    export = client.post("/api/export", json={"model_name_or_path": "tiny:qwen2", "export_dir": ""})
    assert export.status_code == 400 and "path is needed" in export.json()["error"], export.text


def test_the_page_links_the_generated_config_reference(tmp_path):
    """The header's "config reference" opens the page scripts/config_reference.py writes (every key,
    eval_tasks included), served as a fixed file."""
    from fastapi.testclient import TestClient

    from cluster.webui.server import create_app

    client = TestClient(create_app(str(tmp_path / "share"), cwd=REPO_ROOT), base_url="http://127.0.0.1:7860")
    assert 'href="/help/config-reference"' in client.get("/").text
    page = client.get("/help/config-reference")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/markdown")
    with open(os.path.join(REPO_ROOT, "docs", "config-reference.md"), encoding="utf-8") as f:
        assert page.text == f.read()
    assert "`eval_tasks`" in page.text and "`learning_rate`" in page.text
