"""report_to for the RL loops: they run in the driver, with no HF Trainer to report for them.

Each trainer_log.jsonl record's numbers (reward, KL, loss, lr, time/<phase>, ...) go, at the record's
step, to the same trackers and places the Trainer's integrations use for the other stages
(stages/tracking.py). The run name and the resolved config are recorded when the reporter opens.
Every backend gets its own handle (a SummaryWriter, an MlflowClient, a wandb Run), never a library's
process-wide current run, so a reporter cannot write into a run something else in the driver opened.
"""

from __future__ import annotations

import os
import time
from typing import Any

from stages.tracking import default_run_name, flat_config, locations, report_targets

_MLFLOW_BATCH = 100  # MLflow's limit of params (or metrics) in one log_batch call
_STEP_KEYS = ("current_steps", "total_steps")  # the step itself, not a metric


def _numbers(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k not in _STEP_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _TensorBoard:
    def __init__(self, where: dict, run_name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=where["TENSORBOARD_LOGGING_DIR"])
        self.writer.add_text("run_name", run_name)
        self.writer.add_text("config", "\n".join(f"{k}: {v}" for k, v in sorted(config.items())))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a killed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, where: dict, run_name: str, config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if "MLFLOW_ALLOW_FILE_STORE" in where:  # our default file store; MLflow reads this at each store's creation
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(where["MLFLOW_TRACKING_URI"])
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        experiment = self.client.get_experiment_by_name(name) if name else None
        experiment_id = (experiment.experiment_id if experiment else
                         self.client.create_experiment(name) if name else "0")  # "0": MLflow's Default, as HF's
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in config.items()]
        for i in range(0, len(params), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _MLFLOW_BATCH])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Wandb:
    def __init__(self, where: dict, run_name: str, config: dict):
        import wandb

        # WANDB_PROJECT's default is the Trainer integration's, so both kinds of stage land in one project.
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "huggingface"), name=run_name,
                              config=config, dir=where["WANDB_DIR"], reinit="create_new")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_BACKENDS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _Wandb}


class StepReporter:
    """``log(record)`` after each trainer_log.jsonl line, ``close()`` at the end; with report_to none, nothing."""

    def __init__(self, spec):
        options = spec.training
        names = report_targets(options.report_to)
        if not names:
            self.backends = []
            return
        where = locations(options.output_dir)
        run_name = options.run_name or default_run_name(options.output_dir)
        config = flat_config(spec)
        self.backends = [_BACKENDS[name](where, run_name, config) for name in names]

    def log(self, record: dict) -> None:
        step, values = int(record["current_steps"]), _numbers(record)
        for backend in self.backends:
            backend.log(step, values)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []
