"""Run config: a YAML file plus ``key=value`` overrides -> one typed ``RunConfig``.

Keys are flat, as in LLaMA-Factory, and each one belongs to exactly one group by its name:
model, data, finetuning, generating, ray (our dataclasses) or training (the fields of the
installed transformers' Seq2SeqTrainingArguments). Every user mistake becomes one
``ConfigError`` paragraph that says what is wrong, where (file or override) and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import os
import pathlib
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, Union

import yaml

from fabric.args import RayArguments
from registries.datasets.args import DataArguments
from registries.datasets.errors import describe_type
from stages.args import (
    ArgumentError,
    FinetuningArguments,
    GeneratingArguments,
    ModelArguments,
    TrainingOptions,
    trainer_fields,
)

RESOLVED_CONFIG_NAME = "rayfactory_config.yaml"
GROUPS: dict[str, type] = {
    "model": ModelArguments,
    "data": DataArguments,
    "finetuning": FinetuningArguments,
    "generating": GeneratingArguments,
    "ray": RayArguments,
}


class ConfigError(ValueError):
    """A mistake in the user's config. The message is meant to be shown as is, without a traceback."""


@dataclass
class RunConfig:
    model: ModelArguments
    data: DataArguments
    finetuning: FinetuningArguments
    generating: GeneratingArguments
    training: TrainingOptions
    ray: RayArguments
    raw: dict[str, Any] = field(default_factory=dict)  # the keys as the user wrote them, overrides applied
    source: str = "the config dict"
    notes: list[str] = field(default_factory=list)  # LLaMA-Factory keys that were ignored or translated

    def resolved(self) -> dict[str, Any]:
        """Every effective value, flat; ``load_config`` of this dict gives the same run."""
        out: dict[str, Any] = {}
        for group in (self.model, self.data, self.finetuning):
            out.update(dataclasses.asdict(group))
        out.update(self.training.to_dict())
        out.update(dataclasses.asdict(self.generating))
        out.update(dataclasses.asdict(self.ray))
        return out

    def write_yaml(self, path: str | os.PathLike | None = None) -> str:
        """Write ``resolved()`` (default: into output_dir) so a run can be repeated exactly."""
        path = os.fspath(path) if path is not None else os.path.join(self.training.output_dir, RESOLVED_CONFIG_NAME)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            name = os.path.basename(path)
            f.write(f"# Resolved by RayFactory from {self.source}; `rayfactory train {name}` repeats it.\n")
            yaml.safe_dump(self.resolved(), f, sort_keys=False, allow_unicode=True)
        return path


def load_config(path_or_dict: str | os.PathLike | dict | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read, route, type-check and validate a config; ``overrides`` are ``key=value`` strings."""
    values, origin, source = _read_source(path_or_dict)
    for text in overrides or []:
        key, value = parse_override(text)
        values[key] = value
        origin[key] = f"command-line override {text!r}"
    raw = dict(values)
    notes = _apply_lf_compat(values, origin)
    grouped = _route(values, origin)
    run = RunConfig(
        model=_build("model", grouped["model"], origin, source),
        data=_build("data", grouped["data"], origin, source),
        finetuning=_build("finetuning", grouped["finetuning"], origin, source),
        generating=_build("generating", grouped["generating"], origin, source),
        training=TrainingOptions(grouped["training"]),
        ray=_build("ray", grouped["ray"], origin, source),
        raw=raw,
        source=source,
        notes=notes,
    )
    _check_and_resolve(run, lambda key: origin.get(key, source))
    return run


def parse_override(text: str) -> tuple[str, Any]:
    """``lora_rank=16`` -> ("lora_rank", 16); the value is read as a YAML scalar (or flow list/map)."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ConfigError(
            f"command-line override {text!r} is not of the form key=value. Write overrides like "
            "lora_rank=16 or dataset=alpaca_en_demo,identity (no spaces around '=', no leading dashes)."
        )
    try:
        return key, yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"command-line override {text!r}: the value is not valid YAML ({_yaml_problem(exc)}). "
            "Quote it, e.g. key='a: b'."
        ) from None


