"""stage ppo with reward_model_type api on a real local Ray: the reward comes from a server over
HTTP (a tiny http.server thread here), called from the controller; no reward-model actor is
placed. configs/ppo_remote_reward.yaml as shipped, but for the URL (this test's server), 2 steps,
hf rollouts (no vLLM start-up) and no eval set. The three protocols the URL picks: OpenRLHF's
remote reward JSON (/get_reward), ours (/v1/score, as `rayfactory serve` of a stage rm output) and
an LLM judge (/v1/chat/completions).

The server scores each completion by its length, so the run's logged ``rewards/reward_model`` and
``reward`` of each step must be the mean of what the server answered for that step. A server that
is down fails the run at its first step with one paragraph naming the URL, after the configured
retries, in seconds (never a hang).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cluster.driver import run_exp
from stages.training.callbacks import read_log
from tests.e2e.conftest import example_config

STEPS = 2


class RewardServer:
    """A reward server on 127.0.0.1: OpenRLHF's remote reward protocol at /get_reward ({"query",
    "prompts", "labels"} -> {"rewards"}) and ours at /v1/score ({"model", "conversations"} ->
    {"scores"}, the model name from GET /v1/models), as `rayfactory serve` of a stage rm output."""

    def __init__(self):
        self.requests: list[dict] = []
        self.replies: list[list[float]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._reply({"object": "list", "data": [{"id": "test-rm", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/chat/completions":  # a judge: "Score: N" for some answers, none for others
                    answer = body["messages"][0]["content"].split("Answer to grade:\n")[1].split("\n\nHow correct")[0]
                    score = len(answer) % 4  # 3: no score (about a quarter of the answers)
                    with server.lock:
                        server.requests.append(body)
                        server.replies.append([None if score == 3 else score / 10])
                    content = "I cannot tell." if score == 3 else f"Score: {score}"
                    self._reply({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})
                    return
                if self.path == "/v1/score":
                    completions = [conversation[-1]["content"] for conversation in body["conversations"]]
                else:
                    completions = [q[len(p):] for q, p in zip(body["query"], body["prompts"])]
                rewards = [1.0 + 0.1 * len(c) for c in completions]
                server.requests.append(body)
                server.replies.append(rewards)
                self._reply({"scores" if self.path == "/v1/score" else "rewards": rewards})

            def _reply(self, reply):
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def reward_server():
    server = RewardServer()
    yield server
    server.close()


def _config(tmp_path, url: str, **overrides) -> dict:
    return example_config("ppo_remote_reward.yaml", tmp_path, reward_model=url, max_steps=STEPS, logging_steps=1,
                          save_steps=1000, eval_dataset=None, rollout_backend="hf", per_device_train_batch_size=2,
                          **overrides)


def test_ppo_trains_on_an_llm_judges_scores(ray_session, reward_server, tmp_path):
    """A .../chat/completions URL is a judge: one request per completion, "Score: N" read as N / 10,
    a reply without a score adding 0 and left out of the logged mean (the log keeps 6 digits)."""
    result = run_exp(_config(tmp_path, reward_server.url + "/v1/chat/completions"))

    steps = [r for r in read_log(result.output_dir) if r.get("current_steps", 0) > 0 and "reward" in r]
    assert [r["current_steps"] for r in steps] == list(range(1, STEPS + 1))
    assert len(reward_server.replies) == 8 * STEPS  # the steps run one after another: 8 requests each
    for i, record in enumerate(steps):
        scores = [reply[0] for reply in reward_server.replies[8 * i: 8 * (i + 1)]]
        scored = [x for x in scores if x is not None]
        assert record["reward"] == pytest.approx(sum(scored) / 8, abs=1e-5)
        assert record["rewards/reward_model_unscored"] == pytest.approx(1 - len(scored) / 8, abs=1e-5)
        if scored:
            assert record["rewards/reward_model"] == pytest.approx(sum(scored) / len(scored), abs=1e-5)
    assert {body["model"] for body in reward_server.requests} == {"test-rm"}  # the first listed model


@pytest.mark.parametrize("path", ["/get_reward", "/v1/score"])
def test_ppo_trains_on_the_reward_servers_scores(ray_session, reward_server, tmp_path, path):
    result = run_exp(_config(tmp_path, reward_server.url + path))

    steps = [r for r in read_log(result.output_dir) if r.get("current_steps", 0) > 0 and "reward" in r]
    assert [r["current_steps"] for r in steps] == list(range(1, STEPS + 1))
    # 8 prompts a step (2 x 2 accumulation x 2 mini-batches), one completion each: one request a step.
    assert [len(reply) for reply in reward_server.replies] == [8] * STEPS
    for record, reply in zip(steps, reward_server.replies):
        assert record["rewards/reward_model"] == pytest.approx(sum(reply) / len(reply), abs=1e-5)
        # no reward_funcs: the reward is the server's alone
        assert record["reward"] == pytest.approx(sum(reply) / len(reply), abs=1e-5)
    first = reward_server.requests[0]
    if path == "/get_reward":  # OpenRLHF's: the templated prompt, prompt + completion, the references
        assert all(p.startswith("<|im_start|>") and q.startswith(p) for p, q in zip(first["prompts"], first["query"]))
        assert len(first["labels"]) == 8 and all(label.strip() for label in first["labels"])
    else:  # ours: the conversation as messages (the question, untemplated) and the answer
        assert first["model"] == "test-rm"
        for conversation in first["conversations"]:
            assert [m["role"] for m in conversation] == ["user", "assistant"]
            assert conversation[0]["content"].startswith("What is ")  # arith_train's questions
    assert steps[-1]["value_loss"] > 0 and steps[-1]["grad_norm"] > 0  # the critic and the policy trained on it


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections are refused


def test_a_reward_server_that_is_down_fails_the_run_naming_its_url(ray_session, tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/get_reward"
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        run_exp(_config(tmp_path, url, reward_api_retries=1, reward_api_timeout=2))
    message = str(info.value)
    assert f"The reward endpoint {url} failed 2 time(s)" in message, message
    assert "Connection refused" in message or "ConnectionRefusedError" in message, message
    assert time.monotonic() - start < 180  # failed, not retried as a crash or hung
    assert not [r for r in read_log(str(tmp_path / "out")) if r.get("current_steps", 0) > 0 and "loss" in r]
