"""Whether a run needs gradient checkpointing: an estimate of a worker's memory against its budget.

The rule: when the user leaves ``gradient_checkpointing`` unset, each worker estimates what one
training step holds at its peak, weights + gradients + optimizer states + activations + the
loss's logits, for the micro-batch's worst case (per_device_train_batch_size x cutoff_len
tokens). If that fits HEADROOM (90%) of its budget, checkpointing stays off: it costs about a
third more compute per step. If not, it goes on: each decoder layer then keeps only its input and
recomputes the rest in the backward. The budget is the free memory of the worker's GPU; on CPU
workers the ``memory`` resource of resources_per_worker, else the node's available memory shared
by the run's workers on that node. A value the user set (true or false) always wins, and
LLaMA-Factory's ``disable_gradient_checkpointing: true`` is such a value (false).

The estimate, per token of the micro-batch and per decoder layer that backpropagates (all of
them, but for freeze tuning of the last N layers only N), follows the tensors autograd keeps in a
Llama-style layer: the inputs of both norms and their fp32 upcasts, q/k/v, the attention output,
the gated MLP's four I-wide tensors; eager attention adds its softmax, heads x sequence per token
(sdpa and flash attention recompute it). The logits add (dtype + 8) bytes x vocabulary per token
(the logits, their fp32 log-softmax, its gradient), or one chunk's worth with chunked_loss.
AdamW keeps two states per trainable parameter in its dtype (LoRA adapters train in fp32);
ZeRO divides the states (stage 1), gradients (2) and weights (3) by the world size. It is an
estimate: allocator fragmentation, CUDA's context and kernels' workspaces are what the 10% left
over is for.

Pure: the worker reads the model's config and its budget, then calls ``plan_memory``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2**30
HEADROOM = 0.9  # the share of the budget an estimate may fill
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The shapes LoRA's ``lora_target: all`` wraps in a Llama-style layer: (in, out) in units of the
# config's sizes, read by ``ModelShape.linear_shapes``.
LORA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model's config (a Llama-style decoder: gated MLP)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        return cls(
            hidden_size=hidden,
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            intermediate_size=int(getattr(config, "intermediate_size", None) or 4 * hidden),
            vocab_size=int(config.vocab_size),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_parameters(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden_size  # + two norms

    @property
    def embedding_parameters(self) -> int:
        """The input embedding and, unless tied to it, the output head."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def parameters(self) -> int:
        return self.num_layers * self.layer_parameters + self.embedding_parameters + self.hidden_size  # final norm

    def lora_parameters(self, rank: int, targets: list[str] | None = None) -> int:
        shapes = self.linear_shapes()
        names = LORA_ALL if not targets or "all" in targets else [t for t in targets if t in shapes]
        return self.num_layers * sum(rank * sum(shapes[name]) for name in names)


@dataclass(frozen=True)
class TrainingShape:
    """What one micro-batch step trains, as the run's config says."""

    finetuning_type: str = "lora"  # full, freeze, lora
    micro_batch_tokens: int = 2048  # per_device_train_batch_size x cutoff_len (x 2 for paired stages)
    sequence_length: int = 2048  # cutoff_len: how far eager attention's scores reach
    weight_dtype: str = "bfloat16"  # what the weights load in (ModelArguments.load_dtype)
    mixed_precision: bool = True  # bf16 or fp16: activations in 2 bytes
    attention: str = "sdpa"  # eager keeps heads x sequence scores per token; sdpa and flash do not
    chunked_loss: bool = False
    chunk_tokens: int = 1365
    lora_rank: int = 8
    lora_target: tuple[str, ...] = ("all",)
    freeze_trainable_layers: int = 2
    quantization_bit: int | None = None  # 4 or 8: the decoder's linear weights in that many bits
    optimizer: str = "adamw_torch"
    zero_stage: int = 0
    world_size: int = 1
    reference_copy: bool = False  # dpo/kto's frozen reference model, counted as a copy of the weights


