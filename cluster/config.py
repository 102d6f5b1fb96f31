"""Run config: a YAML file plus ``key=value`` overrides -> one typed ``RunConfig``.

Keys are flat, as in LLaMA-Factory, and each one belongs to exactly one group by its name:
model, data, finetuning, generating, ray (our dataclasses) or training (the fields of the
installed transformers' Seq2SeqTrainingArguments). Every user mistake becomes one
``ConfigError`` paragraph that says what is wrong, where (file or override) and how to fix it.

``load_config`` is the only place a config is resolved (stage defaults from the stage table,
absolute paths) and checked; the CLI, the web UI, ``submit`` and ``run_exp`` all call it, so they
refuse the same configs with the same paragraph. Nothing changes the ``RunConfig`` it returns.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import yaml

from fabric.ray_args import RayArguments
from registries.datasets.data_args import DataArguments
from registries.errors import ArgumentError
from stages.run_args import (
    FinetuningArguments,
    GeneratingArguments,
    ModelArguments,
    TrainingOptions,
    trainer_field_names,
    trainer_fields,
)
from stages.job import JobSpec
from stages.inference.eval_args import EvaluationArguments
from stages.inference.inference_args import ExportArguments, InferenceArguments
from stages.inference.loading import InferenceSpec
from stages.rl.config.rl_args import RLArguments

from .config_types import ConfigError, bool_word, coerce_key
from .config_yaml import parse_override, read_source as _read_source  # noqa: F401 (parse_override: its old address)
from .config_rules import run_rules
from .lf_compat import apply_lf_compat
from .paths import unpin_run_defaults
from cluster.serve.serve_args import ServeArguments

RESOLVED_CONFIG_NAME = "rayfactory_config.yaml"
GROUPS: dict[str, type] = {
    "model": ModelArguments,
    "data": DataArguments,
    "finetuning": FinetuningArguments,
    "generating": GeneratingArguments,
    "ray": RayArguments,
    "rl": RLArguments,
    "inference": InferenceArguments,
    "export": ExportArguments,
    "serve": ServeArguments,
    "evaluation": EvaluationArguments,
}
# What a config is read for: a training run needs output_dir and trainer checks; chat, serve and
# export read the same keys (a training YAML works) but need no output_dir.
PURPOSES = ("train", "infer", "submit", "check")


@dataclass(frozen=True)
class RunConfig:
    model: ModelArguments
    data: DataArguments
    finetuning: FinetuningArguments
    generating: GeneratingArguments
    training: TrainingOptions
    ray: RayArguments
    rl: RLArguments
    inference: InferenceArguments = field(default_factory=InferenceArguments)
    export: ExportArguments = field(default_factory=ExportArguments)
    serve: ServeArguments = field(default_factory=ServeArguments)
    evaluation: EvaluationArguments = field(default_factory=EvaluationArguments)
    raw: dict[str, Any] = field(default_factory=dict)  # the keys as the user wrote them, overrides applied
    source: str = "the config dict"
    notes: list[str] = field(default_factory=list)  # LLaMA-Factory keys that were ignored or translated

    def job_spec(self) -> JobSpec:
        """The typed slices every process of the run receives (the same objects, not copies)."""
        return JobSpec(model=self.model, data=self.data, finetuning=self.finetuning, training=self.training,
                       rl=self.rl, generating=self.generating, evaluation=self.evaluation)

    def with_template(self, name: str) -> "RunConfig":
        """A copy with template ``name``: ``auto`` is a fact of the tokenizer, which the driver loads
        (not load_config: validating a form must not load models); this config stays unchanged."""
        return dataclasses.replace(self, data=dataclasses.replace(self.data, template=name))

    def inference_spec(self) -> InferenceSpec:
        """The slice chat, serve, predict and export read."""
        return InferenceSpec(model=self.model, data=self.data, finetuning=self.finetuning,
                             generating=self.generating, inference=self.inference)

    def resolved(self) -> dict[str, Any]:
        """Every effective value, flat; ``load_config`` of this dict gives the same run."""
        out: dict[str, Any] = {}
        for group in (self.model, self.data, self.finetuning):
            out.update(dataclasses.asdict(group))
        out.update(self.training.to_dict())
        out.update(dataclasses.asdict(self.generating))
        out.update(dataclasses.asdict(self.ray))
        out.update(dataclasses.asdict(self.rl))
        for group in (self.inference, self.export, self.serve, self.evaluation):
            out.update(dataclasses.asdict(group))
        out.pop("api_key")  # a secret: never written into the saved config
        return unpin_run_defaults(out)

    def write_yaml(self, path: str | os.PathLike | None = None) -> str:
        """Write ``resolved()`` (default: into output_dir) so a run can be repeated exactly."""
        path = os.fspath(path) if path is not None else os.path.join(self.training.output_dir, RESOLVED_CONFIG_NAME)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            name = os.path.basename(path)
            f.write(f"# Resolved by RayFactory from {self.source}; `rayfactory train {name}` repeats it.\n")
            yaml.safe_dump(self.resolved(), f, sort_keys=False, allow_unicode=True)
        return path


def load_config(path_or_dict: str | os.PathLike | dict | None = None, overrides: list[str] | None = None,
                purpose: str = "train", check_datasets: bool = False) -> RunConfig:
    """Read, route, type-check and validate a config; ``overrides`` are ``key=value`` strings.
    ``purpose`` "infer" (chat, serve, export) skips what only a training run needs; "submit" checks a
    training run on another machine than the one that runs it (``rayfactory submit``): every rule
    but those about this machine (files the config names, installed packages, reward modules);
    "check" is "train" with user modules found on disk, never imported (the web UI's checks).
    ``check_datasets``: the dataset names are looked up in dataset_info.json before the slow part
    (the command line's train does, so a typo is named in about a second)."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    values, origin, source = _read_source(path_or_dict)
    for text in overrides or []:
        key, value = parse_override(text)
        values[key] = value
        origin[key] = f"command-line override {text!r}"
    raw = dict(values)
    notes = apply_lf_compat(values, origin)
    grouped = _route(values, origin)  # an unknown key fails here, before anything imports transformers
    _coerce(grouped, origin, [group for group in grouped if group != "training"])
    _check_registered(grouped.get("rl", {}), origin)
    built = {group: _build(group, grouped[group], origin, source) for group in ("model", "data", "finetuning")}
    if check_datasets:  # a dataset typo too: the trainer's option types import transformers (seconds)
        check_dataset_names(built["data"])
    _coerce(grouped, origin, ["training"])
    given = {key: value for group in grouped.values() for key, value in group.items()}  # typed
    rl_stage = built["finetuning"].spec.rl if purpose != "infer" else None
    if rl_stage is not None:  # the stage's own defaults for the keys the config leaves out
        _defaults(grouped["generating"], dict(rl_stage.sampling_defaults), given)
    built["generating"] = _build("generating", grouped["generating"], origin, source)
    built["training"] = TrainingOptions(grouped["training"])
    built["ray"] = _build("ray", grouped["ray"], origin, source)
    if rl_stage is not None and rl_stage.rl_defaults is not None:
        stage_defaults = rl_stage.load_rl_defaults()(given, built["training"], built["ray"], built["generating"])
        _defaults(grouped["rl"], stage_defaults, given)
    for group in ("rl", "inference", "export", "serve", "evaluation"):
        built[group] = _build(group, grouped[group], origin, source)
    run = RunConfig(**built, raw=raw, source=source, notes=notes)
    run_rules(run, lambda key: origin.get(key, source), purpose)  # cluster/config_rules.py, in order
    return run


def _defaults(group: dict[str, Any], defaults: typing.Mapping[str, Any], given: dict[str, Any]) -> None:
    group.update((key, value) for key, value in defaults.items() if key not in given)


# --- routing and types ---------------------------------------------------------------------


@lru_cache(maxsize=1)
def key_owners() -> dict[str, str]:
    """Option name -> group name. Two groups claiming one name is a bug in RayFactory itself."""
    owners: dict[str, str] = {}
    claims = [(group, f.name) for group, cls in GROUPS.items() for f in dataclasses.fields(cls)]
    claims += [("training", name) for name in trainer_field_names()]
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
        grouped[group][key] = value
    return grouped


def _coerce(grouped: dict[str, dict[str, Any]], origin: dict[str, str], groups: list[str]) -> None:
    """The values of ``groups`` as their fields' types, in place."""
    for group in groups:
        for key, value in grouped[group].items():
            if group != "data":  # DataArguments checks its own values, with messages of its own
                value = coerce_key(key, value, key_annotation(group, key), origin[key])
            elif bool in typing.get_args(key_annotation(group, key)) + (key_annotation(group, key),):
                value = bool_word(value)  # packing: no
            grouped[group][key] = value


def _check_registered(rl: dict[str, Any], origin: dict[str, str]) -> None:
    """advantage_estimator, loss_type and kl_estimator name registered algorithms
    (stages/rl/algorithms/registry.py): checked as a Literal of the registered names, before torch."""
    from stages.rl.algorithms.registry import REGISTRY_BY_KEY

    for key, registry in REGISTRY_BY_KEY.items():
        if key in rl:
            coerce_key(key, rl[key], typing.Literal[registry.names()], origin[key])


def check_dataset_names(data: DataArguments) -> None:
    """Each dataset and eval_dataset name is in dataset_info.json, when there is one (the registries'
    own error names the file and the closest names). A tokenized_path may need none; the driver's
    data checks (fabric/data/prepare.py check_data) do the rest."""
    from registries.datasets.info import get_dataset_attrs

    if data.tokenized_path or not os.path.isfile(os.path.join(data.dataset_dir, "dataset_info.json")):
        return  # a missing file is the driver's to name, with the rest of the data checks
    for names in (data.dataset, data.eval_dataset):
        if names:  # the folder as resolve_paths will name it: the message is the driver's own
            get_dataset_attrs(names, os.path.abspath(os.path.expanduser(data.dataset_dir)))


def key_annotation(group: str, key: str) -> Any:
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
        raise ConfigError(f"invalid {exc.key} in {origin.get(exc.key, source)}: {exc}", key=exc.key) from None
    except ValueError as exc:  # DataArguments' own checks (DataConfigError)
        where = sorted({origin[k] for k in kwargs}) or [source]
        raise ConfigError(f"{exc} (in {' / '.join(where)})") from None


__all__ = ["ConfigError", "RESOLVED_CONFIG_NAME", "RunConfig", "key_owners", "load_config", "parse_override"]
