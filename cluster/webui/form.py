"""The Train tab's form: its fields, and form values <-> the config dict <-> YAML text.

The form edits a plain LLaMA-Factory-style config, the same dict a YAML file holds. Keys the form
has no field for (loaded from a YAML) are kept as they are, so load -> save changes nothing the
user did not touch. Validation is the CLI's own: ``load_config`` of that dict, and its
``ConfigError`` paragraph is what the page shows next to the field it names.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import asdict, dataclass
from typing import Any

import yaml

from registries.errors import UserError


@dataclass(frozen=True)
class Field:
    key: str  # the config key, LLaMA-Factory's name
    section: str  # the YAML section it is written under ("### model" ...)
    kind: str  # text | number | select | datasets | check | list
    default: Any = ""
    choices: tuple = ()  # select: fixed choices; filled from the registries by `form_spec`
    help: str = ""
    when: tuple = ()  # ("stage", "dpo", "kto"): shown (and written) only when that field has one of these values
    item: str = "text"  # list: what its comma-separated entries are (text | number); written as a YAML list


SECTIONS = ("model", "method", "rl", "dataset", "output", "train", "ray")
# The stages with an RL options group (stages/table.py: an ``rl`` entry; a test keeps the two in step).
RL_STAGES = ("grpo", "ppo")
RL = ("stage", *RL_STAGES)
# RL keys whose choices are their Literal type in stages/rl/rl_args.py (filled by `form_spec`).
RL_LITERALS = ("advantage_estimator", "loss_type", "rollout_backend", "async_rollout")
FIELDS: tuple[Field, ...] = (
    Field("model_name_or_path", "model", "text", "tiny:qwen2",
          help="hub id, local folder, tiny:<family> (random-init, offline) or demo:smollm2-135m-instruct"),
    Field("template", "model", "select", "auto", help="auto: the tokenizer's own chat template, else the model family's"),
    Field("stage", "method", "select", "sft"),
    Field("finetuning_type", "method", "select", "lora", choices=("lora", "full", "freeze")),
    Field("lora_rank", "method", "number", 8, when=("finetuning_type", "lora")),
    Field("lora_alpha", "method", "number", "", help="blank: 2 x lora_rank", when=("finetuning_type", "lora")),
    Field("lora_dropout", "method", "number", 0, when=("finetuning_type", "lora")),
    Field("lora_target", "method", "text", "all", help="module names, comma-separated; all = every linear layer",
          when=("finetuning_type", "lora")),
    Field("additional_target", "method", "text", "", help="modules trained fully beside the adapter",
          when=("finetuning_type", "lora")),
    Field("freeze_trainable_layers", "method", "number", 2, when=("finetuning_type", "freeze")),
    Field("pref_loss", "method", "select", "sigmoid", choices=("sigmoid", "hinge", "ipo", "orpo", "simpo"),
          when=("stage", "dpo")),
    Field("pref_beta", "method", "number", 0.1, when=("stage", "dpo", "kto")),
    # --- RL (stage grpo / ppo; stages/rl/rl_args.py). Blank: the stage's own default, not written.
    Field("reward_funcs", "rl", "list", "", when=RL,
          help="comma-separated; built-ins exact_match, digit_ratio, final_number, number_format, short_answer, "
               "starts_with_answer, or module.path:function (grpo needs one; ppo: beside or instead of "
               "reward_model)"),
    Field("reward_weights", "rl", "list", "", item="number", when=RL,
          help="one weight per reward function, comma-separated; blank: 1.0 each"),
    Field("reward_model", "rl", "text", "", when=("stage", "ppo"),
          help="a stage rm output (folder), or a reward server's URL with reward_model_type api"),
    Field("reward_model_type", "rl", "select", "", choices=("lora", "full", "api"), when=("stage", "ppo"),
          help="lora: an rm adapter on this base model; full: a model of its own; api: a URL; blank: lora"),
    Field("num_generations", "rl", "number", "", when=RL, help="completions per prompt; blank: 4 (ppo: 1)"),
    Field("rollout_batch_size", "rl", "number", "", when=RL,
          help="prompts per step; blank: 8 (ppo: batch size x accumulation x ppo_buffer_size x workers)"),
    Field("max_completion_length", "rl", "number", "", when=RL,
          help="tokens per completion (multi-turn: the whole trajectory); blank: 32 (ppo: max_new_tokens)"),
    Field("beta", "rl", "number", "", when=RL, help="KL-to-reference weight, 0 loads no reference; blank: 0 "
                                                    "(ppo: 0.2, the adaptive controller's start)"),
    Field("loss_type", "rl", "select", "", when=RL, help="blank: dapo (token mean)"),
    Field("advantage_estimator", "rl", "select", "", when=RL,
          help="blank: group_norm (ppo: gae, its critic)"),
    Field("epsilon", "rl", "number", "", when=RL, help="clip range of the probability ratio; blank: 0.2"),
    Field("num_iterations", "rl", "number", "", when=RL, help="policy updates per rollout batch; blank: 1"),
    Field("rollout_backend", "rl", "select", "", when=RL,
          help="vllm: engines of their own; hf: generate() in the policy workers; blank: vllm"),
    Field("async_rollout", "rl", "select", "", when=RL,
          help="off; one_step: the next batch is sampled while this one trains; bounded: up to max_staleness "
               "batches ahead; blank: off"),
    Field("max_staleness", "rl", "number", "", when=RL,
          help="batches the engines may run ahead (async_rollout bounded only); blank: 1 for one_step, 2 for bounded"),
    Field("environment", "rl", "text", "", when=RL,
          help="multi-turn rollouts: tools (built-in) or module.path:Class; blank: tools if tools are listed, "
               "else single-turn"),
    Field("tools", "rl", "list", "", when=RL,
          help="comma-separated; built-ins calculator, python, or module.path:tool"),
    Field("max_turns", "rl", "number", "", when=RL, help="policy turns per trajectory; blank: 4"),
    Field("max_turn_tokens", "rl", "number", "", when=RL,
          help="tokens of one policy turn; blank: max_completion_length"),
    Field("dataset_dir", "dataset", "text", "data", help="the folder with dataset_info.json"),
    Field("dataset", "dataset", "datasets", ""),
    Field("eval_dataset", "dataset", "datasets", ""),
    Field("cutoff_len", "dataset", "number", 2048),
    Field("max_samples", "dataset", "number", ""),
    Field("output_dir", "output", "text", "saves/webui/run"),
    Field("logging_steps", "output", "number", 5),
    Field("save_steps", "output", "number", 100),
    Field("per_device_train_batch_size", "train", "number", 4),
    Field("gradient_accumulation_steps", "train", "number", 1),
    Field("learning_rate", "train", "number", 1.0e-4),
    Field("num_train_epochs", "train", "number", 3),
    Field("max_steps", "train", "number", "", help="blank: run num_train_epochs"),
    Field("lr_scheduler_type", "train", "select", "cosine",
          choices=("cosine", "linear", "constant", "constant_with_warmup", "polynomial")),
    Field("warmup_steps", "train", "number", 0),
    Field("bf16", "train", "check", False),
    Field("seed", "train", "number", 42),
    Field("ray_num_workers", "ray", "number", 1),
    Field("resources_per_worker", "ray", "number", 1, help="CPUs per worker (a GPU cluster: edit the YAML)"),
)
FIELD_BY_KEY = {f.key: f for f in FIELDS}
# What the page calls each field; the config key stays beside it ("Learning rate (learning_rate)").
LABELS = {
    "model_name_or_path": "Model", "template": "Chat template", "stage": "Training stage",
    "finetuning_type": "Fine-tuning method", "lora_rank": "LoRA rank", "lora_alpha": "LoRA alpha",
    "lora_dropout": "LoRA dropout", "lora_target": "LoRA target modules", "additional_target": "Fully trained modules",
    "freeze_trainable_layers": "Trainable layers", "pref_loss": "Preference loss", "pref_beta": "Preference beta",
    "reward_funcs": "Reward functions", "reward_weights": "Reward weights", "reward_model": "Reward model",
    "reward_model_type": "Reward model type", "num_generations": "Completions per prompt",
    "rollout_batch_size": "Rollout batch size", "max_completion_length": "Completion length",
    "beta": "KL weight", "loss_type": "Policy loss", "advantage_estimator": "Advantage estimator",
    "epsilon": "Clip range", "num_iterations": "Updates per batch", "rollout_backend": "Rollout backend",
    "async_rollout": "Asynchronous rollouts", "max_staleness": "Max staleness", "environment": "Environment",
    "tools": "Tools", "max_turns": "Max turns", "max_turn_tokens": "Tokens per turn", "dataset_dir": "Data folder",
    "dataset": "Datasets", "eval_dataset": "Eval datasets", "cutoff_len": "Cutoff length",
    "max_samples": "Max samples", "output_dir": "Output folder", "logging_steps": "Logging steps",
    "save_steps": "Save steps", "per_device_train_batch_size": "Batch size per worker",
    "gradient_accumulation_steps": "Gradient accumulation", "learning_rate": "Learning rate",
    "num_train_epochs": "Epochs", "max_steps": "Max steps", "lr_scheduler_type": "LR schedule",
    "warmup_steps": "Warmup steps", "bf16": "bf16", "seed": "Seed", "ray_num_workers": "Workers",
    "resources_per_worker": "CPUs per worker",
}
# Hub ids the model field suggests besides the built-in ones, with their chat template (the UI never
# downloads: one works once it is in this machine's hub cache). A test keeps each template registered.
HUB_MODELS = (
    ("Qwen/Qwen2.5-0.5B-Instruct", "qwen"), ("Qwen/Qwen2.5-1.5B-Instruct", "qwen"), ("Qwen/Qwen3-0.6B", "qwen3"),
    ("Qwen/Qwen3-1.7B", "qwen3"), ("meta-llama/Llama-3.2-1B-Instruct", "llama3"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama3"), ("mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
    ("google/gemma-2-2b-it", "gemma2"), ("google/gemma-3-1b-it", "gemma3"),
    ("microsoft/Phi-3-mini-4k-instruct", "phi"), ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"),
    ("Qwen/Qwen2-VL-2B-Instruct", "qwen2_vl"), ("llava-hf/llava-1.5-7b-hf", "llava"),
)
# Not fields (a run from the board always trains and plots): the extra keys a new form starts with.
NEW_FORM_EXTRA = {"do_train": True, "plot_loss": True}
REQUIRED_CHOICES = ("stage", "finetuning_type")  # every other select has a blank choice: "not written"


def form_spec() -> dict[str, Any]:
    """The fields with their choices filled from the registries, for the page to draw."""
    from registries.templates import list_templates
    from stages.table import STAGES

    fields = []
    for f in FIELDS:
        choices = f.choices
        if f.key == "template":
            choices = ("auto", *sorted(list_templates()))
        elif f.key == "stage":
            choices = tuple(STAGES)
        elif f.key in RL_LITERALS:
            choices = rl_choices(f.key)
        elif f.key == "reward_model_type":
            from stages.run_args import FinetuningArguments

            choices = literal_choices(FinetuningArguments, f.key)
        if f.kind == "select" and f.key not in REQUIRED_CHOICES:
            choices = ("", *choices)
        fields.append({**asdict(f), "choices": list(choices), "label": LABELS.get(f.key, f.key)})
    return {"sections": list(SECTIONS), "fields": fields, "extra_text": extra_text(NEW_FORM_EXTRA),
            "models": model_suggestions(), "model_list": model_list()}


def rl_choices(key: str) -> tuple[str, ...]:
    """The values an RL select offers: the Literal of its RLArguments field, the loader's own check."""
    from stages.rl.rl_args import RLArguments

    return literal_choices(RLArguments, key)


