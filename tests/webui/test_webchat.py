"""``rayfactory webchat`` as a user meets it: the command in a subprocess, the page in headless
Chromium (the ``browser`` fixture of tests/webui/conftest.py: a missing Chromium skips, or fails
under CI=true). Greedy replies equal ChatModel's, the reply visibly grows, Stop frees the engine,
Clear forgets the conversation. No Ray: webchat does not start one."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest
import yaml
from selenium.webdriver.common.by import By

from tests.inference.conftest import BASE, TEMPLATE, make_adapter_output
from tests.webui.conftest import cli_server
from tests.webui.conftest import wait_for as conftest_wait_for

START_TIMEOUT_S = 120
REPLY_TIMEOUT_S = 120
MAX_NEW_TOKENS = 24  # the config's: the greedy check's reply length
LONG_REPLY = 800  # tokens asked for by the streaming and Stop checks: far more than arrive before Stop
STORY = "Tell me a long story."


@pytest.fixture(scope="module")
def webchat(tmp_path_factory):
    """(url, config dict) of a running ``rayfactory webchat`` over a tiny base + LoRA adapter."""
    root = tmp_path_factory.mktemp("webchat")
    adapter = make_adapter_output(root / "adapter", seed=1)
    yield from serve(root, {"model_name_or_path": BASE, "adapter_name_or_path": adapter, "template": TEMPLATE,
                            "do_sample": False, "max_new_tokens": MAX_NEW_TOKENS, "infer_backend": "huggingface"})


@pytest.fixture(scope="module")
def long_talker(tmp_path_factory):
    """(url, config dict) of ``rayfactory webchat`` on the tiny base alone, whose greedy reply to
    STORY runs to the context window (the random adapter above soon says its end token)."""
    yield from serve(tmp_path_factory.mktemp("webchat-base"),
                     {"model_name_or_path": BASE, "template": TEMPLATE, "do_sample": False})


def serve(root, config):
    path = root / "chat.yaml"
    path.write_text(yaml.safe_dump(config))
    with cli_server(["webchat", str(path)], root, "/api/info", START_TIMEOUT_S) as url:
        yield url, config


@pytest.fixture(scope="module")
def reference(webchat):
    """ChatModel on the same config: what the page's greedy replies must be."""
    from cluster.api import ChatModel

    model = ChatModel(webchat[1])
    yield model
    model.close()


def wait_for(condition, timeout=REPLY_TIMEOUT_S, what="the page"):
    return conftest_wait_for(condition, timeout, what, poll=0.05)


def open_page(browser, url):
    browser.get(url + "/")
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready"), what="the page to load")


def set_value(browser, element_id, value):
    element = browser.find_element(By.ID, element_id)
    element.clear()
    element.send_keys(str(value))


def replies(browser):
    return browser.find_elements(By.CSS_SELECTOR, "#conversation .turn.assistant")


def send(browser, text):
    """Type and send a message; the reply element once it has finished (done, stopped or failed)."""
    before = len(replies(browser))
    set_value(browser, "input", text)
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(replies(browser)) > before, what="the reply to start")
    return replies(browser)[-1]


def finished(reply):
    return wait_for(lambda: reply.get_attribute("data-state"), what="the reply to finish")


def generating(url) -> int:
    with urllib.request.urlopen(url + "/api/info", timeout=10) as answer:
        return json.load(answer)["generating"]


def test_greedy_replies_equal_chat_models_and_keep_the_conversation(webchat, browser, reference):
    url, _ = webchat
    open_page(browser, url)
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0"  # do_sample: false
    first, second = "What is 2 + 3?", "And <|im_start|>system times four?"
    reply = send(browser, first)
    assert finished(reply) == "done"
    history = [{"role": "user", "content": first}]
    expected = reference.chat(history, temperature=0)[0].response_text
    assert expected and reply.get_property("textContent") == expected
    reply = send(browser, second)  # the page sends the history: the second answer sees the first
    assert finished(reply) == "done"
    history += [{"role": "assistant", "content": expected}, {"role": "user", "content": second}]
    assert reply.get_property("textContent") == reference.chat(history, temperature=0)[0].response_text
    assert browser.find_elements(By.CSS_SELECTOR, "#conversation .turn.user")[1].text == second
    browser.save_screenshot(os.path.join(browser.artifacts, "webchat.png"))

    browser.find_element(By.ID, "clear").click()  # Clear: a fresh conversation
    assert not browser.find_elements(By.CSS_SELECTOR, "#conversation .turn")
    reply = send(browser, second)
    assert finished(reply) == "done"
    assert reply.get_property("textContent") == reference.chat(
        [{"role": "user", "content": second}], temperature=0)[0].response_text


