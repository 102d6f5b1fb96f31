"""Methods vLLM mixes into its worker class (``worker_extension_cls``), called by
``LLM.collective_rpc``.

vLLM resolves this class by its dotted name inside the engine's worker process(es), so it must
stay importable as ``stages.engines.vllm_weights.WeightReceiver`` and import nothing heavy at
module level. The methods run with ``self`` = the vLLM worker; names must not clash with the
worker's own attributes (vLLM asserts that).
"""

from __future__ import annotations


class WeightReceiver:
    def rf_load_safetensors(self, blob: bytes) -> int:
        """Load a full HF-named state dict (safetensors bytes) into the running model; returns
        the number of tensors.

        ``reload_weights(is_checkpoint_format=True)`` goes through the model's own
        ``load_weights`` (q/k/v and gate/up fusing, tied ``lm_head`` skipping) inside vLLM's
        layer-wise reload, which re-runs the post-load processing: the CPU backend prepacks its
        linear layers at start-up, so writing into the parameters directly would be ignored.
        """
        from safetensors.torch import load

        state = load(blob)
        if not state:
            raise ValueError("empty weight update: no tensors in the blob")
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        return len(state)
