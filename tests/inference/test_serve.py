"""The OpenAI-compatible Serve app, end to end: a real Ray Serve on 127.0.0.1, the official
``openai`` client and raw httpx, the transformers engine over the tiny model + two LoRA adapters
(default: math; lora_modules: poet, and tools, fitted to call a tool). One Serve app for the module (startup is the slow part).
The same app over the vLLM engine is test_serve_vllm.py's."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import yaml

from .conftest import BASE, PROMPTS, TOOL_CALL, TOOL_QUESTION, WEATHER_TOOLS, make_tool_caller_output, serve_apps

API_KEY = "sk-test-key"
MAX_NEW = 12
MAXLEN = 512
LONG = "word " * 1000  # > MAXLEN tokens
CONCURRENT_TOKENS = 8  # enough for each adapter to answer each prompt differently


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory):
    return make_tool_caller_output(tmp_path_factory.mktemp("tools") / "tools")


@pytest.fixture(scope="module")
def config(adapter_outputs, tool_caller):
    return {"model_name_or_path": BASE, "template": "qwen", "adapter_name_or_path": adapter_outputs["math"],
            "lora_modules": {"poet": adapter_outputs["poet"], "tools": tool_caller}, "do_sample": False, "max_new_tokens": MAX_NEW,
            "vllm_maxlen": MAXLEN, "api_key": API_KEY, "serve_max_ongoing_requests": 64,
            # 32 requests at once all wait their turns, which come at every token: the most switching
            # of adapters between requests, so an answer given with another request's adapter would show.
            "serve_max_waiting": 32, "serve_turn_s": 0}


@pytest.fixture(scope="module")
def local_chat(config):
    from cluster.api import ChatModel

    chat = ChatModel(config)
    yield chat
    chat.close()


@pytest.fixture(scope="module")
def reward_output(tmp_path_factory):
    from .test_export import make_reward_output

    return make_reward_output(tmp_path_factory.mktemp("rm") / "rm-out", seed=3)


@pytest.fixture(scope="module")
def server(serve_http, config, reward_output):
    from cluster.serve.app import build_app

    # A reward model (stage rm output) as a second app, for /v1/score.
    rm = build_app({**config, "adapter_name_or_path": reward_output, "lora_modules": None, "api_key": None})
    yield from serve_apps(serve_http, {"rayfactory-test": (build_app(config), "/"), "rayfactory-rm": (rm, "/rm")})


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_models_lists_default_and_adapters(client):
    assert [m.id for m in client.models.list().data] == ["math", "poet", "tools"]


def test_the_openai_client_reads_a_tool_call(client):
    """The tools adapter answers in the template's tool-call format; the client gets a parsed call."""
    messages = [{"role": "user", "content": TOOL_QUESTION}]
    reply = client.chat.completions.create(model="tools", messages=messages, tools=WEATHER_TOOLS, max_tokens=48)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == TOOL_CALL["name"] and json.loads(call.function.arguments) == TOOL_CALL["arguments"]
    # Streamed, the same call arrives in a chunk, and the last choice says tool_calls.
    chunks = [c for c in client.chat.completions.create(model="tools", messages=messages, tools=WEATHER_TOOLS,
                                                         max_tokens=48, stream=True) if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (TOOL_CALL["name"], TOOL_CALL["arguments"])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without the tools in the request, the same reply is plain text (nothing is parsed).
    plain = client.chat.completions.create(model="tools", messages=messages, max_tokens=48).choices[0]
    assert plain.message.tool_calls is None


def test_greedy_completion_matches_in_process_chat_and_usage(client, local_chat):
    reply = client.chat.completions.create(model="math", messages=PROMPTS[2])
    expected = local_chat.chat(PROMPTS[2])[0]
    assert reply.choices[0].message.content == expected.response_text
    assert reply.choices[0].finish_reason == expected.finish_reason
    prompt_ids = local_chat.prompt_ids(PROMPTS[2])
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(expected.token_ids) == expected.response_length
    assert reply.usage.total_tokens == len(prompt_ids) + len(expected.token_ids)


def test_stream_token_by_token_equals_the_whole_reply(client):
    whole = client.chat.completions.create(model="math", messages=PROMPTS[0]).choices[0].message.content
    chunks = list(client.chat.completions.create(model="math", messages=PROMPTS[0], stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2
    assert "".join(pieces) == whole
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0] is [c for c in chunks if c.choices][-1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_adapter_selected_by_name(client, local_chat):
    poet = client.chat.completions.create(model="poet", messages=PROMPTS[1]).choices[0].message.content
    math = client.chat.completions.create(model="math", messages=PROMPTS[1]).choices[0].message.content
    assert poet == local_chat.chat(PROMPTS[1], adapter="poet")[0].response_text
    assert poet != math


def test_n_stop_logprobs(client, local_chat):
    base = local_chat.chat(PROMPTS[0])[0].response_text
    two = client.chat.completions.create(model="math", messages=PROMPTS[0], n=2, temperature=0)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == two.choices[1].message.content == base
    stop = base[3:5]
    cut = client.chat.completions.create(model="math", messages=PROMPTS[0], stop=[stop])
    assert cut.choices[0].message.content == base[: base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    lp = client.chat.completions.create(model="math", messages=PROMPTS[0], logprobs=True, top_logprobs=2)
    entries = lp.choices[0].logprobs.content
    assert len(entries) == lp.usage.completion_tokens
    expected = local_chat.chat(PROMPTS[0], logprobs=2)[0]
    for entry, token_id, ref in zip(entries, expected.token_ids, expected.logprobs):
        assert entry.token == local_chat.tokenizer.decode([token_id])
        assert entry.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes) == entry.token.encode("utf-8")


def test_request_with_tools_is_well_formed(client):
    tools = [{"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
    messages = [{"role": "user", "content": "add 2 and 3"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                      "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    reply = client.chat.completions.create(model="math", messages=messages, tools=tools)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.message.tool_calls is not None) == (choice.finish_reason == "tool_calls")
    assert reply.usage.prompt_tokens > 0


def test_tool_calls_become_openai_tool_calls():
    from cluster.serve import protocol as p
    from registries.templates.tools import FunctionCall
    from stages.inference.chat_model import Response

    response = Response("Action: add\nAction Input: {\"a\": 2}", 9, 20, "tool_calls",
                        tool_calls=[FunctionCall("add", '{"a": 2}')])
    body = p.completion([response], "m", tokenizer=None)
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}
    messages, system = p.to_chat_inputs([p.ChatMessage.model_validate(m) for m in [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "add "}, {"type": "text", "text": "2"}]},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "content": "2"}, {"role": "tool", "content": "ok"}]])
    assert system == "be brief"
    assert messages == [{"role": "user", "content": "add 2"},
                        {"role": "function", "content": json.dumps([{"name": "add", "arguments": {"a": 2}}])},
                        {"role": "observation", "content": "2\nok"}]


@pytest.mark.parametrize("body, headers, status, code", [
    (b"{not json", None, 400, "invalid_json"),
    ({"model": "nope", "messages": PROMPTS[0]}, None, 404, "model_not_found"),
    ({"model": "math"}, None, 400, "invalid_value"),
    ({"model": "math", "messages": "hello"}, None, 400, "invalid_value"),
    ({"model": "math", "messages": PROMPTS[0], "n": 0}, None, 400, "invalid_value"),
    ({"model": "math", "messages": PROMPTS[0], "temperature": "hot"}, None, 400, "invalid_value"),
    ({"model": "math", "messages": [{"role": "assistant", "content": "hi"}]}, None, 400, None),
    ({"model": "math", "messages": [{"role": "user", "content": LONG}]}, None, 400, "context_length_exceeded"),
    ({"model": "math", "messages": [{"role": "user", "content": LONG}], "stream": True}, None, 400,
     "context_length_exceeded"),
    ({"model": "math", "messages": PROMPTS[0], "min_p": 0.1}, None, 400, "unsupported_parameter"),
    ({"model": "math", "messages": PROMPTS[0], "response_format": {"type": "json_object"}}, None, 400,
     "unsupported_parameter"),
    ({"model": "math", "messages": PROMPTS[0]}, {}, 401, "invalid_api_key"),
    ({"model": "math", "messages": PROMPTS[0]}, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
])
def test_client_mistakes_get_openai_errors_and_serving_goes_on(server, body, headers, status, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = httpx.post(server + "/v1/chat/completions", content=content, timeout=60,
                        headers=_auth() if headers is None else headers)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code
    ok = httpx.post(server + "/v1/chat/completions", json={"model": "math", "messages": PROMPTS[0], "max_tokens": 2},
                    headers=_auth(), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_score_on_a_chat_model_is_refused(server):
    answer = httpx.post(server + "/v1/score", headers=_auth(), timeout=60,
                        json={"model": "math", "messages": PROMPTS[2][:2]})
    assert answer.status_code == 400 and "not a reward model" in answer.json()["error"]["message"]


def test_score_with_a_reward_model(server, config, reward_output):
    from cluster.config import load_config
    from stages.inference.scoring import RewardScorer

    conversations = [PROMPTS[2][:2], [{"role": "system", "content": "judge"}, *PROMPTS[2][:2]],
                     [*PROMPTS[0], {"role": "assistant", "content": "5"}]]
    answer = httpx.post(server + "/rm/v1/score", timeout=60, json={"model": "rm-out", "conversations": conversations})
    assert answer.status_code == 200, answer.text
    scorer = RewardScorer(load_config({**config, "adapter_name_or_path": reward_output, "lora_modules": None},
                                      purpose="infer").inference_spec())
    expected = [scorer.score([PROMPTS[2][:2]])[0], scorer.score([PROMPTS[2][:2]], system="judge")[0],
                scorer.score([conversations[2]])[0]]
    assert answer.json()["scores"] == pytest.approx(expected, abs=1e-4)
    assert expected[0] != pytest.approx(expected[1], abs=1e-6)  # the system prompt reached the scorer
    one = httpx.post(server + "/rm/v1/score", timeout=60, json={"model": "rm-out", "messages": conversations[2]})
    assert one.json()["scores"] == pytest.approx(expected[2:], abs=1e-4)
    bad = httpx.post(server + "/rm/v1/score", timeout=60, json={"model": "rm-out", "messages": PROMPTS[2]})
    assert bad.status_code == 400 and "must end with the assistant reply" in bad.json()["error"]["message"]


def test_an_llm_judge_reward_reads_our_chat_replies(server, client):
    """reward_model_type api with a .../chat/completions URL: JudgeReward asks this server (the first
    model it lists) to grade each answer. The tiny random model rarely writes "Score: N", so the
    plumbing is what is checked: each reply was read and parsed exactly as a direct request's."""
    from stages.rl.controller.remote_reward import DEFAULT_RUBRIC, HTTPOptions, JudgeReward, api_reward, parse_score

    judge = api_reward(server + "/v1/chat/completions", HTTPOptions(timeout=60, retries=0, api_key=API_KEY))
    assert isinstance(judge, JudgeReward)
    prompts, answers = ["What is 1+1?", [{"role": "user", "content": "What is 2+3?"}]], ["2", "five"]
    scores = judge(prompts, answers, reference=["2", "5"])
    assert judge.model == "math"  # the first listed: the default model
    expected = []
    for question, answer, reference in zip(["What is 1+1?", "What is 2+3?"], answers, ["2", "5"]):
        text = DEFAULT_RUBRIC.replace("{prompt}", question).replace("{completion}", answer).replace(
            "{reference}", reference)
        reply = client.chat.completions.create(model="math", messages=[{"role": "user", "content": text}],
                                               temperature=0, max_tokens=judge.max_tokens)
        expected.append(parse_score(reply.choices[0].message.content or ""))
    assert scores == expected and all(s is None or 0.0 <= s <= 1.0 for s in scores)


def _greedy_answers_one_at_a_time(url: str, cases, **body) -> dict:
    """{(model, prompt index): (reply text, finish reason, seconds)} for each case, one request after the other."""
    answers = {}
    for model, prompt in sorted(set(cases)):
        start = time.perf_counter()
        answer = httpx.post(url, json={"model": model, "messages": PROMPTS[prompt], **body}, headers=_auth(), timeout=120)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        answers[model, prompt] = choice["message"]["content"], choice["finish_reason"], time.perf_counter() - start
    # Each adapter answers each prompt differently, so an answer given to the wrong request would show.
    assert len({text for text, *_ in answers.values()}) == len(answers), answers
    return answers


def test_32_concurrent_requests(server):
    """32 requests at once over two adapters and three prompts: each gets exactly the greedy answer
    its adapter gives its prompt alone, so none is lost, cut short or swapped with another under load."""
    cases = [("math" if i % 2 else "poet", i % 3) for i in range(32)]
    alone = _greedy_answers_one_at_a_time(server + "/v1/chat/completions", cases, max_tokens=CONCURRENT_TOKENS)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300, headers=_auth()) as http:
            return await asyncio.gather(*(
                http.post(server + "/v1/chat/completions", json={
                    "model": model, "messages": PROMPTS[prompt], "max_tokens": CONCURRENT_TOKENS})
                for model, prompt in cases))

    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 32
    assert [a.json()["choices"][0]["message"]["content"] for a in answers] == [alone[case][0] for case in cases]


def test_cli_writes_a_serve_config(tmp_path, config, monkeypatch):
    from cluster.cli import main

    monkeypatch.delenv("API_PORT", raising=False)
    monkeypatch.delenv("API_HOST", raising=False)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({**config, "serve_num_replicas": 2, "serve_replica_resources": {"CPU": 2}}))
    out = tmp_path / "out" / "serve_config.yaml"
    assert main(["serve", str(cfg), "temperature=0", "--port", "9123", "--write-serve-config", str(out)]) == 0
    written = yaml.safe_load(out.read_text())
    (app,) = written["applications"]
    assert app["import_path"] == "cluster.serve.app:app_builder"
    assert app["args"] == {"config": str(cfg), "overrides": ["temperature=0"]}
    assert app["deployments"] == [{"name": "ChatServer", "max_ongoing_requests": 64, "num_replicas": 2,
                                   "ray_actor_options": {"num_cpus": 2}}]
    assert written["http_options"] == {"host": "127.0.0.1", "port": 9123}
    from cluster.serve.app import app_builder

    built = app_builder(app["args"])  # the import path builds without Ray running anything
    assert type(built).__name__ == "Application"


def _assert_ignore_eos_runs_to_max_tokens(url: str) -> None:
    """vLLM's ignore_eos, as benchmarks send it: every reply is max_tokens long, whole or streamed."""
    for prompt in PROMPTS:
        body = {"model": "math", "messages": prompt, "max_tokens": 24, "ignore_eos": True}
        answer = httpx.post(url, json=body, headers=_auth(), timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 24
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                          headers=_auth(), timeout=120) as streamed:
            chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["usage"]["completion_tokens"] == 24


def test_ignore_eos_runs_every_reply_to_max_tokens(server):
    _assert_ignore_eos_runs_to_max_tokens(server + "/v1/chat/completions")
