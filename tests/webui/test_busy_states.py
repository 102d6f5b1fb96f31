"""Issue 62, a web UI that says what it is doing: Start waits until the config is checked, the Run panel
says "starting job ..." until the job reports, empty boxes are drawn empty (not as black strips), the
charts scale to their data with a smoothed line, `template: auto` shows what it resolves to (tiny:qwen2:
qwen), picking a model sets its template, and the Chat tab streams with token counts like webchat.

The page's requests are held or answered by a stand-in fetch where a test needs a state to last (the
server answers a config check in well under a second); everything else is the real server."""

from __future__ import annotations

import json
import re

import pytest
from selenium.webdriver.common.by import By

from tests.webui.test_webui import open_board, set_field, settle, shot, wait_for

# Installed before the page's own script: requests whose path a test names are held until it lets
# them go (window.HELD[path] = true / releaseHeld()), or answered with a made-up JSON (window.FAKE[path]).
HOLD_FETCH = """
window.HELD = {}; window.FAKE = {}; window.WAITING = [];
const realFetch = window.fetch.bind(window);
window.releaseHeld = () => { const w = window.WAITING; window.WAITING = []; w.forEach((go) => go()); };
window.fetch = async (url, options) => {
  const path = new URL(url, location.href).pathname;
  const method = (options && options.method) || "GET";
  if (window.HELD[path]) await new Promise((go) => window.WAITING.push(go));
  const fake = window.FAKE[`${method} ${path}`];
  if (fake !== undefined) return new Response(JSON.stringify(fake), {status: 200, headers: {"content-type": "application/json"}});
  return realFetch(url, options);
};
"""
BLACK = "rgba(16, 24, 40, 1)"  # .code's background (as Selenium spells it): a box drawn as a black strip


@pytest.fixture
def held_page(webui, browser):
    """The board opened with the stand-in fetch, /api/config held from the first request on."""
    url, _, _ = webui
    script = browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                                     {"source": HOLD_FETCH + "window.HELD['/api/config'] = true;"})
    try:
        browser.get(url + "/")
        yield browser
    finally:  # held requests go with the page, never reaching the server (a held Start would start a job)
        browser.get("about:blank")
        browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": script["identifier"]})


def state(browser):
    return browser.find_element(By.ID, "config-state").get_attribute("data-state")


def test_start_is_off_until_the_config_is_checked(held_page):
    browser = held_page
    # cold start: the check has not answered; the YAML box says so instead of being a black strip
    wait_for(lambda: browser.execute_script("return window.WAITING.length > 0"), what="the held config check")
    start, yaml_box = browser.find_element(By.ID, "run-start"), browser.find_element(By.ID, "yaml")
    assert not start.is_enabled() and state(browser) == "checking"
    assert "checking the config" in browser.find_element(By.ID, "config-state").text
    assert yaml_box.text == "" and yaml_box.value_of_css_property("background-color") != BLACK
    placeholder = browser.execute_script(
        "return getComputedStyle(document.getElementById('yaml'), '::before').content")
    assert "checking the config" in placeholder
    for box in ("console", "export-result"):  # nothing to show yet: drawn empty, saying what comes there
        assert browser.find_element(By.ID, box).value_of_css_property("background-color") != BLACK, box
    shot(browser, "busy-checking")

    # the check answers: the default form has no dataset, so Start stays off and the state says why
    browser.execute_script("window.HELD = {}; releaseHeld();")
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready"), what="the board")
    wait_for(lambda: state(browser) == "error", what="the checked (invalid) config")
    assert not start.is_enabled()

    # a valid form: checking while the answer is held (Start off), then checked OK (Start on)
    browser.execute_script("window.HELD['/api/config'] = true;")
    set_field(browser, "dataset", ["arith_train"])
    wait_for(lambda: browser.execute_script("return window.WAITING.length > 0"), what="the held check")
    assert state(browser) == "checking" and not start.is_enabled()
    assert browser.find_element(By.ID, "yaml").get_attribute("data-valid") == "pending"
    browser.execute_script("window.HELD = {}; releaseHeld();")
    wait_for(lambda: state(browser) == "ok" and start.is_enabled(), what="Start after a good check")
    assert browser.find_element(By.ID, "yaml").value_of_css_property("background-color") == BLACK  # the YAML

    # an edit puts it back to checking at once, before the debounced request leaves
    browser.execute_script("window.HELD['/api/config'] = true;")
    set_field(browser, "learning_rate", "2e-4")
    assert state(browser) == "checking" and not start.is_enabled()
    browser.execute_script("window.HELD = {}; releaseHeld();")
    wait_for(lambda: state(browser) == "ok" and start.is_enabled(), what="Start after the edit's check")


