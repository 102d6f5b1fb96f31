"""Rollout speed of a vLLM engine against transformers ``generate``, and the cost of a weight sync.

    .venv/bin/python benchmarks/rollout_sync.py                 # both models, ~2 min here
    .venv/bin/python benchmarks/rollout_sync.py --models tiny --repeats 2
    .venv/bin/python benchmarks/rollout_sync.py --sync-only tiny,20m,smollm2   # object store vs collective

For each model (``tiny``: the Qwen2-style test model, hidden 64, head_dim 32, 0.2M params;
``20m``: the ~20M-parameter one of train_throughput.py), on a local Ray:

* **rollout tokens/s**: 32 prompts of 16 random tokens, n=4 samples each, exactly 32 new tokens
  per sample (no stop tokens; HF with ``min_new_tokens``), temperature 1; new tokens / wall
  seconds, the best of ``--repeats`` timed calls after one warm-up call. vLLM runs in a
  ``VLLMEngine`` actor with ``num_cpus=1`` (Ray sets OMP_NUM_THREADS=1 in it); HF ``generate``
  runs in this process on one torch thread, all 128 sequences in one left-padded batch.
* **sync**: ``ObjectStoreSync().push(model, [engine])`` of the fp32 weights: export + safetensors
  + ray.put + the engine's reload (``load``); the median of ``--repeats`` pushes, and per MB.
* **LoRA sync** (second table): a LoRA r16 policy on every linear layer, pushed merged (the full
  weights, as ``rollout_lora_sync: merged``) and as the adapter alone (``rollout_lora_sync:
  adapter``, into an engine built with ``rollout_lora_rank``); medians of ``--repeats`` pushes,
  and the rollout tokens/s of that engine through the adapter (vLLM's CPU LoRA kernels) against
  the plain engine's.
* **object store vs collective** (``--sync-only``): the same fp32 weights pushed through the
  object store and broadcast over a gloo weight group (``rollout_weight_sync: collective``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from harness import MODEL_20M, format_table, machine_line  # noqa: E402

MODELS = {"tiny": dict(hidden_size=64, num_heads=2), "20m": MODEL_20M}
MODEL_NAMES = {"tiny": "tiny:qwen2,hidden_size=64,num_heads=2",
               "20m": "tiny:qwen2,hidden_size=512,num_layers=6,num_heads=8,intermediate_size=1536",
               "smollm2": "demo:smollm2-135m-instruct"}
PROMPTS, N, NEW_TOKENS, PROMPT_LEN = 32, 4, 32, 16
COLUMNS = [
    ("model", "model", "{}"), ("params", "params_m", "{:.2f}M"), ("engine start", "start_s", "{:.1f} s"),
    ("vLLM tokens/s", "vllm_tps", "{:,.0f}"), ("HF generate tokens/s", "hf_tps", "{:,.0f}"),
    ("vLLM / HF", "speedup", "{:.1f}x"), ("weights", "mb", "{:.1f} MB"), ("sync", "sync_s", "{:.3f} s"),
    ("of which load", "load_s", "{:.3f} s"), ("sync per MB", "s_per_mb", "{:.4f} s"),
]


def bench_model(name: str, repeats: int) -> dict:
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from fabric.rollout import engine_runtime_env
    from fabric.weight_sync import ObjectStoreSync
    from registries.models.tiny import tiny_model_path
    from stages.engines.types import SamplingSpec
    from stages.engines.vllm_backend import VLLMEngine, VLLMEngineConfig

    path = tiny_model_path("qwen2", **MODELS[name])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, model.config.vocab_size, (PROMPTS, PROMPT_LEN), generator=generator).tolist()
    new_tokens = PROMPTS * N * NEW_TOKENS

    start = time.perf_counter()
    config = VLLMEngineConfig(model_path=str(path), kv_cache_bytes=256 << 20, max_model_len=PROMPT_LEN + NEW_TOKENS)
    engine = ray.remote(VLLMEngine).options(num_cpus=1, runtime_env=engine_runtime_env()).remote(config)
    ray.get(engine.ready.remote())
    start_s = time.perf_counter() - start

    spec = SamplingSpec(n=N, temperature=1.0, max_tokens=NEW_TOKENS, seed=0)
    vllm_times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        out = ray.get(engine.generate_batch.remote(prompts, spec))
        vllm_times.append(time.perf_counter() - t)
        assert sum(len(c.token_ids) for c in out) == new_tokens
    torch.set_num_threads(1)
    ids = torch.tensor(prompts)
    hf_times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=None, num_return_sequences=N, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, pad_token_id=0)
            hf_times.append(time.perf_counter() - t)
            assert out[:, PROMPT_LEN:].numel() == new_tokens
    torch.set_num_threads(os.cpu_count() or 1)

    pushes = [ObjectStoreSync().push(model, [engine]) for _ in range(repeats + 1)][1:]
    ray.kill(engine)
    mb = pushes[0].bytes / 2**20
    sync_s = statistics.median(p.seconds for p in pushes)
    vllm_tps, hf_tps = new_tokens / min(vllm_times[1:]), new_tokens / min(hf_times[1:])
    return dict(model=name, params_m=sum(p.numel() for p in model.parameters()) / 1e6, start_s=start_s,
                vllm_tps=vllm_tps, hf_tps=hf_tps, speedup=vllm_tps / hf_tps, mb=mb, sync_s=sync_s,
                load_s=statistics.median(p.load_seconds for p in pushes), s_per_mb=sync_s / mb)


LORA_COLUMNS = [
    ("model", "model", "{}"), ("merged push", "merged_mb", "{:.1f} MB"), ("merged sync", "merged_s", "{:.3f} s"),
    ("adapter push", "adapter_mb", "{:.2f} MB"), ("adapter sync", "adapter_s", "{:.3f} s"),
    ("sync ratio", "ratio", "{:.1f}x"), ("tokens/s through the adapter", "lora_tps", "{:,.0f}"),
    ("tokens/s plain", "plain_tps", "{:,.0f}"),
]


def bench_lora(name: str, repeats: int, plain_tps: float) -> dict:
    import ray
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fabric.rollout import engine_runtime_env
    from fabric.weight_sync import ObjectStoreSync
    from registries.models.tiny import tiny_model_path
    from stages.engines.types import SamplingSpec
    from stages.engines.vllm_backend import VLLMEngine, VLLMEngineConfig

    path = tiny_model_path("qwen2", **MODELS[name])
    torch.manual_seed(0)
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                            LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    config = VLLMEngineConfig(model_path=str(path), kv_cache_bytes=256 << 20, max_model_len=PROMPT_LEN + NEW_TOKENS,
                              rollout_lora_rank=16)
    engine = ray.remote(VLLMEngine).options(num_cpus=1, runtime_env=engine_runtime_env()).remote(config)
    ray.get(engine.ready.remote())
    merged = [ObjectStoreSync().push(policy, [engine]) for _ in range(repeats + 1)][1:]
    adapter = [ObjectStoreSync(payload="adapter").push(policy, [engine]) for _ in range(repeats + 1)][1:]
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, policy.config.vocab_size, (PROMPTS, PROMPT_LEN), generator=generator).tolist()
    spec = SamplingSpec(n=N, temperature=1.0, max_tokens=NEW_TOKENS, seed=0)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        ray.get(engine.generate_batch.remote(prompts, spec))
        times.append(time.perf_counter() - t)
    ray.kill(engine)
    merged_s, adapter_s = statistics.median(p.seconds for p in merged), statistics.median(p.seconds for p in adapter)
    return dict(model=name, merged_mb=merged[0].bytes / 2**20, merged_s=merged_s, adapter_mb=adapter[0].bytes / 2**20,
                adapter_s=adapter_s, ratio=merged_s / adapter_s, lora_tps=PROMPTS * N * NEW_TOKENS / min(times[1:]),
                plain_tps=plain_tps)


SYNC_COLUMNS = [
    ("model", "model", "{}"), ("weights", "mb", "{:.1f} MB"), ("object store", "store_s", "{:.3f} s"),
    ("per MB", "store_per_mb", "{:.4f} s"), ("collective (gloo)", "coll_s", "{:.3f} s"),
    ("per MB", "coll_per_mb", "{:.4f} s"), ("of which load", "coll_load_s", "{:.3f} s"),
    ("store / collective", "ratio", "{:.2f}x"),
]


def bench_sync(name: str, repeats: int) -> dict:
    """One engine, the same fp32 model pushed ``repeats`` (+1 warm-up) times each way from this
    process: ``ObjectStoreSync.push`` (export, safetensors, ray.put, the engine's load) against
    the collective path (``WeightSender.send``: export and pack into 64 MiB buckets, then the gloo
    broadcast straight into the engine's ``load_weights``), as ``rollout_weight_sync: collective``."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from fabric.actor_group import RoleWorker
    from fabric.rollout import engine_runtime_env
    from fabric.weight_sync import CollectiveSync, ObjectStoreSync, WeightSender
    from stages.engines.vllm_backend import VLLMEngine, VLLMEngineConfig
    from stages.loading import resolve_model_path

    path = resolve_model_path(MODEL_NAMES[name])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = VLLMEngineConfig(model_path=str(path), kv_cache_bytes=256 << 20, max_model_len=PROMPT_LEN + NEW_TOKENS)
    engine = ray.remote(VLLMEngine).options(num_cpus=1, runtime_env=engine_runtime_env()).remote(config)
    ray.get(engine.ready.remote())
    store = [ObjectStoreSync().push(model, [engine]) for _ in range(repeats + 1)][1:]

    host, port = RoleWorker.address_and_free_port(None)
    joined = engine.join_weight_group.remote(host, port, 1, 2, "gloo")
    sender = WeightSender()
    sender.join(host, port, 2, "gloo")
    ray.get(joined)
    collective, loads = [], []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        plan = sender.send(model)
        loads.append(ray.get(CollectiveSync("gloo").start(plan, [engine]))[0])
        collective.append(time.perf_counter() - t)
    ray.kill(engine)
    mb = store[0].bytes / 2**20
    store_s, coll_s = statistics.median(p.seconds for p in store), statistics.median(collective[1:])
    return dict(model=name, mb=mb, store_s=store_s, store_per_mb=store_s / mb, coll_s=coll_s, coll_per_mb=coll_s / mb,
                coll_load_s=statistics.median(loads[1:]), ratio=store_s / coll_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync-only", default=None,
                        help="only the object store vs collective table, for these models (of "
                             f"{list(MODEL_NAMES)}, comma-separated)")
    args = parser.parse_args()

    from fabric.ray_args import RayArguments
    from fabric.ray_session import connect

    connect(RayArguments(ray_num_cpus=4))
    if args.sync_only:
        sync = [bench_sync(name, args.repeats) for name in args.sync_only.split(",")]
        print(f"\n{machine_line()}\n")
        print(format_table(sync, SYNC_COLUMNS))
        return
    results = [bench_model(name, args.repeats) for name in args.models.split(",")]
    lora = [bench_lora(r["model"], args.repeats, r["vllm_tps"]) for r in results]
    print(f"\n{machine_line()}\n")
    print(format_table(results, COLUMNS))
    print()
    print(format_table(lora, LORA_COLUMNS))


if __name__ == "__main__":
    main()