@dataclass(frozen=True)
class MemoryBudget:
    bytes: int
    source: str  # where it came from, for the reason line ("free GPU memory")

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class MemoryPlan:
    gradient_checkpointing: bool
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float  # without checkpointing
    checkpointed_activations_gib: float  # with it: every layer's input plus one layer recomputed
    logits_gib: float
    budget_gib: float
    reason: str  # one line for the run's output

    @property
    def without_checkpointing_gib(self) -> float:
        return self.weights_gib + self.gradients_gib + self.optimizer_gib + self.activations_gib + self.logits_gib

    @property
    def with_checkpointing_gib(self) -> float:
        return (self.weights_gib + self.gradients_gib + self.optimizer_gib + self.checkpointed_activations_gib
                + self.logits_gib)


def trainable_parameters(model: ModelShape, run: TrainingShape) -> int:
    if run.finetuning_type == "full":
        return model.parameters
    if run.finetuning_type == "freeze":
        return min(abs(run.freeze_trainable_layers), model.num_layers) * model.layer_parameters
    return model.lora_parameters(run.lora_rank, list(run.lora_target))


def activation_bytes_per_token_layer(model: ModelShape, run: TrainingShape) -> float:
    """What one decoder layer keeps for the backward, per token."""
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    act = 2 if run.mixed_precision else 4
    kept = act * (4 * h + 2 * q + 2 * kv + 4 * i) + 2 * 4 * h  # + the norms' fp32 upcasts
    if run.attention == "eager":  # the fp32 softmax and its copy in the activations' dtype
        kept += model.num_heads * run.sequence_length * (4 + act)
    return kept


def plan_memory(model: ModelShape, run: TrainingShape, budget: MemoryBudget) -> MemoryPlan:
    """Gradient checkpointing on or off for ``run`` of ``model`` within ``budget`` (module docstring)."""
    act = 2 if run.mixed_precision else 4
    weight_bytes = DTYPE_BYTES.get(run.weight_dtype, 4)
    trainable = trainable_parameters(model, run)
    layers_weights = model.num_layers * model.layer_parameters
    layer_bytes = run.quantization_bit / 8 if run.quantization_bit else weight_bytes
    weights = layers_weights * layer_bytes + (model.parameters - layers_weights) * weight_bytes
    if run.reference_copy:
        weights *= 2
    trainable_bytes = 4 if run.finetuning_type == "lora" else weight_bytes  # PEFT keeps adapters in fp32
    if run.finetuning_type == "lora":
        weights += trainable * trainable_bytes
    gradients = trainable * trainable_bytes
    optimizer = trainable * _optimizer_bytes(run.optimizer, trainable_bytes)
    shards = max(run.world_size, 1)
    optimizer /= shards if run.zero_stage >= 1 else 1
    gradients /= shards if run.zero_stage >= 2 else 1
    weights /= shards if run.zero_stage >= 3 else 1

    tokens = run.micro_batch_tokens
    layers = model.num_layers
    if run.finetuning_type == "freeze" and run.freeze_trainable_layers > 0:  # the gradient stops below them
        layers = min(run.freeze_trainable_layers, model.num_layers)
    per_layer = activation_bytes_per_token_layer(model, run) * tokens
    activations = layers * per_layer
    checkpointed = layers * tokens * model.hidden_size * act + per_layer
    logit_tokens = min(tokens, run.chunk_tokens) if run.chunked_loss else tokens
    logits = logit_tokens * model.vocab_size * (act + 8)
    if run.chunked_loss:
        logits += tokens * model.hidden_size * act  # the labelled tokens' hidden states the chunks read

    parts = [x / GIB for x in (weights, gradients, optimizer, activations, checkpointed, logits)]
    plan = MemoryPlan(False, *parts, budget_gib=budget.gib, reason="")
    limit = HEADROOM * budget.gib
    where = f"{limit:.1f} GiB ({HEADROOM:.0%} of {budget.source}, {budget.gib:.1f} GiB)"
    without, with_ = plan.without_checkpointing_gib, plan.with_checkpointing_gib
    if without <= limit:
        reason = (f"gradient checkpointing off: weights + gradients + optimizer + activations ~{without:.1f} GiB "
                  f"fit {where}")
        return _with(plan, False, reason)
    if with_ <= limit:
        reason = f"gradient checkpointing on: ~{without:.1f} GiB without it > {where}; with it ~{with_:.1f} GiB"
    else:
        reason = (f"gradient checkpointing on, and still over {where}: ~{without:.1f} GiB without it, "
                  f"~{with_:.1f} GiB with it; expect running out of memory (lower per_device_train_batch_size "
                  "or cutoff_len, use finetuning_type lora, quantization_bit, or more workers with DeepSpeed ZeRO)")
    return _with(plan, True, reason)


