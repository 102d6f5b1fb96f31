"""rayfactory eval over two Ray actors (eval_num_workers: 2): the harness splits each task's questions
between them and gathers on rank 0; every question's answer and every metric come out as they do
in one process. Zero-shot: with few-shot examples, the harness draws them per process in order
(its "offset doc_id by rank" TODO), so a split run asks its questions with other examples, as the
harness's own data-parallel runs do (docs/evaluation.md)."""

from __future__ import annotations

import math

from tests.inference.conftest import BASE, TEMPLATE

TASKS = "rf_arith_mc,rf_arith_gen,rf_arith_text"
LIMIT = 6


def test_two_actors_answer_and_score_as_one_process_does(ray_session):
    from cluster.config import load_config
    from fabric.evaluation import evaluate_on_ray
    from stages.inference.evaluation import evaluate

    cfg = load_config({"model_name_or_path": BASE, "template": TEMPLATE, "task": TASKS, "n_shot": 0,
                       "eval_limit": LIMIT, "eval_num_workers": 2}, purpose="infer")
    spread = evaluate_on_ray(cfg.inference_spec(), cfg.evaluation, {"CPU": 1})
    alone = evaluate(cfg.inference_spec(), cfg.evaluation)

    for task in TASKS.split(","):
        by_doc = lambda results: {row["doc_id"]: row["resps"] for row in results["samples"][task]}  # noqa: E731
        ours, theirs = by_doc(spread), by_doc(alone)
        assert sorted(ours) == sorted(theirs) == list(range(LIMIT)), task  # each question once, from both actors
        for doc in theirs:
            for mine, other in zip(ours[doc], theirs[doc]):
                if isinstance(other[0], str):
                    assert mine == other, (task, doc)
                else:  # (log-likelihood, greedy) or a rolling log-likelihood
                    first = lambda r: r[0][0] if isinstance(r[0], (list, tuple)) else r[0]  # noqa: E731
                    assert math.isclose(first(mine), first(other), abs_tol=1e-4), (task, doc, mine, other)
        for metric, value in alone["results"][task].items():
            if isinstance(value, float):
                assert math.isclose(spread["results"][task][metric], value, rel_tol=1e-4, abs_tol=1e-6), (task, metric)
