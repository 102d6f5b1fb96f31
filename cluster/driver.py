"""The driver: config -> Ray -> Ray Data -> Ray Train -> output_dir. Used by the CLI, by
``ray job submit`` and from Python as ``run_exp``."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from .config import ConfigError, RunConfig, load_config
from .console import Console

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    output_dir: str
    metrics: dict[str, Any]
    checkpoint_path: Optional[str]
    data_stats: dict[str, Any]


def run_exp(
    config: "RunConfig | dict | str | None" = None,
    overrides: Iterable[str] = (),
    callbacks: Iterable[Any] = (),
    console: Optional[Console] = None,
) -> RunResult:
    """Run one training job. ``callbacks`` are extra ``transformers.TrainerCallback`` objects
    shipped to every worker (the Python API's hook; the YAML has no such key). ``console`` shows
    the plan, progress and summary (the CLI passes one that also owns the run's log file)."""
    cfg = config if isinstance(config, RunConfig) else load_config(config, list(overrides))
    console = console or Console()

    from fabric.data_pipeline import check_data, prepare_datasets
    from fabric.launcher import launch_training
    from fabric.ray_session import connect
    from stages.loading import check_model_fits

    output_dir = cfg.training.output_dir

    # Mistakes that need no cluster fail before Ray starts: model path, template, datasets.
    # Model facts are resolved once, here: the driver tokenizes (through Ray Data) with this
    # tokenizer and template, and the workers load the template by its resolved name.
    tokenizer, template = _load_tokenizer_and_template(cfg)
    cfg.data.template = template.name  # `template: auto` pinned for the workers and the saved config
    spec = cfg.job_spec()
    check_model_fits(cfg.model, cfg.finetuning)
    check_data(cfg.data, spec.stage)
    os.makedirs(output_dir, exist_ok=True)
    cfg.write_yaml()  # the resolved config, so the run can be repeated exactly
    console.plan(cfg)
    resources = connect(cfg.ray, extra_cpus=_rollout_cpus(cfg))
    _check_resources(cfg, resources)
    data = prepare_datasets(cfg.data, spec.stage, cfg.training.seed, tokenizer, template)
    if spec.stage.launch == "rl_controller":  # roles as actor groups, driven from here
        from fabric.rl_launcher import launch_rl

        result = launch_rl(spec, cfg.ray, data.train, data.eval, tokenizer, template, progress=console.progress_sink())
    else:
        result = launch_training(spec, cfg.ray, data.train, data.eval, callbacks, progress=console.progress_sink())
    if result.error is not None:
        raise result.error
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    console.summary(result, os.path.abspath(output_dir))
    return RunResult(os.path.abspath(output_dir), dict(result.metrics or {}), checkpoint, data.stats)


def _load_tokenizer_and_template(cfg: RunConfig):
    """The tokenizer and template, or a ConfigError that says which setting is wrong."""
    from registries.templates import get_template
    from registries.templates.autodetect import AUTO
    from stages.loading import load_tokenizer_and_template

    _check_local_paths(cfg)
    path = cfg.model.model_name_or_path
    if cfg.data.template not in (None, AUTO):
        try:
            get_template(cfg.data.template)
        except ValueError as exc:  # the only error get_template raises: an unknown name
            raise ConfigError(f"template: {exc}") from None
    try:
        return load_tokenizer_and_template(cfg.model, cfg.data)
    except OSError as exc:  # transformers: no tokenizer files there, or the hub cannot serve the id
        raise ConfigError(
            f"cannot load the tokenizer of model_name_or_path {path!r}: {exc} Check the folder or hub id "
            "(a hub id needs network access or a filled Hugging Face cache)."
        ) from None


def _check_local_paths(cfg: RunConfig) -> None:
    """Every model or adapter path that looks local must exist. Checked here, before any work:
    transformers and peft would take a missing path for a hub id and fail much later, on a worker."""
    tuning = cfg.finetuning
    named = [("model_name_or_path", cfg.model.model_name_or_path), ("ref_model", tuning.ref_model),
             ("reward_model", tuning.reward_model)]
    for key, paths in (("adapter_name_or_path", cfg.model.adapter_name_or_path),
                       ("ref_model_adapters", tuning.ref_model_adapters),
                       ("reward_model_adapters", tuning.reward_model_adapters)):
        named += [(key, p) for p in paths or ()]
    for key, path in named:
        if path and _looks_local(path) and not os.path.exists(os.path.expanduser(path)):
            if "adapter" in key:
                fix = "Point it at a folder holding adapter_config.json, or use a hub id of a PEFT adapter."
            else:
                fix = ("Point it at a model folder, use a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or tiny:qwen2 "
                       "for a tiny test model.")
            raise ConfigError(
                f"{key} {path!r} does not exist (looked for {os.path.abspath(os.path.expanduser(path))}). {fix}"
            )


def _looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id ('name' or 'org/name') or tiny:<family>."""
    if "://" in path or path.startswith("tiny:"):
        return False
    return path.startswith(("/", "./", "../", "~", ".\\")) or path.count("/") > 1 or "\\" in path


def _rollout_cpus(cfg: RunConfig) -> float:
    """CPUs the rollout engines of an RL stage hold on their own bundles (none when colocated)."""
    ray_args = cfg.ray
    if cfg.finetuning.spec.launch != "rl_controller" or cfg.rl.rollout_backend != "vllm" or ray_args.colocate_rollout:
        return 0
    return float(ray_args.rollout_resources.get("CPU", 0) or 0) * ray_args.rollout_num_engines


def _check_resources(cfg: RunConfig, resources: dict) -> None:
    """Fail now, not after a silent wait for resources that will never appear."""
    ray_args = cfg.ray
    for name, amount in ray_args.resources_per_worker.items():
        needed = float(amount) * ray_args.ray_num_workers
        have = float(resources.get(name, 0))
        if needed > have:
            raise ConfigError(
                f"ray_num_workers={ray_args.ray_num_workers} with resources_per_worker {name}={amount} "
                f"needs {needed:g} {name} but the Ray cluster has {have:g}. Lower ray_num_workers or "
                f"resources_per_worker, or add nodes."
            )