def test_after_start_the_page_says_starting_until_the_job_reports(held_page):
    browser = held_page
    browser.execute_script("window.HELD = {}; releaseHeld();")
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready"), what="the board")
    set_field(browser, "dataset", ["arith_train"])
    set_field(browser, "seed", "43")  # typed last: the click on Start takes the focus from it (a change event)
    wait_for(lambda: state(browser) == "ok", what="a checked config")
    job = "rayfactory-webui-test-0001"
    status = browser.find_element(By.ID, "run-status")
    # Start: held while the server would start its head and submit (~15 s on a cold UI)
    browser.execute_script("window.HELD['/api/runs'] = true; window.FAKE['POST /api/runs'] = {job_id: arguments[0]};"
                           "window.FAKE['GET /api/runs'] = {runs: []};", job)
    browser.find_element(By.ID, "run-start").click()  # the input's change event must not turn Start off first
    assert status.text.startswith("starting job ...") and "busy" in status.get_attribute("class")
    assert status.get_attribute("data-status") == "STARTING"
    assert not browser.find_element(By.ID, "run-start").is_enabled()  # not twice
    shot(browser, "busy-starting")
    # submitted: the job id is known, its status not yet
    browser.execute_script("window.HELD = {}; window.HELD['/api/runs/' + arguments[0]] = true; releaseHeld();", job)
    wait_for(lambda: "waiting for the job to report" in status.text, what="the submitted state")
    assert status.text.startswith(job) and "busy" in status.get_attribute("class")
    # the job reports: pending, then running with a step, then finished (no spinner)
    report = {"job_id": job, "status": "PENDING", "ended": False, "output_dir": "/x", "step": 0, "total": None,
              "remaining_s": None, "console": "", "charts": [{"id": "loss", "title": "loss", "series": []}]}
    browser.execute_script("window.FAKE['GET /api/runs/' + arguments[0]] = arguments[1]; window.HELD = {};"
                           "releaseHeld();", job, report)
    wait_for(lambda: status.get_attribute("data-status") == "PENDING", what="PENDING")
    assert "Ray is starting the job" in status.text and "busy" in status.get_attribute("class")
    assert browser.find_element(By.ID, "progress").text == "waiting for the first logged step ..."
    finished = {**report, "status": "SUCCEEDED", "ended": True, "step": 4, "total": 4, "console": "done\n"}
    browser.execute_script("window.FAKE['GET /api/runs/' + arguments[0]] = arguments[1]; pollRun();", job, finished)
    wait_for(lambda: status.get_attribute("data-status") == "SUCCEEDED", what="SUCCEEDED")
    assert "busy" not in status.get_attribute("class") and browser.find_element(By.ID, "run-start").is_enabled()


def chart_geometry(browser, chart_id):
    """(y range of the axis, the raw polyline's y pixels, smoothed polylines, markers) of a drawn chart."""
    svg = browser.find_element(By.ID, f"{chart_id}-chart")
    raw = svg.find_element(By.CSS_SELECTOR, "polyline.series").get_attribute("points")
    ys = [float(point.split(",")[1]) for point in raw.split()]
    return ((float(svg.get_attribute("data-ymin")), float(svg.get_attribute("data-ymax"))), ys,
            svg.find_elements(By.CSS_SELECTOR, "polyline.smoothed"), svg.find_elements(By.CSS_SELECTOR, "circle.marker"))


