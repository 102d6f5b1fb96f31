"""The rollout role's actor: a vLLM engine (stages/engines/vllm_backend.py) that an ActorGroup
places on its rollout bundles. vLLM itself is imported only inside the engine's constructor.

With partial rollouts the actor has a second thread, the ``weights`` concurrency group, on which
pushes (``load_in_flight``) run while a generation is in flight on the default one; the engine
itself takes them between two decoding steps (stages/engines/inflight_weights.py). Without, the
actor runs one call at a time in the order sent, which the asynchronous schedule's version stamps
rely on."""

from __future__ import annotations

import time
from typing import Optional

from stages.engines.types import Completion, SamplingSpec
from stages.engines.vllm_backend import VLLMEngine, rollout_env_vars

from .actor_group import RoleWorker

WEIGHTS_GROUP = "weights"  # the concurrency group in-flight pushes run on


class RolloutActor(RoleWorker, VLLMEngine):
    """A vLLM engine built for rollouts (offline ``LLM``, core in the actor's process)."""

    def generate_timed(self, prompt_ids: list[list[int]], sampling: SamplingSpec,
                       after_loads: Optional[int] = None) -> tuple[list[Completion], float, float]:
        """``generate_batch`` and the wall-clock span it ran (time.time: comparable across the
        processes of a node), from which the controller measures overlap with the policy. With
        ``after_loads`` (partial rollouts): ``generate_stepwise``, once that many in-flight pushes
        are loaded."""
        start = time.time()
        completions = (self.generate_batch(prompt_ids, sampling) if after_loads is None
                       else self.generate_stepwise(prompt_ids, sampling, after_loads))
        return completions, start, time.time()


def rollout_class_options(partial_rollout: bool) -> dict:
    """The rollout actor class's Ray options (``ray.remote``'s): the ``weights`` thread for
    partial rollouts."""
    return {"concurrency_groups": {WEIGHTS_GROUP: 1}} if partial_rollout else {}


def engine_runtime_env() -> dict:
    """The ``runtime_env`` an engine actor needs (merge it into the launcher's own)."""
    return {"env_vars": rollout_env_vars()}
