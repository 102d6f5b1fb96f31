"""The rules ``load_config`` runs over a built RunConfig, one registration each, in the order they run.

Each rule declares the keys it reads (a refusal it raises names the first unless the refusal names
its own), what a config is read for when it applies (``train``, ``infer``: chat, serve, export;
``submit``: a training run checked for another machine; ``check``: the web UI's look at a form),
and whether it reads this machine (files a config names, installed packages, user modules):
``submit`` skips those, as the job's machine checks its own. A few steps resolve rather than
refuse (paths made absolute, an explicit checkpoint found, report_to's trackers listed); they run
at their place in the same list, as the rules after them read what they resolved.

Every refusal is a ``ConfigError`` that carries its key, so each front door (the CLI, ``submit``,
``run_exp``, the web UI) shows the same paragraph and the web UI marks the field without reading
the text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from registries.unique import add_unique
from stages.tracking import default_run_name

from .config_types import ConfigError
from .extras import check_extras, check_report_to
from .local_paths import check_local_paths
from .paths import resolve_paths
from .rl_checks import check_rl
from .training_checks import (
    check_planned_work,
    loaded_zero_stage,
    check_streaming,
    check_template,
    check_training_options,
    read_deepspeed_config,
    resolve_explicit_checkpoint,
)

TRAINING = ("train", "submit", "check")
EVERY_PURPOSE = ("train", "infer", "submit", "check")
Where = Callable[[str], str]


@dataclass(frozen=True)
class Rule:
    name: str
    keys: tuple[str, ...]  # the config keys it reads; a refusal without a key of its own names keys[0]
    purposes: tuple[str, ...]  # what a config is read for when the rule applies
    reads_machine: bool  # files, packages or modules of this machine: skipped by submit
    check: Callable  # (run, where, purpose) -> None, or raises ConfigError

    def applies(self, purpose: str) -> bool:
        return purpose in self.purposes and not (self.reads_machine and purpose == "submit")


RULES: dict[str, Rule] = {}


def register_rule(name: str, keys: tuple[str, ...], purposes: tuple[str, ...] = TRAINING,
                  reads_machine: bool = False) -> Callable:
    """Decorator: ``check(run, where, purpose)`` runs for ``purposes``, after the rules registered
    before it. A second rule of the same name is a mistake."""
    unknown = set(purposes) - set(EVERY_PURPOSE)
    if unknown or not keys:
        raise ValueError(f"rule {name!r}: purposes must be among {EVERY_PURPOSE} and keys not empty")

    def register(check: Callable) -> Callable:
        add_unique(RULES, name, Rule(name, tuple(keys), tuple(purposes), reads_machine, check), "Rule")
        return check

    return register


def run_rules(run, where: Where, purpose: str) -> None:
    """Every rule that applies to ``purpose``, in order; the first refusal ends the run of them, as
    a ConfigError that names its key: its own, else the first key whose source its text cites
    (``where``, which the refusals call as they word themselves), else the rule's first key."""
    for rule in RULES.values():
        if not rule.applies(purpose):
            continue
        cited: list[str] = []

        def citing(key: str) -> str:
            cited.append(key)
            return where(key)

        try:
            rule.check(run, citing, purpose)
        except ConfigError as exc:
            if exc.key is None:
                exc.key = cited[0] if cited else rule.keys[0]
            raise


# --- the rules, in the order they run ------------------------------------------------------


@register_rule("rl", ("stage",), TRAINING)
def _rl(run, where: Where, purpose: str) -> None:
    """The RL stages' rules (cluster/rl_checks.py and the stage's own, from the stage table). On
    another machine (submit) its files are not read; a form being looked at (check) runs no module."""
    if run.finetuning.spec.launch == "rl_controller":
        check_rl(run, where, local=purpose != "submit", run_modules=purpose == "train")


@register_rule("model_named", ("model_name_or_path",), EVERY_PURPOSE)
def _model_named(run, where: Where, purpose: str) -> None:
    if not run.model.model_name_or_path:
        raise ConfigError(
            f"model_name_or_path is missing in {where('model_name_or_path')}. Set it to a model folder "
            "(or a hub id), e.g. model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct."
        )


@register_rule("quantized_needs_lora", ("quantization_bit", "finetuning_type"), EVERY_PURPOSE)
def _quantized_needs_lora(run, where: Where, purpose: str) -> None:
    bits, tuning = run.model.quantization_bit, run.finetuning.finetuning_type
    if bits is not None and tuning != "lora":
        raise ConfigError(
            f"quantization_bit {bits} in {where('quantization_bit')} needs finetuning_type lora (that is "
            f"QLoRA), but finetuning_type is {tuning!r}: quantized weights cannot be trained directly. Use "
            "finetuning_type: lora, or remove quantization_bit."
        )


@register_rule("template_known", ("template",), EVERY_PURPOSE)
def _template_known(run, where: Where, purpose: str) -> None:
    check_template(run.data.template)


@register_rule("paths_absolute", ("output_dir", "model_name_or_path", "dataset_dir"), EVERY_PURPOSE)
def _paths_absolute(run, where: Where, purpose: str) -> None:
    resolve_paths(run)  # workers and Serve replicas do not run in this directory


@register_rule("inference_packages", ("quantization_bit",), ("infer",), reads_machine=True)
def _inference_packages(run, where: Where, purpose: str) -> None:
    check_extras({"quantization_bit": run.model.quantization_bit}, where)


@register_rule("planned_work", ("do_train", "do_predict"))
def _planned_work(run, where: Where, purpose: str) -> None:
    check_planned_work(run, where)


@register_rule("streaming", ("streaming",))
def _streaming(run, where: Where, purpose: str) -> None:
    if run.data.streaming:
        stage = run.finetuning.spec
        check_streaming(stage.name, stage.launch, run.training.values, where)