def _with(plan: MemoryPlan, on: bool, reason: str) -> MemoryPlan:
    return replace(plan, gradient_checkpointing=on, reason=f"memory plan: {reason}")


def training_shape(spec, training_args, model: ModelShape) -> TrainingShape:
    """The TrainingShape of a run: its JobSpec (model, data, finetuning) and built trainer arguments."""
    from stages.training.chunked_loss import AUTO_CHUNK_VALUES, chunk_tokens_for, use_chunked_loss
    from stages.training.sequence_logps import AUTO_CHUNK_VALUES as SEQUENCE_CHUNK_VALUES
    from stages.training.cpu_precision import training_load_dtype

    tuning, stage = spec.finetuning, spec.stage
    bf16, fp16 = bool(training_args.bf16), bool(training_args.fp16)
    deepspeed = training_args.deepspeed if isinstance(training_args.deepspeed, dict) else {}
    # Paired stages (rm, dpo, kto) stack two rows per example: chosen and rejected, or the KL batch.
    rows = 2 if stage.keeps_extra_columns else 1
    target = tuning.lora_target
    return TrainingShape(
        finetuning_type=tuning.finetuning_type,
        micro_batch_tokens=int(training_args.per_device_train_batch_size) * spec.data.cutoff_len * rows,
        sequence_length=spec.data.cutoff_len,
        weight_dtype=training_load_dtype(spec.model, tuning.finetuning_type, bf16, fp16, bool(training_args.use_cpu)),
        mixed_precision=bf16 or fp16,
        attention=spec.model.attn_implementation or "sdpa",  # what transformers picks where it can
        chunked_loss=stage.chunks_logits and use_chunked_loss(tuning.chunked_loss, model.vocab_size),
        chunk_tokens=chunk_tokens_for(model.vocab_size, tuning.chunked_loss_tokens,
                                      SEQUENCE_CHUNK_VALUES if stage.token_logps else AUTO_CHUNK_VALUES),
        lora_rank=tuning.lora_rank,
        lora_target=tuple([target] if isinstance(target, str) else target or ["all"]),
        freeze_trainable_layers=tuning.freeze_trainable_layers,
        quantization_bit=spec.model.quantization_bit,
        optimizer=str(getattr(training_args.optim, "value", training_args.optim)),
        zero_stage=int(deepspeed.get("zero_optimization", {}).get("stage", 0) or 0),
        world_size=int(training_args.world_size),
        # A LoRA policy's reference is itself with the adapter off; any other is a second model,
        # unless its log-probs are precomputed (as set: the plan runs before the data arrives, so
        # null, which decides on the data, is counted with the copy) and the copy freed before
        # the optimizer exists (stages/training/reference_logps.py).
        reference_copy=(tuning.use_ref_model and (tuning.finetuning_type != "lora" or tuning.ref_model is not None)
                        and not (stage.token_logps and tuning.precompute_ref_log_probs)),
    )


def _optimizer_bytes(optimizer: str, trainable_bytes: int) -> float:
    """Optimizer state bytes per trainable parameter."""
    name = str(optimizer).lower()
    if name.startswith("sgd"):
        return 0
    if "adafactor" in name:
        return 0.1  # factored second moments: rows + columns, a sliver of the parameters
    if "8bit" in name:
        return 2  # two one-byte states
    return 2 * trainable_bytes  # AdamW and its kin: two states in the parameters' dtype


def local_budget(use_cpu: bool, device=None) -> MemoryBudget:
    """This process's budget without a cluster's view: the free memory of its GPU (``device``, else
    the current one), or the machine's available memory."""
    import torch

    if not use_cpu and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return MemoryBudget(int(free), "free GPU memory")
    return MemoryBudget(available_system_memory(), "the machine's available memory")


def available_system_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil comes with Ray; /proc says the same on Linux
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
