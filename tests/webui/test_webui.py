"""The board in a real browser: the form's YAML is the CLI's config, a bad value shows the CLI's
error, the data preview colours exactly the registries' label mask, and a run started from the
page trains (live loss chart), stops, resumes from its checkpoint, then chats and exports."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from cluster.config import ConfigError, load_config
from cluster.webui.form import parse_yaml
from tests.webui import conftest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.path.join(REPO_ROOT, "data")
UI_DATA_DIR = "data"  # the UI reads only inside its folder: the webui fixture puts a copy of DATA_DIR there
UI_TIMEOUT_S = 60
RUN_TIMEOUT_S = 420
# The page run: stopped once checkpoint-10 and five loss points exist, which leaves 50 steps for the
# Stop to land before the end.
STEPS = 60


def wait_for(condition, timeout=UI_TIMEOUT_S, what="the page"):
    return conftest.wait_for(condition, timeout, what)


def open_board(browser, url):
    browser.get(url + "/")
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready"), what="the board to load")


def set_field(browser, key, value):
    element = browser.find_element(By.ID, f"f-{key}")
    if element.tag_name == "select":
        select = Select(element)
        for name in [value] if isinstance(value, str) else value:  # lists refill after dataset_dir changes
            wait_for(lambda: any(o.get_attribute("value") == name for o in select.options), what=f"option {name}")
        if select.is_multiple:
            select.deselect_all()
            for name in value:
                select.select_by_value(name)
        else:
            select.select_by_value(value)
    elif element.get_attribute("type") == "checkbox":
        if element.is_selected() != value:
            element.click()
    else:
        element.clear()
        element.send_keys(str(value))


def settle(browser):
    """The YAML panel after the page's debounced refresh has answered for the current form."""
    browser.execute_script("document.getElementById('yaml').dataset.valid = 'pending'")
    set_field(browser, "seed", browser.find_element(By.ID, "f-seed").get_attribute("value"))  # one more input event
    wait_for(lambda: browser.find_element(By.ID, "yaml").get_attribute("data-valid") in ("true", "false"),
             what="the YAML preview")
    return browser.find_element(By.ID, "yaml").text


def fill_tiny_sft(browser, output_dir, **changes):
    form = {
        "model_name_or_path": "tiny:qwen2", "template": "qwen", "stage": "sft", "finetuning_type": "lora",
        "lora_rank": 16, "additional_target": "embed_tokens,lm_head", "dataset_dir": UI_DATA_DIR,
        "dataset": ["arith_train"], "cutoff_len": 64, "output_dir": output_dir, "logging_steps": 2,
        "save_steps": 10, "per_device_train_batch_size": 16, "learning_rate": "5e-3", "max_steps": 30,
        "warmup_steps": 2,
    }
    form.update(changes)
    for key, value in form.items():
        set_field(browser, key, value)
    return settle(browser)


def test_form_yaml_round_trips_through_the_cli_parser(webui, browser):
    url, share, cwd = webui
    open_board(browser, url)
    extra = browser.find_element(By.ID, "extra")
    extra.send_keys("save_total_limit: 2\n")  # a key the form has no field for
    text = fill_tiny_sft(browser, "saves/form-check")
    assert browser.find_element(By.ID, "yaml").get_attribute("data-valid") == "true"
    config = parse_yaml(text)
    expected = {
        "model_name_or_path": "tiny:qwen2", "template": "qwen", "do_train": True, "stage": "sft",
        "finetuning_type": "lora", "lora_rank": 16, "additional_target": "embed_tokens,lm_head",
        "dataset_dir": UI_DATA_DIR, "dataset": "arith_train", "cutoff_len": 64, "output_dir": "saves/form-check",
        "logging_steps": 2, "save_steps": 10, "per_device_train_batch_size": 16, "learning_rate": 5e-3,
        "max_steps": 30, "warmup_steps": 2, "save_total_limit": 2,
    }
    assert {k: config[k] for k in expected} == expected
    run = load_config(dict(config))  # the CLI's parser takes it
    assert run.raw == config  # unchanged: every key as the page wrote it
    assert run.finetuning.lora_rank == 16 and run.data.dataset == ["arith_train"]
    assert browser.find_element(By.ID, "command").text.startswith("rayfactory train ")
    # fields of other stages and tuning types are hidden and not written
    assert not browser.find_element(By.ID, "field-pref_beta").is_displayed()
    assert "pref_beta" not in config and "freeze_trainable_layers" not in config

    # saved, changed, loaded back: the form and the YAML come back as saved
    path = os.path.join(cwd, "saved.yaml")
    browser.find_element(By.ID, "yaml-path").send_keys(path)
    browser.find_element(By.ID, "yaml-save").click()
    wait_for(lambda: browser.find_element(By.ID, "yaml-message").text == f"saved {path}", what="the saved YAML")
    assert parse_yaml(open(path).read()) == config
    set_field(browser, "lora_rank", 4)
    settle(browser)
    extra.clear()
    browser.find_element(By.ID, "yaml-load").click()
    wait_for(lambda: browser.find_element(By.ID, "f-lora_rank").get_attribute("value") == "16", what="the load")
    assert parse_yaml(settle(browser)) == config
    assert "save_total_limit: 2" in extra.get_attribute("value")

    # a misspelt key in the box gets the CLI's own error, with its suggestion
    extra.send_keys("lora_rnk: 4\n")
    settle(browser)
    error = browser.find_element(By.ID, "err-extra")
    assert error.is_displayed() and "lora_rnk" in error.text and "'lora_rank'?" in error.text, error.text


