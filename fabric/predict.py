"""Batch prediction for stage sft: LLaMA-Factory's ``do_predict`` with ``predict_with_generate``.

The eval rows are read and aligned as the data pipeline does it, then ``ray_num_workers``
ChatModel actors answer them (Ray Data ``map_batches`` with a callable class, row order kept):
ChatModel builds each prompt with the training template from the row's turns, system and tools
(no training tokenization: a prediction prompt ends where the reply starts) and generates with
the config's generation settings, as LLaMA-Factory's predict does. The driver then writes, in
output_dir, ``generated_predictions.jsonl`` ({"prompt", "predict", "label"} per row, in row
order) and the scores (stages/inference/metrics.py) into ``predict_results.json``, merged into
``all_results.json`` as the Trainer's ``save_metrics`` does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, replace

import ray
from ray.exceptions import RayTaskError

from registries.datasets.data_args import DataArguments
from registries.datasets.errors import DataConfigError
from stages.inference.loading import InferenceSpec
from stages.inference.metrics import mean_scores
from stages.table import get_stage

# The pipeline's own read -> align -> mix steps and its execution settings (preserve_order,
# user errors carried whole out of Ray Data tasks), so predict rows are exactly its eval rows.
from fabric.ray_args import RayArguments
from .data.common import CarriedDataError, carried_user_error, pipeline_context
from .data.ray_data import aligned_mixed

logger = logging.getLogger(__name__)

PREDICTIONS_FILE = "generated_predictions.jsonl"
RESULTS_FILE = "predict_results.json"
ALL_RESULTS_FILE = "all_results.json"
MODEL_LOAD_TIMEOUT_S = 1800  # how long the actors may take to start and load the model
BATCH_ROWS = 8  # rows per actor call: small, so a few eval rows still spread over every worker


@dataclass
class PredictResult:
    path: str  # generated_predictions.jsonl
    metrics: dict
    rows: int
    workers: int  # actors that answered rows


def trained_model_spec(spec: InferenceSpec, output_dir: str) -> InferenceSpec:
    """The spec of what a training run just saved in ``output_dir``: the adapter (lora, on the
    config's base; training continues at most one adapter, and saves it) or the model itself."""
    if spec.finetuning.finetuning_type == "lora":
        model = replace(spec.model, adapter_name_or_path=[output_dir])
    else:
        model = replace(spec.model, model_name_or_path=output_dir, adapter_name_or_path=None)
    return replace(spec, model=model)


def run_predictions(spec: InferenceSpec, data_args: DataArguments, seed: int, ray_args: RayArguments,
                    output_dir: str) -> PredictResult:
    """Answer every eval_dataset row on Ray; write predictions and scores into ``output_dir``."""
    started = time.time()
    if spec.data.escape_special_tokens is None:  # eval rows are the data author's: encoded as training encodes them
        spec = replace(spec, data=replace(spec.data, escape_special_tokens=False))
    resources = {k: float(v) for k, v in ray_args.resources_per_worker.items()}
    cpus, gpus = resources.pop("CPU", 1.0), resources.pop("GPU", 0.0)
    with pipeline_context(), _actor_pool_context():
        # Read before the actors start, so they never hold the CPUs the reading tasks wait for.
        rows = aligned_mixed(data_args.eval_dataset, data_args, get_stage("sft"), seed).materialize()
        # Blocks of at most BATCH_ROWS, and at least one per worker where there are rows enough:
        # an actor answers whole blocks, so one block would leave the other workers idle. All
        # blocks are ready before the actors are fed: one that arrived late would go to whichever
        # actor is free by then, maybe the one that answered the first block.
        per_block = max(1, min(BATCH_ROWS, math.ceil(rows.count() / ray_args.ray_num_workers)))
        rows = rows.repartition(target_num_rows_per_block=per_block, strict=True).materialize()
        answered = rows.map_batches(
            _Predictor, fn_constructor_kwargs={"spec": spec}, batch_size=per_block, batch_format="pyarrow",
            concurrency=ray_args.ray_num_workers, num_cpus=cpus, num_gpus=gpus or None, resources=resources or None,
        )
        try:
            records = answered.take_all()
        except CarriedDataError as err:
            raise err.error from None
        except RayTaskError as err:
            raise (carried_user_error(err) or err) from None
    elapsed = time.time() - started
    path = os.path.join(output_dir, PREDICTIONS_FILE)
    os.makedirs(output_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"prompt": r["prompt"], "predict": r["predict"], "label": r["label"]},
                               ensure_ascii=False) + "\n")
    metrics = mean_scores((r["predict"], r["label"]) for r in records)
    metrics.update(predict_runtime=round(elapsed, 4), predict_samples_per_second=round(len(records) / elapsed, 3))
    save_metrics(output_dir, metrics)
    workers = len({r["worker"] for r in records})
    logger.debug("predictions for %d rows in %.1fs by %d workers: %s", len(records), elapsed, workers, path)
    return PredictResult(path, metrics, len(records), workers)


