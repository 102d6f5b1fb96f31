"""A PPO step's time by phase (generation's share above all), rollout speed, start-up and peak RSS per role.

    .venv/bin/python benchmarks/ppo_step.py                        # all four settings, 20 steps each
    .venv/bin/python benchmarks/ppo_step.py --settings hf-lora,vllm-lora --steps 40

First, in a temp dir, a reward model: stage rm (configs/rm_lora.yaml, harness.timed_config: 20 steps,
no eval) on ``tiny:qwen2,num_heads=2``, the base the policy then starts from (head size 32: vLLM's CPU
attention needs it), so the rm adapter (``reward_model_type: lora``) fits the policy's base. Then each
setting runs configs/ppo_lora.yaml through ``run_exp`` on a local Ray of its own (shut down between
settings; the driver sizes it to hold every role's CPUs), with that policy and reward model, no eval
prompts, no mid-run checkpoints and a record per step. Per step: 32 prompts x 1 completion of at most
8 tokens, 2 epochs x 2 mini-batches of a critic step and a policy step. Settings (SETTINGS):

* vllm-lora: the config as shipped: policy, critic and one vLLM engine on bundles of their own (CPU: 1
  each), the reward model on the critic's bundle (colocate_critic_reward), a weight sync every step.
* hf-lora: rollout_backend hf: transformers generate inside the policy worker, nothing to sync.
* vllm-lora-colocated: colocate_all: every role on the policy's one bundle (separate processes still).
* vllm-full: finetuning_type full (harness.make_full_finetuning): the reference is a frozen copy.

Figures from output_dir/trainer_log.jsonl, step 1 left out as warm-up: seconds per step (the gap in
elapsed_time between records) and per phase (the mean ``time/<phase>``: generate, reward,
old_logprobs, reference, values, update, sync) with its share; other = what no phase timer covers
(GAE, the KL controller, the log). Completions/s and completion tokens/s = completions per step
(x mean completion_length) / time/generate. Time to first step: from calling run_exp to step 1's record
(the log started at its mtime less the last record's elapsed_time). Peak RSS per role: grpo_step's
poller (psutil every 0.2 s, the driver and its descendants titled ``ray::<Role>Actor``), its title
table widened to the critic and the reward model. The driver's figure includes what the rm build and
earlier settings left in it (imports, caches).
"""

from __future__ import annotations

import os
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import grpo_step  # noqa: E402 (after the path set-up above)
from harness import (format_table, machine_line, make_full_finetuning, settings_arguments,  # noqa: E402
                     timed_config, write_json)

BASE_MODEL = "tiny:qwen2,num_heads=2"
RM_STEPS = 20
SETTINGS = {
    "vllm-lora": {},  # configs/ppo_lora.yaml as shipped
    "hf-lora": dict(rollout_backend="hf"),
    "vllm-lora-colocated": dict(colocate_all=True),
    "vllm-full": dict(finetuning_type="full"),
}
PHASES = ("generate", "reward", "old_logprobs", "reference", "values", "update", "sync")  # in step order
# Ray titles an actor's process ray::<class name>; grpo_step's poller watches the titles it is given.
PPO_ROLES = {"policy": "ray::PolicyActor", "critic": "ray::CriticActor", "reward": "ray::RewardActor",
             "rollout": "ray::RolloutActor"}
RSS_ROLES = (*PPO_ROLES, "driver")
PHASE_COLUMNS = [("phase", "phase", "{}"), ("seconds / step", "seconds", "{:.3f}"), ("share", "share", "{:.0%}")]
SUMMARY_COLUMNS = [("setting", "setting", "{}"), ("steps", "steps", "{}"), ("s / step", "step_s", "{:.3f}"),
                   ("generate share", "generate_share", "{:.0%}"),
                   ("completion length", "completion_length", "{:.1f}"),
                   ("completions/s", "completions_per_s", "{:,.0f}"),
                   ("completion tokens/s", "tokens_per_s", "{:,.0f}"),
                   ("time to first step", "first_step_s", "{:.1f} s"), ("total wall", "wall_s", "{:.1f} s"),
                   *[(f"peak RSS {role}", f"rss_{role}", "{:.0f} MiB") for role in RSS_ROLES]]


