"""The model, fine-tuning, generation and trainer halves of a run config.

Field names and defaults follow LLaMA-Factory, so its YAML files load unchanged. The
dataclasses only hold and resolve values; cluster/config.py checks types and cross-field rules
and turns mistakes into errors that name the file and key.

Trainer options use the names of ``transformers.Seq2SeqTrainingArguments``. They are kept as a
plain mapping (``TrainingOptions``) and become the real object only on the worker, through
``TrainingOptions.build()``: constructing it sets up devices and loads DeepSpeed configs, which
belongs on the machine that trains. The driver builds one only as a check, with the options that
depend on the hardware left out (cluster/training_checks.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from registries.errors import ArgumentError, UserError

from .table import StageSpec, UnknownStageError, get_stage, stages_where

# bitsandbytes (imported by peft, which transformers' training_args imports) warns at import time that
# it cannot fetch an optional CPU kernel from the hub; its built-in fallback runs instead. That line
# would open every run's output, on the driver and on each worker, so keep that logger to errors.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

AttentionImpl = Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"]


class TrainingOptionsError(UserError):
    """Trainer options that transformers refuses (e.g. save and eval strategies that must match)."""


@dataclass
class ModelArguments:
    model_name_or_path: str | None = None  # required; None only so the error can say so clearly
    adapter_name_or_path: list[str] | None = None  # "a,b" merges adapters in order
    trust_remote_code: bool = False  # run the model repo's own Python code (hub models that need it)
    # LLaMA-Factory's key: the embeddings are resized whenever the template adds tokens, either way
    resize_vocab: bool = False
    model_revision: str = "main"  # the hub branch, tag or commit to load
    cache_dir: str | None = None  # the hub cache folder; None: HF_HOME's
    # 4 or 8: load the base quantized with bitsandbytes (lora on it is QLoRA)
    quantization_bit: Literal[4, 8] | None = None
    quantization_method: Literal["bnb"] = "bnb"  # LLaMA-Factory's key; bitsandbytes is the only one here
    quantization_type: Literal["nf4", "fp4"] = "nf4"  # 4-bit data type
    double_quantization: bool = True  # 4-bit: quantize the quantization constants too
    # "auto" loads weights in the trainer's precision: bfloat16 with bf16, float16 with fp16, else float32.
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # chat, predict and serve load weights in this dtype; auto: transformers' choice (CPU vLLM: float32)
    infer_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # None lets transformers pick (sdpa where it can).
    attn_implementation: AttentionImpl | None = None

    def load_dtype(self, bf16: bool, fp16: bool) -> str:
        """The dtype name to load weights in for training, resolving "auto" from the precision flags."""
        if self.torch_dtype != "auto":
            return self.torch_dtype
        return "bfloat16" if bf16 else "float16" if fp16 else "float32"


@dataclass
class FinetuningArguments:
    stage: str = "sft"  # a name in the stage table (stages/table.py)
    # lora: adapters only; freeze: the last layers; full: every weight
    finetuning_type: Literal["full", "freeze", "lora"] = "lora"
    # freeze: train the last N layers (negative: the first N), limited to these modules.
    freeze_trainable_layers: int = 2
    # freeze: the module names trained inside those layers; all: every one
    freeze_trainable_modules: list[str] = field(default_factory=lambda: ["all"])
    freeze_extra_modules: list[str] | None = None  # freeze: modules outside the layers trained too (e.g. embed_tokens)
    lora_rank: int = 8  # the adapters' rank r
    lora_alpha: int | None = None  # None means 2 * lora_rank, as in LLaMA-Factory
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_target: list[str] = field(default_factory=lambda: ["all"])  # "all": every linear layer but the head
    additional_target: list[str] | None = None  # modules trained fully next to the adapter (e.g. embed_tokens)
    use_rslora: bool = False  # rank-stabilised scaling: alpha / sqrt(r) instead of alpha / r
    use_dora: bool = False  # weight-decomposed LoRA (DoRA)
    # Vision-language models (LLaMA-Factory's names and defaults; stages/training/vision_freeze.py has
    # each family's module names): the vision tower and the projector stay frozen and LoRA stays on
    # the language model unless told otherwise. Text models ignore them, as LLaMA-Factory does.
    freeze_vision_tower: bool = True
    freeze_multi_modal_projector: bool = True  # see freeze_vision_tower
    freeze_language_model: bool = False  # see freeze_vision_tower
    # LLaMA-Factory 0.9.2's spelling of "only the projector trains" (full only), kept for its YAML files:
    # it sets the three above (freeze_vision_tower and freeze_language_model true, the projector trained).
    train_mm_proj_only: bool = False
    # Preference stages. pref_loss picks the objective inside stage dpo: sigmoid (DPO), hinge, ipo,
    # orpo and simpo (the last two need no reference model).
    pref_beta: float = 0.1
    pref_ftx: float = 0.0  # weight of the SFT loss added to the preference loss
    pref_loss: Literal["sigmoid", "hinge", "ipo", "orpo", "simpo"] = "sigmoid"  # see pref_beta
    dpo_label_smoothing: float = 0.0  # sigmoid only: the share of pairs assumed mislabelled (cDPO)
    simpo_gamma: float = 0.5  # simpo's target reward margin
    kto_chosen_weight: float = 1.0  # kto: weight of the desirable examples' loss
    kto_rejected_weight: float = 1.0  # kto: weight of the undesirable examples' loss
    ref_model: str | None = None  # None: the policy's own initial weights (adapter disabled for LoRA)
    ref_model_adapters: list[str] | None = None  # adapters merged into ref_model, in order
    # Stage ppo scores completions with reward_model (a stage rm output) and/or reward_funcs.
    # reward_model_type, as in LLaMA-Factory: lora, an rm adapter on the policy's own base model;
    # full, a whole reward model of its own; api, reward_model is the URL of a reward server (or an
    # LLM judge's /v1/chat/completions) that the controller calls (stages/rl/controller/remote_reward.py).
    reward_model: str | None = None
    # LLaMA-Factory's key, refused when set: merge the adapters with rayfactory export first.
    reward_model_adapters: list[str] | None = None
    reward_model_type: Literal["lora", "full", "api"] = "lora"  # see reward_model
    plot_loss: bool = False  # training_<key>.png in output_dir for the loss and the other logged series
    # LLaMA-Factory's key (transformers 5 dropped it from TrainingArguments): a run that starts from step 0
    # in an output_dir holding another run replaces it instead of being refused (cluster/replaced_run.py).
    overwrite_output_dir: bool = False
    # RayFactory's own, pt/sft (the cross-entropy) and dpo/kto (the summed log-probs): the output head
    # in chunks of tokens, each chunk's logits recomputed in the backward instead of kept
    # (stages/training/chunked_loss.py). null: on from a 32768-token vocabulary.
    chunked_loss: bool | None = None
    chunked_loss_tokens: int | None = None  # tokens per chunk; null: ~256 MiB of fp32 logits per chunk
    # TRL's name: the reference's log-probs computed in one pass before training, a separate
    # reference model then freed (stages/training/reference_logps.py). null: planned per run.
    precompute_ref_log_probs: bool | None = None

    def __post_init__(self) -> None:
        try:
            get_stage(self.stage)
        except UnknownStageError as exc:
            raise ArgumentError("stage", str(exc)) from None
        if self.lora_alpha is None:
            self.lora_alpha = 2 * self.lora_rank
        if self.lora_rank < 1:
            raise ArgumentError("lora_rank", f"lora_rank must be at least 1, got {self.lora_rank}. Try lora_rank: 8.")
        if self.lora_alpha <= 0:
            raise ArgumentError(
                "lora_alpha", f"lora_alpha must be positive, got {self.lora_alpha}. Remove it for 2 * lora_rank."
            )
        if not 0 <= self.lora_dropout < 1:
            raise ArgumentError("lora_dropout", f"lora_dropout must be in [0, 1), got {self.lora_dropout}.")
        if self.freeze_trainable_layers == 0:
            raise ArgumentError(
                "freeze_trainable_layers",
                "freeze_trainable_layers is 0, which trains nothing. "
                "Use N > 0 for the last N layers, -N for the first N.",
            )
        if self.pref_loss != "sigmoid" and not self.spec.takes_pref_loss:
            takers = stages_where("takes_pref_loss")
            raise ArgumentError(
                "pref_loss",
                f"pref_loss {self.pref_loss!r} selects a preference objective inside stage {takers}, but stage is "
                f"{self.stage!r}. Set stage: {takers}, or remove pref_loss.",
            )
        if self.dpo_label_smoothing > 0 and self.pref_loss != "sigmoid":
            raise ArgumentError(
                "dpo_label_smoothing",
                f"dpo_label_smoothing only applies to pref_loss sigmoid, not {self.pref_loss!r}. Remove it.",
            )
        if self.chunked_loss_tokens is not None and self.chunked_loss_tokens < 1:
            raise ArgumentError(
                "chunked_loss_tokens",
                f"chunked_loss_tokens must be at least 1, got {self.chunked_loss_tokens}. Remove it for the "
                "automatic size (~256 MiB of fp32 logits per chunk).",
            )
        if self.chunked_loss and not self.spec.chunks_logits:
            raise ArgumentError(
                "chunked_loss",
                f"chunked_loss applies the output head in chunks of tokens in stages {stages_where('chunks_logits')}, "
                f"but stage is {self.stage!r}, whose loss reads no token logits. Remove chunked_loss.",
            )
        if self.precompute_ref_log_probs and not (self.spec.token_logps and self.spec.needs_reference(self)):
            raise ArgumentError(
                "precompute_ref_log_probs",
                f"precompute_ref_log_probs computes a reference model's log-probs before training, but this run has "
                f"no reference (stage {self.stage!r}, pref_loss {self.pref_loss!r}). Remove precompute_ref_log_probs.",
            )
        if self.train_mm_proj_only:
            if self.finetuning_type != "full":
                raise ArgumentError(
                    "train_mm_proj_only",
                    f"train_mm_proj_only trains a vision-language model's projector alone, which needs finetuning_type "
                    f"full (as in LLaMA-Factory), but finetuning_type is {self.finetuning_type!r}. Set finetuning_type: "
                    "full, or remove train_mm_proj_only.",
                )
            self.freeze_vision_tower, self.freeze_multi_modal_projector, self.freeze_language_model = True, False, True
        for name in ("use_rslora", "use_dora"):
            if getattr(self, name) and self.finetuning_type != "lora":
                raise ArgumentError(
                    name, f"{name} is a LoRA option, but finetuning_type is {self.finetuning_type!r}. Remove {name}."
                )

    @property
    def spec(self) -> StageSpec:
        """This stage's entry in the stage table."""
        return get_stage(self.stage)

    @property
    def reward_model_folder(self) -> str | None:
        """The reward model to load (an rm output); None when there is none or it is a remote API
        (reward_model_type api: reward_model is then a URL, scored from the controller)."""
        return None if self.reward_model_type == "api" else self.reward_model

    @property
    def use_ref_model(self) -> bool:
        """Whether the stage needs a frozen reference policy (the stage table says; orpo and simpo do not)."""
        return self.spec.needs_reference(self)


