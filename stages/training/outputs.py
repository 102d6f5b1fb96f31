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


def plot_loss(output_dir: str, keys=("loss", "eval_loss")) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(output_dir)
    written = []
    for key in keys:
        points = [(r["current_steps"], r[key]) for r in records if key in r]
        if not points:
            continue
        steps, values = zip(*points)
        plt.figure()
        plt.plot(steps, values, alpha=0.4, label="original")
        if len(values) > 4:
            plt.plot(steps, _smooth(values), label="smoothed")
        plt.title(f"training {key} of {output_dir}")
        plt.xlabel("step")
        plt.ylabel(key)
        plt.legend()
        path = os.path.join(output_dir, f"training_{key.replace('/', '_')}.png")
        plt.savefig(path, format="png", dpi=100)
        plt.close()
        written.append(path)
    return written


def _smooth(values, weight: float = 0.8) -> list[float]:
    """Exponential moving average, like TensorBoard's smoothing slider."""
    out, last = [], values[0]
    for v in values:
        last = last * weight + (1 - weight) * v
        out.append(last)
    return out
