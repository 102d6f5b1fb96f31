"""Rollout engines: vLLM behind Ray actors (vLLM itself is imported only inside an engine)."""

from .vllm_engine import VLLMEngine, VLLMEngineConfig, VLLMNotInstalled, engine_runtime_env, require_vllm

__all__ = ["VLLMEngine", "VLLMEngineConfig", "VLLMNotInstalled", "engine_runtime_env", "require_vllm"]
