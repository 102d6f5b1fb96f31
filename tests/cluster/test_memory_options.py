"""The memory options in a run config (chunked_loss, LLaMA-Factory's disable_gradient_checkpointing)
and the memory plan's line on the console."""

from __future__ import annotations

import json

import pytest

from cluster.config import load_config
from cluster.console import Console
from fabric.progress import RelayCallback
from tests.cluster.conftest import BASE, error_of

pytestmark = pytest.mark.usefixtures("in_tmp")


def test_disable_gradient_checkpointing_true_is_an_explicit_false():
    run = load_config({**BASE, "disable_gradient_checkpointing": True})
    assert run.training.values["gradient_checkpointing"] is False  # the planner leaves a user's value alone
    assert run.notes == ["translated disable_gradient_checkpointing: True to gradient_checkpointing: False."]


def test_disable_gradient_checkpointing_false_leaves_it_to_the_planner():
    run = load_config({**BASE, "disable_gradient_checkpointing": "no"})
    assert "gradient_checkpointing" not in run.training.values
    assert run.notes == [
        "ignored 'disable_gradient_checkpointing' from the config dict: false leaves gradient checkpointing to the "
        "memory planner (on when the model would not fit without it; gradient_checkpointing: true forces it)."
    ]
    forced = load_config({**BASE, "disable_gradient_checkpointing": False, "gradient_checkpointing": True})
    assert forced.training.values["gradient_checkpointing"] is True


def test_disable_gradient_checkpointing_errors_are_one_paragraph():
    both = error_of({**BASE, "disable_gradient_checkpointing": True, "gradient_checkpointing": True})
    assert "'disable_gradient_checkpointing' in the config dict and 'gradient_checkpointing' in the config dict" in both
    assert "Keep only one of them." in both
    assert "disable_gradient_checkpointing" in error_of({**BASE, "disable_gradient_checkpointing": "sometimes"})


def test_chunked_loss_options_load_and_are_checked():
    run = load_config({**BASE, "stage": "pt", "chunked_loss": "yes", "chunked_loss_tokens": 512})
    assert (run.finetuning.chunked_loss, run.finetuning.chunked_loss_tokens) == (True, 512)
    assert load_config(dict(BASE)).finetuning.chunked_loss is None  # auto
    assert "chunked_loss" in error_of({**BASE, "chunked_loss": "maybe"})
    assert "chunked_loss_tokens must be at least 1, got 0" in error_of({**BASE, "chunked_loss_tokens": 0})
    wrong_stage = error_of({**BASE, "stage": "rm", "chunked_loss": True})
    assert wrong_stage.startswith("invalid chunked_loss in the config dict: chunked_loss applies the output head in "
                                  "chunks of tokens in stages pt, sft, dpo, kto, but stage is 'rm'")
    assert load_config({**BASE, "stage": "rm", "chunked_loss": False}).finetuning.chunked_loss is False
    assert load_config({**BASE, "stage": "dpo", "chunked_loss": True}).finetuning.chunked_loss is True  # summed log-probs


def test_precompute_ref_log_probs_is_for_runs_with_a_reference():
    run = load_config({**BASE, "stage": "dpo", "precompute_ref_log_probs": True})
    assert run.finetuning.precompute_ref_log_probs is True
    assert load_config({**BASE, "stage": "kto"}).finetuning.precompute_ref_log_probs is None  # planned per run
    for refused in ({"stage": "dpo", "pref_loss": "simpo"}, {"stage": "sft"}, {"stage": "grpo"}):
        message = error_of({**BASE, **refused, "precompute_ref_log_probs": True})
        assert "precompute_ref_log_probs computes a reference model's log-probs before training, but this run has " \
               "no reference" in message, message


def test_chunked_loss_true_under_zero_3_is_refused():
    with open("z3.json", "w") as f:
        json.dump({"zero_optimization": {"stage": 3}}, f)
    message = error_of({**BASE, "deepspeed": "z3.json", "chunked_loss": True})
    assert message.startswith("chunked_loss is true in the config dict, but the DeepSpeed ZeRO-3 config")
    assert load_config({**BASE, "deepspeed": "z3.json"}).finetuning.chunked_loss is None  # auto: plain loss there


class WorkerChannel:
    """Stands in for the Ray actor: records what rank 0 sends."""

    def __init__(self):
        self.records = []
        self.put = self

    def remote(self, *records):
        self.records.extend(records)


class State:
    is_world_process_zero = True
    global_step = 0
    max_steps = 4


def test_the_memory_plan_reaches_the_console_once(capsys):
    relay = RelayCallback(WorkerChannel())
    relay.notes.append("memory plan: gradient checkpointing off: ~0.1 GiB fit 9.9 GiB")
    relay.on_train_begin(None, State(), None)
    (begin,) = relay.channel.records
    assert begin["event"] == "begin" and begin["notes"] == ["memory plan: gradient checkpointing off: ~0.1 GiB fit 9.9 GiB"]
    console = Console(verbose=True)
    console.progress(begin)
    console.progress(dict(begin))  # a restarted worker group sends it again
    console._close_bar()
    shown = capsys.readouterr().out
    assert shown.count("[rayfactory] memory plan: gradient checkpointing off") == 1
