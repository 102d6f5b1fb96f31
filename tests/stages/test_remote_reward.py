"""Remote rewards against a real HTTP server on 127.0.0.1: our /v1/score, the plain JSON protocol and
an LLM judge; a server that is down, slow, trickling, answering garbage or failing twice gives a
clear error naming the URL or a retried result, and never a hang."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from registries.errors import UserError
from stages.rl.controller.remote_reward import (
    HTTPOptions,
    JudgeReward,
    RemoteReward,
    RemoteRewardError,
    parse_score,
    post_json,
)
from stages.rl.controller.rewards import load_reward_funcs

QUICK = HTTPOptions(timeout=0.5, retries=2, backoff=0.05, concurrency=4, batch_size=2)


class Server:
    """A local server whose answer to each path is a function of (server, body) -> (status, body)."""

    def __init__(self):
        self.routes, self.requests, self.lock = {}, [], threading.Lock()
        self.in_flight = self.max_in_flight = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with server.lock:
                    server.requests.append((self.path, body, self.headers.get("Authorization")))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    route = server.routes.get(self.path)
                    if route is None:
                        status, reply = 404, {"error": "no such path"}
                    else:
                        status, reply = route(server, body, self)
                finally:
                    # Done before the reply goes out: the client may send its next request the moment
                    # it has this one's, and this thread must not still count as in flight then.
                    with server.lock:
                        server.in_flight -= 1
                if reply is None:  # the route wrote its own reply
                    return
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def free_port_url() -> str:
    """A URL where nothing listens (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/reward"


def test_our_score_protocol_with_the_served_model_name(server):
    server.routes["/v1/models"] = lambda s, body, h: (200, {"object": "list", "data": [{"id": "my-rm"}]})
    server.routes["/v1/score"] = lambda s, body, h: (200, {"scores": [
        float(len(c[-1]["content"])) for c in body["conversations"]]})
    reward = RemoteReward(server.url + "/v1/score", options=QUICK)
    assert reward(["q1", "q2", "q3"], ["a", "bb", "ccc"]) == [1.0, 2.0, 3.0]
    posts = sorted((body for path, body, _ in server.requests if path == "/v1/score"),
                   key=lambda b: b["conversations"][0][0]["content"])  # the two batches go out concurrently
    assert len(posts) == 2  # batch_size 2
    assert posts[0] == {"model": "my-rm", "conversations": [
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "bb"}]]}


def test_the_plain_json_protocol_sends_queries_prompts_and_labels(server):
    server.routes["/reward"] = lambda s, body, h: (200, {"rewards": [[0.5]] * len(body["query"])})
    reward = RemoteReward(server.url + "/reward", options=HTTPOptions(api_key="k", batch_size=8))
    assert reward(["2+2=", "3+3="], ["4", "7"], reference=["4", "6"]) == [0.5, 0.5]
    path, body, auth = server.requests[0]
    assert body == {"query": ["2+2=4", "3+3=7"], "prompts": ["2+2=", "3+3="], "labels": ["4", "6"]}
    assert auth == "Bearer k"


def test_fails_twice_then_succeeds(server):
    calls = []

    def flaky(s, body, h):
        calls.append(1)
        return (503, {"error": "warming up"}) if len(calls) <= 2 else (200, {"rewards": [1.0]})
    server.routes["/reward"] = flaky
    assert RemoteReward(server.url + "/reward", options=QUICK)(["p"], ["c"]) == [1.0]
    assert len(calls) == 3


def test_a_server_that_is_down_is_a_clear_error_naming_the_url():
    url = free_port_url()
    start = time.monotonic()
    with pytest.raises(RemoteRewardError) as info:
        RemoteReward(url, options=QUICK)(["p"], ["c"])
    assert time.monotonic() - start < 2
    message = str(info.value)
    assert url in message and "failed 3 time(s)" in message and "refused" in message.lower()
    assert isinstance(info.value, UserError) and "\n" not in message


def test_a_slow_server_times_out_and_is_retried_never_hung(server):
    def slow(s, body, h):
        time.sleep(2)
        return 200, {"rewards": [1.0]}
    server.routes["/reward"] = slow
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match="timed out"):
        RemoteReward(server.url + "/reward", options=HTTPOptions(timeout=0.3, retries=1, backoff=0.05))(["p"], ["c"])
    assert time.monotonic() - start < 1.5


def test_a_trickling_server_cannot_stretch_an_attempt(server):
    def trickle(s, body, h):
        h.send_response(200)
        h.send_header("Content-Length", "1000")
        h.end_headers()
        for _ in range(100):  # one byte every 0.05 s: each read succeeds, the whole never ends in time
            try:
                h.wfile.write(b" ")
                h.wfile.flush()
            except OSError:
                return 200, None
            time.sleep(0.05)
        return 200, None
    server.routes["/reward"] = trickle
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match="timed out while reading"):
        RemoteReward(server.url + "/reward", options=HTTPOptions(timeout=0.4, retries=0))(["p"], ["c"])
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("reply, message", [
    (b"<html>oops</html>", "the reply is not JSON"),
])
def test_garbage_is_retried_then_a_clear_error(server, reply, message):
    server.routes["/reward"] = lambda s, body, h: (200, reply)
    with pytest.raises(RemoteRewardError, match=message) as info:
        RemoteReward(server.url + "/reward", options=QUICK)(["p"], ["c"])
    assert server.url in str(info.value) and len(server.requests) == 3


