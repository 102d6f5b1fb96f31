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

    def rf_join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str) -> None:
        """Join the policy's weight group (``weight_group.join``) as rank ``rank_offset`` + this
        worker's rank in its engine (tensor-parallel workers each receive the full weights)."""
        from .weight_group import join

        self.rf_weight_group = join(host, port, rank_offset + getattr(self, "rank", 0), world_size, backend)
        self.rf_weight_backend = backend

    def rf_receive_weights(self, plan: list) -> int:
        """Receive one weight push bucket by bucket (``weight_buckets.receive``) straight into the
        model's own ``load_weights`` (as ``rf_load_safetensors``); returns the number of tensors.
        Whatever the loader leaves unread is still received, so both sides stay in step."""
        from .weight_buckets import receive
        from .weight_group import broadcast, buffer_device

        group = getattr(self, "rf_weight_group", None)
        if group is None:
            raise RuntimeError("rf_receive_weights before rf_join_weight_group: this engine is in no weight group")
        count = 0
        incoming = receive(plan, lambda buffer: broadcast(group, buffer), buffer_device(self.rf_weight_backend))

        def counted():
            nonlocal count
            for item in incoming:
                count += 1
                yield item

        try:
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        finally:
            for _ in incoming:  # a loader that stopped early (or failed) must not leave the sender waiting
                pass
        return count
