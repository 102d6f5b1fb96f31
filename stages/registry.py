"""Stage name -> the function a Ray Train worker runs for it."""

from __future__ import annotations

from typing import Callable


def get_stage_runner(stage: str) -> Callable:
    if stage in ("pt", "sft"):
        from .causal_lm import run_causal_lm

        return run_causal_lm
    raise ValueError(
        f"stage {stage!r} is not available yet; this version trains pt and sft "
        "(rm, dpo, kto and ppo are on the roadmap)."
    )
