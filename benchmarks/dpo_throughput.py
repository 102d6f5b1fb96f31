"""Preference-training throughput (pairs/s) and peak memory of dpo runs on a local Ray.

    .venv/bin/python benchmarks/dpo_throughput.py            # every case, prints a table
    .venv/bin/python benchmarks/dpo_throughput.py --cases 20m-full-sigmoid,20m-full-simpo --steps 20

Cases, one Ray Train worker with 1 CPU unless named ``-2w``, on the addition preference pairs
(arith_pref), 16 pairs per optimizer step in all (split across the workers):

* ``tiny-lora-sigmoid``: configs/dpo_lora.yaml as is (tiny Qwen2-style model, 0.2M params);
  the reference is the base with the adapter off.
* ``tiny-full-sigmoid``: the same, full fine-tuning: the reference is a second, frozen model.
* ``20m-full-sigmoid`` / ``20m-lora-sigmoid`` / ``20m-full-simpo``: a ~20M-parameter Qwen2-style
  model (as in train_throughput.py): full DPO (policy + reference copy), LoRA DPO (one model),
  and SimPO (no reference at all), so the reference's cost in time and memory shows.
* ``smollm2-lora-sigmoid``: the real SmolLM2-135M-Instruct (``demo:smollm2-135m-instruct``),
  LoRA r8 DPO, 16 pairs per step: what a user of a real small model sees;
  ``smollm2-lora-sigmoid-2w``: the same on 2 workers, 8 pairs each.

Each case runs in a fresh child process with its own local Ray; memory is that whole process
tree's peak (see harness.py). Figures, not asserts: on a shared machine they vary.
"""

from __future__ import annotations

import sys
import tempfile

from harness import bench_main, make_full_finetuning, measure_run, timed_config

# name -> (model, finetuning_type, pref_loss)
CASES = {
    "tiny-lora-sigmoid": ("tiny", "lora", "sigmoid"),
    "tiny-full-sigmoid": ("tiny", "full", "sigmoid"),
    "20m-full-sigmoid": ("20m", "full", "sigmoid"),
    "20m-lora-sigmoid": ("20m", "lora", "sigmoid"),
    "20m-full-simpo": ("20m", "full", "simpo"),
    "smollm2-lora-sigmoid": ("smollm2", "lora", "sigmoid"),
    "smollm2-lora-sigmoid-2w": ("smollm2", "lora", "sigmoid"),
}
WORKERS = {"smollm2-lora-sigmoid-2w": 2}  # cases not named here run on 1 worker
DEFAULT_STEPS = {"tiny": 60, "20m": 20, "smollm2": 10}
PAIRS_PER_STEP = 16  # pairs per optimizer step over all workers (configs/dpo_lora.yaml's batch, 1 worker)
COLUMNS = [
    ("case", "case", "{}"), ("params", "params_m", "{:.1f}M"), ("workers", "workers", "{}"),
    ("steps", "steps", "{}"),
    ("pairs/s", "pairs_per_s", "{:.1f}"), ("train tokens/s", "tokens_per_s", "{:,.0f}"),
    ("time to first step", "time_to_first_step_s", "{:.1f} s"), ("total wall", "wall_s", "{:.1f} s"),
    ("peak PSS (all procs)", "peak_tree_pss_gib", "{:.2f} GiB"),
    ("max RSS / worker", "worker_max_rss_mib", "{:.0f} MiB"),
]


def case_config(name: str, steps: int, model_path: str | None, out_dir: str) -> dict:
    model, finetuning_type, pref_loss = CASES[name]
    workers = WORKERS.get(name, 1)
    config = timed_config("dpo_lora.yaml", out_dir, steps, pref_loss=pref_loss, ray_num_workers=workers,
                          per_device_train_batch_size=PAIRS_PER_STEP // workers)
    if pref_loss == "simpo":
        config.update(pref_beta=2.0, simpo_gamma=0.5)
    if finetuning_type == "full":
        make_full_finetuning(config)
    if model == "smollm2":  # the real model: LoRA alone, at its example's rank and learning rate
        config.update(model_name_or_path="demo:smollm2-135m-instruct", template="smollm2", lora_rank=8,
                      learning_rate=1.0e-3)
        config.pop("additional_target", None)
    if model == "20m":
        config.update(model_name_or_path=model_path, learning_rate=1.0e-3)
        if finetuning_type == "lora":
            config.pop("additional_target", None)  # LoRA alone: the reference shares every base weight
    return config


def run_case(name: str, steps: int, model_path: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-dpo-{name}-") as out_dir:
        config = case_config(name, steps, model_path, out_dir)
        figures = measure_run(config)
    figures["workers"] = config["ray_num_workers"]
    steady = figures["steady_s"]
    figures["pairs_per_s"] = (figures["steps"] - 1) * PAIRS_PER_STEP / steady if steady else None
    return figures


if __name__ == "__main__":
    sys.exit(bench_main(__file__, __doc__, CASES, lambda name: DEFAULT_STEPS[CASES[name][0]], run_case, COLUMNS))
