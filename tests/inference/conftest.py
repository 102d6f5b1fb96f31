"""Trained-looking outputs for the inference tests, made in seconds without a training run:
the tiny Qwen2 model (head size 32, so vLLM's CPU attention takes it) plus LoRA adapters with
random non-zero weights, saved the way a finetuning_type: lora run saves its output_dir."""

from __future__ import annotations

import os
import socket

import pytest
import yaml

BASE = "tiny:qwen2,num_heads=2"
TEMPLATE = "qwen"


def make_adapter_output(folder, seed: int, rank: int = 8, model=None) -> str:
    """An adapter folder like a LoRA sft run leaves: adapter, tokenizer with the training chat
    template, rayfactory_config.yaml naming the template. ``model``: a fitted PeftModel to save
    instead of a random adapter."""
    from registries.datasets.data_args import DataArguments
    from registries.templates.jinja import to_jinja
    from stages.run_args import ModelArguments
    from stages.loading import load_tokenizer_and_template, resolve_model_path

    tokenizer, template = load_tokenizer_and_template(ModelArguments(model_name_or_path=BASE), DataArguments(template=TEMPLATE))
    model = model if model is not None else _random_adapter(seed, rank)
    folder = str(folder)
    model.save_pretrained(folder)
    tokenizer.chat_template = to_jinja(template, tokenizer)
    tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "rayfactory_config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump({"model_name_or_path": resolve_model_path(BASE), "template": TEMPLATE,
                        "finetuning_type": "lora"}, f)
    return folder


def _random_adapter(seed: int, rank: int):
    """LoRA with random non-zero weights on the tiny base, large enough to change greedy replies."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from stages.loading import resolve_model_path

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(BASE), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                     "up_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_http(ray_session):
    """A Ray Serve HTTP proxy on 127.0.0.1 for a module's serve tests, which run their apps on it
    with ``serve_apps``. One per module, not per session: a test file that swaps the worker's Ray
    for a cluster of its own (tests/e2e/test_rl_placement.py) ends Serve with it, and a session-wide
    proxy left its URL pointing at nothing (CI of stop 67: refused connections)."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def serve_apps(serve_http: str, apps: dict):
    """Run ``apps`` ({name: (application, route_prefix)}) on the shared proxy; yield its URL, then
    delete them. For a module fixture: ``yield from serve_apps(serve_http, {...})``."""
    from ray import serve

    try:
        for name, (app, route_prefix) in apps.items():
            serve.run(app, name=name, route_prefix=route_prefix)
        _wait_for_routes(serve_http, {route for _, route in apps.values()})
        yield serve_http
    finally:
        for name in apps:
            serve.delete(name)


def _wait_for_routes(serve_http: str, routes: set[str], timeout_s: float = 60) -> None:
    """Block until the proxy answers and routes every prefix in ``routes``.

    ``serve.run`` returns once the replicas are healthy; the proxy learns the new routes a moment
    later, by long poll. When it never does, the error shows Serve's own view, which is how a proxy
    of a replaced Ray, listening elsewhere, was found (CI of stop 67)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            listed = httpx.get(serve_http + "/-/routes", timeout=10)
            if listed.status_code == 200 and routes <= set(listed.json()):
                return
            seen = listed.text[:300]
        except httpx.HTTPError as exc:
            seen = repr(exc)
        if time.monotonic() > deadline:
            from ray import serve

            raise AssertionError(f"the Serve proxy at {serve_http} did not route {sorted(routes)} within "
                                 f"{timeout_s:.0f} s; last answer: {seen}; serve.status(): {serve.status()}")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def adapter_outputs(tmp_path_factory):
    """Two adapters on the same base: {"math": path, "poet": path}."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter_output(root / name, seed) for name, seed in (("math", 1), ("poet", 2))}


@pytest.fixture(scope="session")
def base_model_path():
    from stages.loading import resolve_model_path

    return resolve_model_path(BASE)


PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "user", "content": "Say something about the sea."}],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
     {"role": "user", "content": "count to five"}],
]


# A tool the "tools" adapter learned to call: for TOOL_QUESTION it answers with this call, in the
# template's own tool-call format (qwen: <tool_call>{...}</tool_call>).
WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_QUESTION = "Weather in Paris?"
TOOL_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


def make_tool_caller_output(folder, steps: int = 300) -> str:
    """An adapter output that really calls WEATHER_TOOLS: LoRA fitted (in seconds) to answer
    TOOL_QUESTION, with the tools in the prompt, by the TOOL_CALL function turn, as sft would
    train on a tool-use row. Fails loudly if the fit does not take."""
    import json

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from registries.datasets.data_args import DataArguments
    from stages.run_args import ModelArguments
    from stages.loading import load_tokenizer_and_template, resolve_model_path

    tokenizer, template = load_tokenizer_and_template(ModelArguments(model_name_or_path=BASE), DataArguments(template=TEMPLATE))
    messages = [{"role": "user", "content": TOOL_QUESTION}, {"role": "function", "content": json.dumps(TOOL_CALL)}]
    prompt, response = template.encode_oneturn(tokenizer, messages, None, json.dumps(WEATHER_TOOLS))
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(BASE), dtype=torch.float32)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    ids = torch.tensor([prompt + response])
    labels = torch.tensor([[-100] * len(prompt) + response])
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        out = model(input_ids=ids, labels=labels)
        predicted = out.logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        if predicted == response:
            break
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    else:
        raise AssertionError(f"the tool-call adapter did not fit its one example in {steps} steps")
    return make_adapter_output(folder, seed=0, model=model)
