"""Optional dependencies a config turns on, checked on the driver before Ray starts.

Without this check, a LLaMA-Factory YAML with ``deepspeed:`` on an install without DeepSpeed (the
quickstart's) would die inside every Ray worker with ``No module named 'deepspeed'``.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

from stages.tracking import TRACKERS, report_targets

from .config_types import ConfigError

# option -> (module it imports, pyproject extra that installs it, the other way out)
EXTRAS = {
    "deepspeed": ("deepspeed", "deepspeed", "or remove deepspeed"),
    "quantization_bit": ("bitsandbytes", "qlora", "or remove quantization_bit"),
    # True only for RL stages whose rollouts run on vLLM engines.
    "rollout_backend": ("vllm", "vllm", "or set rollout_backend: hf (transformers generate in the policy workers)"),
    "eval_tasks": ("lm_eval", "eval", "or remove eval_tasks"),
    "task": ("lm_eval", "eval", "then run rayfactory eval again"),
}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module blocked in sys.modules
        return False


def check_extras(options: dict[str, object], where: Callable[[str], str]) -> None:
    """``options``: the config's values by key; ``where(key)`` names the file or override that set it."""
    for key, (module, extra, alternative) in EXTRAS.items():
        if options.get(key) and not installed(module):
            raise ConfigError(
                f"{key} in {where(key)} needs the Python package {module!r}, which is not installed here. "
                f"Install RayFactory's {extra!r} extra (pip install -e '.[{extra}]' in the RayFactory folder), "
                f"{alternative}."
            )


def check_report_to(report_to: object, where: Callable[[str], str], local: bool = True) -> list[str]:
    """report_to's trackers as a list ("all": those installed, as the Trainer reads it; "none": []),
    each one RayFactory supports and, where this machine runs the job, installed."""
    names = report_targets(report_to)
    if "all" in names:
        return [name for name, module in TRACKERS.items() if installed(module)]
    for name in names:
        if name == "swanlab":
            raise ConfigError(
                f"report_to: swanlab in {where('report_to')} is not supported: the swanlab package pins "
                "protobuf below 7, which breaks the vllm extra's gRPC packages in the same environment. Use "
                "report_to: tensorboard, mlflow or wandb (offline: WANDB_MODE=offline), or remove report_to."
            )
        if name not in TRACKERS:
            raise ConfigError(
                f"report_to: {name} in {where('report_to')} is not a tracker RayFactory reports to. Use "
                f"{', '.join(TRACKERS)}, a list of them, all or none."
            )
        if local and not installed(TRACKERS[name]):
            raise ConfigError(
                f"report_to: {name} in {where('report_to')} needs the Python package {TRACKERS[name]!r}, which "
                "is not installed here. Install RayFactory's 'tracking' extra (pip install -e '.[tracking]' in "
                "the RayFactory folder), or remove report_to."
            )
    return list(dict.fromkeys(names))
