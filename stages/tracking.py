"""report_to: which experiment trackers a run writes to, and where their offline files go.

One set of rules for the Ray Train stages (the HF Trainer's own integrations, rank 0 only) and the RL
loops (stages/rl/controller/trackers.py, in the driver), so both put a run's files in the same places:

- tensorboard: event files in TENSORBOARD_LOGGING_DIR, else output_dir/runs;
- mlflow: runs in MLFLOW_TRACKING_URI, else a file store in output_dir/mlruns (never the process's
  working directory, which for a Ray worker is a Ray session folder);
- wandb: runs in WANDB_DIR, else output_dir (output_dir/wandb/...); WANDB_MODE=offline needs no network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator

# report_to name -> the module its library imports (pyproject's "tracking" extra installs them all)
TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def report_targets(report_to: Any) -> list[str]:
    """LLaMA-Factory's spellings (a name, a comma list, a YAML list, "none") as a list of lower-case
    names; "all" is left for the config check to resolve to the installed trackers."""
    if report_to is None:
        return []
    items = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = [str(item).strip().lower() for item in items]
    return [name for name in names if name not in ("", "none")]


def default_run_name(output_dir: str) -> str:
    """LLaMA-Factory's run_name default is the Trainer's (output_dir); its last part reads better in a
    tracker's run list and keeps transformers from warning about a run named like a path."""
    return os.path.basename(os.path.normpath(output_dir)) or "run"


def locations(output_dir: str) -> dict[str, str]:
    """Each tracker's location: the user's environment where it says, else under output_dir."""
    where = {
        "TENSORBOARD_LOGGING_DIR": os.path.join(output_dir, "runs"),
        "WANDB_DIR": os.path.abspath(output_dir),
        "MLFLOW_TRACKING_URI": "file://" + os.path.abspath(os.path.join(output_dir, "mlruns")),
    }
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        # MLflow 3 refuses a file store unless asked (it wants a database); the store we pick is a file one.
        where["MLFLOW_ALLOW_FILE_STORE"] = "true"
    return {k: os.environ.get(k) or v for k, v in where.items()}


def driver_env() -> dict[str, str]:
    """The trackers' settings in the driver's environment (WANDB_MODE, MLFLOW_TRACKING_URI, ...): a Ray
    worker has its raylet's environment, which a cluster started earlier did not get them in."""
    return {k: v for k, v in os.environ.items() if k.startswith(("WANDB_", "MLFLOW_", "TENSORBOARD_"))}


@contextlib.contextmanager
def tracker_env(output_dir: str, settings: dict[str, str]) -> Iterator[dict[str, str]]:
    """The HF integrations read their settings from the environment: the driver's ``settings`` and the
    locations under output_dir, for one run only (training in the driver must not hand them on)."""
    with _set_env(settings):
        wanted = locations(output_dir)
    with _set_env({**settings, **wanted}):
        yield wanted


@contextlib.contextmanager
def _set_env(wanted: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def flat_config(spec) -> dict[str, Any]:
    """The resolved config (what rayfactory_config.yaml holds) as flat keys for params/hparams:
    every section's fields, then the trainer options; values a tracker cannot hold become strings."""
    flat: dict[str, Any] = {}
    for section in (spec.model, spec.data, spec.finetuning, spec.rl, spec.generating):
        for f in dataclasses.fields(section):
            flat[f.name] = getattr(section, f.name)
    flat.update(spec.training.to_dict())
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items() if v is not None}


def config_callback(spec):
    """A TrainerCallback that adds the resolved config to the runs the Trainer's integrations opened
    (they record the TrainingArguments and the model's config, not RayFactory's keys: model, template,
    dataset, LoRA...) and ends the wandb run at the end of training. Listed after the integrations, it runs
    after they opened their runs; rank 0 only."""
    from transformers import TrainerCallback

    class TrackerRuns(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            config = flat_config(spec)
            names = set(args.report_to or [])
            if "tensorboard" in names:  # a second event file in the integration's folder; TensorBoard merges them
                from torch.utils.tensorboard import SummaryWriter

                with SummaryWriter(log_dir=os.environ["TENSORBOARD_LOGGING_DIR"]) as writer:
                    writer.add_text("rayfactory_config", "\n".join(f"{k}: {v}" for k, v in sorted(config.items())))
            if "mlflow" in names:
                import mlflow

                # prefixed: MLflow refuses a param logged twice with another value (the Trainer's own str())
                items = [(f"rayfactory.{k}", str(v)[:6000]) for k, v in config.items()]
                if mlflow.active_run() is not None:
                    for i in range(0, len(items), 100):  # MLflow's batch limit
                        mlflow.log_params(dict(items[i:i + 100]))
            if "wandb" in names:
                import wandb

                if wandb.run is not None:
                    wandb.run.config.update({"rayfactory": config}, allow_val_change=True)

        def on_train_end(self, args, state, control, **kwargs):
            # The Trainer leaves its wandb run open until the process exits; when training ran in the
            # driver that is after the CLI returned, with the offline run file not yet complete.
            if state.is_world_process_zero and "wandb" in set(args.report_to or []):
                import wandb

                if wandb.run is not None:
                    wandb.run.finish()

    return TrackerRuns()
