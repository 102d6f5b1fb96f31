"""The data of RayFactory's own lm-evaluation-harness tasks (data/eval_tasks/rayfactory).

Addition questions with four choices and an answer, from the same split as the demo datasets:
the test rows are arith_eval's held-out prompts, the few-shot rows arith_train's. One file per
split serves both tasks: ``rf_arith_mc`` scores the choices (log-likelihood), ``rf_arith_gen``
generates the answer and compares it exactly. The task YAML files beside them are written by hand.
"""

from __future__ import annotations

import json
import random

from .tasks import ADDITION

FEWSHOT_ROWS = 40  # the train split only serves few-shot examples
CHOICES = 4


def eval_task_files(train: list[str], held_out: list[str], seed: int) -> dict[str, str]:
    """File name -> text, for the given train and held-out addition prompts."""
    rng = random.Random(f"{seed}:eval_tasks")
    return {
        "arith_train.jsonl": _jsonl([_row(p, rng) for p in train[:FEWSHOT_ROWS]]),
        "arith_test.jsonl": _jsonl([_row(p, rng) for p in held_out]),
    }


def _row(prompt: str, rng: random.Random) -> dict:
    answer = ADDITION.solve(prompt)
    total = int(answer)
    # Near misses, the kind a model that almost adds would give: off by one or two, or by ten.
    near = [str(total + d) for d in (-2, -1, 1, 2, -10, 10) if total + d >= 0]
    ordered = rng.sample(near, CHOICES - 1) + [answer]
    rng.shuffle(ordered)
    return {"question": prompt, "choices": ordered, "label": ordered.index(answer), "answer": answer}


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