@contextlib.contextmanager
def _actor_pool_context():
    """Every worker gets rows: dispatch starts once all actors have loaded their model (Ray Data
    otherwise feeds the first one ready), and an actor holds one block at a time."""
    context = ray.data.DataContext.get_current()
    saved = context.wait_for_min_actors_s, context.max_tasks_in_flight_per_actor
    context.wait_for_min_actors_s, context.max_tasks_in_flight_per_actor = MODEL_LOAD_TIMEOUT_S, 1
    try:
        yield
    finally:
        context.wait_for_min_actors_s, context.max_tasks_in_flight_per_actor = saved


def save_metrics(output_dir: str, metrics: dict) -> None:
    """predict_results.json, and the same keys merged into all_results.json (transformers' layout)."""
    _write_json(os.path.join(output_dir, RESULTS_FILE), metrics)
    all_path = os.path.join(output_dir, ALL_RESULTS_FILE)
    merged = {}
    if os.path.isfile(all_path):
        with open(all_path, encoding="utf-8") as f:
            merged = json.load(f)
    merged.update(metrics)
    _write_json(all_path, merged)


def _write_json(path: str, values: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(values, f, indent=4, sort_keys=True)


class _Predictor:
    """One actor: a ChatModel over the spec's model, answering a batch of aligned rows."""

    def __init__(self, spec: InferenceSpec):
        from stages.inference.chat_model import ChatModel

        self.chat = ChatModel(spec)

    def __call__(self, batch) -> dict[str, list[str]]:
        from stages.engines.types import PromptTooLong

        rows = batch.to_pylist()
        # batch_chat takes one system and tool list: answer the rows that share them together. A
        # row with images (an image eval dataset, a vision template) is its own group: its pictures
        # belong to it alone, expanded by the template's vision plugin as training expands them.
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):
            own = i if row.get("_images") else None
            groups.setdefault((row["_system"] or None, row["_tools"] or None, own), []).append(i)
        replies: list[str] = [""] * len(rows)
        prompts: list[str] = [""] * len(rows)
        for (system, tools, own), indices in groups.items():
            conversations = [rows[i]["_prompt"] for i in indices]
            images = _row_images(rows[own]) if own is not None else None
            try:
                if images:
                    answers = [self.chat.chat(conversations[0], system, tools, images=images)]
                else:
                    answers = self.chat.batch_chat(conversations, system, tools)
            except PromptTooLong as exc:
                raise CarriedDataError(self._too_long(rows, indices, system, tools, exc)) from None
            for i, answer in zip(indices, answers):
                replies[i] = answer[0].response_text
                ids = self.chat.prompt_ids(rows[i]["_prompt"], system, tools, images=images)
                prompts[i] = self.chat.tokenizer.decode(ids, skip_special_tokens=False)
        labels = [row["_response"][0]["content"] if row["_response"] else "" for row in rows]
        return {"prompt": prompts, "predict": replies, "label": labels, "worker": [os.getpid()] * len(rows)}

    def _too_long(self, rows, indices, system, tools, exc) -> DataConfigError:
        limit = exc.max_model_len
        longest = max(indices, key=lambda i: len(self.chat.prompt_ids(rows[i]["_prompt"], system, tools,
                                                                      _row_images(rows[i]))))
        row = rows[longest]
        return DataConfigError(
            f"eval row {row['_source_row']} of {row['_source_file']} is too long to predict: {exc} Raise "
            f"vllm_maxlen (now {limit} tokens, the context window prediction runs with), or shorten the row."
        )


def _row_images(row: dict):
    """An eval row's image paths (None for a text row), as ChatModel takes them."""
    return [str(path) for path in row["_images"]] if row.get("_images") else None