@pytest.mark.parametrize("reply, message", [
    ({"scores": [1.0]}, "without 'rewards'"),
    ({"rewards": [1.0, 2.0]}, "rewards=2 values for 1 completions"),
    ({"rewards": ["high"]}, "holding 'high'; each must be a finite number"),
    ({"rewards": [float("nan")]}, "holding nan"),
])
def test_wrong_shapes_are_clear_errors_without_retries(server, reply, message):
    server.routes["/reward"] = lambda s, body, h: (200, json.dumps(reply).encode())
    with pytest.raises(RemoteRewardError, match=message):
        RemoteReward(server.url + "/reward", options=QUICK)(["p"], ["c"])
    assert len(server.requests) == 1


def test_a_client_error_is_not_retried(server):
    server.routes["/reward"] = lambda s, body, h: (400, {"error": "bad field"})
    with pytest.raises(RemoteRewardError, match=r"refused the request with HTTP 400: .*bad field"):
        RemoteReward(server.url + "/reward", options=QUICK)(["p"], ["c"])
    assert len(server.requests) == 1


def test_the_judge_parses_scores_with_bounded_concurrency(server):
    server.routes["/v1/models"] = lambda s, body, h: (200, {"data": [{"id": "judge"}]})

    def chat(s, body, h):
        time.sleep(0.1)
        prompt = body["messages"][0]["content"]
        assert body["model"] == "judge" and body["temperature"] == 0
        content = "I cannot tell." if "skip" in prompt else ("Score: 9" if "good" in prompt else "score = 2")
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}
    server.routes["/v1/chat/completions"] = chat
    judge = JudgeReward(server.url, rubric="Q: {prompt}\nA: {completion}\nRef: {reference} {json: kept}",
                        options=HTTPOptions(timeout=2, concurrency=3))
    completions = ["good", "bad", "skip"] * 3
    scores = judge(["q"] * 9, completions, reference=["r"] * 9)
    assert scores == [0.9, 0.2, None] * 3
    assert 2 <= server.max_in_flight <= 3
    first = next(body for path, body, _ in server.requests if path == "/v1/chat/completions")
    assert first["messages"][0]["content"].startswith("Q: q\nA: ") and first["messages"][0]["content"].endswith(
        "Ref: r {json: kept}")


@pytest.mark.parametrize("reply, score", [
    ("Score: 7", 0.7), ("**Score:** 10", 1.0), ("8", 0.8), ("8/10", 0.8), ("Score: 3\nScore: 6", 0.6),
    ("Score: 15", 1.0), ("Score: -1", 0.0), ("no idea", None), ("", None),
])
def test_parse_score(reply, score):
    assert parse_score(reply) == score


def test_remote_rewards_are_reward_functions(server, tmp_path, monkeypatch):
    server.routes["/reward"] = lambda s, body, h: (200, {"rewards": [float(l == "4") for l in body["labels"]]})
    module = tmp_path / "rf_test_remote_rewards.py"
    url = server.url + "/reward"
    module.write_text(f"from stages.rl.controller.remote_reward import RemoteReward\nscore = RemoteReward({url!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = load_reward_funcs(["rf_test_remote_rewards:score"])
    scores = rewards.score(["2+2="] * 2, ["4", "5"], {"reference": ["4", "x"], "completion_ids": [[1], [2]]})
    assert scores.total == [1.0, 0.0]


def test_post_json_get(server):
    server.routes["/v1/models"] = lambda s, body, h: (200, {"data": []})
    assert post_json(server.url + "/v1/models", None, QUICK, method="GET") == {"data": []}


@pytest.mark.parametrize("path, kind, protocol", [
    ("/v1/score", RemoteReward, "score"), ("/get_reward", RemoteReward, "json"),
    ("/v1/chat/completions", JudgeReward, None), ("/v1/chat/completions/", JudgeReward, None),
])
def test_api_reward_picks_the_scorer_by_the_url(path, kind, protocol):
    from stages.rl.controller.remote_reward import api_reward

    scorer = api_reward("http://host:8000" + path, QUICK)
    assert type(scorer) is kind and scorer.options is QUICK
    assert getattr(scorer, "protocol", None) == protocol


def test_api_reward_builds_the_judge_from_the_reward_judge_keys(server):
    """reward_judge_rubric / _model / _max_score reach the judge: the rubric as sent, the named
    model asked (no /v1/models lookup), replies scaled by the top score."""
    from stages.rl.controller.remote_reward import api_reward

    def chat(s, body, h):
        assert body["model"] == "grader-7b"
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Score: 4"}}]}
    server.routes["/v1/chat/completions"] = chat
    judge = api_reward(server.url + "/v1/chat/completions", QUICK, rubric="Rate {completion} against {reference}.",
                       model="grader-7b", max_score=5)
    assert isinstance(judge, JudgeReward)
    assert judge(["q"], ["forty-two"], reference=["42"]) == [0.8]
    assert [path for path, _, _ in server.requests] == ["/v1/chat/completions"]
    assert server.requests[0][1]["messages"][0]["content"] == "Rate forty-two against 42."
    assert isinstance(api_reward(server.url + "/v1/score", QUICK, rubric="ignored {completion}"), RemoteReward)
