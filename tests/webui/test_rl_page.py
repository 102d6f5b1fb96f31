"""The Train tab's RL fields and the run page's RL charts in a real browser (issue 38): choosing grpo
shows the RL fieldset, what is typed there lands in the YAML the CLI loads, sft hides it and writes
none of it, and a real grpo run started from the page gets its charts (reward, turns per trajectory)
drawn from its own trainer_log.jsonl, read through the UI's GET /api/runs/<id>."""

from __future__ import annotations

import os

import pytest
from selenium.webdriver.common.by import By

from cluster.config import load_config
from cluster.webui.form import parse_yaml
from cluster.webui.runs import ENDED, charts, read_records
from tests.webui.test_rl_form import GRPO_TYPED, GRPO_WRITTEN, RL_KEYS
from tests.webui.test_webui import (RUN_TIMEOUT_S, UI_DATA_DIR, fill_tiny_sft, open_board, run_status, set_field,
                                    settle, shot, wait_for)


def rl_fieldset(browser):
    return browser.find_element(By.ID, "field-reward_funcs").find_element(By.XPATH, "./ancestor::fieldset")


def test_grpo_fields_write_the_rl_keys_and_sft_hides_them(webui, browser):
    url, _, _ = webui
    open_board(browser, url)
    fill_tiny_sft(browser, "saves/rl-form")
    assert not rl_fieldset(browser).is_displayed()  # sft: no RL fieldset at all
    set_field(browser, "stage", "grpo")
    for key, value in GRPO_TYPED.items():
        set_field(browser, key, value)
    text = settle(browser)
    assert rl_fieldset(browser).is_displayed()
    assert not browser.find_element(By.ID, "field-reward_model").is_displayed()  # ppo's
    assert browser.find_element(By.ID, "yaml").get_attribute("data-valid") == "true", browser.find_element(
        By.ID, "config-error").text
    config = parse_yaml(text)
    assert {k: config[k] for k in GRPO_WRITTEN} == GRPO_WRITTEN
    run = load_config(dict(config))
    assert run.rl.tools == ["calculator", "python"] and run.rl.max_turns == 3
    shot(browser, "train-grpo")

    set_field(browser, "max_turns", "0")  # a bad value: the CLI's error at the field, Start off
    settle(browser)
    error = browser.find_element(By.ID, "err-max_turns")
    assert error.is_displayed() and "max_turns" in error.text, error.text
    assert not browser.find_element(By.ID, "run-start").is_enabled()

    set_field(browser, "stage", "sft")
    config = parse_yaml(settle(browser))
    assert not rl_fieldset(browser).is_displayed()
    assert not any(key in config for key in RL_KEYS)


# A tiny multi-turn grpo run (tools, HF rollouts: no vLLM engine to start), eval before and after.
GRPO_RUN = {
    "model_name_or_path": "tiny:qwen2", "template": "qwen", "stage": "grpo", "finetuning_type": "full",
    "dataset_dir": UI_DATA_DIR, "dataset": ["arith_train"], "eval_dataset": ["arith_eval"], "max_samples": 8,
    "cutoff_len": 64, "logging_steps": 1, "max_steps": 2, "learning_rate": "1e-3",
    "reward_funcs": "exact_match, digit_ratio", "num_generations": "4", "rollout_batch_size": "2",
    "max_completion_length": "16", "rollout_backend": "hf", "environment": "tools", "tools": "calculator",
    "max_turns": "2", "max_turn_tokens": "8",
}


def drawn(browser, chart_id) -> dict[str, int]:
    """The series the page drew in chart ``chart_id``: key -> number of points."""
    return {line.get_attribute("data-key"): int(line.get_attribute("data-points"))
            for line in browser.find_elements(By.CSS_SELECTOR, f"#{chart_id}-chart .series")}


@pytest.mark.ray
def test_the_page_draws_a_real_grpo_runs_charts_from_its_log(webui, browser):
    """A tiny multi-turn grpo run started from the page, as a Ray job on the UI's head: the page
    polls GET /api/runs/<id>, which reads the run's own trainer_log.jsonl, and draws its loss,
    reward and eval_reward, and turns and tool calls per trajectory: every series the log holds,
    with every logged step."""
    url, _, cwd = webui
    open_board(browser, url)
    output_dir = "saves/rl-page-run"
    for key, value in GRPO_RUN.items():
        set_field(browser, key, value)
    set_field(browser, "output_dir", output_dir)
    settle(browser)
    assert browser.find_element(By.ID, "yaml").get_attribute("data-valid") == "true", browser.find_element(
        By.ID, "config-error").text
    start = browser.find_element(By.ID, "run-start")
    wait_for(start.is_enabled, what="Start to be enabled (the config checked)")
    start.click()
    error = browser.find_element(By.ID, "run-error")
    wait_for(lambda: run_status(browser) or error.text, RUN_TIMEOUT_S, "the run to be submitted")
    assert not error.text, error.text
    wait_for(lambda: run_status(browser) in ENDED, RUN_TIMEOUT_S, "the grpo run to end")
    assert run_status(browser) == "SUCCEEDED", browser.find_element(By.ID, "console").text[-3000:]

    records = read_records(os.path.join(cwd, output_dir))  # what the run itself logged
    steps = [r["current_steps"] for r in records if "loss" in r]
    assert steps == [1, 2], steps
    assert all("rollout/turns" in r and "rollout/tool_calls" in r for r in records if "loss" in r)
    evals = [r["current_steps"] for r in records if "eval_reward" in r]
    assert evals[0] == 0 and evals[-1] == 2, evals  # before training and at its end
    expected = {chart["id"]: {series["key"]: len(series["points"]) for series in chart["series"]}
                for chart in charts(records) if chart["series"]}  # a chart without series is not drawn
    assert expected == {"loss": {"loss": 2}, "metric": {"reward": 2, "eval_reward": len(evals)},
                        "turns": {"rollout/turns": 2, "rollout/tool_calls": 2}}, expected
    # The page's last poll (the run had ended) drew exactly those series, in the server's order.
    for chart_id, series in expected.items():
        assert browser.find_element(By.ID, f"{chart_id}-chart").is_displayed(), chart_id
        assert drawn(browser, chart_id) == series, chart_id
        assert list(drawn(browser, chart_id)) == list(series)
    assert browser.find_element(By.ID, "progress").text.startswith("step 2/2")
    shot(browser, "train-grpo-finished")

    # A single-turn run's log has no turns series: the same page then draws no turns chart.
    single_turn = [{**chart, "series": [] if chart["id"] == "turns" else chart["series"]}
                   for chart in charts(records)]
    browser.execute_script("drawCharts(arguments[0], 4);", single_turn)
    assert not browser.find_element(By.ID, "turns-chart").is_displayed()
    assert drawn(browser, "metric") == expected["metric"]
