"""A real pretrained model, offline: LoRA sft of SmolLM2-135M-Instruct (``demo:smollm2-135m-instruct``)
on our identity data (configs/smollm2_lora_sft.yaml), judged the way a user would, by chatting with
the output (greedy, through ``cluster.api.ChatModel``).

The default suite runs three steps: the loss falls, the saved adapter loads and changes the
model's answer. The ``slow`` test runs the example config as it is (30 steps, ~2 min here) and asks
questions phrased unlike any training row: the model must give its new name and maker, and still
answer an unrelated question.
"""

from __future__ import annotations

import os

import pytest
import yaml

from cluster.api import ChatModel
from cluster.driver import run_exp
from registries.synthetic.identity import DEMO_AUTHOR, DEMO_NAME
from stages.training.callbacks import read_log
from tests.e2e.conftest import DATA_DIR, REPO_ROOT

BASE = {"model_name_or_path": "demo:smollm2-135m-instruct", "template": "smollm2", "temperature": 0,
        "max_new_tokens": 24}
# Phrased unlike every row of identity_demo (registries/synthetic/identity.py).
HELD_OUT = ["Could you tell me your name?", "Who built you?", "What are you called, and who created you?"]


def example_config(tmp_path, **overrides) -> dict:
    with open(os.path.join(REPO_ROOT, "configs", "smollm2_lora_sft.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    return {**config, "dataset_dir": DATA_DIR, "output_dir": str(tmp_path / "out"),
            "ray_storage_path": str(tmp_path / "ray"), "plot_loss": False, **overrides}


def replies(adapter: str | None, questions: list[str]) -> list[str]:
    chat = ChatModel({**BASE, "adapter_name_or_path": adapter} if adapter else BASE)
    return [chat.chat([{"role": "user", "content": q}])[0].response_text for q in questions]


def test_a_few_lora_steps_on_the_real_model_change_its_answer(ray_session, tmp_path):
    # Three steps (measured: loss 4.67 -> 3.54 -> 3.18, and the answer changes); the learning claim is the slow test's.
    config = example_config(tmp_path, max_steps=3, logging_steps=1, warmup_steps=0)
    result = run_exp(config)
    losses = [r["loss"] for r in read_log(result.output_dir) if "loss" in r]
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], losses
    assert os.path.isfile(os.path.join(result.output_dir, "adapter_model.safetensors"))
    question = ["Who are you?"]
    base, trained = replies(None, question), replies(result.output_dir, question)
    assert trained != base, (base, trained)


@pytest.mark.slow
def test_the_identity_run_answers_held_out_questions_with_its_new_name(ray_session, tmp_path):
    result = run_exp(example_config(tmp_path))
    before = replies(None, HELD_OUT)
    assert not any(DEMO_NAME in r for r in before), before  # SmolLM2 does not call itself Quill
    after = replies(result.output_dir, HELD_OUT + ["What is the capital of France?"])
    assert DEMO_NAME in after[0], after
    assert DEMO_AUTHOR in after[1], after
    assert DEMO_NAME in after[2] and DEMO_AUTHOR in after[2], after
    assert "Paris" in after[3], after  # still a general assistant