def build_reward_model(work_dir: str) -> str:
    """A stage rm LoRA output (adapter + value head) on BASE_MODEL, trained for RM_STEPS steps."""
    import ray

    from cluster.driver import run_exp

    out_dir = os.path.join(work_dir, "rm")
    try:
        run_exp(timed_config("rm_lora.yaml", out_dir, RM_STEPS, model_name_or_path=BASE_MODEL))
    finally:
        ray.shutdown()  # each setting starts a Ray of its own
    return out_dir


def setting_config(name: str, steps: int, out_dir: str, reward_model: str) -> dict:
    import yaml

    with open(os.path.join(REPO_ROOT, "configs", "ppo_lora.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config.update(SETTINGS[name], model_name_or_path=BASE_MODEL, reward_model=reward_model,
                  reward_model_type="lora", output_dir=out_dir, ray_storage_path=os.path.join(out_dir, "ray"),
                  dataset_dir=os.path.join(REPO_ROOT, "data"), max_steps=steps, logging_steps=1,
                  eval_dataset=None, save_steps=100000, plot_loss=False)  # checkpoints would be timed as steps
    if config["finetuning_type"] == "full":
        make_full_finetuning(config)
    return config


def summarize(records: list[dict], completions_per_step: int, log_start: float, t0: float) -> dict:
    """Figures of one run from its per-step records (step 1 is warm-up, left out)."""
    steady = [r for r in records if r["current_steps"] > 1]
    step_s = (records[-1]["elapsed_time"] - records[0]["elapsed_time"]) / len(steady)
    phase_s = {p: sum(r.get(f"time/{p}", 0.0) for r in steady) / len(steady) for p in PHASES}
    generate_s = sum(r["time/generate"] for r in steady)
    lengths = [r["completion_length"] for r in steady]
    return {"steps": records[-1]["current_steps"], "step_s": step_s, "phase_s": phase_s,
            "other_s": step_s - sum(phase_s.values()), "generate_share": phase_s["generate"] / step_s,
            "completion_length": sum(lengths) / len(lengths),
            "completions_per_s": completions_per_step * len(steady) / generate_s,
            "tokens_per_s": completions_per_step * sum(lengths) / generate_s,
            "first_step_s": log_start + records[0]["elapsed_time"] - t0}


def run_setting(name: str, steps: int, work_dir: str, reward_model: str) -> dict:
    from cluster.config import load_config

    out_dir = os.path.join(work_dir, name)
    config = setting_config(name, steps, out_dir, reward_model)
    completions_per_step = load_config(dict(config)).rl.completions_per_step  # ppo sizes it from the batch keys
    records, log_start, t0, wall, peak = grpo_step.timed_run(config, out_dir, PPO_ROLES)
    figures = summarize(records, completions_per_step, log_start, t0)
    return {"setting": name, **figures, "wall_s": wall, **{f"rss_{k}": v for k, v in peak.items()}}


def phase_table(result: dict) -> str:
    step_s = result["step_s"]
    rows = [{"phase": p, "seconds": s, "share": s / step_s} for p, s in result["phase_s"].items()]
    rows += [{"phase": "other", "seconds": result["other_s"], "share": result["other_s"] / step_s},
             {"phase": "step", "seconds": step_s, "share": 1.0}]
    return format_table(rows, PHASE_COLUMNS)


def main() -> int:
    args, names = settings_arguments(__doc__, SETTINGS, "PPO")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-ppo-") as work_dir:
        print(f"[bench] reward model (stage rm, {RM_STEPS} steps) ...", file=sys.stderr, flush=True)
        reward_model = build_reward_model(work_dir)
        for name in names:
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            results.append(run_setting(name, args.steps, work_dir, reward_model))
    print(f"\n{machine_line()}\n")
    for result in results:
        print(f"{result['setting']} ({result['steps']} steps, step 1 left out), mean seconds per step:\n")
        print(phase_table(result) + "\n")
    print(format_table(results, SUMMARY_COLUMNS))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
