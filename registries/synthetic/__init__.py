"""Synthetic, checkable tasks and the demo datasets built from them (``python -m registries.synthetic``)."""

from .generate import SEED, build, split_prompts, write
from .tasks import (
    TASKS,
    SyntheticTask,
    check_answer,
    exact_match_accuracy,
    get_task,
    register_task,
    task_for_prompt,
)

__all__ = [
    "SEED",
    "TASKS",
    "SyntheticTask",
    "build",
    "check_answer",
    "exact_match_accuracy",
    "get_task",
    "register_task",
    "split_prompts",
    "task_for_prompt",
    "write",
]
