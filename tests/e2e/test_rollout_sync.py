"""A real vLLM (CPU build) engine in a Ray actor: what it samples, and that a weight push is real.

"Real" is checked the strict way: after a large training step and a push, the engine's own
log-probs of what it samples equal the trained HF model's (``completion_logprobs``) to 1e-4;
after another large step without a push they are off by more than 1e-2. One engine serves the
whole module (start-up costs seconds); every test pushes the weights it needs first.
"""

from __future__ import annotations

import importlib.util

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from registries.models.tiny import tiny_model_path
from stages.rl.workers.logprobs import completion_logprobs
from stages.engines.types import SamplingSpec
from tests.ci import skip_or_fail_in_ci

# head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... only.
MODEL = dict(hidden_size=64, num_heads=2)
PROMPTS = [[1, 20, 30, 40], [1, 50], [7, 8, 9, 10, 11, 12]]
SAMPLE = SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=0)
MATCH, MISMATCH = 1e-4, 1e-2


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path("qwen2", **MODEL)


@pytest.fixture(scope="module")
def engine(ray_session, model_path):
    if importlib.util.find_spec("vllm") is None:
        message = "vllm is not installed (pip install -e .[vllm])"
        skip_or_fail_in_ci(message)
    from fabric.rollout import engine_runtime_env
    from stages.engines.vllm_backend import VLLMEngine, VLLMEngineConfig

    config = VLLMEngineConfig(model_path=str(model_path), kv_cache_bytes=64 << 20, max_model_len=128)
    actor = ray.remote(VLLMEngine).options(num_cpus=1, runtime_env=engine_runtime_env()).remote(config)
    assert ray.get(actor.ready.remote(), timeout=300)
    yield actor
    ray.kill(actor)


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def big_step(model, seed: int, lr: float = 3.0) -> None:
    """One plain SGD step on next-token loss over random text, large enough to move every
    sampled token's log-prob by far more than the tolerance."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (4, 24), generator=generator)
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.sub_(lr * param.grad)
    model.zero_grad()


def engine_vs_hf(engine, model, sampling: SamplingSpec = SAMPLE) -> float:
    """Largest |engine log-prob - HF log-prob (temperature 1)| over what the engine samples now."""
    completions = ray.get(engine.generate_batch.remote(PROMPTS, sampling))
    with torch.no_grad():
        ours = completion_logprobs(model, [PROMPTS[c.prompt_index] for c in completions],
                                   [c.token_ids for c in completions], pad_token_id=0)
    return max((torch.tensor(c.logprobs) - mine).abs().max().item() for c, mine in zip(completions, ours))


def test_generate_returns_n_completions_per_prompt_with_stop_tokens_kept(engine):
    stop = tuple(range(100, 300))  # ~a fifth of the vocabulary: some completions stop, some run out
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=10, stop_token_ids=stop, seed=7)
    completions = ray.get(engine.generate_batch.remote(PROMPTS, spec))
    assert [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs)
        assert not any(t in stop for t in c.token_ids[:-1])
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in stop  # the stop token is part of the completion
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 10 and c.token_ids[-1] not in stop
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    # each prompt (and each of its samples) has its own random stream; the same seed repeats it
    assert len({tuple(c.token_ids[:3]) for c in completions}) == len(completions)
    assert ray.get(engine.generate_batch.remote(PROMPTS, spec)) == completions


def test_object_store_push_makes_the_engine_sample_from_the_trained_weights(engine, model_path):
    from fabric.weight_sync import ObjectStoreSync

    model = hf_model(model_path)
    big_step(model, seed=1)
    stats = ObjectStoreSync().push(model, [engine])
    assert stats.bytes > sum(p.numel() for p in model.parameters()) * 4 and stats.load_seconds > 0
    assert engine_vs_hf(engine, model) < MATCH
    # raw log-probs: of the model itself, whatever temperature / top-k / top-p sampled them
    assert engine_vs_hf(engine, model, SamplingSpec(n=2, temperature=0.6, top_p=0.8, top_k=50, seed=1)) < MATCH

    big_step(model, seed=2)  # no push: the engine still samples from the previous weights
    assert engine_vs_hf(engine, model) > MISMATCH


def test_lora_policy_is_pushed_merged_and_keeps_training_unchanged(engine, model_path):
    from peft import LoraConfig, get_peft_model

    from fabric.weight_sync import ObjectStoreSync

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)  # B != 0
    policy = get_peft_model(hf_model(model_path), config).eval()
    big_step(policy, seed=3)
    probe = torch.tensor([[1, 20, 30, 40, 50, 60]])
    with torch.no_grad():
        before = policy(input_ids=probe).logits
    trainable = {n: p.detach().clone() for n, p in policy.named_parameters()}

    ObjectStoreSync().push(policy, [engine])  # export_state_dict: merge, read, restore
    with torch.no_grad():
        assert torch.equal(policy(input_ids=probe).logits, before)
    assert all(torch.equal(p, trainable[n]) for n, p in policy.named_parameters())
    assert engine_vs_hf(engine, policy) < MATCH

    big_step(policy, seed=4)
    assert engine_vs_hf(engine, policy) > MISMATCH


@pytest.fixture(scope="module")
def lora_engine(ray_session, model_path):
    """An engine that samples through the adapters pushed to it (rollout_lora_rank)."""
    if importlib.util.find_spec("vllm") is None:
        skip_or_fail_in_ci("vllm is not installed (pip install -e .[vllm])")
    from fabric.rollout import engine_runtime_env
    from stages.engines.vllm_backend import VLLMEngine, VLLMEngineConfig

    config = VLLMEngineConfig(model_path=str(model_path), kv_cache_bytes=64 << 20, max_model_len=128,
                              rollout_lora_rank=4)
    actor = ray.remote(VLLMEngine).options(num_cpus=1, runtime_env=engine_runtime_env()).remote(config)
    assert ray.get(actor.ready.remote(), timeout=300)
    yield actor
    ray.kill(actor)


def test_adapter_only_push_serves_the_lora_policy_beside_an_untouched_base(lora_engine, model_path):
    """rollout_lora_sync adapter: only the adapter travels (a few KB here against the model's
    bytes), the engine's log-probs equal the LoRA policy's after each push, a stale adapter is
    visibly off, and a second push replaces the first (not served from vLLM's cache of it)."""
    from peft import LoraConfig, get_peft_model

    from fabric.weight_sync import ObjectStoreSync

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)  # B != 0
    policy = get_peft_model(hf_model(model_path), config).eval()
    base = hf_model(model_path)
    assert engine_vs_hf(lora_engine, base) < MATCH  # nothing pushed yet: the bare base
    big_step(policy, seed=5, lr=0.5)  # LoRA on the toy moves log-probs far at this rate
    sync = ObjectStoreSync(payload="adapter")
    stats = sync.push(policy, [lora_engine])
    adapter_numel = sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n)
    assert adapter_numel * 4 <= stats.bytes < sum(p.numel() for p in base.parameters()) * 4 / 4
    assert engine_vs_hf(lora_engine, policy) < MATCH
    assert engine_vs_hf(lora_engine, base) > MISMATCH  # it samples through the adapter, not the base

    big_step(policy, seed=6, lr=0.5)  # not pushed: the engine serves the previous adapter
    assert engine_vs_hf(lora_engine, policy) > MISMATCH
    sync.push(policy, [lora_engine])  # a new version, a new LoRA id: served, not the cached first one
    assert engine_vs_hf(lora_engine, policy) < MATCH


