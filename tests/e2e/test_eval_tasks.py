"""eval_tasks: harness tasks scored at each evaluation of an sft run, logged beside eval_loss.

The run scores perplexity on rf_arith_text (continuous, so a model that did not change would show)
and multiple choice on rf_arith_mc, at steps 2 and 4. Its step-4 scores must be what
``rayfactory eval`` gives on the saved model: the callback scores the very weights being trained.
"""

from __future__ import annotations

import math

from cluster.driver import run_exp
from stages.training.callbacks import read_log

TASKS = "rf_arith_text,rf_arith_mc"
LIMIT = 8


def test_eval_tasks_log_a_curve_that_rayfactory_eval_reproduces_on_the_saved_model(ray_session, sft_config):
    from cluster.config import load_config
    from stages.inference.evaluation import evaluate
    from stages.inference.harness_eval import flatten_results

    config = sft_config(max_steps=4, eval_dataset="arith_eval", eval_strategy="steps", eval_steps=2,
                        per_device_eval_batch_size=16, eval_tasks=TASKS, n_shot=0, eval_limit=LIMIT)
    result = run_exp(config)

    rows = [r for r in read_log(result.output_dir) if "eval_tasks/rf_arith_text/word_perplexity" in r]
    assert [r["current_steps"] for r in rows] == [2, 4]
    for row in rows:
        assert 0 <= row["eval_tasks/rf_arith_mc/acc"] <= 1 and row["eval_tasks/rf_arith_text/word_perplexity"] > 1
    first, last = (r["eval_tasks/rf_arith_text/word_perplexity"] for r in rows)
    assert first != last, "the score did not move while the model trained"

    saved = load_config({"model_name_or_path": result.output_dir, "template": "qwen", "task": TASKS, "n_shot": 0,
                         "eval_limit": LIMIT}, purpose="infer")
    again = flatten_results(evaluate(saved.inference_spec(), saved.evaluation))
    for key, value in again.items():
        assert math.isclose(rows[-1][key], value, rel_tol=1e-4), (key, rows[-1][key], value)
