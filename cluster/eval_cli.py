"""``rayfactory eval cfg.yaml [key=value ...]``: score a model on lm-evaluation-harness tasks.

LLaMA-Factory's ``llamafactory-cli eval``: the model keys (model_name_or_path, adapter_name_or_path,
template, infer_backend) as chat reads them, plus ``task``, ``n_shot``, ``batch_size`` and
``save_dir``. The tasks are the harness's (mmlu, hellaswag, ... where their data can be reached),
RayFactory's own offline ones (rf_arith_mc, rf_arith_gen) and any in ``task_dir``. Prints the
harness's results table; with ``save_dir``, writes results.json and each task's samples there.
Runs in this process, on the configured engine, without Ray; with ``eval_num_workers`` above 1, on
that many Ray actors, which split each task's questions (fabric/evaluation.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from .config import ConfigError, RunConfig, load_config

RESULTS_FILE = "results.json"


def run_eval(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides, purpose="infer")
    check_eval_request(cfg)
    for note in cfg.notes:  # LLaMA-Factory keys that mean something else here, or nothing
        print(f"note: {note}")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # The harness tells every task with its own loader (ours: data/eval_tasks) how to pass it
    # arguments; nobody asked, and it reads like a problem.
    logging.getLogger("lm_eval.api.task").addFilter(lambda record: "Custom kwargs" not in record.getMessage())
    from lm_eval.utils import make_table

    from stages.inference.evaluation import check_tasks, task_manager

    manager = task_manager(cfg.evaluation)
    names = check_tasks(cfg.evaluation, manager)  # a wrong name is named before the model loads
    spec = cfg.inference_spec()
    adapters = ", ".join(spec.adapters) or "none"
    print(f"rayfactory eval: {spec.model.model_name_or_path} + adapters [{adapters}] on {', '.join(names)} "
          f"({cfg.inference.infer_backend} engine, template {cfg.data.template or 'the tokenizer default'})", flush=True)
    results = _evaluate(cfg, spec, manager)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if cfg.evaluation.save_dir:
        for path in save_results(results, cfg.evaluation.save_dir):
            print(f"wrote {path}")
    return 0


def _evaluate(cfg: RunConfig, spec, manager) -> dict:
    """In this process, or over eval_num_workers Ray actors (a local Ray, or ray_address's cluster)."""
    from stages.inference.evaluation import evaluate

    if cfg.evaluation.eval_num_workers == 1:
        return evaluate(spec, cfg.evaluation, manager)
    from fabric.evaluation import evaluate_on_ray
    from fabric.ray_session import connect, shutdown, started_local_ray

    connect(cfg.ray)
    try:
        return evaluate_on_ray(spec, cfg.evaluation, cfg.ray.resources_per_worker)
    finally:
        if started_local_ray():
            shutdown()


def check_eval_request(cfg: RunConfig) -> None:
    """What ``rayfactory eval`` refuses before anything loads."""
    from .extras import check_extras

    ev = cfg.evaluation
    check_extras({"task": ev.task or True}, lambda key: cfg.source)
    if ev.lang == "zh" and "mmlu" in ev.task_names():
        raise ConfigError(
            f"lang: zh asks for Chinese prompts, but the harness's mmlu asks in English (in {cfg.source}). For "
            "Chinese questions run cmmlu_test or ceval_validation; for mmlu remove lang or set lang: en."
        )
    if ev.save_dir and os.path.exists(os.path.join(ev.save_dir, RESULTS_FILE)):
        raise ConfigError(
            f"save_dir {ev.save_dir} already holds a {RESULTS_FILE} (in {cfg.source}); it is not overwritten. "
            "Name a new save_dir, or move the old results away."
        )


def save_results(results: dict, save_dir: str) -> list[str]:
    """results.json (the harness's dict, less the samples) and samples_<task>.jsonl per task."""
    os.makedirs(save_dir, exist_ok=True)
    samples = results.get("samples", {})
    summary = {key: value for key, value in results.items() if key != "samples"}
    written = [os.path.join(save_dir, RESULTS_FILE)]
    with open(written[0], "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str, ensure_ascii=False)
    for task, rows in samples.items():
        path = os.path.join(save_dir, f"samples_{task}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")
        written.append(path)
    return written