@pytest.fixture(scope="module")
def sender(engine):
    """This test process as the policy's rank 0 of a gloo weight group with the engine (the
    ``rollout_weight_sync: collective`` path; NCCL differs in the backend name only)."""
    from fabric.actor_group import RoleWorker
    from fabric.weight_sync import WeightSender

    host, port = RoleWorker.address_and_free_port(None)
    joined = engine.join_weight_group.remote(host, port, 1, 2, "gloo")
    sender = WeightSender()
    sender.join(host, port, 2, "gloo")  # returns once the engine has joined too
    ray.get(joined, timeout=60)
    yield sender
    sender.flush()


def collective_push(sender, engine, model, bucket_bytes=1 << 14) -> float:
    from fabric.weight_sync import CollectiveSync

    plan = sender.send(model, bucket_bytes=bucket_bytes)
    assert len(plan) > 1 or bucket_bytes > plan[0].nbytes  # small buckets: their boundaries are crossed
    (seconds,) = ray.get(CollectiveSync("gloo").start(plan, [engine]), timeout=120)
    return seconds


def test_collective_push_makes_the_engine_sample_from_the_trained_weights(engine, sender, model_path):
    model = hf_model(model_path)
    big_step(model, seed=11)
    assert engine_vs_hf(engine, model) > MISMATCH  # the engine holds other weights before the push
    assert collective_push(sender, engine, model) > 0
    assert engine_vs_hf(engine, model) < MATCH

    big_step(model, seed=12)  # no push: the engine still samples from the previous weights
    assert engine_vs_hf(engine, model) > MISMATCH
    collective_push(sender, engine, model, bucket_bytes=64 << 20)  # the whole model in one bucket
    assert engine_vs_hf(engine, model) < MATCH


def test_collective_pushes_are_snapshots_received_in_the_order_sent(engine, sender, model_path):
    """An asynchronous run queues a push while the engine is busy and trains on: the buckets hold
    the weights as they were when sent, and two queued pushes arrive in order."""
    import copy

    model = hf_model(model_path)
    big_step(model, seed=13)
    first = sender.send(model, bucket_bytes=1 << 14)
    as_sent = copy.deepcopy(model)
    big_step(model, seed=14)  # the policy trains on before the engine has received anything
    second = sender.send(model, bucket_bytes=1 << 14)
    ray.get(engine.receive_weights.remote(first), timeout=120)
    assert engine_vs_hf(engine, as_sent) < MATCH
    assert engine_vs_hf(engine, model) > MISMATCH
    ray.get(engine.receive_weights.remote(second), timeout=120)
    assert engine_vs_hf(engine, model) < MATCH


def test_collective_push_of_a_lora_policy_is_merged_and_leaves_it_unchanged(engine, sender, model_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    policy = get_peft_model(hf_model(model_path), config).eval()
    big_step(policy, seed=15)
    trainable = {n: p.detach().clone() for n, p in policy.named_parameters()}
    collective_push(sender, engine, policy)
    assert all(torch.equal(p, trainable[n]) for n, p in policy.named_parameters())
    assert engine_vs_hf(engine, policy) < MATCH
