"""The rollout role's actor: a vLLM engine that an ActorGroup can place on its bundles."""

from __future__ import annotations

from ..actor_group import RoleWorker
from .vllm_engine import VLLMEngine


class RolloutActor(RoleWorker, VLLMEngine):
    """A vLLM engine in a Ray actor on its rollout bundle (vLLM itself is imported in __init__)."""
