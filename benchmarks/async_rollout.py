"""GRPO synchronous vs asynchronous rollouts: steps/s, tokens/s, where a step's time goes, how much
of the engine's generation overlapped the policy's work, and the reward curve over seeds.

    .venv/bin/python benchmarks/async_rollout.py                          # tiny model, 4 modes x 3 seeds, 40 steps
    .venv/bin/python benchmarks/async_rollout.py --config smollm2_lora_grpo.yaml --seeds 1 --steps 12 \\
        --modes off one_step

Each run is configs/<config> (default grpo_full.yaml: the tiny Qwen2-style model, full fine-tuning,
one policy worker {CPU: 1}, one vLLM engine {CPU: 1}, 8 prompts x 8 completions of at most 8
tokens, the digit_ratio reward it learns), sampled untruncated (top_k 0, top_p 1: rollout correction
reads the engines' raw log-probs), through ``run_exp`` on a local Ray of its own, eval off, with
``async_rollout`` set by the mode:

    off              the synchronous loop
    one_step         the next batch generated while the policy trains (correction on by default:
                     token_truncate, clip_max 3)
    bounded2         up to 2 batches ahead (max_staleness 2)
    one_step_nocorr  one_step with vllm_importance_sampling_correction false: stale and uncorrected
    one_step_seqmask one_step with vllm_importance_sampling_mode sequence_mask, the synchronous
                     default (TRL's) (not run by default)
    one_step_seq_tis one_step with sequence_truncate (not run by default)
    one_step_partial, bounded2_partial
                     the same with partial_rollout: a push is loaded between two decoding steps of
                     the batch in flight (not run by default; give the completions room, e.g.
                     --set max_completion_length=64, or every batch ends first)

Per mode, over the seeds: steps/s and completion tokens/s over the steady steps (step 1, which
starts the engine's cache and the pipeline, left out), the mean seconds per step of each phase
(``generate`` is what the controller waited for the batch; ``engine`` the engine's own time on it;
``overlap`` the part of that spent while the policy was busy; ``sync_load`` an engine's own time
on the last finished push, which for an in-flight one includes waiting for the decoding step in
progress), ``after push`` the share of a batch's tokens sampled by weights pushed while it was
being generated (partial rollouts), the mean reward of the last 10
steps per seed, and peak RSS per role. The speed-up column is against ``off``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grpo_step import timed_run  # noqa: E402
from harness import format_table, machine_line, relative_to_base, write_json  # noqa: E402

MODES = {
    "off": dict(async_rollout="off"),
    "one_step": dict(async_rollout="one_step"),
    "bounded2": dict(async_rollout="bounded", max_staleness=2),
    "one_step_nocorr": dict(async_rollout="one_step", vllm_importance_sampling_correction=False),
    "one_step_seqmask": dict(async_rollout="one_step", vllm_importance_sampling_mode="sequence_mask"),
    "one_step_seq_tis": dict(async_rollout="one_step", vllm_importance_sampling_mode="sequence_truncate"),
    "one_step_partial": dict(async_rollout="one_step", partial_rollout=True),
    "bounded2_partial": dict(async_rollout="bounded", max_staleness=2, partial_rollout=True),
}
PHASES = ("generate", "generate_engine", "overlap", "reward", "reference", "update", "sync", "sync_load")
COLUMNS = [("mode", "mode", "{}"), ("seeds", "seeds", "{}"), ("steps/s", "steps_per_s", "{:.2f}"),
           ("vs off", "speedup", "{}"), ("tokens/s", "tokens_per_s", "{:,.0f}"),
           *[(p.replace("generate_", ""), p, "{:.3f}") for p in PHASES],
           ("staleness", "staleness", "{}"), ("after push", "after_push", "{:.2f}"),
           ("last-10 reward per seed", "last10", "{}"),
           ("last-10 mean", "last10_mean", "{:.3f}"), ("first step", "first_step_s", "{:.1f} s"),
           ("peak RSS policy", "rss_policy", "{:.0f} MiB"), ("peak RSS rollout", "rss_rollout", "{:.0f} MiB")]


def run_config(config_name: str, mode: str, seed: int, steps: int, out_dir: str, overrides: dict) -> dict:
    import yaml

    with open(os.path.join(REPO_ROOT, "configs", config_name), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config.pop("num_train_epochs", None)
    config.update(top_k=0, top_p=1.0)  # the correction reads raw log-probs: the sampling must not cut (rl_checks.py)
    config.update(output_dir=out_dir, ray_storage_path=os.path.join(out_dir, "ray"), max_steps=steps,
                  dataset_dir=os.path.join(REPO_ROOT, "data"), logging_steps=1, eval_dataset=None, plot_loss=False,
                  save_strategy="no", seed=seed, **MODES[mode], **overrides)
    return config


def one_run(config_name: str, mode: str, seed: int, steps: int, overrides: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-async-{mode}-") as out_dir:
        config = run_config(config_name, mode, seed, steps, out_dir, overrides)
        records, log_start, t0, _, peak = timed_run(config, out_dir)
    steps_logged = [r for r in records if r.get("current_steps", 0) > 0 and "reward" in r]
    steady = [r for r in steps_logged if r["current_steps"] > 1]
    step_s = (steps_logged[-1]["elapsed_time"] - steps_logged[0]["elapsed_time"]) / len(steady)
    per_step = config["rollout_batch_size"] * config["num_generations"]
    return {
        "step_s": step_s,
        "tokens_per_s": per_step * statistics.mean(r["completion_length"] for r in steady) / step_s,
        **{p: statistics.mean(r.get(f"time/{p}", 0.0) for r in steady) for p in PHASES},
        "staleness": sorted({r.get("async/staleness", 0) for r in steady}),
        "after_push": statistics.mean(r.get("async/tokens_after_push", 0.0) for r in steady),
        "last10": statistics.mean(r["reward"] for r in steps_logged[-10:]),
        "first_step_s": log_start + steps_logged[0]["elapsed_time"] - t0,
        **{f"rss_{k}": v for k, v in peak.items()},
    }


def summarize(mode: str, runs: list[dict]) -> dict:
    row = {"mode": mode, "seeds": len(runs), "steps_per_s": statistics.mean(1 / r["step_s"] for r in runs),
           "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in runs),
           "staleness": ",".join(str(s) for s in sorted({s for r in runs for s in r["staleness"]})),
           "last10": " ".join(f"{r['last10']:.3f}" for r in runs),
           "last10_mean": statistics.mean(r["last10"] for r in runs)}
    for key in (*PHASES, "after_push", "first_step_s", "rss_policy", "rss_rollout"):
        row[key] = statistics.mean(r.get(key, 0.0) for r in runs)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="grpo_full.yaml")
    parser.add_argument("--modes", nargs="+", default=list(MODES)[:4], choices=list(MODES))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config key for every run (YAML value), e.g. --set max_completion_length=16")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for seed in range(args.seeds):  # seeds outermost: a drift in the machine's load hits every mode alike
        for mode in args.modes:
            print(f"[bench] {mode} seed {seed} ...", file=sys.stderr, flush=True)
            runs[mode].append(one_run(args.config, mode, 42 + seed, args.steps, overrides))
    rows = [summarize(mode, results) for mode, results in runs.items()]
    relative_to_base(rows, lambda r: r["mode"] == "off", "steps_per_s", "speedup")
    print(f"\n{machine_line()}\nconfig {args.config}, {args.steps} steps, overrides {overrides or 'none'}\n")
    print(format_table(rows, COLUMNS))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
