"""Preference learning on a real model, without crutches: held-out figures before and after.

    .venv/bin/python benchmarks/preference_learning.py                  # every case (~1 h here)
    .venv/bin/python benchmarks/preference_learning.py --cases dpo-42,kto-42 --steps 20

Each case runs one example config on SmolLM2-135M-Instruct (``demo:smollm2-135m-instruct``,
LoRA r8, one Ray Train worker with 1 CPU, one epoch) with a seed, then judges the saved output on
held-out pairs of ours:

* ``dpo-<seed>``: configs/smollm2_lora_dpo.yaml (sigmoid, pref_ftx 0: the preference loss alone),
  ``kto-<seed>``: configs/smollm2_lora_kto.yaml (KTO alone, on single tagged answers) and
  ``orpo-<seed>``: configs/smollm2_lora_orpo.yaml (no reference model), judged on
  data/arith_pref_eval.json: 80 unseen "What is a+b?" prompts, the right sum against a near miss,
  which the base model gets right at chance.
* ``rm-<seed>``: configs/smollm2_lora_rm.yaml (LoRA + value head) on arith_format_pref, judged on
  arith_format_pref_eval (unseen prompts, the sum against a word); ``rm-sums-42``: the same on
  the near-miss pairs (arith_pref, judged on arith_pref_eval).

Figures: *log-prob accuracy*, the fraction of pairs where the model gives the chosen answer the
higher log-prob, of the base model and of the trained policy, and the mean log-prob margin
(chosen - rejected, nats); the *implied reward* accuracy and mean margin, beta * (log-ratio of
chosen - log-ratio of rejected) with log-ratio = log(policy / reference), the reward DPO and KTO
optimise (the reference is the base: the adapter switched off). For rm, the value head's pairwise
accuracy, the untrained head's (the Trainer's evaluation before step 1) against the trained one's,
and the trained mean score margin. Figures, not asserts.
"""

from __future__ import annotations

import os
import sys
import tempfile

from harness import REPO_ROOT, bench_main

EXAMPLES = {"dpo": "smollm2_lora_dpo.yaml", "kto": "smollm2_lora_kto.yaml",
            "orpo": "smollm2_lora_orpo.yaml", "rm": "smollm2_lora_rm.yaml"}
SEEDS = (42, 1, 2)
# name -> (stage, seed, held-out pairs, config overrides)
CASES = {f"{stage}-{seed}": (stage, seed, "arith_pref_eval", {}) for stage in ("dpo", "kto", "orpo") for seed in SEEDS}
CASES.update({f"rm-{seed}": ("rm", seed, "arith_format_pref_eval", {}) for seed in SEEDS})
# The reward model on the near-miss sums too (the pairs dpo learns from): what it makes of them.
CASES["rm-sums-42"] = ("rm", 42, "arith_pref_eval", {"dataset": "arith_pref"})
STEPS = 40  # one epoch of each example's data
COLUMNS = [
    ("case", "case", "{}"), ("steps", "steps", "{}"), ("train wall", "wall_s", "{:.0f} s"),
    ("base log-prob acc", "base_accuracy", "{:.3f}"), ("trained log-prob acc", "trained_accuracy", "{:.3f}"),
    ("base margin", "base_margin", "{:+.2f}"), ("trained margin", "trained_margin", "{:+.2f}"),
    ("implied reward acc", "reward_accuracy", "{:.3f}"), ("implied reward margin", "reward_margin", "{:+.3f}"),
]


def learning_config(stage: str, seed: int, held_out: str, overrides: dict, steps: int, out_dir: str) -> dict:
    import yaml

    with open(os.path.join(REPO_ROOT, "configs", EXAMPLES[stage]), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config.pop("num_train_epochs", None)  # max_steps decides
    config.update(seed=seed, max_steps=steps, output_dir=out_dir, dataset_dir=os.path.join(REPO_ROOT, "data"),
                  ray_storage_path=os.path.join(out_dir, "ray"), plot_loss=False, **overrides)
    if stage == "rm":  # the untrained head's accuracy comes from the Trainer's evaluation at step 0
        config.update(eval_dataset=held_out, eval_on_start=True, eval_steps=steps)
    else:  # judged after the run, on the saved adapter (below): no evaluation inside it
        config.pop("eval_dataset", None)
        config["eval_strategy"] = "no"
    return config


def held_out_pairs(dataset: str, stage: str, tokenizer, template) -> list[dict]:
    """A ranking dataset of ours tokenized as ``stage`` (dpo or rm) does it."""
    from registries.datasets import DataArguments
    from stages.table import STAGES

    data_args = DataArguments(dataset=dataset, dataset_dir=os.path.join(REPO_ROOT, "data"), cutoff_len=64)
    return STAGES[stage].tokenize_here(tokenizer, template, data_args)


def judge_reward_model(out_dir: str, held_out: str) -> dict:
    """The value head's pairwise accuracy and margin on the held-out pairs, untrained and trained."""
    from stages.training.callbacks import read_log
    from stages.training.value_head import score_pairs
    from stages.loading import load_reward_model

    model, _ = load_reward_model(out_dir)
    tokenizer, template = saved_tokenizer_and_template(out_dir)
    chosen, rejected = score_pairs(model, held_out_pairs(held_out, "rm", tokenizer, template), tokenizer.pad_token_id)
    before = next(r for r in read_log(out_dir) if "eval_accuracy" in r and r["current_steps"] == 0)
    return {"base_accuracy": before["eval_accuracy"], "trained_accuracy": float((chosen > rejected).float().mean()),
            "trained_margin": float((chosen - rejected).mean())}


def saved_tokenizer_and_template(out_dir: str):
    """The tokenizer saved with a run's output and its template (detected from the saved chat template)."""
    from registries.datasets import DataArguments
    from stages.run_args import ModelArguments
    from stages.loading import load_tokenizer_and_template

    return load_tokenizer_and_template(ModelArguments(model_name_or_path=out_dir), DataArguments())


def run_case(name: str, steps: int, model_path: str | None) -> dict:
    import time

    from cluster.driver import run_exp
    from stages.recipes.preference import judge_adapter

    stage, seed, held_out, overrides = CASES[name]
    with tempfile.TemporaryDirectory(prefix=f"bench-pref-{name}-") as out_dir:
        config = learning_config(stage, seed, held_out, overrides, steps, out_dir)
        start = time.time()
        run_exp(config)
        figures = {"steps": steps, "wall_s": time.time() - start}
        if stage == "rm":
            figures.update(judge_reward_model(out_dir, held_out))
        else:
            beta = None if stage == "orpo" else config["pref_beta"]  # orpo: no reference, no implied reward
            figures.update(judge_adapter(out_dir, held_out, config["dataset_dir"], beta))
    return figures


if __name__ == "__main__":
    sys.exit(bench_main(__file__, __doc__, CASES, lambda name: STEPS, run_case, COLUMNS))
