"""Do the vLLM engine's samples and transformers ``generate``'s come from the same distribution?

    .venv/bin/python benchmarks/sampler_parity.py                      # 32 prompts x 8, seeds 1 2 3
    .venv/bin/python benchmarks/sampler_parity.py --prompts 64 --seeds 1 2

The GRPO setting of vs_trl_grpo.py at its first step: SmolLM2-135M-Instruct (``demo:``), the first
``--prompts`` questions of ``arith_train`` in the model's chat template, 8 samples each of at most 32
tokens at temperature 1 (no top-k, no top-p), stopped at ``<|im_end|>``. Each (backend, seed) is a
child process: our VLLMEngine (float32, seeded at start, as the RL engine is) or our HFEngine on the
same weights (seeded per batch, as ``rollout_backend: hf`` is). Each is scored with the run's rewards
(``final_number`` + 0.5 x ``short_answer``).

Log-prob equality (engine against policy, 1e-4) says the two compute the same distribution; this
says whether they draw from it alike: mean reward, its parts, mean length and the share that stop
on their own, with a standard error over prompts (a prompt's samples are not independent draws).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from harness import REPO_ROOT, format_table, machine_line, write_json

MODEL = "demo:smollm2-135m-instruct"
SAMPLES, COMPLETION = 8, 32
REWARDS = {"final_number": 1.0, "short_answer": 0.5}  # the run's reward_funcs and reward_weights
COLUMNS = [("backend", "backend", "{}"), ("seeds", "seeds", "{}"), ("samples", "samples", "{}"),
           ("reward", "reward", "{}"), ("final_number", "final_number", "{}"), ("short_answer", "short_answer", "{}"),
           ("length", "length", "{}"), ("stopped", "stopped", "{}"), ("s / batch", "seconds", "{:.0f}")]


def sample(backend: str, prompts: int, seed: int) -> dict:
    """In the child: one batch from ``backend`` on the first ``prompts`` questions; per-prompt figures."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.engines.types import SamplingSpec
    from stages.loading import resolve_model_path
    from stages.rl.controller.rewards import load_reward_funcs

    path = resolve_model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with open(os.path.join(REPO_ROOT, "data", "arith_train.json"), encoding="utf-8") as f:
        rows = json.load(f)[:prompts]
    prompt_ids = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": r["instruction"]}],
                                                          add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False).input_ids for r in rows]
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    spec = SamplingSpec(n=SAMPLES, temperature=1.0, top_p=1.0, top_k=0, max_tokens=COMPLETION, stop_token_ids=(stop,),
                        seed=seed if backend == "hf" else None)
    if backend == "hf":
        from stages.engines.hf_backend import HFEngine

        engine = HFEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), pad_token_id=stop)
    else:
        from stages.engines.vllm_backend import VLLMEngine, VLLMEngineConfig

        engine = VLLMEngine(VLLMEngineConfig(model_path=path, max_model_len=128, kv_cache_bytes=1 << 30, seed=seed))
    start = time.perf_counter()
    completions = sorted(engine.generate_batch(prompt_ids, spec), key=lambda c: (c.prompt_index, c.index))
    seconds = time.perf_counter() - start
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    refs = [rows[c.prompt_index]["output"] for c in completions]
    scores = load_reward_funcs(list(REWARDS), list(REWARDS.values())).score(
        [""] * len(texts), texts, {"reference": refs, "completion_ids": [c.token_ids for c in completions]})
    per_sample = [{"prompt": c.prompt_index, "reward": total, "length": len(c.token_ids),
                   "stopped": float(c.finish_reason == "stop"),
                   **{name: scores.per_function[name][i] for name in REWARDS}}
                  for i, (c, total) in enumerate(zip(completions, scores.total))]
    return {"samples": per_sample, "seconds": seconds}


def summary(backend: str, seeds: list[int], runs: list[dict]) -> dict:
    """Each figure's mean over all samples, with the standard error of the per-prompt means
    (each (seed, prompt) a unit)."""
    row = {"backend": backend, "seeds": " ".join(map(str, seeds)),
           "samples": sum(len(r["samples"]) for r in runs), "seconds": statistics.mean(r["seconds"] for r in runs)}
    for key in ("reward", "final_number", "short_answer", "length", "stopped"):
        units = []
        for run in runs:
            by_prompt: dict[int, list[float]] = {}
            for s in run["samples"]:
                by_prompt.setdefault(s["prompt"], []).append(s[key])
            units += [statistics.mean(v) for v in by_prompt.values()]
        mean, error = statistics.mean(units), statistics.stdev(units) / len(units) ** 0.5
        row[key] = f"{mean:.3f} ± {error:.3f}"
        row[key + "_mean"], row[key + "_se"] = mean, error
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--backends", nargs="+", default=["vllm", "hf"], choices=["vllm", "hf"])
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # backend prompts seed
    args = parser.parse_args()
    if args.child:
        backend, prompts, seed = args.child
        print("RESULT " + json.dumps(sample(backend, int(prompts), int(seed))), flush=True)
        return 0
    rows = []
    for backend in args.backends:
        runs = []
        for seed in args.seeds:
            print(f"[bench] {backend} seed {seed} ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", backend, str(args.prompts), str(seed)],
                                 capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                raise SystemExit(f"{backend} seed {seed} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            runs.append(json.loads(lines[-1].removeprefix("RESULT ")))
        rows.append(summary(backend, args.seeds, runs))
    print(f"\n{machine_line()}\n{args.prompts} prompts x {SAMPLES} samples x {COMPLETION} tokens, seeds {args.seeds}\n")
    print(format_table(rows, COLUMNS))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
