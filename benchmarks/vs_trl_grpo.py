"""GRPO side by side with TRL's GRPOTrainer: the same model, prompts, rewards, group size, batch,
completion length and learning rate; steps/s, the reward curve and peak memory.

    .venv/bin/python benchmarks/vs_trl_grpo.py                       # trl, ours sync / one_step, merged / adapter; 12 steps
    .venv/bin/python benchmarks/vs_trl_grpo.py --steps 6 --runs ours-sync ours-one_step
    .venv/bin/python benchmarks/vs_trl_grpo.py --runs trl ours-sync --seeds 42 43 44   # reward curves over seeds

The setting (the one the RL-at-speed issue measured): SmolLM2-135M-Instruct (``demo:``, shipped
with the project), LoRA r16 on every linear layer (alpha 32), 8 prompts of ``arith_train`` x 8
completions of at most 32 tokens, temperature 1, no top-k, rewards ``final_number`` + 0.5 x
``short_answer``, learning rate 2e-4 constant, beta 0 (no reference), DAPO's token-mean loss, one
update per batch, seed 42 (``--seeds``: each run once per seed, the rows then gain each step's
mean reward over the seeds). Each run is a child process (its own memory, nothing shared):

    trl            TRL 1.16 GRPOTrainer on the CPU (use_cpu), transformers generate, torch's threads
    ours-sync      configs/smollm2_lora_grpo.yaml: 1 policy worker {CPU: 1}, 1 vLLM engine {CPU: 1}
    ours-one_step  the same with async_rollout one_step (correction on, token_truncate)
    ours-sync-adapter, ours-one_step-adapter
                   the same with rollout_lora_sync adapter (the adapter alone pushed, vLLM LoRA)
    ours-hf        the same, synchronous, transformers generate inside the policy worker

Figures: steps/s over steps 2..N (step 1 holds start-up work in both), whole-run wall seconds,
the mean reward of the last 5 steps, and the peak PSS of the run's whole process tree (the driver,
Ray's processes, the actors), sampled every 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import format_table, machine_line, relative_to_base, write_json  # noqa: E402

MODEL = "demo:smollm2-135m-instruct"
PROMPTS, GENERATIONS, COMPLETION, LR, SEED = 8, 8, 32, 2e-4, 42
RUNS = ("trl", "ours-sync", "ours-one_step", "ours-sync-adapter", "ours-one_step-adapter", "ours-hf")
COLUMNS = [("run", "run", "{}"), ("seed", "seed", "{}"), ("steps", "steps", "{}"), ("s / step", "step_s", "{:.1f}"),
           ("steps/s", "steps_per_s", "{:.4f}"), ("vs trl", "vs_trl", "{}"), ("wall", "wall_s", "{:.0f} s"),
           ("reward per step", "rewards", "{}"), ("last-5 reward", "last5", "{:.3f}"),
           ("peak PSS", "pss_mib", "{:,.0f} MiB")]


def trl_child(out_dir: str, steps: int, seed: int) -> None:
    """In the child: TRL's GRPOTrainer on the setting; writes its log history."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from stages.loading import resolve_model_path
    from stages.rl.controller.rewards import final_number, short_answer

    with open(os.path.join(REPO_ROOT, "data", "arith_train.json"), encoding="utf-8") as f:
        rows = json.load(f)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["instruction"]}], "reference": r["output"]}
                              for r in rows])

    def text(completions):
        return [c[0]["content"] for c in completions]

    def final_number_reward(prompts, completions, reference, **kwargs):
        return final_number(prompts, text(completions), reference)

    def short_answer_reward(prompts, completions, completion_ids, **kwargs):
        return short_answer(prompts, text(completions), completion_ids)

    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, max_steps=steps, learning_rate=LR, lr_scheduler_type="constant",
        per_device_train_batch_size=PROMPTS * GENERATIONS, gradient_accumulation_steps=1,
        num_generations=GENERATIONS, max_completion_length=COMPLETION, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", num_iterations=1, reward_weights=[1.0, 0.5], logging_steps=1, seed=seed,
        save_strategy="no", report_to=[], bf16=False, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=resolve_model_path(MODEL), reward_funcs=[final_number_reward, short_answer_reward],
                          args=args, train_dataset=data, callbacks=[step_clock()],
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainer.train()  # GRPOConfig's seed seeds the adapter's initialisation and the sampling
    steps_log = [{"step": r["step"], "reward": r["reward"]} for r in trainer.state.log_history if "reward" in r]
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"steps": steps_log, "step_times": STEP_TIMES}, f)


STEP_TIMES: list[float] = []


