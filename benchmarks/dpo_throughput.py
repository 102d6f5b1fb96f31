"""Preference-training throughput (pairs/s) and peak memory of dpo runs on a local Ray.

    .venv/bin/python benchmarks/dpo_throughput.py            # every case, prints a table
    .venv/bin/python benchmarks/dpo_throughput.py --cases 20m-full-sigmoid,20m-full-simpo --steps 20

Cases, one Ray Train worker with 1 CPU each, on the addition preference pairs (arith_pref):

* ``tiny-lora-sigmoid``: configs/dpo_lora.yaml as is (tiny Qwen2-style model, 0.2M params);
  the reference is the base with the adapter off.
* ``tiny-full-sigmoid``: the same, full fine-tuning: the reference is a second, frozen model.
* ``20m-full-sigmoid`` / ``20m-lora-sigmoid`` / ``20m-full-simpo``: a ~20M-parameter Qwen2-style
  model (as in train_throughput.py): full DPO (policy + reference copy), LoRA DPO (one model),
  and SimPO (no reference at all), so the reference's cost in time and memory shows.

Each case runs in a fresh child process with its own local Ray; memory is that whole process
tree's peak (see train_throughput.py, whose measuring helpers this script reuses). Figures, not
asserts: on a shared machine they vary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO_ROOT, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)

import train_throughput  # noqa: E402 (after the path set-up above)
from train_throughput import (  # noqa: E402
    BenchCallback,
    TreeMemorySampler,
    _count_params,
    build_20m_model,
    machine_line,
)

# (model, finetuning_type, pref_loss)
CASES = {
    "tiny-lora-sigmoid": ("tiny", "lora", "sigmoid"),
    "tiny-full-sigmoid": ("tiny", "full", "sigmoid"),
    "20m-full-sigmoid": ("20m", "full", "sigmoid"),
    "20m-lora-sigmoid": ("20m", "lora", "sigmoid"),
    "20m-full-simpo": ("20m", "full", "simpo"),
}
DEFAULT_STEPS = {"tiny": 60, "20m": 20}
PAIRS_PER_STEP = 16  # per_device_train_batch_size of configs/dpo_lora.yaml, 1 worker


def case_config(name: str, steps: int, model_path: str | None, out_dir: str) -> dict:
    import yaml

    model, finetuning_type, pref_loss = CASES[name]
    with open(os.path.join(REPO_ROOT, "configs", "dpo_lora.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config.pop("eval_dataset", None)  # timing the training loop, not the final evaluation
    config.pop("num_train_epochs", None)
    config.update(
        dataset_dir=os.path.join(REPO_ROOT, "data"),
        output_dir=out_dir,
        ray_storage_path=os.path.join(out_dir, "ray"),
        max_steps=steps,
        logging_steps=10,
        save_steps=100000,  # no mid-run checkpoints: they would be timed as training
        plot_loss=False,
        report_to="none",
        include_num_input_tokens_seen="non_padding",
        pref_loss=pref_loss,
        per_device_train_batch_size=PAIRS_PER_STEP,
    )
    if pref_loss == "simpo":
        config.update(pref_beta=2.0, simpo_gamma=0.5)
    if finetuning_type == "full":
        for key in ("lora_target", "lora_rank", "additional_target"):
            config.pop(key, None)
        config["finetuning_type"] = "full"
    if model == "20m":
        config.update(model_name_or_path=model_path, learning_rate=1.0e-3)
        if finetuning_type == "lora":
            config.pop("additional_target", None)  # LoRA alone: the reference shares every base weight
    return config


def run_case(name: str, steps: int, model_path: str | None, result_file: str) -> None:
    """Child process: one run on a fresh local Ray; writes its figures as JSON."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(train_throughput)  # workers cannot import this folder
    sampler = TreeMemorySampler()
    sampler.start()
    with tempfile.TemporaryDirectory(prefix=f"bench-dpo-{name}-") as out_dir:
        from cluster.driver import run_exp
        from stages.loading import resolve_model_path

        marks_dir = os.path.join(out_dir, "bench")
        config = case_config(name, steps, model_path, os.path.join(out_dir, "out"))
        start = time.time()
        run_exp(config, callbacks=[BenchCallback(marks_dir)])
        wall = time.time() - start
        sampler.stop()
        marks = json.load(open(os.path.join(marks_dir, "rank0.json")))
        params = _count_params(resolve_model_path(config["model_name_or_path"]))
    steady = marks["train_end"] - marks["first_step"]
    figures = {
        "case": name,
        "params_m": params / 1e6,
        "steps": marks["steps"],
        "pairs_per_s": (marks["steps"] - 1) * PAIRS_PER_STEP / steady if steady > 0 else None,
        "tokens_per_s": (marks["tokens"] - marks["tokens_at_first_step"]) / steady if steady > 0 else None,
        "time_to_first_step_s": marks["first_step"] - start,
        "wall_s": wall,
        "peak_tree_pss_gib": sampler.peak_pss / 2**30,
        "worker_max_rss_mib": marks["max_rss_mib"],
        "driver_max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    with open(result_file, "w") as f:
        json.dump(figures, f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=None, help="training steps per case (default: per model)")
    parser.add_argument("--json", default=None, help="also write every case's figures to this file")
    parser.add_argument("--run-case", default=None, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_case:
        run_case(args.run_case, args.steps, args.model_path, args.result_file)
        return 0

    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # each child measures its own Ray
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as work:
        needs_20m = any(CASES[n][0] == "20m" for n in names)
        model_path = build_20m_model(os.path.join(work, "qwen2-20m")) if needs_20m else None
        for name in names:
            result_file = os.path.join(work, f"{name}.json")
            steps = args.steps or DEFAULT_STEPS[CASES[name][0]]
            command = [sys.executable, os.path.abspath(__file__), "--run-case", name, "--result-file", result_file,
                       "--steps", str(steps)]
            if model_path:
                command += ["--model-path", model_path]
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            log_path = os.path.join(work, f"{name}.log")
            with open(log_path, "w") as log:
                code = subprocess.call(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
            if code != 0:
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    sys.stderr.write(f.read()[-4000:])
                print(f"[bench] {name} failed (exit {code})", file=sys.stderr)
                continue
            with open(result_file) as f:
                results.append(json.load(f))
    print(machine_line())
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "results": results}, f, indent=2)
    return 0 if len(results) == len(names) else 1


def format_table(results: list[dict]) -> str:
    columns = [
        ("case", "case", "{}"), ("params", "params_m", "{:.1f}M"), ("steps", "steps", "{}"),
        ("pairs/s", "pairs_per_s", "{:.1f}"), ("train tokens/s", "tokens_per_s", "{:,.0f}"),
        ("time to first step", "time_to_first_step_s", "{:.1f} s"), ("total wall", "wall_s", "{:.1f} s"),
        ("peak PSS (all procs)", "peak_tree_pss_gib", "{:.2f} GiB"),
        ("max RSS / worker", "worker_max_rss_mib", "{:.0f} MiB"),
    ]
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in results:
        cells = [fmt.format(row[key]) if row.get(key) is not None else "n/a" for _, key, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