# --- reading -------------------------------------------------------------------------------


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, second: int):
        self.key, self.first, self.second = key, first, second


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice (PyYAML would silently keep the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, typing.Hashable) and key in seen:
            raise _DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
        if isinstance(key, typing.Hashable):
            seen[key] = key_node.start_mark.line + 1
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_source(path_or_dict: Any) -> tuple[dict[str, Any], dict[str, str], str]:
    if path_or_dict is None or isinstance(path_or_dict, dict):
        values, source = dict(path_or_dict or {}), "the config dict"
    elif isinstance(path_or_dict, (str, os.PathLike)):
        source = os.fspath(path_or_dict)
        values = _read_file(source)
    else:
        raise ConfigError(
            f"a config must be a YAML file path or a dict, got {type(path_or_dict).__name__}. "
            "Pass the path of your YAML file, or a dict of options."
        )
    bad = [k for k in values if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"key {bad[0]!r} in {source} is not a name. Option names are words like lora_rank.")
    return values, {key: source for key in values}, source


def _read_file(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(
            f"config file {path} not found (looked for {os.path.abspath(path)}). "
            "Check the path; relative paths start from the current directory."
        )
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKey as dup:
        raise ConfigError(
            f"key {dup.key!r} appears twice in {path} (lines {dup.first} and {dup.second}); "
            "YAML would silently keep only the last one. Delete one of them."
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(exc)}. Fix the file's syntax.") from None
    if data is None:
        raise ConfigError(f"config file {path} is empty. It needs at least model_name_or_path and output_dir.")
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must be a mapping of option: value lines, but its top level is "
            f"{describe_type(data)}. Write one option per line, e.g. lora_rank: 8."
        )
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


# --- routing and types ---------------------------------------------------------------------


@lru_cache(maxsize=1)
def key_owners() -> dict[str, str]:
    """Option name -> group name. Two groups claiming one name is a bug in RayFactory itself."""
    owners: dict[str, str] = {}
    claims = [(group, f.name) for group, cls in GROUPS.items() for f in dataclasses.fields(cls)]
    claims += [("training", name) for name in trainer_fields()]
    for group, name in claims:
        if name in owners:
            raise RuntimeError(f"option {name!r} is claimed by both {owners[name]} and {group} arguments")
        owners[name] = group
    return owners


