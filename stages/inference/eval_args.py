"""The evaluation half of a config: what ``rayfactory eval`` runs on lm-evaluation-harness.

The key names are LLaMA-Factory's ``llamafactory-cli eval`` keys (``task``, ``task_dir``,
``n_shot``, ``batch_size``, ``lang``, ``save_dir``) plus the harness's own where LLaMA-Factory
has none (``apply_chat_template``, ``eval_limit``). LLaMA-Factory's three benchmarks, named its way
(``mmlu_test``, ``cmmlu_test``, ``ceval_validation``), are the harness's tasks of the same data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from registries.errors import ArgumentError

# LLaMA-Factory's task names (benchmark_split) -> the harness task that scores the same split.
LF_TASKS = {"mmlu_test": "mmlu", "cmmlu_test": "cmmlu", "ceval_validation": "ceval-valid"}
LF_LANGUAGES = ("en", "zh")


@dataclass
class EvaluationArguments:
    # harness task or group names, comma-separated (e.g. rf_arith_mc,rf_arith_gen; mmlu); LLaMA-Factory's
    # mmlu_test, cmmlu_test and ceval_validation name the harness's mmlu, cmmlu and ceval-valid
    task: Optional[str] = None
    # a folder of harness task YAML files (and their data), searched besides the harness's own
    # tasks and the tasks RayFactory ships (data/eval_tasks)
    task_dir: Optional[str] = None
    n_shot: Optional[int] = None  # few-shot examples per question (None: each task's own default)
    batch_size: int = 4  # sequences per forward pass while scoring
    # LLaMA-Factory's prompt language for mmlu/cmmlu/ceval; harness tasks are written in one language
    # each, so only the default "en" (or "zh" with a Chinese task) is accepted
    lang: str = "en"
    save_dir: Optional[str] = None  # where results.json and the per-sample log go (must not hold results yet)
    # render each question with the model's chat template (the harness's --apply_chat_template);
    # off scores the plain text, as base-model benchmarks are reported
    apply_chat_template: bool = False
    eval_limit: Optional[float] = None  # the first N questions of each task (a fraction below 1: that share)
    # rayfactory eval: Ray actors that split each task's questions, one model each (resources_per_worker
    # each); 1 evaluates in the command's own process, without Ray
    eval_num_workers: int = 1
    # harness tasks scored at every evaluation of a pt / sft / dpo / kto run (eval_strategy, eval_steps),
    # logged as eval_tasks/<task>/<metric> beside eval_loss; the keys above (n_shot, eval_limit, ...) apply
    eval_tasks: Optional[str] = None

    def __post_init__(self) -> None:
        if self.n_shot is not None and self.n_shot < 0:
            raise ArgumentError("n_shot", f"n_shot is a number of examples, 0 or more; got {self.n_shot}.")
        if self.batch_size < 1:
            raise ArgumentError("batch_size", f"batch_size must be at least 1, got {self.batch_size}.")
        if self.lang not in LF_LANGUAGES:
            raise ArgumentError("lang", f"lang is en or zh (LLaMA-Factory's values), got {self.lang!r}.")
        if self.eval_num_workers < 1:
            raise ArgumentError("eval_num_workers", f"eval_num_workers must be at least 1, got {self.eval_num_workers}.")
        if self.eval_limit is not None and self.eval_limit <= 0:
            raise ArgumentError("eval_limit", f"eval_limit must be positive, got {self.eval_limit}.")

    def task_names(self) -> list[str]:
        """The harness names of the configured tasks, LLaMA-Factory's names translated."""
        return _names(self.task)

    def during_training(self) -> "EvaluationArguments":
        """These arguments with ``eval_tasks`` as the tasks to run."""
        return dataclasses.replace(self, task=self.eval_tasks)


def _names(text: Optional[str]) -> list[str]:
    names = [name.strip() for name in (text or "").split(",") if name.strip()]
    return [LF_TASKS.get(name, name) for name in names]