def test_charts_scale_to_their_data_with_a_smoothed_line(webui, browser):
    url, _, _ = webui
    open_board(browser, url)
    losses = [6.96, 6.955, 6.957, 6.95, 6.948, 6.949, 6.944, 6.94]
    charts = [{"id": "loss", "title": "loss", "series": [{"key": "loss", "points": [[i + 1, v] for i, v in
                                                                                      enumerate(losses)]}]}]
    browser.execute_script("clearInterval(POLL); RUN = null; drawCharts(arguments[0], 10);", charts)  # no poll redraws
    (low, high), ys, smoothed, markers = chart_geometry(browser, "loss")
    assert 6.93 < low < 6.94 and 6.96 < high < 6.97, (low, high)  # the data's range with a little padding
    height = browser.find_element(By.ID, "loss-chart").size["height"]
    assert max(ys) - min(ys) > 0.6 * height  # a slope across the chart, not a flat line at its top
    assert len(smoothed) == 1 and len(markers) == len(losses)  # short: a dot per point
    ticks = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#loss-chart text.tick")]
    assert len(ticks) >= 3 and len(set(ticks)) == len(ticks), ticks  # distinct labels: 6.94, 6.95, 6.96
    browser.find_element(By.ID, "loss-chart").screenshot(f"{browser.artifacts}/chart-scaled.png")

    # the smoothed line is LlamaBoard's EMA of the values
    def ema(values):
        import math

        weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(values))) - 0.5)
        out, last = [], values[0]
        for v in values:
            last = last * weight + (1 - weight) * v
            out.append(last)
        return out

    drawn = browser.execute_script("return smooth(arguments[0])", losses)
    assert drawn == pytest.approx(ema(losses))

    # a long noisy series: no dots, and the range still follows the data (rewards of -1..3)
    noisy = [[i, 1 + 2 * ((i * 37) % 11) / 10 - 1] for i in range(1, 201)]
    browser.execute_script("drawCharts(arguments[0], 200);", [charts[0], {"id": "metric", "title": "reward",
                                                                         "series": [{"key": "reward", "points": noisy}]}])
    (low, high), _, smoothed, markers = chart_geometry(browser, "metric")
    values = [p[1] for p in noisy]
    assert low < min(values) and high > max(values) and high - low < 1.3 * (max(values) - min(values))
    assert len(smoothed) == 1 and not markers
    # one point, or a flat series: a range around it, and the point drawn
    browser.execute_script("drawCharts(arguments[0], 10);", [{"id": "loss", "title": "loss",
                                                              "series": [{"key": "loss", "points": [[1, 2.5]]}]}])
    (low, high), _, smoothed, markers = chart_geometry(browser, "loss")
    assert low < 2.5 < high and not smoothed and len(markers) == 1


def test_template_auto_shows_what_it_resolves_to_and_a_picked_model_sets_its_template(webui, browser):
    url, _, _ = webui
    open_board(browser, url)
    assert browser.find_element(By.ID, "f-model_name_or_path").get_attribute("value") == "tiny:qwen2"
    assert browser.find_element(By.ID, "f-template").get_attribute("value") == "auto"
    resolved = browser.find_element(By.ID, "template-resolved")
    wait_for(lambda: resolved.get_attribute("data-template") == "qwen", what="auto resolved for tiny:qwen2")
    assert resolved.text.startswith("auto \u2192 qwen: the tokenizer has no chat template"), resolved.text
    assert "qwen2 family" in resolved.text
    # labels say what a field is, with the YAML key beside it
    label = browser.find_element(By.ID, "field-learning_rate")
    assert label.find_element(By.CSS_SELECTOR, ".label-text").text == "Learning rate"
    assert label.find_element(By.CSS_SELECTOR, "code.key").text == "learning_rate"
    shot(browser, "template-auto")

    # picking a model the registries know sets the template to its family's
    options = {o.get_attribute("value"): o.get_attribute("label")
               for o in browser.find_elements(By.CSS_SELECTOR, "#model-suggestions option")}
    assert "template llama3" in options["tiny:llama"] and "template smollm2" in options["demo:smollm2-135m-instruct"]
    assert "template qwen" in options["Qwen/Qwen2.5-0.5B-Instruct"]
    set_field(browser, "model_name_or_path", "tiny:llama")
    assert browser.find_element(By.ID, "f-template").get_attribute("value") == "llama3"
    assert "template: llama3" in settle(browser)
    wait_for(lambda: resolved.text.startswith("set from the model: llama3"), what="the picked model's note")
    set_field(browser, "model_name_or_path", "tiny:qwen2")
    set_field(browser, "template", "auto")
    wait_for(lambda: resolved.get_attribute("data-template") == "qwen", what="auto again")


