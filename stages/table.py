"""The stage table: everything RayFactory knows about a stage, in one declarative entry.

A ``StageSpec`` says what a stage's datasets must carry, how its rows are tokenized and
collated, which recipe trains it, how the fabric launches it, whether it needs a frozen
reference policy, and for the RL stages (``RLSpec``) which roles it runs, how many optimizer
updates a step makes, its defaults and its config checks. Config checks, the data pipeline, the
workers, the RL launcher, the console, ``rayfactory --help`` and error messages all read this
table; nothing else compares stage names. Adding a stage is one ``register_stage`` call here
plus its recipe module under stages/recipes/.

Recipes and collators are named as "module:function" inside stages/ and imported only where
they run, so reading the table (config checks, the CLI's help) imports neither torch nor
Transformers.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal

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


def _num_iterations(rl) -> int:
    return rl.num_iterations


def _ppo_updates(rl) -> int:
    return rl.ppo_epochs * rl.ppo_buffer_size  # one update of each role per mini-batch and epoch


# RL samples from the policy itself: LLaMA-Factory's chat defaults (temperature 0.95, top_p 0.7,
# top_k 50) would make it learn from a truncated distribution. Keys the config sets win.
FULL_DISTRIBUTION = (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0))


@dataclass(frozen=True)
class RLSpec:
    """What the RL launcher, the policy, the console and the config checks ask of an RL stage."""

    # A critic trains beside the policy when the advantage estimator is gae (the only one needing it).
    critic: bool = False
    # reward_model (an rm output) may score completions, beside or instead of reward_funcs.
    reward_model: bool = False
    # (RLArguments) -> optimizer updates of the policy per step (its learning-rate schedule's unit).
    updates_per_step: Callable[..., int] = _num_iterations
    # beta * KL(policy || reference) is part of the policy loss (grpo); False: the recipe puts it
    # into the rewards instead (ppo).
    kl_in_loss: bool = True
    # Its loop drops prompt groups whose completions all scored alike and refills the batch
    # (dynamic_filtering, max_num_gen_batches); False: it trains on every group (ppo).
    filters_groups: bool = False
    # (key, value) defaults of the generating keys (sampling) for keys the config leaves out.
    sampling_defaults: tuple[tuple[str, Any], ...] = FULL_DISTRIBUTION
    # "module:function" in stages/ or a callable: (given keys, the other groups' values) -> defaults
    # of the RL keys the config leaves out; None: RLArguments' own.
    rl_defaults: str | Callable[..., dict] | None = None
    # "module:function" in stages/ or callables (RunConfig, where) run by load_config; each raises a
    # UserError paragraph. ``where(key)`` names the file or override a key came from.
    checks: tuple[str | Callable[..., None], ...] = ()
    # The same, for rules about files on the machine that runs the job (a reward model folder):
    # `rayfactory submit` checks a config on another machine and skips them.
    file_checks: tuple[str | Callable[..., None], ...] = ()

    def roles(self, finetuning_args, rl_args) -> tuple[str, ...]:
        """The roles a run of this stage has. Each is an actor group of its own but the reference,
        a frozen copy inside the policy workers (only when beta > 0: the KL needs it), and the
        rollout engines, only for vLLM rollouts (hf rollouts generate inside the policy workers)."""
        roles = ["policy"]
        if finetuning_args.use_ref_model and rl_args.beta > 0:
            roles.append("reference")
        if rl_args.rollout_backend == "vllm":
            roles.append("rollout")
        if self.critic and rl_args.uses_critic:
            roles.append("critic")
        if self.reward_model and finetuning_args.reward_model_folder:  # api: a URL, called from the controller
            roles.append("reward")
        return tuple(roles)

    def load_checks(self, local: bool = True) -> list[Callable[..., None]]:
        return [_load(check) for check in self.checks + (self.file_checks if local else ())]

    def load_rl_defaults(self) -> Callable[..., dict] | None:
        return None if self.rl_defaults is None else _load(self.rl_defaults)


@dataclass(frozen=True)
class StageSpec:
    name: str
    summary: str  # one line for help texts
    dataset_need: str  # registries.datasets.stage_fields.DATASET_NEEDS
    tokenize: str  # registries.tokenize.KINDS
    collator: str  # "module:function" in stages/: (tokenizer, data_args, model) -> collator
    runner: str  # "module:function" in stages/: (StageJob) -> metrics (rl_controller: (RLRun) -> metrics)
    launch: Launch = "train_workers"
    pack_by_default: bool = False  # packing: null means this
    # The recipe feeds columns the model's forward() does not name (chosen_*, kl_*) to its collator.
    keeps_extra_columns: bool = False
    needs_reference: Callable[..., bool] = _never  # (FinetuningArguments) -> bool
    # The recipe trains on the model's own causal-LM loss, which chunked_loss can chunk.
    causal_lm_loss: bool = False
    # The recipe sums labelled tokens' log-probs (stages/training/sequence_logps.py): chunked_loss
    # applies the head in chunks there too.
    token_logps: bool = False
    takes_pref_loss: bool = False  # pref_loss (sigmoid, hinge, ipo, orpo, simpo) picks this stage's objective
    # do_predict: generated_predictions.jsonl and its BLEU/ROUGE after training (answers to compare with).
    predicts: bool = False
    # The output is a reward model (a value head that scores): serve answers with scores, not text.
    scores: bool = False
    rl: RLSpec | None = None  # set exactly for launch rl_controller

    def __post_init__(self) -> None:
        if self.dataset_need not in DATASET_NEEDS:
            raise ValueError(f"stage {self.name!r}: dataset_need must be one of {', '.join(DATASET_NEEDS)}")
        if self.tokenize not in KINDS:
            raise ValueError(f"stage {self.name!r}: tokenize must be one of {', '.join(KINDS)}")
        if self.pack_by_default and self.tokenize not in PACKABLE:
            raise ValueError(f"stage {self.name!r}: {self.tokenize} examples cannot be packed")
        if (self.rl is not None) != (self.launch == "rl_controller"):
            raise ValueError(f"stage {self.name!r}: an RLSpec is given exactly for launch rl_controller")

    @property
    def chunks_logits(self) -> bool:
        """Whether chunked_loss means anything here: the causal-LM loss, or summed token log-probs."""
        return self.causal_lm_loss or self.token_logps

    @property
    def checkpoint_kind(self) -> str:
        """The kind of checkpoint its runs write and resume from (stages/training/checkpoints.py)."""
        return "rl" if self.launch == "rl_controller" else "trainer"

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
    """A stage name the table lacks."""


def get_stage(name: str) -> StageSpec:
    spec = STAGES.get(name)
    if spec is None:
        close = difflib.get_close_matches(str(name), STAGES, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        extra = " (orpo and simpo are pref_loss values of stage dpo.)" if name in ("orpo", "simpo") else ""
        raise UnknownStageError(f"unknown stage {name!r}; the stages are {describe_stages()}.{hint}{extra}")
    return spec


def describe_stages() -> str:
    return ", ".join(STAGES)


def stages_where(fact: str) -> str:
    """The stages whose entry has ``fact`` true, for error messages: "sft" or "dpo, kto".
    ``fact`` may name an RL stage's fact: "rl.filters_groups"."""
    def holds(spec, names):
        for name in names:
            spec = getattr(spec, name, None)
        return bool(spec)

    return ", ".join(s.name for s in STAGES.values() if holds(s, fact.split(".")))