def test_bad_value_shows_the_cli_error_next_to_the_field(webui, browser):
    url, _, _ = webui
    open_board(browser, url)
    fill_tiny_sft(browser, "saves/bad", learning_rate="fast")
    assert browser.find_element(By.ID, "yaml").get_attribute("data-valid") == "false"
    error = browser.find_element(By.ID, "err-learning_rate")
    assert error.is_displayed()
    with pytest.raises(ConfigError) as cli:  # the CLI's own paragraph, word for word
        load_config({"model_name_or_path": "tiny:qwen2", "dataset": "arith_train", "output_dir": "x",
                     "learning_rate": "fast"})
    assert error.text == str(cli.value)
    assert not browser.find_element(By.ID, "run-start").is_enabled()  # nothing can start

    set_field(browser, "learning_rate", "5e-3")
    set_field(browser, "dataset", [])
    settle(browser)
    assert "dataset is not set" in browser.find_element(By.ID, "err-dataset").text
    shot(browser, "train-error")


def test_preview_colours_the_registries_label_mask(webui, browser):
    url, _, _ = webui
    open_board(browser, url)
    fill_tiny_sft(browser, "saves/preview", cutoff_len=24)
    Select(browser.find_element(By.ID, "preview-dataset")).select_by_value("arith_train")
    browser.find_element(By.ID, "preview-run").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#preview .preview-row"), what="the preview rows")
    first = browser.find_elements(By.CSS_SELECTOR, "#preview .preview-row")[0]
    spans = first.find_elements(By.CSS_SELECTOR, ".tok")
    shown_ids = [int(s.get_attribute("data-id")) for s in spans]
    shown_trained = ["trained" in s.get_attribute("class") for s in spans]

    # the same row through the registries directly
    from cluster.driver import tokenizer_and_template

    cfg = load_config({"model_name_or_path": "tiny:qwen2", "template": "qwen", "dataset": "arith_train",
                       "dataset_dir": DATA_DIR, "cutoff_len": 24, "output_dir": "x"})
    tokenizer, template = tokenizer_and_template(cfg)
    example = cfg.job_spec().stage.tokenize_here(tokenizer, template, dataclasses.replace(cfg.data, max_samples=1))[0]
    assert shown_ids == example["input_ids"]
    assert shown_trained == [label != -100 for label in example["labels"]]
    assert any(shown_trained) and not all(shown_trained)  # the prompt is masked, the answer trained

    stats = browser.find_element(By.ID, "preview-stats").text
    full = cfg.job_spec().stage.tokenize_here(
        tokenizer, template, dataclasses.replace(cfg.data, cutoff_len=10**9))
    longer = sum(len(e["input_ids"]) > 24 for e in full)
    assert f"{len(full)} rows" in stats and f"{longer} longer than cutoff_len 24" in stats, stats
    bins = browser.find_elements(By.CSS_SELECTOR, "#length-hist rect.bin")
    assert sum(int(b.get_attribute("data-count")) for b in bins) == len(full)
    shot(browser, "train-preview")


def shot(browser, name):
    """A screenshot of the page from its top, kept as a test artifact (docs/webui.md shows copies of them)."""
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(os.path.join(browser.artifacts, f"{name}.png"))


