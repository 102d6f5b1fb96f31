"""The stage table: everything RayFactory knows about a stage, in one declarative entry.

A ``StageSpec`` says what a stage's datasets must carry, how its rows are tokenized and
collated, which recipe trains it, how the fabric launches it, and whether it needs a frozen
reference policy. Config checks, the data pipeline, the workers, ``rayfactory --help`` and error
messages all read this table. Adding a stage is one ``register_stage`` call here plus its
recipe module under stages/.

Recipes and collators are named as "module:function" inside stages/ and imported only where
they run, so reading the table (config checks, the CLI's help) imports neither torch nor
Transformers.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Callable, Literal

from registries.datasets.stage_fields import DATASET_NEEDS
from registries.errors import UserError
from registries.tokenize import KINDS, PACKABLE, get_preprocess_fn, resolve_packing
from registries.unique import add_unique

# How the fabric runs a stage: N identical Ray Train workers, or an RL controller driving
# separate actor groups (policy, reference, rollout, reward, ...).
Launch = Literal["train_workers", "rl_controller"]


def _never(finetuning_args) -> bool:
    return False


def _always(finetuning_args) -> bool:
    return True


def _dpo_reference(finetuning_args) -> bool:
    return finetuning_args.pref_loss not in ("orpo", "simpo")  # both compare the policy with itself


@dataclass(frozen=True)
class StageSpec:
    name: str
    summary: str  # one line for help texts
    dataset_need: str  # registries.datasets.stage_fields.DATASET_NEEDS
    tokenize: str  # registries.tokenize.KINDS
    collator: str  # "module:function" in stages/: (tokenizer, data_args, model) -> collator
    runner: str | None  # "module:function" in stages/: (StageJob) -> metrics; None: not available yet
    launch: Launch = "train_workers"
    pack_by_default: bool = False  # packing: null means this
    # The recipe feeds columns the model's forward() does not name (chosen_*, kl_*) to its collator.
    keeps_extra_columns: bool = False
    needs_reference: Callable[..., bool] = _never  # (FinetuningArguments) -> bool
    # The recipe trains on the model's own causal-LM loss, which chunked_loss can chunk.
    causal_lm_loss: bool = False

    def __post_init__(self) -> None:
        if self.dataset_need not in DATASET_NEEDS:
            raise ValueError(f"stage {self.name!r}: dataset_need must be one of {', '.join(DATASET_NEEDS)}")
        if self.tokenize not in KINDS:
            raise ValueError(f"stage {self.name!r}: tokenize must be one of {', '.join(KINDS)}")
        if self.pack_by_default and self.tokenize not in PACKABLE:
            raise ValueError(f"stage {self.name!r}: {self.tokenize} examples cannot be packed")

    @property
    def available(self) -> bool:
        return self.runner is not None

    def preprocess_fn(self, tokenizer, template, data_args):
        """The picklable batch function that tokenizes and masks this stage's aligned rows."""
        packing = self.tokenize in PACKABLE and resolve_packing(data_args, self.pack_by_default)
        return get_preprocess_fn(self.tokenize, tokenizer, template, data_args, packing)

    def tokenize_here(self, tokenizer, template, data_args) -> list[dict]:
        """``data_args.dataset`` aligned and tokenized as this stage does it, in this process, without
        Ray (evaluations and small tools): one dict of columns per example."""
        from registries.datasets import load_aligned

        rows = load_aligned(data_args, self.name, self.dataset_need).train
        if not rows:
            return []
        columns = self.preprocess_fn(tokenizer, template, data_args)({k: [r[k] for r in rows] for k in rows[0]})
        return [dict(zip(columns, values)) for values in zip(*columns.values())]

    def load_runner(self) -> Callable:
        return _load(self.runner)

    def load_collator_factory(self) -> Callable:
        return _load(self.collator)


STAGES: dict[str, StageSpec] = {}


def register_stage(spec: StageSpec) -> StageSpec:
    return add_unique(STAGES, spec.name, spec, "Stage")


class UnknownStageError(UserError):
    """A stage name the table lacks, or one whose recipe is not built yet."""


def get_stage(name: str, trainable: bool = True) -> StageSpec:
    """The spec of ``name``; with ``trainable``, only a stage that has a recipe."""
    spec = STAGES.get(name)
    if spec is None:
        close = difflib.get_close_matches(str(name), STAGES, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        extra = " (orpo and simpo are pref_loss values of stage dpo.)" if name in ("orpo", "simpo") else ""
        raise UnknownStageError(f"unknown stage {name!r}; the stages are {describe_stages()}.{hint}{extra}")
    if trainable and not spec.available:
        ready = ", ".join(s.name for s in STAGES.values() if s.available)
        raise UnknownStageError(
            f"stage {name!r} cannot be trained yet ({spec.summary}); the stages that can: {ready}."
        )
    return spec


def describe_stages() -> str:
    return ", ".join(s.name if s.available else f"{s.name} (not yet)" for s in STAGES.values())


def _load(target: str) -> Callable:
    module, function = target.split(":")
    return getattr(importlib.import_module(f"stages.{module}"), function)


# --- the stages ----------------------------------------------------------------------------------
register_stage(StageSpec(
    "pt", "pre-training: next-token loss on plain text",
    dataset_need="plain", tokenize="pretrain", collator="collators:padding_collator",
    runner="causal_lm:run_causal_lm", pack_by_default=True, causal_lm_loss=True,
))
register_stage(StageSpec(
    "sft", "supervised fine-tuning: loss on the answers, prompts masked",
    dataset_need="plain", tokenize="supervised", collator="collators:supervised_collator",
    runner="causal_lm:run_causal_lm", causal_lm_loss=True,
))
register_stage(StageSpec(
    "rm", "reward model: a value head trained on preference pairs",
    dataset_need="ranking", tokenize="pairwise", collator="collators:pairwise_collator",
    runner="rm:run_rm", keeps_extra_columns=True,
))
register_stage(StageSpec(
    "dpo", "direct preference optimisation (pref_loss: sigmoid, hinge, ipo, orpo, simpo)",
    dataset_need="ranking", tokenize="pairwise", collator="collators:pairwise_collator",
    runner="dpo:run_dpo", keeps_extra_columns=True, needs_reference=_dpo_reference,
))
register_stage(StageSpec(
    "kto", "Kahneman-Tversky optimisation on answers labelled good or bad",
    dataset_need="kto_tag", tokenize="feedback", collator="collators:kto_collator",
    runner="kto:run_kto", keeps_extra_columns=True, needs_reference=_always,
))
register_stage(StageSpec(
    "grpo", "GRPO: groups of sampled answers scored by reward functions; policy and vLLM rollouts as Ray actors",
    dataset_need="prompt_only", tokenize="unsupervised", collator="collators:prompt_collator",
    runner="grpo:run_grpo", launch="rl_controller",
    needs_reference=_always,  # when beta > 0; beta 0 loads none (stages/rl/policy.py)
))
register_stage(StageSpec(
    "ppo", "PPO: policy, critic, reward model and vLLM rollouts as Ray actor groups, GAE and a KL controller",
    dataset_need="prompt_only", tokenize="unsupervised", collator="collators:prompt_collator",
    runner="ppo:run_ppo", launch="rl_controller", needs_reference=_always,
))
