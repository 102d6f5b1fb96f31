"""Generation engines: one token-ids-in / token-ids-out interface (types.py), two backends.

* hf_backend.HFEngine: transformers ``generate`` on a model in this process (the RL policy's own
  weights for ``rollout_backend: hf``, or a loaded model for chat, serve and predict);
* vllm_backend.VLLMEngine: vLLM, offline for rollout actors (with the weight-update hooks) or
  AsyncLLM for concurrent requests.

Rollouts (stages/rl), ChatModel (chat, serve, predict, the web UI) and tests all generate through
these; nothing else calls ``model.generate`` or vLLM.
"""