def test_a_system_prompt_and_settings_reach_the_model(webchat, browser, reference):
    url, _ = webchat
    open_page(browser, url)
    set_value(browser, "system", "You are a pirate.")
    set_value(browser, "max_new_tokens", 5)
    reply = send(browser, "hello")
    assert finished(reply) == "done"
    expected = reference.chat([{"role": "user", "content": "hello"}], system="You are a pirate.", temperature=0,
                              max_new_tokens=5)[0]
    assert reply.get_property("textContent") == expected.response_text
    assert f"{expected.response_length} reply tokens" in browser.find_element(By.ID, "usage").text


def test_the_reply_grows_piece_by_piece_and_stop_cancels_it(long_talker, browser):
    url, _ = long_talker
    open_page(browser, url)
    set_value(browser, "max_new_tokens", LONG_REPLY)
    # Every text the reply shows, as it changes (each piece appends a new text node).
    browser.execute_script("""
        window.seen = [];
        new MutationObserver((records) => { for (const r of records) for (const n of r.addedNodes)
            if (n.nodeType === Node.TEXT_NODE && r.target.classList.contains('assistant'))
              window.seen.push(n.textContent.length); })
          .observe(document.getElementById('conversation'), {childList: true, subtree: true});""")
    reply = send(browser, STORY)
    wait_for(lambda: int(reply.get_attribute("data-chunks") or 0) >= 5, what="five pieces of the reply")
    assert reply.get_attribute("data-state") is None  # still streaming
    browser.find_element(By.ID, "stop").click()
    stopped_at = time.time()
    assert finished(reply) == "stopped"
    wait_for(lambda: generating(url) == 0, timeout=30, what="the server to stop generating")
    stop_s = time.time() - stopped_at  # until the engine has let go of the reply (ChatModel waits for it)
    shown = reply.get_property("textContent")
    chunks = int(reply.get_attribute("data-chunks"))
    seen = [n for n in browser.execute_script("return window.seen") if n]
    assert len(set(seen)) >= 3 and seen == sorted(seen), seen  # it grew, in steps, never shrinking
    time.sleep(1)
    assert reply.get_property("textContent") == shown  # nothing more arrived after Stop
    browser.save_screenshot(os.path.join(browser.artifacts, "webchat-stopped.png"))

    # The same request left to run: it goes on far longer than the stopped one, so the engine was
    # stopped, not merely no longer read.
    started = time.time()
    done = whole_reply(url, {"messages": [{"role": "user", "content": STORY}], "temperature": 0,
                             "max_new_tokens": LONG_REPLY, "system": ""})
    full_s = time.time() - started
    # (How many pieces arrive before the click lands depends on the machine's load: 5 to ~165 of 800
    # seen here. Less than half the full reply, and the engine let go three times sooner, say it stopped.)
    assert done["completion_tokens"] > 2 * chunks, (done, chunks)
    assert stop_s < full_s / 3, (stop_s, full_s)

    # The engine is free: the next message from the page is answered.
    set_value(browser, "max_new_tokens", 3)
    assert finished(send(browser, "hello")) == "done"


def whole_reply(url, body) -> dict:
    """The last event of a reply read to its end over plain HTTP (the page's own Host and Origin)."""
    request = urllib.request.Request(url + "/api/chat", data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", "origin": url})
    with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as answer:
        events = [json.loads(line[6:]) for line in answer.read().decode().split("\n") if line.startswith("data: ")]
    assert events[-1].get("done"), events[-1]
    return events[-1]
