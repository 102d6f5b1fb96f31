"""Training throughput, start-up time and peak memory of sft runs on a local Ray.

    .venv/bin/python benchmarks/train_throughput.py            # every case, prints a table
    .venv/bin/python benchmarks/train_throughput.py --cases quickstart-1w,20m-2w --steps 40

Cases: the quickstart run (tiny Qwen2-style model, ~0.2M params, LoRA as in
configs/quickstart.yaml) and a ~20M-parameter Qwen2-style model (hidden 512, 6 layers, full
fine-tuning), each on 1 and 2 Ray Train workers with 1 CPU each, on the addition task; and the
real SmolLM2-135M-Instruct (configs/smollm2_lora_sft.yaml: LoRA r8 on every linear layer) on
tasks_sharegpt (multi-turn rows, cutoff_len 128), on 1 and 2 workers.

Each case runs in a fresh child process that starts its own local Ray, so the memory figure
covers exactly that run: the driver plus every process of its Ray (GCS, raylet, Ray Data and
Train workers), sampled with psutil. Figures, not asserts: on a shared machine they vary.
"""

from __future__ import annotations

import sys
import tempfile

from harness import bench_main, make_full_finetuning, measure_run, timed_config

# name -> (model, Ray Train workers)
CASES = {
    "quickstart-1w": ("quickstart", 1),
    "quickstart-2w": ("quickstart", 2),
    "20m-1w": ("20m", 1),
    "20m-2w": ("20m", 2),
    "smollm2-1w": ("smollm2", 1),
    "smollm2-2w": ("smollm2", 2),
}
DEFAULT_STEPS = {"quickstart": 60, "20m": 30, "smollm2": 20}
COLUMNS = [
    ("case", "case", "{}"), ("params", "params_m", "{:.1f}M"), ("workers", "workers", "{}"),
    ("steps", "steps", "{}"), ("train tokens/s", "tokens_per_s", "{:,.0f}"), ("steps/s", "steps_per_s", "{:.2f}"),
    ("time to first step", "time_to_first_step_s", "{:.1f} s"), ("train loop", "train_loop_s", "{:.1f} s"),
    ("total wall", "wall_s", "{:.1f} s"), ("peak RSS (all procs)", "peak_tree_rss_gib", "{:.2f} GiB"),
    ("peak PSS (all procs)", "peak_tree_pss_gib", "{:.2f} GiB"),
    ("max RSS / worker", "worker_max_rss_mib", "{:.0f} MiB"),
]


def case_config(model: str, workers: int, steps: int, model_path: str | None, out_dir: str) -> dict:
    if model == "smollm2":  # the real model's example, on multi-turn data of varied length
        return timed_config("smollm2_lora_sft.yaml", out_dir, steps, ray_num_workers=workers,
                            dataset="tasks_sharegpt", cutoff_len=128)
    config = timed_config("quickstart.yaml", out_dir, steps, ray_num_workers=workers)
    if model == "20m":
        make_full_finetuning(config)
        config.update(model_name_or_path=model_path, learning_rate=1.0e-3)
    return config


def run_case(name: str, steps: int, model_path: str | None) -> dict:
    model, workers = CASES[name]
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as out_dir:
        figures = measure_run(case_config(model, workers, steps, model_path, out_dir))
    return {"workers": workers, **figures}


if __name__ == "__main__":
    sys.exit(bench_main(__file__, __doc__, CASES, lambda name: DEFAULT_STEPS[CASES[name][0]], run_case, COLUMNS))
