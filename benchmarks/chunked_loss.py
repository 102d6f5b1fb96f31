"""Peak memory and step time of the causal-LM loss, plain vs chunked (stages/training/chunked_loss.py).

    .venv/bin/python benchmarks/chunked_loss.py [--threads 2] [--steps 4] [--tokens 2048]

A random-init Llama (hidden 256, 4 layers, MLP 1024, vocabulary 49152, untied head: 29M
parameters) trains on one row of ``--tokens`` tokens, every token labelled: forward + backward
+ AdamW. Each case runs in a child process of its own, so its peak RSS (getrusage) is its alone;
``step peak`` is that peak less the RSS before the first step (model, AdamW states after one
warm-up step excluded: the memory the step itself needs). On a GPU, torch's peak allocation
instead. Figures, not asserts.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from harness import machine_line  # noqa: F401 (sets up the import path)

CASES = {"plain": None, "chunked (auto: 1365 tokens)": 0, "chunked (256 tokens)": 256}
MIB = 2**20


def run_case(chunk: int | None, tokens: int, steps: int, threads: int) -> dict:
    import contextlib

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.training.chunked_loss import chunk_tokens_for, chunked_head_loss

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens,
                         tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
    batch = {"input_ids": ids, "labels": ids}
    size = None if chunk is None else chunk_tokens_for(config.vocab_size, chunk or None)

    def step() -> float:
        start = time.perf_counter()
        with chunked_head_loss(model, size) if size else contextlib.nullcontext():
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, loss.item()

    step()  # warm-up: AdamW allocates its states
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_now()
    times, losses = zip(*(step() for _ in range(steps)))
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"chunk_tokens": size, "peak_mib": peak / MIB, "step_peak_mib": (peak - before) / MIB,
            "ms_per_step": 1000 * sum(times) / len(times), "loss": losses[0], "device": device,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process's one case
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(run_case(CASES[args.case], args.tokens, args.steps, args.threads)))
        return 0
    print(machine_line())
    print(f"{args.tokens} tokens a step, vocabulary 49152, {args.threads} threads")
    print("| loss | peak RSS | step peak | ms a step | first loss |\n|---|---|---|---|---|")
    for name in CASES:
        done = subprocess.run([sys.executable, __file__, "--case", name, "--tokens", str(args.tokens),
                               "--steps", str(args.steps), "--threads", str(args.threads)],
                              capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['peak_mib']:.0f} MiB | {r['step_peak_mib']:.0f} MiB | {r['ms_per_step']:.0f} | "
              f"{r['loss']:.6f} |")
    print(f"({r['params_m']:.1f}M parameters, on {r['device']}; peaks are torch's allocations on a GPU, RSS on CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