@dataclass
class GeneratingArguments:
    """Decoding options (LLaMA-Factory names). Parsed and saved with every run; chat, predict and
    the RL rollouts read them (as a stages/engines SamplingSpec)."""

    do_sample: bool = True  # false: greedy decoding
    temperature: float = 0.95  # sampling temperature
    top_p: float = 0.7  # nucleus sampling: the smallest set of tokens whose probabilities sum to top_p
    top_k: int = 50  # sample among the k likeliest tokens; 0: no cut
    num_beams: int = 1  # beam search width (transformers engine; 1: none)
    max_length: int = 1024  # prompt + reply tokens, when max_new_tokens is not set
    max_new_tokens: int = 1024  # reply tokens at most
    repetition_penalty: float = 1.0  # penalises tokens already present (1.0: none)
    length_penalty: float = 1.0  # beam search's length exponent
    skip_special_tokens: bool = True  # decode replies without special tokens

    def to_generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``model.generate``; sampling knobs only when sampling."""
        kwargs = dataclasses.asdict(self)
        kwargs.pop("skip_special_tokens")  # a decode option, not a generate one
        if kwargs["max_new_tokens"]:
            kwargs.pop("max_length")  # generate() prefers max_new_tokens; passing both warns
        if not self.do_sample:
            for name in ("temperature", "top_p", "top_k"):
                kwargs.pop(name)
        return kwargs


@dataclass(frozen=True)
class TrainerField:
    """What a Seq2SeqTrainingArguments field accepts: its annotation and default."""

    name: str
    annotation: Any
    default: Any


@lru_cache(maxsize=1)
def trainer_fields() -> dict[str, TrainerField]:
    """The fields of the installed transformers' Seq2SeqTrainingArguments.

    Read from the class rather than copied here, so a transformers upgrade that renames a
    field (5.x dropped ``warmup_ratio`` and ``overwrite_output_dir``) shows up as an unknown
    key instead of a silently ignored one. Importing it imports torch: a few seconds, once.
    """
    import typing

    from transformers import Seq2SeqTrainingArguments

    hints = typing.get_type_hints(Seq2SeqTrainingArguments)
    result = {}
    for f in dataclasses.fields(Seq2SeqTrainingArguments):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        result[f.name] = TrainerField(f.name, hints.get(f.name, f.type), default)
    return result


@lru_cache(maxsize=1)
def trainer_field_names() -> frozenset[str]:
    """The names of ``trainer_fields()``, without importing transformers (and torch: seconds) when
    this install has listed them before: a key typo is then reported in well under a second. Kept
    per transformers version in RayFactory's cache; written the first time, whole or not at all."""
    import json
    import os
    from importlib import metadata

    from registries.models.tiny import cache_root

    path = cache_root() / "trainer-fields" / f"transformers-{metadata.version('transformers')}.json"
    try:
        names = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
            return frozenset(names)
    except (OSError, ValueError):
        pass
    names = sorted(trainer_fields())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(names), encoding="utf-8")
        os.replace(partial, path)
    except OSError:  # a read-only home: the next run lists them again
        pass
    return frozenset(names)


@dataclass
class TrainingOptions:
    """Trainer options the user set (already checked), with transformers' defaults for the rest.

    ``options.learning_rate`` reads like the real arguments object; ``build()`` makes it.
    """

    values: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # Dunder lookups (pickle, copy) must not land here: Ray ships this object to workers.
        if name.startswith("__") or name == "values":
            raise AttributeError(name)
        if name in self.values:
            return self.values[name]
        known = trainer_fields()
        if name not in known:
            raise AttributeError(f"{name!r} is not a Seq2SeqTrainingArguments field")
        return known[name].default

    def to_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def build(self, **overrides: Any):
        """The real ``transformers.Seq2SeqTrainingArguments`` (call this on the worker)."""
        from transformers import Seq2SeqTrainingArguments

        try:
            return Seq2SeqTrainingArguments(**{**self.values, **overrides})
        except ValueError as exc:  # transformers' checks across options; one paragraph for the CLI
            raise TrainingOptionsError("training options: " + " ".join(str(exc).split())) from None