def _load(target: str | Callable) -> Callable:
    if callable(target):
        return target
    module, function = target.split(":")
    return getattr(importlib.import_module(f"stages.{module}"), function)


# --- the stages ----------------------------------------------------------------------------------
register_stage(StageSpec(
    "pt", "pre-training: next-token loss on plain text",
    dataset_need="plain", tokenize="pretrain", collator="training.collators:padding_collator",
    runner="recipes.causal_lm:run_causal_lm", pack_by_default=True, causal_lm_loss=True,
))
register_stage(StageSpec(
    "sft", "supervised fine-tuning: loss on the answers, prompts masked",
    dataset_need="plain", tokenize="supervised", collator="training.collators:supervised_collator",
    runner="recipes.causal_lm:run_causal_lm", causal_lm_loss=True, predicts=True,
))
register_stage(StageSpec(
    "rm", "reward model: a value head trained on preference pairs",
    dataset_need="ranking", tokenize="pairwise", collator="training.preference_collators:pairwise_collator",
    runner="recipes.rm:run_rm", keeps_extra_columns=True, scores=True,
))
register_stage(StageSpec(
    "dpo", "direct preference optimisation (pref_loss: sigmoid, hinge, ipo, orpo, simpo)",
    dataset_need="ranking", tokenize="pairwise", collator="training.preference_collators:dpo_pair_collator",
    runner="recipes.dpo:run_dpo", keeps_extra_columns=True, needs_reference=_dpo_reference, takes_pref_loss=True,
    token_logps=True,
))
register_stage(StageSpec(
    "kto", "Kahneman-Tversky optimisation on answers labelled good or bad",
    dataset_need="kto_tag", tokenize="feedback", collator="training.preference_collators:kto_collator",
    runner="recipes.kto:run_kto", keeps_extra_columns=True, needs_reference=_always, token_logps=True,
))
register_stage(StageSpec(
    "grpo", "GRPO: groups of sampled answers scored by reward functions; policy and vLLM rollouts as Ray actors",
    dataset_need="prompt_only", tokenize="unsupervised", collator="training.collators:prompt_collator",
    runner="recipes.grpo:run_grpo", launch="rl_controller",
    needs_reference=_always,  # when beta > 0; beta 0 loads none (stages/rl/workers/policy.py)
    rl=RLSpec(filters_groups=True),
))
register_stage(StageSpec(
    "ppo", "PPO: policy, critic, reward model and vLLM rollouts as Ray actor groups, GAE and a KL controller",
    dataset_need="prompt_only", tokenize="unsupervised", collator="training.collators:prompt_collator",
    runner="recipes.ppo:run_ppo", launch="rl_controller", needs_reference=_always,
    rl=RLSpec(
        critic=True, reward_model=True, kl_in_loss=False,
        updates_per_step=_ppo_updates,
        rl_defaults="rl.config.rl_args:ppo_defaults", checks=("rl.config.checks:check_ppo",),
        file_checks=("rl.config.checks:check_ppo_reward_model",),
    ),
))
