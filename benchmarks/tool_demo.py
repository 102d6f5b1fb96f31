"""Tool use learnt by RL: held-out accuracy and tool-call rate before and after multi-turn GRPO with
the calculator, over seeds.

    .venv/bin/python benchmarks/tool_demo.py --sft-epochs 4.8        # tiny model, 2 seeds (the README figures)
    .venv/bin/python benchmarks/tool_demo.py --seeds 1 --rl-steps 20 --set learning_rate=5e-5

Per seed: configs/sft_calculator.yaml (the warm start on our tool-use demonstrations,
data/calc_tool_sft.json), then configs/grpo_calculator.yaml from its output (tools:
[calculator], reward exact_match + 0.2 tool_use, greedy episodes on data/calc_eval.json scored
before and after). Reported: the eval's exact-match accuracy and tool-call rate after the warm
start ("before") and after RL, the training reward of the first and last 5 steps, and the mean
turns per trajectory. ``--set key=value`` overrides the grpo config (repeatable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import format_table, machine_line, write_json  # noqa: E402

COLUMNS = [("seed", "seed", "{}"), ("acc before", "acc_before", "{:.3f}"), ("acc after", "acc_after", "{:.3f}"),
           ("tool rate before", "tool_before", "{:.3f}"), ("tool rate after", "tool_after", "{:.3f}"),
           ("reward first 5", "reward_first5", "{:.3f}"), ("reward last 5", "reward_last5", "{:.3f}"),
           ("turns", "turns", "{:.2f}"), ("sft s", "sft_s", "{:.0f}"), ("rl s", "rl_s", "{:.0f}")]


def _config(name: str, **overrides) -> dict:
    import yaml

    with open(os.path.join(REPO_ROOT, "configs", name), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config.update(dataset_dir=os.path.join(REPO_ROOT, "data"), plot_loss=False, report_to="none", **overrides)
    return config


def _run(config: dict) -> float:
    import time

    import ray

    from cluster.driver import run_exp

    start = time.time()
    try:
        run_exp(config)
    finally:
        ray.shutdown()
    return time.time() - start


def run_seed(seed: int, sft_epochs: float, rl_steps: int, grpo_overrides: dict, work: str) -> dict:
    sft_out, rl_out = os.path.join(work, f"sft-{seed}"), os.path.join(work, f"grpo-{seed}")
    sft_s = _run(_config("sft_calculator.yaml", output_dir=sft_out, ray_storage_path=os.path.join(sft_out, "ray"),
                         seed=seed, num_train_epochs=sft_epochs, save_steps=100000))
    rl_s = _run(_config("grpo_calculator.yaml", model_name_or_path=sft_out, output_dir=rl_out,
                        ray_storage_path=os.path.join(rl_out, "ray"), seed=seed, max_steps=rl_steps,
                        logging_steps=1, eval_steps=rl_steps, save_steps=100000, **grpo_overrides))
    with open(os.path.join(rl_out, "all_results.json"), encoding="utf-8") as f:
        results = json.load(f)
    with open(os.path.join(rl_out, "trainer_log.jsonl"), encoding="utf-8") as f:
        steps = [r for r in map(json.loads, f) if r.get("current_steps", 0) > 0 and "reward" in r]
    rewards = [r["reward"] for r in steps]
    return {
        "seed": seed,
        "acc_before": results["before_eval_rewards/exact_match"], "acc_after": results["eval_rewards/exact_match"],
        "tool_before": results["before_eval_rewards/tool_use"], "tool_after": results["eval_rewards/tool_use"],
        "reward_first5": statistics.mean(rewards[:5]), "reward_last5": statistics.mean(rewards[-5:]),
        "turns": statistics.mean(r["rollout/turns"] for r in steps), "sft_s": sft_s, "rl_s": rl_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--sft-epochs", type=float, default=12)
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--set", action="append", default=[], help="key=value for the grpo config (YAML value)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    import yaml

    overrides = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.set)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tool-demo-") as work:
        for seed in range(args.seeds):
            rows.append(run_seed(42 + seed, args.sft_epochs, args.rl_steps, overrides, work))
            print(format_table(rows[-1:], COLUMNS), flush=True)
    print(machine_line())
    print(f"sft {args.sft_epochs} epochs, grpo {args.rl_steps} steps, overrides {overrides}")
    print(format_table(rows, COLUMNS))
    for key in ("acc_before", "acc_after", "tool_before", "tool_after"):
        print(f"mean {key}: {statistics.mean(r[key] for r in rows):.3f}")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
