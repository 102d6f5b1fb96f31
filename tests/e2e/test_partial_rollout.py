"""Partial rollouts on a real vLLM engine in a Ray actor: a weight push loaded between two decoding
steps of the generation in flight (stages/engines/inflight_weights.py).

What a token after the load must be, exactly: the new weights' prediction over a KV cache the old
weights computed for everything before it (the cache is kept, not recomputed). So each completion
is checked in two halves against HF: the tokens before the switch against the old weights alone,
the tokens after it against the new weights run on top of the old weights' cache of the prefix, to
1e-4; the new weights alone, recomputing that prefix, are off by more than 1e-2 (the negative
control that shows the cache was kept). Both transports are checked, the object store's and the
collective (gloo) one's.
"""

from __future__ import annotations

import copy
import importlib.util
import time

import pytest
import ray
import torch

from stages.engines.types import SamplingSpec
from tests.ci import skip_or_fail_in_ci
from tests.e2e.test_rollout_sync import MATCH, MISMATCH, big_step, hf_model, model_path  # noqa: F401 (fixture)

pytestmark = pytest.mark.ray

PROMPTS = [[1, 20, 30, 40], [1, 50], [7, 8, 9, 10, 11, 12]]
# No stop tokens: every sample runs its whole budget, so the push lands inside every one of them.
LONG = SamplingSpec(n=2, temperature=1.0, max_tokens=110, seed=0, logprobs=0)


@pytest.fixture(scope="module")
def engine(ray_session, model_path):  # noqa: F811
    if importlib.util.find_spec("vllm") is None:
        skip_or_fail_in_ci("vllm is not installed (pip install -e .[vllm])")
    from fabric.rollout import RolloutActor, engine_runtime_env, rollout_class_options
    from stages.engines.vllm_backend import VLLMEngineConfig

    config = VLLMEngineConfig(model_path=str(model_path), kv_cache_bytes=64 << 20, max_model_len=128)
    actor_class = ray.remote(**rollout_class_options(True))(RolloutActor)
    actor = actor_class.options(num_cpus=1, runtime_env=engine_runtime_env()).remote(config)
    assert ray.get(actor.ready.remote(), timeout=300)
    yield actor
    ray.kill(actor)


def weights_thread(engine, method: str):
    from fabric.rollout import WEIGHTS_GROUP

    return getattr(engine, method).options(concurrency_group=WEIGHTS_GROUP)


def generate_then_push(engine, sync, model, after_loads: int, push_at_step: int = 5):
    """Start a long batch; once it has decoded ``push_at_step`` steps, push ``model`` in flight."""
    start = ray.get(weights_thread(engine, "steps_taken").remote())
    batch = engine.generate_timed.remote(PROMPTS, LONG, after_loads)
    deadline = time.monotonic() + 120
    while ray.get(weights_thread(engine, "steps_taken").remote()) < start + push_at_step:
        assert time.monotonic() < deadline, "the batch never started decoding"
        time.sleep(0.002)
    loads = sync.start(model, [engine])
    completions, _, _ = ray.get(batch, timeout=120)
    ray.get(loads, timeout=120)
    return completions


def split(completion, new_version: int) -> int:
    """Where the new weights took over: the first token stamped ``new_version`` (the stamps go
    old, old, ..., new, new)."""
    versions = completion.versions
    assert len(versions) == len(completion.token_ids) == LONG.max_tokens
    switch = versions.index(new_version)
    assert set(versions[:switch]) == {new_version - 1} and set(versions[switch:]) == {new_version}
    return switch


@torch.no_grad()
def token_logprobs(model, prompt: list[int], tokens: list[int], cache_from=None, cached: int = 0) -> torch.Tensor:
    """log p(tokens | prompt) under ``model``; with ``cache_from``, the KV cache of the prompt and
    the first ``cached`` - 1 tokens is ``cache_from``'s, and ``model`` predicts tokens[cached:]."""
    if cache_from is None:
        ids = torch.tensor([prompt + tokens])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    prefix = cache_from(input_ids=torch.tensor([prompt + tokens[:cached - 1]]), use_cache=True)
    rest = model(input_ids=torch.tensor([tokens[cached - 1:]]), past_key_values=prefix.past_key_values)
    logits = rest.logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens[cached:])[:, None])[:, 0]