def _route(values: dict[str, Any], origin: dict[str, str]) -> dict[str, dict[str, Any]]:
    owners = key_owners()
    grouped: dict[str, dict[str, Any]] = {group: {} for group in [*GROUPS, "training"]}
    for key, value in values.items():
        group = owners.get(key)
        if group is None:
            close = difflib.get_close_matches(key, owners, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ConfigError(
                f"unknown key {key!r} in {origin[key]}{hint} RayFactory reads LLaMA-Factory option names "
                "and transformers' TrainingArguments names; fix the spelling or remove the key."
            )
        if group != "data":  # DataArguments checks its own values, with messages of its own
            value = _coerce_key(key, value, _annotation(group, key), origin[key])
        grouped[group][key] = value
    return grouped


def _annotation(group: str, key: str) -> Any:
    if group == "training":
        return trainer_fields()[key].annotation
    return _hints(GROUPS[group])[key]


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(group: str, kwargs: dict[str, Any], origin: dict[str, str], source: str) -> Any:
    try:
        return GROUPS[group](**kwargs)
    except ArgumentError as exc:
        raise ConfigError(f"invalid {exc.key} in {origin.get(exc.key, source)}: {exc}") from None
    except ValueError as exc:  # DataArguments' own checks (DataConfigError)
        where = sorted({origin[k] for k in kwargs}) or [source]
        raise ConfigError(f"{exc} (in {' / '.join(where)})") from None


class _Mismatch(Exception):
    def __init__(self, hint: str = ""):
        self.hint = hint


def _coerce_key(key: str, value: Any, annotation: Any, where: str) -> Any:
    try:
        return coerce(value, annotation)
    except _Mismatch as exc:
        kind = "value" if _is_choice(annotation) else "type"
        hint = f"; {exc.hint}" if exc.hint else "."
        raise ConfigError(
            f"wrong {kind} for {key!r} in {where}: got {value!r} ({describe_type(value)}), "
            f"expected {describe(annotation)}{hint}"
        ) from None


def coerce(value: Any, ann: Any) -> Any:
    """``value`` as ``ann`` wants it. Numbers written as text ("1e-4", which YAML 1.1 reads as a
    string) become numbers and a comma-separated string becomes a list; nothing else is guessed."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is Any:
        return value
    if origin in (Union, types.UnionType):
        return _coerce_union(value, args)
    if origin is Literal:
        for choice in args:
            if value == choice and isinstance(value, bool) == isinstance(choice, bool):
                return choice
        raise _Mismatch(_suggest(value, args))
    if ann is type(None):
        if value is None:
            return None
        raise _Mismatch()
    if ann is list or origin is list:
        item = args[0] if args else Any
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",")]
        if not isinstance(value, (list, tuple)):
            raise _Mismatch()
        return [coerce(v, item) for v in value]
    if ann is dict or origin is dict:
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise _Mismatch() from None
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Mismatch()
        item = args[1] if len(args) == 2 else Any
        return {k: coerce(v, item) for k, v in value.items()}
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        members = [m.value for m in ann]
        if value in members:
            return value
        raise _Mismatch(_suggest(value, members))
    if ann is bool:
        if isinstance(value, bool):
            return value
    elif ann is int:
        return _as_number(value, integer=True)
    elif ann is float:
        return _as_number(value, integer=False)
    elif ann is str or ann is pathlib.Path:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # e.g. ray_run_name: 2024
    elif isinstance(ann, type):
        if isinstance(value, ann):
            return value
    else:
        return value
    raise _Mismatch()


def _coerce_union(value: Any, arms: tuple) -> Any:
    enum_arms = [a for a in arms if isinstance(a, type) and issubclass(a, enum.Enum)]
    if enum_arms:  # "SchedulerType | str": transformers turns the str into the enum, so check it now
        arms = tuple(a for a in arms if a is not str)
    hints = []
    for arm in arms:
        try:
            return coerce(value, arm)
        except _Mismatch as exc:
            hints.append(exc.hint)
    raise _Mismatch(next((h for h in hints if h), ""))


def _as_number(value: Any, integer: bool) -> int | float:
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value.lower() for c in ".en") else int(value)
        except ValueError:
            raise _Mismatch() from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Mismatch()
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise _Mismatch()
        return int(value)
    return value  # an int is a fine float (num_train_epochs: 3); keeping it int keeps row counts exact


def _is_choice(ann: Any) -> bool:
    arms = typing.get_args(ann) if typing.get_origin(ann) in (Union, types.UnionType) else (ann,)
    return any(typing.get_origin(a) is Literal or (isinstance(a, type) and issubclass(a, enum.Enum)) for a in arms)


def describe(ann: Any) -> str:
    """An annotation in words, as an error message wants it."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (Union, types.UnionType):
        if any(isinstance(a, type) and issubclass(a, enum.Enum) for a in args):
            args = tuple(a for a in args if a is not str)
        return " or ".join(dict.fromkeys(describe(a) for a in args))
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in args)
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        values = [m.value for m in ann]
        shown = ", ".join(repr(v) for v in values[:12])
        return f"one of {shown}" + (f" (and {len(values) - 12} more in {ann.__name__})" if len(values) > 12 else "")
    if ann is list or origin is list:
        item = args[0] if args else Any
        plural = {str: "strings", int: "integers", float: "numbers"}.get(item, "values")
        return f"a list of {plural} (or a comma-separated string)"
    if ann is dict or origin is dict:
        return "a mapping (e.g. {CPU: 1, GPU: 1})"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             pathlib.Path: "a path", type(None): "null", Any: "any value"}
    if ann in names:
        return names[ann]
    return f"a {getattr(ann, '__name__', ann)} object (which a config file cannot express)"


