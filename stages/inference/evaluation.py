"""Runs lm-evaluation-harness tasks on a model loaded the RayFactory way (``rayfactory eval``).

Tasks come from the harness's registry, from the tasks RayFactory ships (data/eval_tasks: small
offline ones of our own) and from the config's ``task_dir``. The harness does the rest as its
users know it: few-shot sampling, prompts, filters, metrics and their standard errors.
"""

from __future__ import annotations

import difflib
import functools
import os

from registries.errors import UserError

from .eval_args import EvaluationArguments
from .loading import InferenceSpec

SHIPPED_TASKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "data", "eval_tasks")


class EvalTaskError(UserError):
    """A task name the harness does not know, or a task folder that is not there."""


def task_manager(args: EvaluationArguments):
    """The harness's task index: its own tasks, ours, and the config's task_dir."""
    paths = [SHIPPED_TASKS]
    if args.task_dir:
        folder = os.path.abspath(os.path.expanduser(args.task_dir))
        if not os.path.isdir(folder):
            raise EvalTaskError(
                f"task_dir {args.task_dir!r} is not a folder ({folder}). Point it at a folder of lm-evaluation-harness "
                "task YAML files, or remove it to use the harness's tasks and RayFactory's own (data/eval_tasks)."
            )
        paths.append(folder)
    return _indexed(tuple(paths))


@functools.lru_cache(maxsize=4)
def _indexed(paths: tuple[str, ...]):
    """Indexing the harness's thousands of task files takes seconds: once per process and folder set."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths))


def check_tasks(args: EvaluationArguments, manager) -> list[str]:
    """The configured task names, each known to ``manager`` (else one paragraph naming the closest)."""
    names = args.task_names()
    if not names:
        raise EvalTaskError(
            "task is missing: name the lm-evaluation-harness tasks to run, comma-separated, e.g. task: rf_arith_mc "
            "(RayFactory's own, offline), mmlu or hellaswag. `lm_eval ls tasks` lists the harness's."
        )
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            where = f", RayFactory's (data/eval_tasks) and task_dir {args.task_dir}" if args.task_dir else \
                " and RayFactory's (data/eval_tasks)"
            raise EvalTaskError(
                f"task {name!r} is not an lm-evaluation-harness task here: it is not among the harness's tasks{where}."
                f"{hint} Fix the name, or put its task YAML in a folder and set task_dir to that folder."
            )
    return names


def evaluate(spec: InferenceSpec, args: EvaluationArguments, manager=None, chat=None, rank: int = 0,
             world_size: int = 1) -> dict | None:
    """The harness's results dict (``results``, ``configs``, ``n-shot``, ``samples`` ...) for the
    configured tasks. ``chat``: a ChatModel already loaded (else one is built from ``spec``).
    ``rank`` / ``world_size``: one member of a torch.distributed group that splits the questions;
    rank 0 returns the results of all, the others None."""
    from lm_eval import simple_evaluate

    from .chat_model import ChatModel
    from .harness_model import HarnessModel

    manager = manager or task_manager(args)
    names = check_tasks(args, manager)
    own = chat is None
    chat = chat or ChatModel(spec)
    try:
        model = HarnessModel(chat, batch_size=args.batch_size, chat_prompts=args.apply_chat_template, rank=rank,
                             world_size=world_size)
        return simple_evaluate(
            model=model, tasks=names, num_fewshot=args.n_shot, batch_size=args.batch_size, limit=args.eval_limit,
            task_manager=manager, apply_chat_template=args.apply_chat_template, log_samples=True,
        )
    finally:
        if own:
            chat.close()
