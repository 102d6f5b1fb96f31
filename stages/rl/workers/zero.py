"""DeepSpeed ZeRO for the RL roles that learn (the policy, PPO's critic).

The run's ``deepspeed`` key is the one the sft stages read (cluster/training_checks.py turns a
file path into its JSON, e.g. configs/deepspeed/ds_z2_config.json or ds_z3_config.json); here it
becomes a DeepSpeed engine around the role's model instead of DDP. What this module holds:

* ``engine_config``: the JSON with its ``"auto"`` values filled from the trainer options, as the
  HF Trainer fills them for the fields that matter to an RL step (micro batch, accumulation,
  clipping, precision, bucket sizes, the optimizer's and scheduler's parameters).
* ``build_engine``: ``deepspeed.initialize`` with the role's own AdamW and schedule, or
  DeepSpeed's when the JSON names an ``optimizer`` / ``scheduler``.
* ``gathered``: the one way every reader of the full weights (the weight sync's exports, the
  final save) sees a ZeRO-3 model whole; a no-op for anything else.
* ``ranks_max`` / ``idle_forward``: keeping the ranks' collective calls paired. Under ZeRO-3 every
  forward all-gathers parameters, and ZeRO-2's backwards reduce gradients, so each rank
  must run as many as the others even when the token budget splits their samples differently.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Callable, Optional

import torch

from registries.errors import UserError

AUTO = "auto"
# Every "auto" engine_config fills; any other is an error (check_autos), at config load and at setup.
FILLED = frozenset({
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
    "bf16.enabled", "fp16.enabled", "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps",
})


class ZeroConfigError(UserError):
    """A deepspeed config the RL roles cannot run."""


def deepspeed_config(options) -> Optional[dict]:
    """The run's DeepSpeed JSON (a dict once the config was loaded), or None without one."""
    value = options.values.get("deepspeed") if hasattr(options, "values") else None
    return value or None


def zero_stage(ds_config: Optional[dict]) -> int:
    return int((ds_config or {}).get("zero_optimization", {}).get("stage", 0) or 0)


def engine_config(ds_config: dict, options, world_size: int, model: torch.nn.Module, learning_rate: float,
                  total_updates: int, warmup_steps: int) -> dict:
    """A copy of ``ds_config`` with every ``"auto"`` an RL role meets filled from the trainer options.

    One optimizer step per ``_optimizer_step`` call, whatever number of micro-batches the token
    budget gives it: the role sets DeepSpeed's accumulation boundary itself, so
    gradient_accumulation_steps is 1 and train_batch_size is micro x ranks (DeepSpeed only checks
    that the three agree). Explicit numbers in the JSON are kept as written.
    """
    check_autos(ds_config)
    config = copy.deepcopy(ds_config)
    micro = max(1, int(options.per_device_train_batch_size))
    _fill(config, "train_micro_batch_size_per_gpu", micro)
    _fill(config, "gradient_accumulation_steps", 1)
    gas = int(config["gradient_accumulation_steps"]) if "gradient_accumulation_steps" in config else 1
    _fill(config, "train_batch_size", int(config.get("train_micro_batch_size_per_gpu", micro)) * gas * world_size)
    _fill(config, "gradient_clipping", float(options.max_grad_norm or 0.0))
    bf16 = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32) == torch.bfloat16
    _fill(config.get("bf16") or {}, "enabled", bf16)  # DeepSpeed's bf16 mode: the model as loaded
    _fill(config.get("fp16") or {}, "enabled", False)  # cluster/rl_checks.py refuses fp16 for RL
    hidden = _hidden_size(model)
    zero = config.get("zero_optimization") or {}
    for key, value in (("reduce_bucket_size", hidden and hidden * hidden),
                       ("stage3_prefetch_bucket_size", hidden and int(0.9 * hidden * hidden)),
                       ("stage3_param_persistence_threshold", hidden and 10 * hidden)):
        if zero.get(key) == AUTO:
            if value:
                zero[key] = value
            else:  # no hidden size to size them by: DeepSpeed's own defaults
                del zero[key]
    betas = [options.adam_beta1, options.adam_beta2]
    if "optimizer" in config:  # DeepSpeed's own optimizer (e.g. its CPU Adam under offload)
        params = config["optimizer"].setdefault("params", {})
        for key, value in (("lr", learning_rate), ("betas", betas), ("eps", options.adam_epsilon),
                           ("weight_decay", options.weight_decay)):
            _fill(params, key, value)
    else:  # ours; DeepSpeed asks for this flag before it wraps an optimizer it did not test
        config.setdefault("zero_allow_untested_optimizer", True)
        if _offloads_optimizer(zero):
            # ZeRO-Offload steps the optimizer on the host's fp32 partitions; DeepSpeed wants its
            # CPU Adam there and refuses a torch one unless told that it is meant.
            config.setdefault("zero_force_ds_cpu_optimizer", False)
    if "scheduler" in config:
        params = config["scheduler"].setdefault("params", {})
        for key, value in (("warmup_min_lr", 0.0), ("warmup_max_lr", learning_rate),
                           ("warmup_num_steps", warmup_steps), ("total_num_steps", total_updates)):
            _fill(params, key, value)
    return config