def test_template_api_and_the_runs_console_line(tmp_path, capsys):
    """The API the page asks, and the run's console line: `template qwen (template: auto)`."""
    from fastapi.testclient import TestClient

    from cluster.config import load_config
    from cluster.console import Console
    from cluster.driver import tokenizer_and_template
    from cluster.webui.server import create_app

    client = TestClient(create_app(str(tmp_path / "share"), cwd=str(tmp_path)), base_url="http://127.0.0.1:7860")
    answer = client.post("/api/template", json={"model_name_or_path": "tiny:qwen2", "template": "auto"}).json()
    assert answer["template"] == "qwen" and answer["auto"] and "qwen2 family" in answer["reason"]
    named = client.post("/api/template", json={"model_name_or_path": "tiny:qwen2", "template": "chatml"}).json()
    assert named == {"template": "chatml", "auto": False, "reason": "named in the config"}
    demo = client.post("/api/template", json={"model_name_or_path": "demo:smollm2-135m-instruct"}).json()
    assert demo["template"] == "smollm2"
    hub = client.post("/api/template", json={"model_name_or_path": "nobody/no-such-model-xyz"}).json()
    assert hub["template"] is None and "hub cache" in hub["reason"]  # never downloaded to find out
    outside = client.post("/api/template", json={"model_name_or_path": "/etc"})
    assert outside.status_code == 200 and outside.json()["template"] is None

    cfg = load_config({"model_name_or_path": "tiny:qwen2", "dataset": "arith_train", "output_dir": str(tmp_path / "o"),
                       "template": "auto"})
    _, template = tokenizer_and_template(cfg)
    assert template.name == "qwen"
    Console().plan(cfg.with_template(template.name))
    line = capsys.readouterr().out.splitlines()[0]
    assert line.endswith("model tiny:qwen2, template qwen (template: auto)"), line


def test_chat_streams_events_with_token_counts(tmp_path):
    """The Chat tab's API speaks webchat's events: text pieces, then the token counts; top_p is taken."""
    from fastapi.testclient import TestClient

    from cluster.webui.server import create_app

    client = TestClient(create_app(str(tmp_path / "share"), cwd=str(tmp_path)), base_url="http://127.0.0.1:7860")
    body = {"model_name_or_path": "tiny:qwen2", "template": "qwen", "messages": [{"role": "user", "content": "2+3?"}],
            "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5}
    answer = client.post("/api/chat", json=body)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream"), answer.text
    events = [json.loads(line[len("data: "):]) for line in answer.text.split("\n\n") if line.startswith("data: ")]
    done = events[-1]
    assert done["done"] and done["finish_reason"] in ("stop", "length")
    assert 0 < done["completion_tokens"] <= 5 and done["prompt_tokens"] > 5
    assert all("text" in e for e in events[:-1])
    bad = client.post("/api/chat", json={**body, "top_p": 1.5})
    assert bad.status_code == 400 and "top_p" in bad.json()["error"]


def test_the_chat_tab_has_webchats_controls(webui, browser):
    url, _, _ = webui
    open_board(browser, url)
    browser.find_element(By.ID, "tab-chat").click()
    for control in ("chat-top-p", "chat-stop", "chat-clear", "chat-temperature", "chat-max-new-tokens"):
        assert browser.find_element(By.ID, control).is_displayed(), control
    assert not browser.find_element(By.ID, "chat-stop").is_enabled()  # nothing streams
    model = browser.find_element(By.ID, "chat-model")
    model.send_keys("tiny:qwen2")
    browser.find_element(By.ID, "chat-template").send_keys("qwen")
    browser.find_element(By.ID, "chat-max-new-tokens").clear()
    browser.find_element(By.ID, "chat-max-new-tokens").send_keys("6")
    browser.find_element(By.ID, "chat-input").send_keys("What is 2+3?")
    browser.find_element(By.ID, "chat-send").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='true']"), 180, "the reply")
    usage = browser.find_element(By.ID, "chat-usage").text
    assert re.fullmatch(r"\d+ prompt tokens, [1-6] reply tokens \((stop|length)\)", usage), usage
    shot(browser, "chat-usage")
    browser.find_element(By.ID, "chat-clear").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg") and browser.find_element(By.ID, "chat-usage").text == ""
    browser.find_element(By.ID, "tab-train").click()
