"""Tool use learnt by RL: held-out accuracy and tool-call rate before and after multi-turn GRPO with
the calculator, over seeds.

    .venv/bin/python benchmarks/tool_demo.py --sft-epochs 4.8        # tiny model, 2 seeds (the README figures)
    .venv/bin/python benchmarks/tool_demo.py --seeds 1 --rl-steps 20 --set learning_rate=5e-5
    .venv/bin/python benchmarks/tool_demo.py --model smollm2 --seeds 3   # SmolLM2-135M-Instruct, LoRA

Per seed: configs/sft_calculator.yaml (the warm start on our tool-use demonstrations,
data/calc_tool_sft.json), then configs/grpo_calculator.yaml from its output (tools:
[calculator], reward exact_match + 0.2 tool_use, greedy episodes on data/calc_eval.json scored
before and after). Reported: the eval's exact-match accuracy and tool-call rate after the warm
start ("before") and after RL, the training reward of the first and last 5 steps, and the mean
turns per trajectory. ``--set key=value`` overrides the grpo config (repeatable).

``--model smollm2`` runs the real SmolLM2-135M-Instruct (``demo:``) with LoRA instead of the tiny
model: a short warm start (``--sft-steps``, a few dozen demonstrations, so the policy writes a call
only some of the time and RL has something to add), and the model's own accuracy on the same
questions without tools or warm start ("alone": greedy, the last number in its reply counts, the
generous reading of a chatty answer).
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

SMOLLM2 = "demo:smollm2-135m-instruct"
# What --model smollm2 changes in each config (the headers of configs/sft_calculator.yaml and
# grpo_calculator.yaml say the same): the family's template, LoRA and its learning rates.
MODELS = {
    "tiny": ({}, {}),
    "smollm2": (
        dict(model_name_or_path=SMOLLM2, template="smollm2", finetuning_type="lora", lora_target="all", lora_rank=16,
             learning_rate=2e-4, per_device_train_batch_size=8, lr_scheduler_type="constant", warmup_steps=0),
        dict(model_name_or_path=SMOLLM2, template="smollm2", finetuning_type="lora", lora_target="all", lora_rank=16,
             learning_rate=1e-4, rollout_batch_size=4),
    ),
}


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

    start, own = time.time(), not ray.is_initialized()  # a test's session Ray outlives the run
    try:
        run_exp(config)
    finally:
        if own:
            ray.shutdown()
    return time.time() - start


def alone_accuracy(model: str, template: str) -> float:
    """The model's own greedy accuracy on calc_eval, no tools and no warm start: the last integer
    of its reply against the answer (final_number, the reward that reads a chatty reply kindly)."""
    from cluster.api import ChatModel
    from stages.rl.controller.rewards import final_number

    with open(os.path.join(REPO_ROOT, "data", "calc_eval.json"), encoding="utf-8") as f:
        rows = json.load(f)
    chat = ChatModel({"model_name_or_path": model, "template": template, "do_sample": False, "max_new_tokens": 48})
    try:
        replies = [chat.chat([{"role": "user", "content": r["instruction"]}])[0].response_text for r in rows]
    finally:
        chat.close()
    scores = final_number(None, replies, [r["output"] for r in rows])
    return statistics.mean(scores)


def run_seed(seed: int, sft: dict, rl_steps: int, grpo_overrides: dict, work: str) -> dict:
    sft_out, rl_out = os.path.join(work, f"sft-{seed}"), os.path.join(work, f"grpo-{seed}")
    sft_s = _run(_config("sft_calculator.yaml", output_dir=sft_out, ray_storage_path=os.path.join(sft_out, "ray"),
                         seed=seed, save_steps=100000, **sft))
    # A LoRA warm start is an adapter: RL goes on training it on the same base (as LLaMA-Factory's
    # adapter_name_or_path does); a full one is the model itself.
    start = ({"adapter_name_or_path": sft_out} if sft.get("finetuning_type") == "lora"
             else {"model_name_or_path": sft_out})
    rl_s = _run(_config("grpo_calculator.yaml", output_dir=rl_out, ray_storage_path=os.path.join(rl_out, "ray"),
                        seed=seed, max_steps=rl_steps, logging_steps=1, eval_steps=rl_steps, save_steps=100000,
                        **{**start, **grpo_overrides}))
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
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--sft-epochs", type=float, default=12)
    parser.add_argument("--sft-steps", type=int, help="a warm start of this many steps instead of --sft-epochs")
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--set", action="append", default=[], help="key=value for the grpo config (YAML value)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    import yaml

    sft, grpo = MODELS[args.model]
    overrides = {**grpo, **{k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.set)}}
    sft = {**sft, **({"max_steps": args.sft_steps} if args.sft_steps else {"num_train_epochs": args.sft_epochs})}
    alone = None
    if args.model != "tiny":  # the tiny model knows nothing on its own: 0 by construction
        alone = alone_accuracy(sft["model_name_or_path"], sft["template"])
        print(f"alone (no tools, no warm start): {alone:.3f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tool-demo-") as work:
        for seed in range(args.seeds):
            rows.append(run_seed(42 + seed, sft, args.rl_steps, overrides, work))
            print(format_table(rows[-1:], COLUMNS), flush=True)
    print(machine_line())
    warm = f"{args.sft_steps} steps" if args.sft_steps else f"{args.sft_epochs} epochs"
    print(f"model {args.model}, sft {warm}, grpo {args.rl_steps} steps, overrides {overrides}")
    if alone is not None:
        print(f"accuracy alone (no tools, no warm start, final_number): {alone:.3f}")
    print(format_table(rows, COLUMNS))
    for key in ("acc_before", "acc_after", "tool_before", "tool_after"):
        print(f"mean {key}: {statistics.mean(r[key] for r in rows):.3f}")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