def _suggest(value: Any, choices: typing.Iterable[Any]) -> str:
    if not isinstance(value, str):
        return ""
    texts = [c for c in choices if isinstance(c, str)]
    same_case = [c for c in texts if c.lower() == value.lower()]
    close = same_case or difflib.get_close_matches(value, texts, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else ""


# --- LLaMA-Factory compatibility -----------------------------------------------------------

# Keys LLaMA-Factory YAMLs carry that mean nothing here: accepted, dropped, and reported as a note.
IGNORED_KEYS = {
    "preprocessing_num_workers": "Ray Data sizes the preprocessing parallelism itself",
    "preprocessing_batch_size": "Ray Data picks the preprocessing batch size",
    "overwrite_output_dir": (
        "transformers 5 removed it; output_dir is written into, and resuming needs resume_from_checkpoint"
    ),
    "disable_gradient_checkpointing": (
        "gradient checkpointing is transformers' gradient_checkpointing option (off unless set)"
    ),
    "master_addr": "Ray Train sets up the process group",
    "master_port": "Ray Train sets up the process group",
    "ignore_pad_token_for_loss": "padding never counts in the loss",
    "use_fast_tokenizer": "the fast tokenizer is always used",
    "low_cpu_mem_usage": "transformers 5 always loads this way",
    "data_shared_file_system": "Ray Data tokenizes once for all nodes",
    "print_param_status": "the trainable-parameter count is always logged",
    "hf_hub_token": "set HF_TOKEN in the environment instead (secrets stay out of saved configs)",
}
# LLaMA-Factory features not built here. Accepted only when off, so a YAML that lists them
# still loads, and one that turns them on fails instead of quietly training something else.
UNSUPPORTED_KEYS = (
    "use_unsloth", "use_unsloth_gc", "enable_liger_kernel", "use_galore", "use_apollo", "use_badam",
    "use_llama_pro", "use_adam_mini", "use_muon", "pissa_init", "pissa_convert", "use_dft_loss",
    "use_asft_loss", "use_eaft_loss", "use_mca", "use_kt", "use_swanlab", "streaming", "shift_attn",
    "mixture_of_depths", "rope_scaling", "loraplus_lr_ratio", "create_new_adapter", "add_tokens",
    "add_special_tokens", "upcast_layernorm", "upcast_lmhead_output", "train_from_scratch",
    "compute_accuracy", "pure_bf16", "media_dir", "fp8",
)
MULTIMODAL_KEYS = (
    "image_max_pixels", "image_min_pixels", "video_max_pixels", "video_min_pixels", "video_fps",
    "video_maxlen", "use_audio_in_video", "audio_sampling_rate", "freeze_vision_tower",
    "freeze_multi_modal_projector", "freeze_language_model",
)
FLASH_ATTN = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2", "fa3": "flash_attention_3"}


def _apply_lf_compat(values: dict[str, Any], origin: dict[str, str]) -> list[str]:
    """Drop ignored keys and translate LLaMA-Factory spellings in place; return the notes."""
    notes = []
    for key in list(values):
        if key in IGNORED_KEYS:
            values.pop(key)
            notes.append(f"ignored {key!r} from {origin[key]}: {IGNORED_KEYS[key]}.")
        elif key in UNSUPPORTED_KEYS and values.pop(key) not in (None, False):
            raise ConfigError(
                f"{key!r} in {origin[key]} turns on a LLaMA-Factory feature that RayFactory does not "
                f"support (yet). Remove {key} from the config."
            )
        elif key in MULTIMODAL_KEYS:
            raise ConfigError(
                f"{key!r} in {origin[key]} is a LLaMA-Factory option for image, video or audio models; "
                "RayFactory trains text-only models. Remove it (and use a text-only model and dataset)."
            )

    def move(old: str, old_value: Any, new: str, value: Any) -> None:
        if new in values:
            raise ConfigError(
                f"{old!r} in {origin[old]} and {new!r} in {origin[new]} set the same thing "
                f"({old} is LLaMA-Factory's name for {new}). Keep only one of them."
            )
        values[new] = value
        origin[new] = origin[old]
        notes.append(f"translated {old}: {old_value!r} to {new}: {value!r}.")

    if values.get("finetuning_type") == "qlora":  # LLaMA-Factory spells QLoRA as lora + quantization_bit
        values["finetuning_type"] = "lora"
        if values.get("quantization_bit") is None:
            values["quantization_bit"] = 4
            origin["quantization_bit"] = origin["finetuning_type"]
        notes.append(f"finetuning_type qlora means lora with quantization_bit {values['quantization_bit']}.")
    if "warmup_ratio" in values:  # transformers 5 folded it into warmup_steps: a float below 1 is a ratio
        ratio = _coerce_key("warmup_ratio", values.pop("warmup_ratio"), float, origin["warmup_ratio"])
        if not 0 <= ratio < 1:
            raise ConfigError(
                f"warmup_ratio is {ratio} in {origin['warmup_ratio']}; it must be in [0, 1) (a fraction of "
                "the training steps). For a step count use warmup_steps."
            )
        move("warmup_ratio", ratio, "warmup_steps", float(ratio))
    if "flash_attn" in values:
        choice = values.pop("flash_attn")
        if choice not in FLASH_ATTN:
            raise ConfigError(
                f"wrong value for 'flash_attn' in {origin['flash_attn']}: got {choice!r}, expected one of "
                f"{', '.join(map(repr, FLASH_ATTN))}; or set attn_implementation instead."
            )
        if FLASH_ATTN[choice] is not None:
            move("flash_attn", choice, "attn_implementation", FLASH_ATTN[choice])
    return notes


# --- rules across groups, and paths made absolute for workers on other machines -----------------


def _check_and_resolve(run: RunConfig, where: typing.Callable[[str], str]) -> None:
    model, tuning, data, training = run.model, run.finetuning, run.data, run.training.values
    if not model.model_name_or_path:
        raise ConfigError(
            f"model_name_or_path is missing in {where('model_name_or_path')}. Set it to a model folder "
            "(or a hub id), e.g. model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct."
        )
    if model.quantization_bit is not None and tuning.finetuning_type != "lora":
        raise ConfigError(
            f"quantization_bit {model.quantization_bit} in {where('quantization_bit')} needs finetuning_type "
            f"lora (that is QLoRA), but finetuning_type is {tuning.finetuning_type!r}: quantized weights "
            "cannot be trained directly. Use finetuning_type: lora, or remove quantization_bit."
        )
    if not training.get("output_dir"):
        raise ConfigError(
            f"output_dir is missing in {where('output_dir')}. Set the folder that receives checkpoints, "
            "logs and the trained model, e.g. output_dir: saves/my-run."
        )
    if training.get("bf16") and training.get("fp16"):
        raise ConfigError(f"bf16 and fp16 are both true in {where('fp16')}. Pick one precision (bf16 on recent GPUs).")
    strategy = training.get("eval_strategy", "no")
    if strategy != "no" and not data.val_size and not data.eval_dataset:
        raise ConfigError(
            f"eval_strategy is {strategy!r} in {where('eval_strategy')} but there is nothing to evaluate on. "
            "Set val_size (a fraction of the training data) or eval_dataset, or set eval_strategy: no."
        )
    ds = training.get("deepspeed")
    if isinstance(ds, str):  # load it here: workers on other nodes may not have the file
        if not os.path.isfile(ds):
            raise ConfigError(
                f"deepspeed config file {ds!r} from {where('deepspeed')} not found (looked for {os.path.abspath(ds)}; "
                "relative paths start from the current directory). Fix the path or remove deepspeed."
            )
        try:
            with open(ds, encoding="utf-8") as f:
                training["deepspeed"] = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"deepspeed config file {ds} is not valid JSON ({exc}). Fix the file.") from None
    resume = training.get("resume_from_checkpoint")
    if isinstance(resume, str):
        if not os.path.isdir(resume):
            raise ConfigError(
                f"resume_from_checkpoint {resume!r} in {where('resume_from_checkpoint')} does not exist "
                f"(looked for {os.path.abspath(resume)}). Point it at a checkpoint folder, or remove it."
            )
        training["resume_from_checkpoint"] = os.path.abspath(resume)
    training.setdefault("report_to", "none")
    # Ray Train workers do not run in the driver's directory: hand them absolute paths.
    training["output_dir"] = _absolute(training["output_dir"])
    if model.cache_dir:
        model.cache_dir = _absolute(model.cache_dir)
    if data.tokenized_path:
        data.tokenized_path = _absolute(data.tokenized_path)
    model.model_name_or_path = _absolute_if_local(model.model_name_or_path)
    data.dataset_dir = _absolute_if_local(data.dataset_dir)
    for obj, name in ((tuning, "ref_model"), (tuning, "reward_model")):
        setattr(obj, name, _absolute_if_local(getattr(obj, name)))
    adapter_lists = ((model, "adapter_name_or_path"), (tuning, "ref_model_adapters"), (tuning, "reward_model_adapters"))
    for obj, name in adapter_lists:
        if getattr(obj, name):
            setattr(obj, name, [_absolute_if_local(p) for p in getattr(obj, name)])


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def _absolute_if_local(path: str | None) -> str | None:
    """A hub id such as Qwen/Qwen3-0.6B stays as it is; an existing local path becomes absolute."""
    return _absolute(path) if path and os.path.exists(os.path.expanduser(path)) else path


__all__ = ["ConfigError", "RESOLVED_CONFIG_NAME", "RunConfig", "coerce", "describe", "key_owners",
           "load_config", "parse_override"]