def run_status(browser):
    return browser.find_element(By.ID, "run-status").get_attribute("data-status") or ""


@pytest.mark.ray
def test_run_from_the_page_trains_stops_resumes_then_chats_and_exports(webui, browser):
    url, share, cwd = webui
    open_board(browser, url)
    output_dir = "saves/page-run"
    fill_tiny_sft(browser, output_dir, max_steps=STEPS)
    browser.find_element(By.ID, "run-start").click()

    # live: the loss chart gets points while the job runs; then Stop
    chart = browser.find_element(By.ID, "loss-chart")
    wait_for(lambda: int(chart.get_attribute("data-points")) >= 2 and run_status(browser) == "RUNNING",
             RUN_TIMEOUT_S, "two loss points while running")
    progress = browser.find_element(By.ID, "progress").text
    assert progress.startswith("step ") and f"/{STEPS}" in progress, progress
    out = os.path.join(cwd, output_dir)
    wait_for(lambda: os.path.isdir(os.path.join(out, "checkpoint-10")), RUN_TIMEOUT_S, "the first checkpoint")
    wait_for(lambda: int(chart.get_attribute("data-points")) >= 5, RUN_TIMEOUT_S, "five loss points")
    shot(browser, "train-running")
    browser.find_element(By.ID, "run-stop").click()
    wait_for(lambda: run_status(browser) == "STOPPED", RUN_TIMEOUT_S, "the job to stop")
    before = [json.loads(line) for line in open(os.path.join(out, "trainer_log.jsonl"))]
    assert max(r["current_steps"] for r in before) < STEPS  # stopped before the end
    assert os.path.isdir(os.path.join(out, "checkpoint-10"))  # the checkpoint stays

    # Resume: a new job continues from the latest checkpoint to the end
    browser.find_element(By.ID, "run-resume").click()
    wait_for(lambda: run_status(browser) == "SUCCEEDED", RUN_TIMEOUT_S, "the resumed job to finish")
    records = [json.loads(line) for line in open(os.path.join(out, "trainer_log.jsonl"))]
    steps = [r["current_steps"] for r in records if "loss" in r]
    assert steps == list(range(2, STEPS + 1, 2)), steps  # every step once, as one uninterrupted run
    # resumed, not restarted: the steps up to the checkpoint are the first job's records, kept as
    # they were (a fresh start would have logged them again, with other times)
    kept = [r for r in before if r["current_steps"] <= 10]
    assert records[:len(kept)] == kept and len(kept) == 5
    assert int(chart.get_attribute("data-points")) == STEPS // 2
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0]
    shot(browser, "train-finished")

    # Chat with the trained adapter: the page streams what ChatModel answers for the same prompt
    browser.find_element(By.ID, "tab-chat").click()
    browser.find_element(By.ID, "chat-use-run").click()
    browser.find_element(By.ID, "chat-template").send_keys("qwen")
    prompt = "What is 2+3?"  # the synthetic task it trained on
    browser.find_element(By.ID, "chat-input").send_keys(prompt)
    browser.find_element(By.ID, "chat-send").click()
    reply = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='true']"),
                     RUN_TIMEOUT_S, "the chat reply")[0].text
    from cluster.api import ChatModel

    model = ChatModel({"model_name_or_path": "tiny:qwen2", "adapter_name_or_path": out, "template": "qwen",
                       "temperature": 0, "max_new_tokens": 64})
    expected = model.chat([{"role": "user", "content": prompt}])[0].response_text
    model.close()
    assert reply == expected.strip() or reply == expected
    shot(browser, "chat")

    # Export: merge the adapter into a standalone model
    browser.find_element(By.ID, "tab-export").click()
    browser.find_element(By.ID, "export-use-run").click()
    export_dir = browser.find_element(By.ID, "export-dir")
    export_dir.clear()
    export_dir.send_keys("saves/page-merged")
    browser.find_element(By.ID, "export-run").click()
    wait_for(lambda: "wrote to" in browser.find_element(By.ID, "export-result").text, RUN_TIMEOUT_S, "the export")
    merged = os.path.join(cwd, "saves/page-merged")
    assert os.path.exists(os.path.join(merged, "model.safetensors")) and os.path.exists(
        os.path.join(merged, "config.json"))
    assert not os.path.exists(os.path.join(merged, "adapter_config.json"))
    shot(browser, "export")