def ours_child(out_dir: str, steps: int, mode: str, seed: int) -> None:
    import yaml

    from cluster.driver import run_exp

    with open(os.path.join(REPO_ROOT, "configs", "smollm2_lora_grpo.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config.update(output_dir=out_dir, ray_storage_path=os.path.join(out_dir, "ray"), max_steps=steps,
                  dataset_dir=os.path.join(REPO_ROOT, "data"), rollout_batch_size=PROMPTS, num_generations=GENERATIONS,
                  max_completion_length=COMPLETION, learning_rate=LR, seed=seed, eval_dataset=None, logging_steps=1,
                  save_strategy="no", plot_loss=False)
    config.pop("eval_strategy", None)
    config.pop("eval_steps", None)
    config.update(ours_settings(mode))
    run_exp(config)


def ours_settings(run: str) -> dict:
    """The config keys of one of our runs (its name less "ours-")."""
    mode, _, sync = run.partition("-")
    keys = {"rollout_backend": "hf"} if mode == "hf" else {"async_rollout": {"sync": "off"}.get(mode, mode)}
    if sync == "adapter":
        keys["rollout_lora_sync"] = "adapter"
    return keys


class PeakPSS(threading.Thread):
    """Peak PSS (MiB) of a process and all its descendants together, every 0.5 s."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self._halt = pid, 0.0, threading.Event()

    def run(self) -> None:
        import psutil

        while not self._halt.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_full_info().pss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total / 2**20)
            except psutil.Error:
                pass
            self._halt.wait(0.5)

    def stop(self) -> float:
        self._halt.set()
        self.join()
        return self.peak


def one_run(name: str, steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-vs-trl-{name}-") as out_dir:
        env = {**os.environ, "PYTHONPATH": REPO_ROOT}
        start = time.time()
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", name, "--out", out_dir,
                                 "--steps", str(steps), "--seed", str(seed)], env=env, cwd=REPO_ROOT)
        sampler = PeakPSS(proc.pid)
        sampler.start()
        if proc.wait() != 0:
            raise RuntimeError(f"run {name} failed (exit {proc.returncode})")
        wall, pss = time.time() - start, sampler.stop()
        if name == "trl":
            with open(os.path.join(out_dir, "result.json")) as f:
                result = json.load(f)
            rewards = [s["reward"] for s in result["steps"]]
            times = result["step_times"]
        else:
            with open(os.path.join(out_dir, "trainer_log.jsonl")) as f:
                records = [json.loads(line) for line in f if line.strip()]
            records = [r for r in records if r.get("current_steps", 0) > 0 and "reward" in r]
            rewards = [r["reward"] for r in records]
            times = [r["elapsed_time"] for r in records]
    step_s = (times[-1] - times[0]) / (len(times) - 1)
    return {"run": name, "seed": seed, "steps": len(rewards), "step_s": step_s, "steps_per_s": 1 / step_s, "wall_s": wall,
            "per_step": rewards, "rewards": " ".join(f"{r:.2f}" for r in rewards), "last5": sum(rewards[-5:]) / len(rewards[-5:]),
            "pss_mib": pss}


MEAN_COLUMNS = [("run", "run", "{}"), ("seeds", "seeds", "{}"), ("steps/s (mean)", "steps_per_s", "{:.4f}"),
                ("mean reward per step over the seeds", "rewards", "{}"), ("last-5 reward (mean)", "last5", "{:.3f}"),
                ("last-5 per seed", "last5_seeds", "{}")]


def seed_means(rows: list[dict]) -> list[dict]:
    """Per run: each step's reward averaged over the seeds that ran, and the last-5 figures."""
    means = []
    for name in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == name]
        steps = min(len(r["per_step"]) for r in mine)
        curve = [sum(r["per_step"][i] for r in mine) / len(mine) for i in range(steps)]
        means.append({"run": name, "seeds": len(mine), "steps_per_s": sum(r["steps_per_s"] for r in mine) / len(mine),
                      "rewards": " ".join(f"{v:.2f}" for v in curve),
                      "last5": sum(r["last5"] for r in mine) / len(mine),
                      "last5_seeds": " ".join(f"{r['last5']:.2f}" for r in mine)})
    return means


def step_clock():
    """A TrainerCallback that notes the wall time at the end of every optimizer step (TRL's log
    history has no per-step timestamps)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            STEP_TIMES.append(time.time())

    return Clock()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(RUNS[:5]), choices=RUNS)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", nargs="+", type=int, default=[SEED])
    parser.add_argument("--seed", type=int, default=SEED, help=argparse.SUPPRESS)
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "trl":
        trl_child(args.out, args.steps, args.seed)
        return 0
    if args.child:
        ours_child(args.out, args.steps, args.child.removeprefix("ours-"), args.seed)
        return 0
    rows = []
    for seed in args.seeds:  # seed by seed, so a cut-short sweep still pairs the runs
        for name in args.runs:
            print(f"[bench] {name} seed {seed} ...", file=sys.stderr, flush=True)
            try:
                rows.append(one_run(name, args.steps, seed))
            except RuntimeError as exc:  # the other runs' figures still count
                print(f"[bench] {exc}", file=sys.stderr, flush=True)
            print(f"[bench] {rows[-1] if rows else ''}", file=sys.stderr, flush=True)
    for seed in args.seeds:  # each run against TRL's run of the same seed
        relative_to_base([r for r in rows if r["seed"] == seed], lambda r: r["run"] == "trl", "steps_per_s", "vs_trl")
    print(f"\n{machine_line()}\n{args.steps} steps, seeds {args.seeds}\n")
    print(format_table(rows, COLUMNS))
    if len(args.seeds) > 1:
        print("\n" + format_table(seed_means(rows), MEAN_COLUMNS))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
