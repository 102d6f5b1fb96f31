"""The policy's weights as the rollout engines load them: full, HF-named, adapter merged in.

A rollout engine holds a plain copy of the base architecture, so whatever the policy trains (all
weights, or a LoRA adapter plus ``modules_to_save``) is shipped as the state dict a fresh
``AutoModelForCausalLM`` of the base would load. Torch and peft only; the transport (Ray object
store, NCCL) lives in ``fabric/weight_sync.py``.
"""

from __future__ import annotations

import sys
from typing import Mapping, Optional

import torch


def export_state_dict(model, dtype: Optional[torch.dtype] = None, device="cpu",
                      copy: bool = True) -> dict[str, torch.Tensor]:
    """A snapshot (copies on ``device``) of ``model``'s weights under the base model's HF names.

    ``model`` is a transformers causal LM or a peft ``PeftModel`` of one. A LoRA-style adapter is
    merged (peft's own ``merge_adapter``, so rsLoRA, DoRA and friends merge the way peft
    computes them), read, and taken out again; ``modules_to_save`` are exported as the active
    adapter's trained copy. The policy keeps training on bit-identical weights: merging and
    unmerging in place is not exact (``W + BA - BA`` rounds, badly so in bf16), so the base
    layers' weights are copied aside before the merge and copied back after it.

    Tied weights (``tie_word_embeddings``: ``lm_head.weight`` is ``embed_tokens.weight``) are
    exported once, under the source name, as ``save_pretrained`` writes them: a fresh HF model
    re-ties on load and vLLM's loaders skip ``lm_head`` for tied models. ``dtype`` casts the
    floating-point tensors (e.g. to the engines' dtype, to ship fewer bytes). ``copy=False``: a
    plain model's tensors already of that dtype and device are handed out as they are (for a caller
    that copies them itself at once); a merged adapter is always a copy.
    Parameters partitioned by DeepSpeed ZeRO-3 must be gathered by the caller.
    """
    def snapshot(tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else None
        return tensor.detach().to(device=device, dtype=cast, copy=copy).contiguous()

    peft = sys.modules.get("peft")  # a PeftModel can only exist once peft was imported
    with torch.no_grad():
        if peft is not None and isinstance(model, peft.PeftModel):
            base, state = _merged_state(model, snapshot)  # copies taken while merged
            return _drop_tied(base, state)
        return {name: snapshot(t, copy) for name, t in _drop_tied(model, model.state_dict()).items()}


def state_dict_to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """``state`` as safetensors bytes; tensors are made contiguous and storages unshared first
    (safetensors refuses both), leaving ``state`` itself untouched."""
    from safetensors.torch import save

    seen: set[int] = set()
    flat = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tensor = tensor.clone()
        seen.add(ptr)
        flat[name] = tensor
    return save(flat)


def export_adapter(model, dtype: Optional[torch.dtype] = None) -> bytes:
    """A PeftModel's active LoRA adapter as one safetensors blob: its tensors under the names
    ``save_pretrained`` writes, and its adapter_config.json in the metadata. What an engine needs to
    serve the adapter beside an untouched base (stages/engines/vllm_adapters.py unpacks it)."""
    import json

    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    from stages.engines.vllm_adapters import ADAPTER_CONFIG_KEY

    name = model.active_adapter
    state = {k: t.detach().to("cpu", dtype=dtype if dtype is not None and t.is_floating_point() else None).contiguous()
             for k, t in get_peft_model_state_dict(model, adapter_name=name).items()}
    config = model.peft_config[name].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}  # JSON has no sets
    return save(state, metadata={ADAPTER_CONFIG_KEY: json.dumps(config)})


def bytes_to_state_dict(blob: bytes) -> dict[str, torch.Tensor]:
    """The state dict ``state_dict_to_bytes`` wrote (CPU tensors owning their memory)."""
    from safetensors.torch import load

    return load(blob)


def _merged_state(model, snapshot) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The HF-named state dict (``snapshot`` copies) of a PeftModel with its active adapter
    merged into the base."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    base = model.get_base_model()
    tuner = model.base_model
    prefix = getattr(tuner, "prefix", "lora_")  # the names of the adapter's own tensors
    layers = [m for m in base.modules() if isinstance(m, BaseTunerLayer)]
    merge = bool(layers) and not any(m.merged for m in layers)  # already merged (inference): read as is
    if merge:
        saved = [(p, p.detach().to("cpu", copy=True)) for m in layers for p in m.get_base_layer().parameters()]
        tuner.merge_adapter()
    try:
        raw = base.state_dict()
        state = {}
        keep = _modules_to_save_prefixes(base, ModulesToSaveWrapper)
        for name, tensor in raw.items():
            if any(part.startswith(prefix) for part in name.split(".")):
                continue  # lora_A / lora_B / lora_magnitude_vector / ...: merged already
            owner = next((w for w in keep if name.startswith(w + ".")), None)
            if owner is not None:
                used = keep[owner]
                if not name.startswith(used):
                    continue  # the frozen original or another adapter's copy
                name = owner + "." + name[len(used):]
            state[name.replace(".base_layer.", ".")] = snapshot(tensor)
    finally:
        if merge:
            tuner.unmerge_adapter()  # peft's bookkeeping (merged_adapters) back to unmerged ...
            for param, original in saved:  # ... and the exact pre-merge values back
                param.data.copy_(original)
    leftovers = [n for n in state if ".original_module." in n or ".modules_to_save." in n or "base_layer" in n]
    if leftovers:
        raise RuntimeError(f"peft wrapper names left after export (an adapter type not handled here): {leftovers[:5]}")
    return base, state


def _modules_to_save_prefixes(base, wrapper_cls) -> dict[str, str]:
    """For each ``modules_to_save`` wrapper: its path -> the name prefix of the copy in use
    (the active adapter's trained copy, or the original when no adapter is active)."""
    out = {}
    for path, module in base.named_modules():
        if isinstance(module, wrapper_cls):
            active = [a for a in module.active_adapters if a in module.modules_to_save]
            out[path] = f"{path}.modules_to_save.{active[0]}." if active else f"{path}.original_module."
    return out


def _drop_tied(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the targets of tied weights (``{target: source}`` from transformers), after
    checking they still equal their source: a tie broken in training (e.g. ``lm_head`` in
    ``modules_to_save`` of a tied model) cannot be loaded by a tied engine."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in tied.items():
        if target in state and source in state:
            if state[target].data_ptr() != state[source].data_ptr() and not torch.equal(state[target], state[source]):
                from registries.errors import UserError

                raise UserError(
                    f"{target} was trained apart from {source}, but the model ties them "
                    "(tie_word_embeddings), so the rollout engines would load only one of them. "
                    "Train both together (e.g. put both in modules_to_save, or neither)."
                )
            del state[target]
    return state