def literal_choices(cls: type, key: str) -> tuple[str, ...]:
    import typing

    hint = typing.get_type_hints(cls)[key]
    while typing.get_origin(hint) is not typing.Literal:  # Optional[Literal[...]]
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return tuple(typing.get_args(hint))


def model_suggestions() -> list[str]:
    """What the model field offers besides a hub id or a folder: the offline tiny and demo models."""
    from registries.models.demo import DEMO_PREFIX, list_demo_models
    from registries.models.families import list_model_families

    return [f"tiny:{family}" for family in list_model_families()] + [DEMO_PREFIX + m for m in list_demo_models()]


def model_list() -> list[dict[str, str]]:
    """Every model the field suggests, as {name, template (what picking it sets), note}: the tiny
    models with their family's template and the demo models with their own (the registries'), then
    HUB_MODELS."""
    from registries.models.demo import DEMO_PREFIX, get_demo_model, list_demo_models
    from registries.models.families import get_model_family, list_model_families

    out = [{"name": f"tiny:{name}", "template": get_model_family(name).template,
            "note": f"random-init {name}, offline"} for name in list_model_families()]
    out += [{"name": DEMO_PREFIX + name, "template": get_demo_model(name).template, "note": "a real small model"}
            for name in list_demo_models()]
    out += [{"name": name, "template": template, "note": "hub id (from the hub cache)"} for name, template in HUB_MODELS]
    return out


