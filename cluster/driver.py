"""The driver: config -> Ray -> Ray Data -> Ray Train -> output_dir. Used by the CLI, by
``ray job submit`` and from Python as ``run_exp``."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from .config import ConfigError, RunConfig, load_config
from .console import Console
from .finished_run import finished_run, resume_point
from .output_checks import check_output_dirs
from .replaced_run import clear_replaced_run, replaced_run
from .training_checks import planned_work

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
    """Run one job: training, then batch prediction when ``do_predict`` is set (or prediction
    alone with ``do_train: false``). ``callbacks`` are extra ``transformers.TrainerCallback`` objects
    shipped to every worker (the Python API's hook; the YAML has no such key). ``console`` shows
    the plan, progress and summary (the CLI passes one that also owns the run's log file)."""
    cfg = config if isinstance(config, RunConfig) else load_config(config, list(overrides))
    console = console or Console()

    from fabric.data.prepare import check_data, prepare_datasets
    from fabric.train_in_driver import trains_in_driver
    from fabric.launcher import launch_training
    from fabric.ray_session import connect
    from stages.loading import check_model_fits

    output_dir = cfg.training.output_dir
    do_train, do_predict = planned_work(cfg.training.values)  # load_config checked that there is work
    finished = finished_run(cfg)
    if finished is not None:  # before anything is written: the outputs stay as they were
        console.say(f"rayfactory: {finished}")
        if not do_predict:
            return RunResult(os.path.abspath(output_dir), {}, None, {"finished": True})
        do_train = False  # the trained output is there; its predictions are still to be made
    # Another run in output_dir that this one would start over: refused unless overwrite_output_dir.
    replaced = replaced_run(cfg) if do_train else []

    # Mistakes that need no cluster fail before Ray starts: model path, tokenizer, datasets.
    # Model facts are resolved once, here: the driver tokenizes (through Ray Data) with this
    # tokenizer and template, and the workers load the template by its resolved name.
    tokenizer, template = tokenizer_and_template(cfg)
    configured_template = cfg.data.template  # prediction alone keeps a model folder's saved template
    cfg = cfg.with_template(template.name)  # `template: auto` pinned for the workers and the saved config
    spec = cfg.job_spec()
    if do_train:
        check_model_fits(cfg.model, cfg.finetuning)
        check_data(cfg.data, spec.stage)
    else:  # prediction only: the eval datasets are all it reads
        check_data(dataclasses.replace(cfg.data, dataset=cfg.data.eval_dataset), spec.stage)
    # Writable, with room for a checkpoint (and a local ray_storage_path too); creates output_dir.
    check_output_dirs(cfg, train=do_train)
    if replaced:  # overwrite_output_dir: the replaced run's checkpoints go, now that every check has passed
        clear_replaced_run(cfg, replaced)
    if do_train:  # a prediction-only run leaves the model folder's own saved config alone
        cfg.write_yaml()  # the resolved config, so the run can be repeated exactly
    rl = spec.stage.launch == "rl_controller"
    in_driver = do_train and trains_in_driver(spec, cfg.ray)  # a lone local CPU worker: fabric/train_in_driver.py
    console.plan(cfg, in_driver)
    console.mark("checks")
    # A streamed dataset is read by Ray tasks that hold a CPU each while they read their whole file;
    # a local Ray declares one more CPU so that tokenization runs beside the reading (without it
    # the first batch waited for an 800k-line corpus to be read whole: 170 s instead of 13 s).
    resources = connect(cfg.ray, extra_cpus=_rl_role_cpus(cfg) + (1 if cfg.data.streaming else 0))
    _check_resources(cfg, resources)
    console.mark("Ray")
    if not do_train:  # prediction alone: the config's model, or the finished run's trained output
        predicted = _predict(cfg, console, trained=finished is not None, template=configured_template)
        stats = {"eval_examples": predicted.rows, "predict_workers": predicted.workers}
        return RunResult(os.path.abspath(output_dir), predicted.metrics, None, stats)
    # Ray Train's workers start first and import and load while the data is tokenized (not for
    # a stream, which Ray Train needs up front, nor for RL, whose roles start from the data).
    overlapped = not rl and not cfg.data.streaming and not in_driver

    def prepare_data():
        data = prepare_datasets(cfg.data, spec.stage, cfg.training.seed, tokenizer, template)
        console.mark("data (workers starting)" if overlapped else "data")
        return data

    if rl:  # roles as actor groups, driven from here
        from fabric.rl_launcher import launch_rl

        data = prepare_data()
        result = launch_rl(spec, cfg.ray, data.train, data.eval, tokenizer, template, progress=console.progress_sink())
    else:
        result, data = launch_training(spec, cfg.ray, prepare_data, callbacks, progress=console.progress_sink(),
                                       in_driver=in_driver)
    if result.error is not None:
        raise result.error
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    metrics = dict(result.metrics or {})
    if do_predict:
        metrics.update(_predict(cfg, console, trained=True).metrics)
    console.summary(result, os.path.abspath(output_dir), resume_point(output_dir, spec.stage.checkpoint_kind))
    return RunResult(os.path.abspath(output_dir), metrics, checkpoint, data.stats)


def _predict(cfg: RunConfig, console: Console, trained: bool, template: Optional[str] = None):
    """Generate replies for the eval rows with the trained output, or (``trained`` false) with the
    config's own model and adapters under the template the config names (``template``)."""
    from fabric.predict import run_predictions, trained_model_spec

    spec = cfg.inference_spec()
    if trained:
        spec = trained_model_spec(spec, cfg.training.output_dir)
    else:  # unset or auto: ChatModel takes the template the adapter or model folder trained with
        spec = dataclasses.replace(spec, data=dataclasses.replace(spec.data, template=template))
    predicted = run_predictions(spec, cfg.data, cfg.training.seed, cfg.ray, cfg.training.output_dir)
    console.predictions(predicted.path, predicted.rows, predicted.metrics)
    return predicted


def tokenizer_and_template(cfg: RunConfig):
    """The tokenizer and template, or a ConfigError that says which setting is wrong."""
    from stages.loading import load_tokenizer_and_template

    path = cfg.model.model_name_or_path  # load_config checked that a local path exists
    try:
        return load_tokenizer_and_template(cfg.model, cfg.data)
    except OSError as exc:  # transformers: no tokenizer files there, or the hub cannot serve the id
        raise ConfigError(
            f"cannot load the tokenizer of model_name_or_path {path!r}: {exc} Check the folder or hub id "
            "(a hub id needs network access or a filled Hugging Face cache)."
        ) from None


def _rl_role_cpus(cfg: RunConfig) -> float:
    """CPUs the roles of an RL stage other than the policy (rollout engines, critic, reward model)
    hold on bundles of their own; colocated roles share the policy's."""
    if cfg.finetuning.spec.launch != "rl_controller":
        return 0
    from fabric.rl_launcher import role_specs

    return sum(float(role.resources.get("CPU", 0) or 0) * role.num_actors for role in role_specs(cfg.ray, cfg)
               if role.name != "policy" and role.colocate_with is None)


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
