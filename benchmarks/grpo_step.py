"""A GRPO step's time by phase, rollout speed, start-up time and peak memory per role.

    .venv/bin/python benchmarks/grpo_step.py                       # all three settings, 20 steps each
    .venv/bin/python benchmarks/grpo_step.py --settings hf-lora --steps 40

Each setting runs configs/grpo_lora.yaml (tiny Qwen2-style model, 1 policy worker with CPU: 1,
8 prompts x 8 completions per step, at most 8 new tokens, beta 0.02) through ``run_exp``, on a
local Ray of its own (shut down between settings), without eval prompts (settings: SETTINGS).

Figures from output_dir/trainer_log.jsonl (one record per step), step 1 left out as warm-up:
seconds per step (elapsed_time between records) and per phase (``time/<phase>``) with its share;
completions/s and completion tokens/s = rollout_batch_size x num_generations (x completion_length)
/ time/generate; time to first step, from calling run_exp to step 1's record (the log started at
its mtime less the last record's elapsed_time). Peak RSS: a thread polls psutil every 0.2 s for the
driver (this process: controller, rewards, Ray Data) and its descendants titled ``ray::PolicyActor``
/ ``ray::RolloutActor`` (descendants only: other Rays on a shared machine run the same names). The
driver's figure includes what earlier settings left in it (imports, caches).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from harness import format_table, machine_line, settings_arguments, write_json  # noqa: E402

SETTINGS = {
    "vllm-lora": dict(rollout_backend="vllm"),  # the config as it is: 1 vLLM engine (CPU: 1), sync every step
    "hf-lora": dict(rollout_backend="hf"),  # transformers generate inside the policy worker; nothing to sync
    "vllm-full": dict(rollout_backend="vllm", finetuning_type="full"),  # the reference: a frozen copy
}
PHASES = ("generate", "reward", "reference", "old_logprobs", "update", "sync")
ROLES = {"policy": "ray::PolicyActor", "rollout": "ray::RolloutActor"}  # Ray's process titles
POLL_S = 0.2
COLUMNS = [("setting", "setting", "{}"), ("steps", "steps", "{}"), ("s / step", "step_s", "{:.3f}"),
           *[(p, p, "{}") for p in PHASES], ("other", "other", "{}"),
           ("completion length", "completion_length", "{:.1f}"),
           ("completions/s", "completions_per_s", "{:,.0f}"), ("completion tokens/s", "tokens_per_s", "{:,.0f}"),
           ("time to first step", "first_step_s", "{:.1f} s"), ("total wall", "wall_s", "{:.1f} s"),
           ("peak RSS policy", "rss_policy", "{:.0f} MiB"), ("peak RSS rollout", "rss_rollout", "{:.0f} MiB"),
           ("peak RSS driver", "rss_driver", "{:.0f} MiB")]


class RolePeakRSS(threading.Thread):
    """Peak RSS (MiB) of the driver and of the largest process of each role, sampled every POLL_S."""

    def __init__(self, roles: dict[str, str] = ROLES):
        super().__init__(daemon=True)
        self.roles = roles  # role -> the marker in its process title
        self.peak: dict[str, float] = {}
        self._halt = threading.Event()

    def _note(self, role: str, proc) -> None:
        self.peak[role] = max(self.peak.get(role, 0.0), proc.memory_info().rss / 2**20)

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._halt.is_set():
            self._note("driver", me)
            for proc in me.children(recursive=True):
                try:
                    title = " ".join(proc.cmdline())
                    for role, marker in self.roles.items():
                        if marker in title:
                            self._note(role, proc)
                except psutil.Error:  # gone between the listing and the read
                    pass
            self._halt.wait(POLL_S)

    def stop(self) -> dict[str, float]:
        self._halt.set()
        self.join()
        return self.peak


def setting_config(name: str, steps: int, out_dir: str) -> dict:
    import yaml

    with open(os.path.join(REPO_ROOT, "configs", "grpo_lora.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    if SETTINGS[name].get("finetuning_type") == "full":
        config.pop("lora_rank", None)
    config.update(SETTINGS[name], output_dir=out_dir, ray_storage_path=os.path.join(out_dir, "ray"),
                  dataset_dir=os.path.join(REPO_ROOT, "data"), max_steps=steps, logging_steps=1,
                  eval_dataset=None, plot_loss=False)
    return config


def summarize(config: dict, records: list[dict], log_start: float, t0: float) -> dict:
    """Figures of one run from its per-step records (step 1 is warm-up, left out)."""
    steady = [r for r in records if r["current_steps"] > 1]
    step_s = (records[-1]["elapsed_time"] - records[0]["elapsed_time"]) / len(steady)
    phase_s = {p: sum(r.get(f"time/{p}", 0.0) for r in steady) / len(steady) for p in PHASES}
    row = {p: f"{s:.3f} s ({s / step_s:.0%})" for p, s in phase_s.items()}
    other = step_s - sum(phase_s.values())  # advantages, log writing, the controller's bookkeeping
    per_step = config["rollout_batch_size"] * config["num_generations"]
    generate_s = sum(r["time/generate"] for r in steady)
    return {**row, "other": f"{other:.3f} s ({other / step_s:.0%})", "steps": records[-1]["current_steps"],
            "step_s": step_s, "completions_per_s": per_step * len(steady) / generate_s,
            "tokens_per_s": per_step * sum(r["completion_length"] for r in steady) / generate_s,
            "completion_length": sum(r["completion_length"] for r in steady) / len(steady),
            "first_step_s": log_start + records[0]["elapsed_time"] - t0}


def timed_run(config: dict, out_dir: str, roles: dict[str, str] = ROLES) -> tuple[list[dict], float, float, float, dict]:
    """run_exp(config) on a local Ray of its own under the peak-RSS poller: the trainer_log records,
    when the log started, when the call started, its wall seconds, and the peak RSS per role."""
    import ray

    from cluster.driver import run_exp

    sampler = RolePeakRSS(roles)
    sampler.start()
    t0 = time.time()
    try:
        run_exp(dict(config))
        wall = time.time() - t0
    finally:
        peak = sampler.stop()
        ray.shutdown()  # the next setting starts a Ray of its own
    log_path = os.path.join(out_dir, "trainer_log.jsonl")
    with open(log_path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    log_start = os.path.getmtime(log_path) - records[-1]["elapsed_time"]
    return records, log_start, t0, wall, peak


def run_setting(name: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-grpo-{name}-") as out_dir:
        config = setting_config(name, steps, out_dir)
        records, log_start, t0, wall, peak = timed_run(config, out_dir)
        figures = summarize(config, records, log_start, t0)
    return {"setting": name, **figures, "wall_s": wall, **{f"rss_{k}": v for k, v in peak.items()}}


def main() -> int:
    args, names = settings_arguments(__doc__, SETTINGS, "GRPO")
    results = []
    for name in names:
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        results.append(run_setting(name, args.steps))
    print(f"\n{machine_line()}\n")
    print(format_table(results, COLUMNS))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
