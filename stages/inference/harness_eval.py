"""Harness tasks while training (``eval_tasks``): each time the Trainer evaluates, rank 0 also scores
the model being trained on lm-evaluation-harness tasks and logs ``eval_tasks/<task>/<metric>``
(``eval/tasks/...`` in TensorBoard and the other trackers, which drop the underscore as for eval_loss).

The model is scored in place (the same weights object, the adapter as it is now) through the
transformers engine, so nothing is saved or copied; ``rayfactory eval`` on a saved checkpoint gives
the same numbers. The other ranks go on to the next step and wait for rank 0 there.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from .eval_args import EvaluationArguments
from .loading import InferenceSpec

logger = logging.getLogger(__name__)
LOG_PREFIX = "eval_tasks/"  # an eval_ key: trainer_log.jsonl keeps it, the trackers file it under eval/


class HarnessEvalCallback(TrainerCallback):
    def __init__(self, spec: InferenceSpec, evaluation: EvaluationArguments):
        """``spec``: the run's model, data, method and sampling slices (what chat would load);
        ``evaluation``: its eval_tasks and their settings."""
        self.spec, self.evaluation = spec, evaluation.during_training()
        self.trainer = None  # set by StageJob.build_trainer once the Trainer exists
        self._chat = None  # built at the first evaluation, on the model the Trainer holds
        self._scored_step = -1

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        # The final evaluation after the last step repeats that step's, when eval_steps divides it.
        if not state.is_world_process_zero or model is None or state.global_step == self._scored_step:
            return
        self._scored_step = state.global_step
        metrics = self.score(model)
        logger.info("eval_tasks at step %d: %s", state.global_step, metrics)
        self.trainer.log(metrics)

    def score(self, model) -> dict[str, float]:
        from stages.training.per_example_attention import attending

        from .evaluation import evaluate

        # Training may attend padding-free rows one example at a time, which refuses the padded
        # batches scoring and generation use: plain sdpa while the tasks run.
        with attending(model, "sdpa"):
            results = evaluate(self.spec, self.evaluation, chat=self._chat_model(model))
        return flatten_results(results)

    def _chat_model(self, model):
        if self._chat is None:
            from stages.engines.hf_backend import HFEngine

            from .chat_model import ChatModel
            from .loading import load_tokenizer_and_template

            tokenizer, _ = load_tokenizer_and_template(self.spec)
            # No adapter names: a PeftModel scores with the adapter being trained, as it trains.
            self._chat = ChatModel(self.spec, engine=HFEngine(model, tokenizer.pad_token_id))
        return self._chat


def flatten_results(results: dict) -> dict[str, float]:
    """The harness's {task: {"acc,none": 0.5, "acc_stderr,none": ...}} as {"eval_tasks/task/acc": 0.5}
    (a filter other than "none" stays in the name; standard errors are left out)."""
    flat = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or "stderr" in metric or not isinstance(value, (int, float)):
                continue
            suffix = metric if filter_name == "none" else f"{metric}_{filter_name}"
            flat[f"{LOG_PREFIX}{task}/{suffix}"] = float(value)
    return flat
