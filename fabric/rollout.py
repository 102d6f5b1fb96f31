"""The rollout role's actor: a vLLM engine (stages/engines/vllm_backend.py) that an ActorGroup
places on its rollout bundles. vLLM itself is imported only inside the engine's constructor."""

from __future__ import annotations

from stages.engines.vllm_backend import VLLMEngine, rollout_env_vars

from .actor_group import RoleWorker


class RolloutActor(RoleWorker, VLLMEngine):
    """A vLLM engine built for rollouts (offline ``LLM``, core in the actor's process)."""


def engine_runtime_env() -> dict:
    """The ``runtime_env`` an engine actor needs (merge it into the launcher's own)."""
    return {"env_vars": rollout_env_vars()}
