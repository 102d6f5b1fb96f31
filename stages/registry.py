"""Stage name -> the function a Ray Train worker runs for it."""

from __future__ import annotations

import importlib
from typing import Callable

# stage -> "module:function" inside stages/, imported only by the workers that run it
_RUNNERS = {
    "pt": "causal_lm:run_causal_lm",
    "sft": "causal_lm:run_causal_lm",
    "rm": "rm:run_rm",
    "dpo": "dpo:run_dpo",
    "kto": "kto:run_kto",
}


def check_stage(stage: str) -> None:
    """ValueError for a stage the config knows but no worker can run yet."""
    if stage not in _RUNNERS:
        raise ValueError(
            f"stage {stage!r} cannot be trained yet; available: {', '.join(_RUNNERS)} (ppo is on the roadmap)."
        )


def get_stage_runner(stage: str) -> Callable:
    check_stage(stage)
    module, function = _RUNNERS[stage].split(":")
    return getattr(importlib.import_module(f"stages.{module}"), function)