def check_autos(ds_config: dict, place: str = "deepspeed") -> None:
    """Refuse an ``"auto"`` that engine_config does not fill (the HF Trainer fills a few more,
    for features the RL roles do not use). ``place``: how the message names the key."""
    left = [path for path in _autos(ds_config) if path not in FILLED]
    if left:
        raise ZeroConfigError(
            f"{place}: the config has \"auto\" in {', '.join(left)}, which the RL roles do not know how to "
            "fill (they fill the batch sizes, gradient_accumulation_steps, gradient_clipping, fp16/bf16, the ZeRO "
            "bucket sizes and the optimizer's and scheduler's parameters). Write a value there, or remove the key "
            "to take DeepSpeed's default."
        )


def build_engine(model: torch.nn.Module, config: dict, optimizer: Optional[torch.optim.Optimizer],
                 make_scheduler: Callable):
    """``(engine, optimizer, scheduler)``: DeepSpeed's engine around ``model``. ``optimizer`` is
    ours (None when ``config`` names DeepSpeed's own); ``make_scheduler(optimizer)`` builds our
    schedule on whichever optimizer the engine steps, unless ``config`` names a scheduler. The
    engine steps both, once per accumulation boundary.

    Joins the torch.distributed group the role's actors already formed (gloo on CPU, NCCL on GPU);
    a process outside any group gets a one-rank one from MASTER_ADDR / MASTER_PORT.
    """
    import deepspeed

    # Ray leaves a GPU actor its own device as cuda:0; DeepSpeed picks its device by LOCAL_RANK.
    os.environ.setdefault("LOCAL_RANK", "0")
    if not torch.distributed.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               auto_mpi_discovery=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, ds_optimizer, _, scheduler = deepspeed.initialize(
        model=model, config=config, optimizer=optimizer,
        model_parameters=trainable if optimizer is None else None, lr_scheduler=make_scheduler,
    )
    return engine, ds_optimizer, scheduler


def is_partitioned(model: torch.nn.Module) -> bool:
    """True when ``model``'s parameters are ZeRO-3 shards (each rank holds a slice)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """``model`` with every parameter whole for the block; ZeRO-3 shards are all-gathered (a
    collective: every rank of the role must enter it) and freed again after, changes inside it
    discarded. Anything else: the model as it is."""
    if not is_partitioned(model):
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        yield model


def ranks_max(count: int) -> int:
    """The largest ``count`` over the role's ranks (itself with no process group)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return count
    value = torch.tensor([count], dtype=torch.long)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return int(value.item())


def idle_forward(model: torch.nn.Module, token_id: int) -> torch.Tensor:
    """A forward of one token through every layer, as a scalar 0 that still depends on every
    parameter used: what a rank with fewer micro-batches runs so that its parameter gathers
    (ZeRO-3) and, under a backward, its gradient reductions pair with the other ranks'. Its
    gradient is zero, so the update is the real micro-batches' alone."""
    device = next(model.parameters()).device
    ids = torch.tensor([[token_id]], device=device)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    tensor = getattr(out, "logits", None)
    if tensor is None:
        tensor = out.values  # a value-head model
    return tensor.float().sum() * 0.0


def _fill(section: dict, key: str, value: Any) -> None:
    if section.get(key) == AUTO:
        section[key] = value


def _autos(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for key, value in node.items() for p in _autos(value, f"{path}.{key}" if path else key)]
    return [path] if node == AUTO else []


def _offloads_optimizer(zero: dict) -> bool:
    device = (zero.get("offload_optimizer") or {}).get("device")
    return device not in (None, "none")


def _hidden_size(model: torch.nn.Module) -> Optional[int]:
    inner = getattr(model, "pretrained_model", model)  # a value-head model's language model
    config = getattr(inner, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    size = getattr(config, "hidden_size", None)
    return int(size) if size else None
