"""streaming: true (LLaMA-Factory's key) and what it cannot be combined with, checked on the driver."""

from __future__ import annotations

import pytest

from cluster.config import load_config
from tests.cluster.conftest import BASE, error_of

pytestmark = pytest.mark.usefixtures("in_tmp")

STREAM = {**BASE, "streaming": True, "max_steps": 100}


def test_streaming_and_buffer_size_load_as_data_options():
    run = load_config({**STREAM, "buffer_size": 128})
    assert (run.data.streaming, run.data.buffer_size) == (True, 128)
    assert load_config(BASE).data.buffer_size == 16384  # LLaMA-Factory's default


def test_streaming_needs_max_steps():
    message = error_of({**BASE, "streaming": True, "num_train_epochs": 3})
    assert message.startswith("streaming is true in the config dict but max_steps is None: a streamed dataset has no length")
    assert "Set max_steps" in message


@pytest.mark.parametrize(("extra", "named"), [
    ({"val_size": 0.1}, "val_size"),
    ({"mix_strategy": "interleave_under", "dataset": "a,b"}, "mix_strategy 'interleave_under'"),
    ({"tokenized_path": "cache"}, "tokenized_path"),
])
def test_streaming_refuses_what_needs_every_row_first(extra, named):
    message = error_of({**STREAM, **extra})
    assert f"streaming: true cannot be combined with {named}:" in message
    assert message.endswith("or set streaming: false. (in the config dict)")


def test_rl_stages_have_nothing_to_stream():
    message = error_of({**STREAM, "stage": "grpo", "reward_funcs": "exact_match", "finetuning_type": "lora"})
    assert "stage 'grpo' keeps its prompts on the driver" in message and "Remove streaming." in message


@pytest.mark.parametrize("value", [0, -5, "big", True])
def test_buffer_size_must_be_a_positive_count(value):
    assert "buffer_size is" in error_of({**BASE, "buffer_size": value})
