"""What a stage is handed: the run's typed config (``JobSpec``) and, on a worker, ``StageJob``.

``JobSpec`` is the one object the driver ships to every process of a run, whatever its role:
Ray Train workers today, long-lived RL and serving actors next. Each component takes the slice
it needs from it. ``StageJob`` adds what exists only on the worker: the built trainer
arguments, this worker's data and the fabric's hooks. Its methods are the steps every recipe
shares, so a recipe only says what differs: which Trainer, which extra pieces. Torch and
Transformers are imported only by those methods: the driver builds a JobSpec while parsing the
config, which must stay quick.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from registries.datasets.data_args import DataArguments

from stages.inference.eval_args import EvaluationArguments
from stages.run_args import FinetuningArguments, GeneratingArguments, ModelArguments, TrainingOptions
from stages.rl.config.rl_args import RLArguments
from .table import StageSpec

if TYPE_CHECKING:  # heavy imports, only for the annotations
    import datasets
    from transformers import Seq2SeqTrainingArguments, TrainerCallback

    from stages.training.memory_plan import MemoryBudget, MemoryPlan

logger = logging.getLogger(__name__)


@dataclass
class JobSpec:
    """The run's typed config: model, data (template already resolved), method and trainer options;
    for RL stages also the RL options and the sampling settings of the rollouts."""

    model: ModelArguments
    data: DataArguments
    finetuning: FinetuningArguments
    training: TrainingOptions
    rl: RLArguments = field(default_factory=RLArguments)
    generating: GeneratingArguments = field(default_factory=GeneratingArguments)
    evaluation: EvaluationArguments = field(default_factory=EvaluationArguments)  # eval_tasks and their settings

    @property
    def stage(self) -> StageSpec:
        return self.finetuning.spec

    def training_arguments(self, use_cpu: bool) -> "Seq2SeqTrainingArguments":
        """The real trainer arguments, built where training runs (it sets up devices)."""
        from stages.training.cpu_precision import bf16_note

        overrides = {"use_cpu": True} if use_cpu else {}
        # The Trainer's own rotation counts half-written folders and may delete the last good
        # checkpoint for one; CommitCheckpoints (build_trainer) rotates committed ones by the
        # user's save_total_limit instead (stages/training/hf_checkpoints.py).
        overrides["save_total_limit"] = None
        if "disable_tqdm" not in self.training.values:
            # The driver draws the progress bar from rank 0's log records; a worker's own bar only
            # reaches the log file, and each redraw wakes Ray's log pipe and the driver (9% of a
            # 9M model's training speed on 2 cores, benchmarks/README.md).
            overrides["disable_tqdm"] = True
        if bf16_note(bool(self.training.values.get("bf16")), use_cpu):
            overrides["bf16"] = False  # emulated bfloat16 is slower than float32 (stages/training/cpu_precision.py)
        if self.stage.keeps_extra_columns:
            # The Trainer keeps only columns forward() names; this stage's collator needs the rest.
            overrides["remove_unused_columns"] = False
        return self.training.build(**overrides)


@dataclass
class StageJob:
    spec: JobSpec
    training_args: "Seq2SeqTrainingArguments"
    train_dataset: Optional["datasets.Dataset"]  # tokenized rows; None until receive_data has run
    eval_dataset: Optional["datasets.Dataset"] = None
    # Where the datasets still come from, when the fabric starts the worker before they are ready:
    # called once, after the model has loaded, to fill train_dataset and eval_dataset.
    receive_data: Optional[Callable[[], tuple["datasets.Dataset", Optional["datasets.Dataset"]]]] = None
    callbacks: list["TrainerCallback"] = field(default_factory=list)  # Ray reporting, the Python API's hooks
    # Where training resumes: a restarted worker group's last Ray checkpoint, or the user's folder.
    resume_from_checkpoint: Optional[str] = None
    # The distribution layer's last word on the trainer (e.g. Ray's prepare_trainer); stages stay placement-free.
    prepare_trainer: Optional[Callable] = None
    # What this worker may fill (the fabric knows its share of the node); None: this process's view.
    memory_budget: Optional["MemoryBudget"] = None
    # Lines for the user's console (the memory plan); the fabric's progress relay shows rank 0's once.
    notes: list[str] = field(default_factory=list)

    def tokenizer_and_template(self):
        """The tokenizer and template exactly as the driver tokenized the data with."""
        from .loading import load_tokenizer_and_template

        return load_tokenizer_and_template(self.spec.model, self.spec.data)

    def load_model(self, tokenizer):
        """The model with its adapter (full / freeze / lora / qlora), in the trainer's precision;
        gradient checkpointing as the user set it, else as the memory plan says."""
        from .loading import load_model

        self.plan_memory()
        return load_model(self.spec.model, self.spec.finetuning, tokenizer, self.training_args)

    def plan_memory(self) -> Optional["MemoryPlan"]:
        """Set ``gradient_checkpointing`` from stages/training/memory_plan.py when the user left it unset
        (before the model loads: loading reads it). Returns the plan, None where the user chose."""
        if "gradient_checkpointing" in self.spec.training.values:
            return None
        from .loading import model_config
        from stages.training.memory_plan import ModelShape, local_budget, plan_memory, training_shape

        try:
            model = ModelShape.from_config(model_config(self.spec.model))
        except (AttributeError, TypeError, ValueError) as exc:  # a config without a decoder's usual sizes
            logger.warning("memory plan skipped (%s): gradient checkpointing stays off unless "
                           "gradient_checkpointing is set", exc)
            return None
        budget = self.memory_budget or local_budget(use_cpu=bool(self.training_args.use_cpu))
        plan = plan_memory(model, training_shape(self.spec, self.training_args, model), budget)
        self.training_args.gradient_checkpointing = plan.gradient_checkpointing
        logger.info(plan.reason)
        self.notes.append(plan.reason)
        return plan

    def build_reference(self, policy, tokenizer):
        """The frozen reference policy the stage needs (none, the adapter-disabled base, or a copy)."""
        from stages.loading import build_reference

        return build_reference(policy, self.spec.model, self.spec.finetuning, tokenizer, self.training_args)

    def collator(self, tokenizer, model=None):
        """The stage table's collator for this stage's tokenized columns."""
        return self.spec.stage.load_collator_factory()(tokenizer, self.spec.data, model)

    def build_trainer(self, trainer_class, model, tokenizer, **extra):
        """`trainer_class` on this worker's data, logging to trainer_log.jsonl, handed to the fabric's hook."""
        from stages.training.callbacks import JsonlLogCallback
        from stages.training.hf_checkpoints import CommitCheckpoints

        if self.receive_data is not None:
            self.train_dataset, self.eval_dataset = self.receive_data()
            self.receive_data = None
        if self.training_args.ddp_find_unused_parameters is None and _every_trainable_weight_in_the_loss(model):
            # transformers has DDP search for parameters without a gradient after every backward
            # (another walk of the autograd graph per step, and on every rank a warning that it
            # found none) in any model but a PreTrainedModel trained with gradient checkpointing.
            # Where every trainable weight is in each step's loss, the search finds nothing.
            self.training_args.ddp_find_unused_parameters = False
        collator = self.collator(tokenizer, model)
        harness = None
        if self.spec.evaluation.eval_tasks:
            from stages.inference.harness_eval import HarnessEvalCallback
            from stages.inference.loading import InferenceSpec

            spec = self.spec
            harness = HarnessEvalCallback(InferenceSpec(model=spec.model, data=spec.data, finetuning=spec.finetuning,
                                                        generating=spec.generating), spec.evaluation)
        if getattr(collator, "needs_no_cache", False):
            # A KV cache (use_cache: true) makes transformers skip the per-example masks that
            # padding-free rows rely on; training never reads the cache anyway.
            self.training_args.use_cache = False
        if getattr(collator, "attention", None):
            from stages.training.per_example_attention import use_attention

            use_attention(model, collator.attention)  # e.g. sdpa one example at a time, for one-row batches
        trainer = trainer_class(
            model=model,
            args=self.training_args,
            train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
            data_collator=collator,
            processing_class=tokenizer,
            # CommitCheckpoints before the fabric's callbacks: Ray's report copies a committed folder.
            callbacks=[JsonlLogCallback(self.training_args.output_dir),
                       CommitCheckpoints(self.spec.training.save_total_limit), *self.callbacks,
                       *([harness] if harness else [])],
            **extra,
        )
        if harness:
            harness.trainer = trainer  # its scores go through trainer.log, to every logger and tracker
        return self.prepare_trainer(trainer) if self.prepare_trainer is not None else trainer

    def train_and_save(self, trainer, tokenizer, template) -> dict:
        """Train (a resume restores optimizer, scheduler, RNG and the data position), then write the
        adapter or model, the tokenizer with its chat template, state, metrics and the loss plot."""
        import gc

        from stages.training.outputs import save_outputs

        # Everything made so far (libraries, model, trainer: ~475k objects) lives as long as the
        # run. Frozen, the garbage collector stops re-scanning it: the full collection that
        # accelerate runs as training starts, and any during it, took 0.18 s each, and 0 s after.
        # Frozen objects are not in gc.get_objects(): a callback that walks it unfreezes first.
        gc.freeze()
        result = trainer.train(resume_from_checkpoint=self.resume_from_checkpoint)
        return save_outputs(trainer, tokenizer, template, result, self.spec.finetuning)


def _every_trainable_weight_in_the_loss(model) -> bool:
    """True for the models that the stages training them use whole in every step's loss:
    a PeftModel (its adapters and modules_to_save; LLaMA-Factory turns the search off for LoRA
    too), and the causal LM of a registered model family, all dense decoders (no experts routed
    per token, no vision tower: registries/models/families.py). Not for the rest: rm's value-head
    model never uses its LM head, a multimodal wrapper has a tower that text rows skip, and an
    unregistered architecture may route tokens to experts."""
    from peft import PeftModel
    from transformers import PreTrainedModel

    from registries.models.families import is_registered_model_type

    if isinstance(model, PeftModel):
        return True
    return (isinstance(model, PreTrainedModel) and type(model).__name__.endswith("ForCausalLM")
            and is_registered_model_type(model.config.model_type))
