"""The driver: config -> Ray -> Ray Data -> Ray Train -> output_dir. Used by the CLI, by
``ray job submit`` and from Python as ``run_exp``."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from .config import ConfigError, RunConfig, load_config

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
) -> RunResult:
    """Run one training job. ``callbacks`` are extra ``transformers.TrainerCallback`` objects
    shipped to every worker (the Python API's hook; the YAML has no such key)."""
    cfg = config if isinstance(config, RunConfig) else load_config(config, list(overrides))

    from fabric.data_pipeline import prepare_datasets
    from fabric.launcher import launch_training
    from fabric.ray_session import connect
    from stages.loading import load_tokenizer_and_template

    output_dir = cfg.training.output_dir
    os.makedirs(output_dir, exist_ok=True)
    cfg.write_yaml()  # the resolved config, so the run can be repeated exactly
    for note in cfg.notes:
        print(f"[rayfactory] note: {note}", flush=True)

    resources = connect(cfg.ray)
    _check_resources(cfg, resources)
    # The driver tokenizes (through Ray Data) with the very tokenizer and template the workers load.
    tokenizer, template = load_tokenizer_and_template(cfg.model, cfg.data)
    data = prepare_datasets(cfg, tokenizer, template)
    result = launch_training(cfg, data.train, data.eval, callbacks)
    if result.error is not None:
        raise result.error
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    print(f"[rayfactory] done: outputs in {os.path.abspath(output_dir)}", flush=True)
    return RunResult(os.path.abspath(output_dir), dict(result.metrics or {}), checkpoint, data.stats)


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
