"""Everything a finished stage leaves in output_dir."""

from __future__ import annotations

import logging
import os

from registries.templates.jinja import to_jinja

from stages.training.callbacks import read_log

logger = logging.getLogger(__name__)


def save_outputs(trainer, tokenizer, template, train_result, finetuning_args) -> dict:
    """Model/adapter, tokenizer with the training chat template (and a vision model's image
    processor), state, metrics, loss plot.

    ``save_model`` runs on every rank: under DeepSpeed ZeRO-3 the full weights are gathered
    collectively; only the main process writes.
    """
    output_dir = trainer.args.output_dir
    trainer.save_model(output_dir)
    metrics = dict(train_result.metrics)
    eval_metrics = trainer.evaluate() if trainer.eval_dataset is not None else {}  # collective: every rank
    if trainer.is_world_process_zero():
        tokenizer.chat_template = to_jinja(template, tokenizer)  # serving formats prompts as training did
        tokenizer.save_pretrained(output_dir)
        if getattr(template, "image_processor", None) is not None:  # a vision model reads images with it
            template.image_processor.save_pretrained(output_dir)
        trainer.save_state()
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)  # train_results.json + all_results.json
        if eval_metrics:
            trainer.log_metrics("eval", eval_metrics)
            trainer.save_metrics("eval", eval_metrics)
        if getattr(finetuning_args, "plot_loss", False):
            plot_loss(output_dir)
    return {**metrics, **eval_metrics}


MARKED_POINTS = 30  # a series this short is drawn with a marker at each point: one eval is a dot, not nothing
SMOOTHED_POINTS = 3  # and from this many points on, with its smoothed curve over the raw one


def plot_loss(output_dir: str, keys=("loss", "eval_loss")) -> list[str]:
    """``training_<key>.png`` for each logged key: the raw values (pale, marked when few) and their
    smoothed curve, titled by the key and the run's folder name (the full path is the file's place)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(output_dir)
    run_name = os.path.basename(os.path.normpath(output_dir))
    written = []
    for key in keys:
        points = [(r["current_steps"], r[key]) for r in records if key in r]
        if not points:
            continue
        figure = loss_figure(*zip(*points), key, run_name)
        path = os.path.join(output_dir, f"training_{key.replace('/', '_')}.png")
        figure.savefig(path, format="png", dpi=100)
        plt.close(figure)
        written.append(path)
    return written


def loss_figure(steps, values, key: str, run_name: str):
    """One key's figure (matplotlib, Agg): see plot_loss."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    marker = "o" if len(values) <= MARKED_POINTS else None
    smoothed = len(values) >= SMOOTHED_POINTS
    axes.plot(steps, values, color="#1f77b4", alpha=0.35 if smoothed else 1.0, linewidth=1.5, marker=marker,
              markersize=4, label=f"{key} (raw)" if smoothed else key)
    if smoothed:
        axes.plot(steps, _smooth(values), color="#1f77b4", linewidth=2.2, label=f"{key} (smoothed)")
    axes.set_title(f"{key} · {run_name}")
    axes.set_xlabel("step")
    axes.set_ylabel(key)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return figure


def _smooth(values, weight: float = 0.8) -> list[float]:
    """Exponential moving average, like TensorBoard's smoothing slider."""
    out, last = [], values[0]
    for v in values:
        last = last * weight + (1 - weight) * v
        out.append(last)
    return out
