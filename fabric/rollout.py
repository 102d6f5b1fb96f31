"""The rollout role's actor: a vLLM engine (stages/engines/vllm_backend.py) that an ActorGroup
places on its rollout bundles. vLLM itself is imported only inside the engine's constructor."""

from __future__ import annotations

import time

from stages.engines.types import Completion, SamplingSpec
from stages.engines.vllm_backend import VLLMEngine, rollout_env_vars

from .actor_group import RoleWorker


class RolloutActor(RoleWorker, VLLMEngine):
    """A vLLM engine built for rollouts (offline ``LLM``, core in the actor's process)."""

    def generate_timed(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> tuple[list[Completion], float, float]:
        """``generate_batch`` and the wall-clock span it ran (time.time: comparable across the
        processes of a node), from which the controller measures overlap with the policy."""
        start = time.time()
        completions = self.generate_batch(prompt_ids, sampling)
        return completions, start, time.time()


def engine_runtime_env() -> dict:
    """The ``runtime_env`` an engine actor needs (merge it into the launcher's own)."""
    return {"env_vars": rollout_env_vars()}