def extra_text(extra: dict[str, Any]) -> str:
    """The keys the form has no field for, as the YAML the page's "more keys" box holds."""
    if not extra:
        return ""
    return yaml.safe_dump(extra, default_flow_style=False, sort_keys=False, allow_unicode=True)


def config_from_form(values: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config dict the form describes: ``extra`` (keys the form has no field for, or whose
    field is hidden) first, then every shown field that is not blank, with numbers as numbers and
    dataset lists comma-joined."""
    config: dict[str, Any] = dict(extra or {})
    for f in FIELDS:
        if not _shown(f, values):  # another stage's or tuning type's option: only what extra holds
            continue
        value = _typed(f, values.get(f.key, f.default))
        if value is None:
            if not (f.kind == "check" and config.get(f.key) is False):  # a loaded explicit false stays
                config.pop(f.key, None)
        elif f.key == "resources_per_worker":  # the form edits the CPUs; GPUs and others stay
            kept = config.get(f.key)
            config[f.key] = {**(kept if isinstance(kept, dict) else {}), "CPU": value}
        else:
            config[f.key] = value
    return config


def form_from_config(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(form values, the keys the form has no field for) of a loaded config. A field the loaded
    values hide (lora_rank of a full fine-tune) keeps its key in extra, so saving writes it back."""
    values, extra = {}, {}
    for key, value in config.items():
        f = FIELD_BY_KEY.get(key)
        if f is None:
            extra[key] = value
        elif key == "resources_per_worker" and isinstance(value, dict):
            values[key] = value.get("CPU", "")
            if set(value) - {"CPU"}:  # GPUs and custom resources live on in extra, merged back on save
                extra[key] = value
        elif f.kind == "datasets":
            values[key] = value if isinstance(value, list) else [v.strip() for v in str(value).split(",") if v.strip()]
        elif f.kind == "list":  # the text box's comma-separated entries; _typed makes the list again
            values[key] = ", ".join(map(str, value)) if isinstance(value, list) else value
        else:
            values[key] = value
    for f in FIELDS:  # a field the YAML leaves out is blank, not the form's default
        values.setdefault(f.key, False if f.kind == "check" else "")
    for f in FIELDS:
        if f.key in config and (not _shown(f, values) or (f.kind == "check" and config[f.key] is False)):
            extra[f.key] = config[f.key]
    return values, extra


def _shown(f: Field, values: dict[str, Any]) -> bool:
    if not f.when:
        return True
    controller, *allowed = f.when
    value = values.get(controller)
    return (FIELD_BY_KEY[controller].default if value in (None, "") else value) in allowed


def _typed(f: Field, value: Any) -> Any:
    """None for blank; numbers parsed (a text the CLI would refuse stays text, so it gets the
    CLI's own error); a dataset list joined the way LLaMA-Factory writes it."""
    if f.kind == "check":
        return True if value in (True, "true", "on") else None
    if f.kind == "datasets":
        names = value if isinstance(value, list) else str(value).split(",")
        names = [n.strip() for n in names if str(n).strip()]
        return ",".join(names) or None
    if f.kind == "list":  # "a, b" (or a JSON list) -> [a, b]; an entry the CLI would refuse stays text
        entries = value if isinstance(value, list) else str(value if value is not None else "").split(",")
        entries = [e.strip() if isinstance(e, str) else e for e in entries]
        entries = [e for e in entries if e not in ("", None)]
        if f.item == "number":
            entries = [_number(e) if isinstance(e, str) else e for e in entries]
        return entries or None
    if isinstance(value, str):
        value = value.strip()
        if value == "":
            return None
        if f.kind == "number":
            return _number(value)
    return value


def _number(text: str) -> Any:
    """An int or float of ``text``, or ``text`` itself when it is neither, or not finite ("nan",
    "1e999": no config holds those, and JSON cannot carry them back): the CLI names the mistake."""
    for parse in (int, float):
        try:
            number = parse(text)
        except ValueError:
            continue
        return number if math.isfinite(number) else text
    return text


def to_yaml(config: dict[str, Any]) -> str:
    """YAML in LLaMA-Factory's example layout: one ``### section`` block per group of keys."""
    lines: list[str] = []
    placed = set()
    for section in SECTIONS:
        keys = [f.key for f in FIELDS if f.section == section and f.key in config]
        if section == "method":
            keys = [k for k in ("do_train",) if k in config] + keys
        if section == "output":
            keys += [k for k in ("plot_loss",) if k in config]
        if keys:
            lines.append(f"### {section}")
            lines += [_dump(k, config[k]) for k in keys]
            lines.append("")
            placed.update(keys)
    rest = [k for k in config if k not in placed]
    if rest:
        lines.append("### more")
        lines += [_dump(k, config[k]) for k in rest]
    return "\n".join(lines).rstrip() + "\n"


def write_yaml(path: str, config: dict[str, Any]) -> None:
    """``to_yaml`` into ``path``, whole or not at all (a file being replaced is never left half-written)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.partial"
    if os.path.islink(partial):  # never write through a link left in the way
        os.remove(partial)
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644),
              "w", encoding="utf-8") as f:
        f.write(to_yaml(config))
    os.replace(partial, path)


def _dump(key: str, value: Any) -> str:
    return yaml.safe_dump({key: value}, default_flow_style=False, sort_keys=False, allow_unicode=True).rstrip()


def parse_yaml(text: str) -> dict[str, Any]:
    """A YAML file's config dict, read by the CLI's own reader (duplicate keys refused, and so on).
    The page's YAML holds plain data only: no anchors or aliases (one alias can stand for millions of
    values) and nothing JSON cannot carry back to the page."""
    from ..config_yaml import load_yaml as _load_yaml

    try:
        if any(isinstance(t, (yaml.AnchorToken, yaml.AliasToken)) for t in yaml.scan(text)):
            raise UserError("the YAML uses anchors or aliases (&name, *name); the web UI takes plain YAML: "
                            "write the values out.")
        config = _load_yaml(text)
        _check_plain(config, "")
    except yaml.YAMLError as exc:
        raise UserError(f"the YAML does not parse: {exc}") from None
    except RecursionError:
        raise UserError("the YAML is nested too deeply.") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UserError(f"a config is a mapping of keys to values; this YAML holds a {type(config).__name__}.")
    return config


def _check_plain(value: Any, where: str) -> None:
    """Refuse what JSON cannot carry: dates, binary, sets, non-string keys, NaN and infinities."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise UserError(f"the YAML key {key!r} {where and f'under {where} '}is not a name; quote it.")
            _check_plain(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{where or 'the YAML'}: {value} is not a number the web UI takes; give a finite one.")
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise UserError(f"{where or 'the YAML'} holds a {type(value).__name__} ({value!r:.60}); the web UI takes "
                        f"strings, numbers, booleans, lists and mappings: quote it.")


def command_line(config_path: str, job_address: str | None = None) -> str:
    """The command the Start button runs (as a Ray job) and a user could run instead."""
    command = f"rayfactory train {shlex.quote(config_path)}"
    if job_address:
        command = f"rayfactory submit {shlex.quote(config_path)} --address {shlex.quote(job_address)}"
    return command


def validate(config: dict[str, Any]) -> dict[str, str] | None:
    """None when the CLI would accept ``config``, else {"key": the field it names, "message": its paragraph}."""
    from fabric.data.prepare import check_data
    from registries.datasets.info import get_dataset_attrs

    from ..config import load_config

    for f in FIELDS:  # "nan" or "1e999" in a number field: no config holds those (parse_yaml refuses them)
        value = config.get(f.key) if f.kind == "number" or f.item == "number" else None
        bad = [e for e in (value if isinstance(value, list) else [value]) if isinstance(e, str) and _not_finite(e)]
        if bad:
            return {"key": f.key, "message": f"{f.key}: {bad[0]!r} is not a finite number; give a finite one"
                                             f"{' (comma-separated)' if f.kind == 'list' else ''}."}
    try:
        cfg = load_config(dict(config), purpose="check")  # a config being looked at runs none of its modules
    except UserError as exc:
        message = str(exc)
        return {"key": _named_key(message, config), "message": message}
    except (TypeError, ValueError) as exc:  # a dataclass's own check, worded for the developer
        return {"key": _named_key(str(exc), config), "message": str(exc)}
    for key in ("dataset", "eval_dataset"):  # an unknown name fails here, not minutes later in the job
        try:
            get_dataset_attrs(getattr(cfg.data, key), cfg.data.dataset_dir)
        except UserError as exc:
            return {"key": key, "message": str(exc)}  # the CLI's paragraph; the page shows it at the field
    try:  # the driver's own data checks: a dataset is set, fits the stage, its files exist
        check_data(cfg.data, cfg.job_spec().stage)
    except UserError as exc:
        return {"key": "dataset", "message": str(exc)}
    return None


def _not_finite(text: str) -> bool:
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _named_key(message: str, config: dict[str, Any]) -> str:
    """Where the page shows a config error: the first key of the config it quotes (its field, or
    the "more keys" box for a key without one), else the first field it names."""
    leading = re.match(r"(?:invalid )?([a-z][a-z_0-9]*) in ", message)  # the CLI's "invalid beta in <file>: ..."
    if leading and leading.group(1) in config:
        return leading.group(1) if leading.group(1) in FIELD_BY_KEY else "extra"
    quoted = re.findall(r"'([a-z_0-9]+)'", message)
    for candidate in quoted:
        if candidate in config:
            return candidate if candidate in FIELD_BY_KEY else "extra"
    words = re.findall(r"\b([a-z][a-z_0-9]+)\b", message)
    for candidate in quoted + words:
        if candidate in FIELD_BY_KEY:
            return candidate
    return ""
