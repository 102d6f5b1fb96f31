"""What the RL roles that learn (the policy, PPO's critic) share: one data-parallel rank's optimizer.

A role owns a model; this base class wraps it in DDP when there are several ranks (or, with the
run's ``deepspeed`` key, in a DeepSpeed ZeRO engine: stages/rl/workers/zero.py), builds AdamW and the
schedule from the trainer options (learning_rate, weight_decay, adam_*, warmup_steps,
lr_scheduler_type), takes one optimizer step over micro-batches, and writes / reads its part of
an RL checkpoint. The subclass says only what a micro-batch's loss is.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Callable, Optional

import torch

from .logprobs import budget_slices

if TYPE_CHECKING:
    from stages.job import JobSpec

logger = logging.getLogger(__name__)


class TrainableRole:
    spec: "JobSpec"
    dp_rank: int = 0
    dp_size: int = 1
    rows = None  # the PaddingFreeCollator that lays out this role's forwards; None: padded (set by _prepare_training)
    engine = None  # the DeepSpeed engine under the run's `deepspeed` key; None: DDP or one plain process

    def _prepare_training(self, model: torch.nn.Module, rank: int, world_size: int, total_updates: int,
                          learning_rate: Optional[float] = None) -> None:
        """DDP (world_size > 1), AdamW over the trainable parameters and the learning-rate schedule;
        with the run's ``deepspeed`` key a DeepSpeed engine instead of DDP, stepping the same AdamW
        and schedule unless its JSON names its own (stages/rl/workers/zero.py)."""
        from transformers import get_scheduler

        options = self.spec.training
        self.dp_rank, self.dp_size = rank, world_size
        self.model = model
        self.rows = forward_rows(self.tokenizer, self.spec.data, model)
        if rank == 0:
            logger.info("%s forwards: %s", type(self).__name__, "padded" if self.rows is None else
                        f"padding-free, {'one row' if self.rows.one_row else 'rows'} per micro-batch, attention "
                        f"{self.rows.attention or 'its own'}")
        self.train_model = model
        params = [p for p in model.parameters() if p.requires_grad]
        lr = learning_rate or options.learning_rate
        warmup = options.warmup_steps
        warmup = int(warmup * total_updates) if 0 < warmup < 1 else int(warmup)  # a ratio, as in transformers 5

        def schedule(optimizer):
            return get_scheduler(
                options.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_updates,
                scheduler_specific_kwargs=_scheduler_kwargs(options.lr_scheduler_kwargs),
            )

        def adamw():
            return torch.optim.AdamW(
                params, lr=lr, betas=(options.adam_beta1, options.adam_beta2),
                eps=options.adam_epsilon, weight_decay=options.weight_decay,
            )

        from .zero import deepspeed_config

        ds_config = deepspeed_config(options)
        if ds_config is not None:  # DeepSpeed ZeRO in place of DDP (stages/rl/workers/zero.py)
            from .zero import build_engine, engine_config, zero_stage

            config = engine_config(ds_config, options, world_size, model, lr, total_updates, warmup)
            self.engine, self.optimizer, self.scheduler = build_engine(
                model, config, None if "optimizer" in config else adamw(), schedule)
            self.train_model = self.engine
            if rank == 0:
                logger.info("%s: DeepSpeed ZeRO stage %d over %d rank(s)", type(self).__name__, zero_stage(config),
                            world_size)
            return
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # Every trainable parameter is in the loss, so DDP need not search for unused ones.
            self.train_model = DistributedDataParallel(model, find_unused_parameters=False)
        self.optimizer = adamw()
        self.scheduler = schedule(self.optimizer)

    def _optimizer_step(self, samples: list, chunk_loss: Callable[[list], tuple[torch.Tensor, dict]]) -> dict:
        """One optimizer step on this rank's share of a mini-batch, in per_device_train_batch_size chunks.

        ``chunk_loss(chunk)`` returns the chunk's part of the WHOLE mini-batch's loss (every rank's
        samples in the denominator), so the chunks' summed gradient, with DDP's mean over ranks
        undone by ``dp_size``, equals one big batch's. Metrics come back sample-weighted; "loss"
        is this rank's share times dp_size, which the controller averages over ranks.
        """
        options = self.spec.training
        micro = max(1, int(options.per_device_train_batch_size))
        budget = self.spec.rl.max_tokens_per_micro_batch
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
        chunks = [samples[part] for part in budget_slices(lengths, micro, budget, padded=self.rows is None)]
        if self.engine is not None:
            totals, grad_norm = self._zero_micro_batches(chunks, chunk_loss)
        else:
            totals: dict[str, float] = {}
            self.optimizer.zero_grad(set_to_none=True)
            for index, chunk in enumerate(chunks):
                last = index == len(chunks) - 1
                # DDP syncs gradients on the last micro-batch only; no_sync must cover its forward too.
                sync = self.train_model.no_sync() if (self.dp_size > 1 and not last) else contextlib.nullcontext()
                with sync, self.forwards():  # the backward too: checkpointing recomputes attention in it
                    loss, metrics = chunk_loss(chunk)
                    (loss * self.dp_size).backward()  # DDP averages over ranks; the loss is already a global share
                self._add_metrics(totals, loss, metrics, len(chunk))
            grad_norm = None
            if options.max_grad_norm and options.max_grad_norm > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), options.max_grad_norm))
            self.optimizer.step()
            self.scheduler.step()
        out = {key: (value if key == "loss" else value / max(len(samples), 1)) for key, value in totals.items()}
        out.update(grad_norm=grad_norm, lr=self.scheduler.get_last_lr()[0], num_samples=len(samples),
                   micro_batches=len(chunks))
        return out

    def _add_metrics(self, totals: dict[str, float], loss: torch.Tensor, metrics: dict, rows: int) -> None:
        """Add one micro-batch's loss (already its share of the whole batch) and its metrics,
        weighted by its ``rows``, to ``totals``."""
        metrics.pop("num_tokens", None)  # a per-micro-batch count: meaningless once merged
        for key, value in {"loss": loss.item() * self.dp_size, **metrics}.items():
            totals[key] = totals.get(key, 0.0) + value * (1 if key == "loss" else rows)

    def _zero_micro_batches(self, chunks: list, chunk_loss) -> tuple[dict, Optional[float]]:
        """The DeepSpeed engine's side of ``_optimizer_step``: every chunk's backward accumulates,
        the last one is the accumulation boundary, and one ``engine.step()`` clips (gradient_clipping,
        from max_grad_norm), steps the optimizer and the schedule. The loss is scaled as on the
        DDP path (DeepSpeed also averages gradients over ranks); a rank with fewer chunks than the
        others first runs idle ones (zero gradient) so that the ranks' reductions pair up."""
        from .zero import idle_forward, ranks_max

        engine = self.engine
        idle = ranks_max(len(chunks)) - len(chunks) if self.dp_size > 1 else 0
        steps = [None] * idle + chunks  # idle ones first: the boundary is a real chunk's backward
        totals: dict[str, float] = {}
        for index, chunk in enumerate(steps):
            engine.set_gradient_accumulation_boundary(index == len(steps) - 1)
            if chunk is None:
                engine.backward(idle_forward(engine, self.pad_token_id), scale_wrt_gas=False)
                continue
            with self.forwards():
                loss, metrics = chunk_loss(chunk)
                engine.backward(loss * self.dp_size, scale_wrt_gas=False)
            self._add_metrics(totals, loss, metrics, len(chunk))
        engine.step()
        norm = engine.get_global_grad_norm()
        return totals, (None if norm is None else float(norm))

    @contextlib.contextmanager
    def _paired_forwards(self, own: int):
        """The block of a no-grad pass that splits this rank's samples into ``own`` forwards. Under
        ZeRO-3 with several ranks every forward all-gathers parameters, so the ranks agree on the
        most forwards first (before any of them starts a forward) and this rank runs idle ones up
        to it at the end, inside the block (an adapter switched off gathers fewer parameters)."""
        from .zero import idle_forward, is_partitioned, ranks_max

        paired = self.engine is not None and self.dp_size > 1 and is_partitioned(self.model)
        extra = ranks_max(own) - own if paired else 0
        yield
        with torch.no_grad():
            for _ in range(extra):
                idle_forward(self.model, self.pad_token_id)

    def _forward_count(self, samples: list, micro_batch_size: int = 16, sort: bool = True) -> int:
        """How many forwards completion_logprobs (sorted by length) or completion_values (in order)
        split ``samples`` into, at their default micro_batch_size and the run's token budget."""
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
        return len(budget_slices(sorted(lengths) if sort else lengths, micro_batch_size,
                                 self.spec.rl.max_tokens_per_micro_batch, padded=self.rows is None))

    def forwards(self, *models) -> contextlib.ExitStack:
        """The block the role's forwards and backwards run in: ``models`` (default: the role's own)
        attend as its padding-free rows need (sdpa one sequence at a time), and go back to their
        own attention after it, for what takes padded batches (the HF rollout backend's generate)."""
        from stages.training.per_example_attention import attending

        stack = contextlib.ExitStack()
        attention = self.rows.attention if self.rows is not None else None
        for model in models or (self.model,):
            stack.enter_context(attending(getattr(model, "pretrained_model", model), attention))
        return stack

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id (eos when it has none): what rows are padded with."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    # --- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, folder: str) -> None:
        """This rank's part of an RL checkpoint: rank 0 the trainable weights, optimizer and
        schedule (DDP keeps them equal on every rank), every rank its RNG state. Under DeepSpeed,
        every rank writes its shards through the engine (checkpoint.save_zero_state)."""
        if self.engine is not None:
            from .checkpoint import save_zero_state

            save_zero_state(folder, self.dp_rank, self.engine)
            return
        from .checkpoint import save_role_state

        save_role_state(folder, self.dp_rank, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, folder: str) -> None:
        from .checkpoint import check_zero_layout

        check_zero_layout(folder, zero=self.engine is not None)
        if self.engine is not None:
            from .checkpoint import load_zero_state

            load_zero_state(folder, self.dp_rank, self.engine)
            return
        from .checkpoint import load_role_state

        load_role_state(folder, self.dp_rank, self.model, self.optimizer, self.scheduler)


def forward_rows(tokenizer, data_args, model):
    """How an RL role lays out its forwards: a PaddingFreeCollator under ``padding_free`` (the
    sft/dpo key; null: where the model keeps sequences apart in a shared row), None for padded
    micro-batches. The same decision, and the same error for ``padding_free: true`` on a model
    that cannot, as the training stages' (collators.padding_free_layout); a value head's language
    model decides, as for stage rm."""
    from stages.training.collators import padding_free_layout

    return padding_free_layout(tokenizer, data_args, getattr(model, "pretrained_model", model))


def _scheduler_kwargs(value) -> Optional[dict]:
    """lr_scheduler_kwargs as transformers takes it: a dict, or its JSON text."""
    if isinstance(value, str):
        import json

        value = json.loads(value) if value.strip() else None
    return value or None
