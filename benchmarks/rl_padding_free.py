"""Tokens/s of the GRPO policy update, padded micro-batches against padding-free ones.

    .venv/bin/python benchmarks/rl_padding_free.py                  # ~30 s on 2 CPU cores
    .venv/bin/python benchmarks/rl_padding_free.py --max-completion 32 --updates 5

The policy of configs/grpo_full.yaml (tiny Qwen2-style model, full fine-tuning, beta > 0, its
per_device_train_batch_size) built in this process without Ray (stages/rl/workers/policy.py), updated on
one step's batch of that config's shape: rollout_batch_size x num_generations = 64 samples, prompts
of 20-40 random ids, completions of uneven length, uniform in 1..--max-completion (the config's
own max_completion_length is 8; longer ones show what the padding costs). Each layout gets the
same samples, one warm-up update, then --updates timed ones, taken in turns with the other
layouts' (the fastest and the median); tokens/s counts real tokens
(prompt + completion) of the batch per update second. Also with a token budget
(max_tokens_per_micro_batch), padded (rows x the longest) and padding-free (real tokens).
The old-log-prob pass (the reference's is the same code on the frozen copy) is timed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402
import yaml  # noqa: E402

from harness import format_table, machine_line  # noqa: E402

CONFIG = os.path.join(REPO_ROOT, "configs", "grpo_full.yaml")
COLUMNS = [("layout", "layout", "{}"), ("micro-batches", "micro_batches", "{}"),
           ("update s (min / median)", "update_s", "{}"), ("update tokens/s (best)", "update_tps", "{:,.0f}"),
           ("log-prob pass s (min / median)", "logprobs_s", "{}"), ("log-prob tokens/s (best)", "logprobs_tps", "{:,.0f}")]


def policy(out_dir: str, **overrides):
    from cluster.config import load_config
    from stages.rl.workers.policy import PolicyWorker

    with open(CONFIG) as f:
        config = yaml.safe_load(f)
    config.update(rollout_backend="hf", output_dir=out_dir, dataset_dir=os.path.join(REPO_ROOT, "data"),
                  eval_dataset=None, **overrides)
    worker = PolicyWorker(load_config({k: v for k, v in config.items() if v is not None}).job_spec())
    worker.setup(0, 1, total_updates=100)
    return worker, config


def samples(count: int, max_completion: int, seed: int = 0):
    from stages.rl.config.types import RolloutSample

    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(5, 900, (int(torch.randint(20, 41, (1,), generator=generator)),), generator=generator)
        length = int(torch.randint(1, max_completion + 1, (1,), generator=generator))
        completion = torch.randint(5, 900, (length,), generator=generator)
        out.append(RolloutSample(prompt.tolist(), completion.tolist(), group=i // 8,
                                 advantage=float(torch.randn(1, generator=generator))))
    return out


def measure(layouts: dict[str, dict], max_completion: int, updates: int) -> list[dict]:
    """Every layout's policy is built first, then the timed updates and log-prob passes go round
    the layouts in turn: a machine shared with other work slows them alike. The fastest of each
    layout's runs is the least disturbed one (tokens/s from it); the median is printed beside it."""
    from stages.rl.algorithms.grpo_math import loss_normalizer

    with tempfile.TemporaryDirectory() as out_dir:
        workers = {name: policy(os.path.join(out_dir, str(i)), max_completion_length=max_completion, **overrides)
                   for i, (name, overrides) in enumerate(layouts.items())}
        config = next(iter(workers.values()))[1]
        batch = samples(config["rollout_batch_size"] * config["num_generations"], max_completion)
        tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch)
        norm = loss_normalizer(config["loss_type"], [len(s.completion_ids) for s in batch], max_completion)
        reference = next(iter(workers.values()))[0].reference_logprobs(batch)  # beta > 0: the KL term reads them
        for sample, ref in zip(batch, reference):
            sample.ref_logprobs = ref
        times: dict[str, dict[str, list[float]]] = {name: {"update": [], "logprobs": []} for name in workers}
        reports = {name: worker.update(batch, norm) for name, (worker, _) in workers.items()}  # warm-up
        for _ in range(updates):
            for name, (worker, _) in workers.items():
                start = time.perf_counter()
                worker.update(batch, norm)
                times[name]["update"].append(time.perf_counter() - start)
                start = time.perf_counter()
                worker.logprobs(batch)
                times[name]["logprobs"].append(time.perf_counter() - start)
    def spread(seconds: list[float]) -> str:
        return f"{min(seconds):.3f} / {statistics.median(seconds):.3f}"

    return [dict(layout=name, micro_batches=reports[name]["micro_batches"], update_s=spread(spent["update"]),
                 update_tps=tokens / min(spent["update"]), logprobs_s=spread(spent["logprobs"]),
                 logprobs_tps=tokens / min(spent["logprobs"]), tokens=tokens) for name, spent in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-completion", type=int, default=128)
    parser.add_argument("--updates", type=int, default=10)
    # One thread: on a machine shared with other work, a second one waits for a busy core at every
    # barrier (the same update measured 0.2 s to 12 s with two threads here).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=int, default=2048, help="max_tokens_per_micro_batch of the budget rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layouts = {
        "padded": dict(padding_free=False),
        "padding-free": dict(padding_free=True),
        f"padded, budget {args.budget}": dict(padding_free=False, max_tokens_per_micro_batch=args.budget),
        f"padding-free, budget {args.budget}": dict(padding_free=True, max_tokens_per_micro_batch=args.budget),
    }
    results = measure(layouts, args.max_completion, args.updates)
    print(f"configs/grpo_full.yaml policy, 64 samples, prompts 20-40 tokens, completions 1-{args.max_completion} "
          f"tokens ({results[0]['tokens']} real tokens a batch), {args.updates} timed updates each, torch threads "
          f"{torch.get_num_threads()}")
    print(format_table(results, COLUMNS))
    print(machine_line())


if __name__ == "__main__":
    main()