def check_switch(completions, old, new, new_version: int) -> None:
    """Every completion: old weights before the switch, new weights over the old cache after it."""
    assert len(completions) == len(PROMPTS) * LONG.n
    kept_cache_gap = 0.0
    for c in completions:
        prompt, switch = PROMPTS[c.prompt_index], split(c, new_version)
        assert 0 < switch < LONG.max_tokens  # the push landed inside the batch
        sampled = torch.tensor(c.logprobs)
        before = token_logprobs(old, prompt, c.token_ids[:switch])
        assert (sampled[:switch] - before).abs().max().item() < MATCH
        after = token_logprobs(new, prompt, c.token_ids, cache_from=old, cached=switch)
        assert (sampled[switch:] - after).abs().max().item() < MATCH
        recomputed = token_logprobs(new, prompt, c.token_ids)[switch:]
        kept_cache_gap = max(kept_cache_gap, (sampled[switch:] - recomputed).abs().max().item())
    assert kept_cache_gap > MISMATCH  # the new weights alone would have predicted otherwise


def test_object_store_push_lands_between_two_decoding_steps(engine, model_path):  # noqa: F811
    from fabric.weight_sync import ObjectStoreSync

    sync = ObjectStoreSync(in_flight=True)
    old = hf_model(model_path)
    big_step(old, seed=21)
    ray.get(sync.start(old, [engine]), timeout=120)  # in-flight load 1, with nothing in flight
    new = copy.deepcopy(old)
    big_step(new, seed=22)
    completions = generate_then_push(engine, sync, new, after_loads=sync.loads_sent)
    check_switch(completions, old, new, new_version=sync.loads_sent)
    assert ray.get(weights_thread(engine, "loads_done").remote()) == sync.loads_sent == 2


def test_a_batch_waits_for_the_pushes_sent_before_it(engine, model_path):  # noqa: F811
    """A batch is stamped with the pushes sent before it, so it must not start before they are
    loaded: here it is sent first and waits; the push then arrives and every token is the new
    weights'."""
    from fabric.weight_sync import ObjectStoreSync

    sync = ObjectStoreSync(in_flight=True)
    sync.loads_sent = ray.get(weights_thread(engine, "loads_done").remote())  # this engine's count so far
    model = hf_model(model_path)
    big_step(model, seed=23)
    batch = engine.generate_timed.remote(PROMPTS, LONG, sync.loads_sent + 1)
    ready, _ = ray.wait([batch], timeout=1.0)
    assert not ready  # waiting for push loads_sent + 1
    ray.get(sync.start(model, [engine]), timeout=120)
    completions, _, _ = ray.get(batch, timeout=120)
    for c in completions:
        assert set(c.versions) == {sync.loads_sent}
        mine = token_logprobs(model, PROMPTS[c.prompt_index], c.token_ids)
        assert (torch.tensor(c.logprobs) - mine).abs().max().item() < MATCH


def test_collective_push_lands_between_two_decoding_steps(engine, model_path):  # noqa: F811
    from fabric.actor_group import RoleWorker
    from fabric.weight_sync import CollectiveSync, WeightSender

    host, port = RoleWorker.address_and_free_port(None)
    joined = engine.join_weight_group.remote(host, port, 1, 2, "gloo")
    sender = WeightSender()
    sender.join(host, port, 2, "gloo")
    ray.get(joined, timeout=60)
    sync = CollectiveSync("gloo", in_flight=True)
    sync.loads_sent = ray.get(weights_thread(engine, "loads_done").remote())

    old = hf_model(model_path)
    big_step(old, seed=24)
    ray.get(sync.start(sender.send(old, bucket_bytes=1 << 14), [engine]), timeout=120)
    new = copy.deepcopy(old)
    big_step(new, seed=25)

    class Packing:  # the controller's order: the policy packs (and broadcasts behind), the engines receive
        def start(self, model, engines):
            return sync.start(sender.send(model, bucket_bytes=1 << 14), engines)

    completions = generate_then_push(engine, Packing(), new, after_loads=sync.loads_sent)
    sender.flush()
    check_switch(completions, old, new, new_version=sync.loads_sent)
