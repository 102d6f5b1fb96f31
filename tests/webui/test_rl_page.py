"""The Train tab's RL fields and the run page's RL charts in a real browser (issue 38): choosing grpo
shows the RL fieldset, what is typed there lands in the YAML the CLI loads, sft hides it and writes
none of it, and the charts the server sends (reward, turns per trajectory) are drawn."""

from __future__ import annotations

from selenium.webdriver.common.by import By

from cluster.config import load_config
from cluster.webui.form import parse_yaml
from tests.webui.test_rl_form import GRPO_TYPED, GRPO_WRITTEN, RL_KEYS
from tests.webui.test_webui import fill_tiny_sft, open_board, set_field, settle, shot, wait_for


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


def test_the_page_draws_the_series_the_server_sends(webui, browser):
    url, _, _ = webui
    open_board(browser, url)
    charts = [
        {"id": "loss", "title": "loss", "series": [{"key": "loss", "points": [[1, 0.5], [2, 0.4]]}]},
        {"id": "metric", "title": "accuracy and reward", "series": [
            {"key": "reward", "points": [[1, 0.2], [2, 0.4]]}, {"key": "eval_reward", "points": [[2, 0.5]]}]},
        {"id": "turns", "title": "per trajectory", "series": [
            {"key": "rollout/turns", "points": [[1, 1.5], [2, 2.0]]},
            {"key": "rollout/tool_calls", "points": [[1, 0.5], [2, 1.0]]}]},
    ]

    def drawn():  # drawn again each time: a run the page follows may redraw its own charts meanwhile
        browser.execute_script("clearInterval(POLL); drawCharts(arguments[0], 4);", charts)
        turns = browser.find_element(By.ID, "turns-chart")
        return turns.is_displayed() and turns.get_attribute("data-series") == "rollout/turns,rollout/tool_calls"

    wait_for(drawn, what="the charts")
    keys = [p.get_attribute("data-key") for p in browser.find_elements(By.CSS_SELECTOR, "#metric-chart .series")]
    assert keys == ["reward", "eval_reward"]
    assert browser.find_element(By.ID, "loss-chart").get_attribute("data-points") == "2"
    single_turn = [charts[0], charts[1], {**charts[2], "series": []}]
    browser.execute_script("drawCharts(arguments[0], 4);", single_turn)
    assert not browser.find_element(By.ID, "turns-chart").is_displayed()  # no turns logged: no turns chart