@register_rule("output_dir_set", ("output_dir",))
def _output_dir_set(run, where: Where, purpose: str) -> None:
    if not run.training.values.get("output_dir"):
        raise ConfigError(
            f"output_dir is missing in {where('output_dir')}. Set the folder that receives checkpoints, "
            "logs and the trained model, e.g. output_dir: saves/my-run."
        )


@register_rule("one_precision", ("fp16", "bf16"))
def _one_precision(run, where: Where, purpose: str) -> None:
    if run.training.values.get("bf16") and run.training.values.get("fp16"):
        raise ConfigError(f"bf16 and fp16 are both true in {where('fp16')}. Pick one precision (bf16 on recent GPUs).")


@register_rule("eval_data", ("eval_strategy", "val_size", "eval_dataset"))
def _eval_data(run, where: Where, purpose: str) -> None:
    strategy, data = run.training.values.get("eval_strategy", "no"), run.data
    if strategy != "no" and not data.val_size and not data.eval_dataset:
        raise ConfigError(
            f"eval_strategy is {strategy!r} in {where('eval_strategy')} but there is nothing to evaluate on. "
            "Set val_size (a fraction of the training data) or eval_dataset, or set eval_strategy: no."
        )


@register_rule("deepspeed_file", ("deepspeed",), reads_machine=True)
def _deepspeed_file(run, where: Where, purpose: str) -> None:
    read_deepspeed_config(run.training.values, run.model, run.finetuning, where)


@register_rule("eval_tasks", ("eval_tasks", "eval_strategy", "deepspeed"))
def _eval_tasks(run, where: Where, purpose: str) -> None:
    if not run.evaluation.eval_tasks:
        return
    stage = run.finetuning.spec
    if stage.scores or stage.launch != "train_workers":
        raise ConfigError(
            f"eval_tasks in {where('eval_tasks')} scores a generating model during training: stages pt, sft, dpo "
            f"and kto. Stage {stage.name} trains {'a reward model' if stage.scores else 'in its own RL loop'}; remove "
            "eval_tasks and score a saved checkpoint with rayfactory eval instead."
        )
    if run.evaluation.eval_num_workers > 1:
        raise ConfigError(
            f"eval_num_workers in {where('eval_num_workers')} splits rayfactory eval over Ray actors; eval_tasks "
            f"(in {where('eval_tasks')}) scores on the training run's rank 0. Remove eval_num_workers from the "
            "training config.", key="eval_num_workers",
        )
    if run.training.values.get("eval_strategy", "no") == "no":
        raise ConfigError(
            f"eval_tasks in {where('eval_tasks')} runs at each evaluation, but eval_strategy is no. Set eval_strategy: "
            "steps with eval_steps (and an eval_dataset or val_size), or remove eval_tasks."
        )
    if loaded_zero_stage(run.training.values) == 3:
        raise ConfigError(
            f"eval_tasks in {where('eval_tasks')} scores the model on one worker, but the DeepSpeed ZeRO-3 config from "
            f"{where('deepspeed')} splits its weights over all of them. Use a ZeRO-2 config, or remove eval_tasks and "
            "score the saved checkpoints with rayfactory eval."
        )


@register_rule("train_in_driver", ("train_in_driver",))
def _train_in_driver(run, where: Where, purpose: str) -> None:
    if not run.ray.train_in_driver:
        return
    training = run.training.values
    needs = run.ray.worker_group_reasons(streaming=run.data.streaming, deepspeed=bool(training.get("deepspeed")),
                                         rl=run.finetuning.spec.launch == "rl_controller")
    if needs:
        raise ConfigError(
            f"train_in_driver is true in {where('train_in_driver')}, but this run needs a Ray Train worker "
            f"group: {'; '.join(needs)}. Remove train_in_driver (the default trains in the driver wherever it "
            "can) or set it to false."
        )


@register_rule("resume_checkpoint", ("resume_from_checkpoint",), reads_machine=True)
def _resume_checkpoint(run, where: Where, purpose: str) -> None:
    resolve_explicit_checkpoint(run.training.values, where, run.finetuning.spec.checkpoint_kind)


@register_rule("trackers", ("report_to",))
def _trackers(run, where: Where, purpose: str) -> None:
    training = run.training.values
    trackers = check_report_to(training.get("report_to", "none"), where, local=purpose != "submit")
    training["report_to"] = trackers or "none"
    if trackers:  # LLaMA-Factory's key; the trackers' run list shows it (stages/tracking.py)
        training.setdefault("run_name", default_run_name(training["output_dir"]))


@register_rule("training_packages", ("deepspeed", "quantization_bit", "rollout_backend"), reads_machine=True)
def _training_packages(run, where: Where, purpose: str) -> None:
    vllm = run.finetuning.spec.launch == "rl_controller" and run.rl.rollout_backend == "vllm"
    check_extras({"deepspeed": run.training.values.get("deepspeed"), "quantization_bit": run.model.quantization_bit,
                  "rollout_backend": vllm, "eval_tasks": run.evaluation.eval_tasks}, where)


@register_rule("trainer_options", ("per_device_train_batch_size",))
def _trainer_options(run, where: Where, purpose: str) -> None:
    check_training_options(run.training, where)


# Last: a refusal about the config's values comes first; then a folder that is not there (the job's
# machine, and a chat or export, read it; a form being looked at does not).
@register_rule("local_paths", ("model_name_or_path", "adapter_name_or_path", "ref_model", "reward_model"),
               ("train", "infer"), reads_machine=True)
def _local_paths(run, where: Where, purpose: str) -> None:
    check_local_paths(run)
