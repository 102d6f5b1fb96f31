"""A tiny VLM learns to see: held-out accuracy on the shapes task against a control that cannot see.

The random-init ``tiny:qwen2_vl`` (vision tower and projector trained too: a random tower has
nothing worth keeping frozen) is trained through ``run_exp`` on 960 fresh shapes pictures and judged
on ``shapes_eval`` (24 pictures never trained on) greedily through ChatModel. The control trains
and is judged on the same questions with the pictures taken out. Its prompts are then identical
within a question kind, so whatever it answers, it answers for all of them: it can do no better
than chance (1/4 on colour, 1/3 on shape), which is what shows the seeing model uses the image.

The default suite runs the short version, both arms; the ``slow`` one the benchmark's length. benchmarks/vision_learning.py is the same run over several seeds, with its
figures in benchmarks/README.md.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from cluster.driver import run_exp
from tests.e2e.conftest import REPO_ROOT

pytestmark = pytest.mark.ray


def _benchmark():
    spec = importlib.util.spec_from_file_location("vision_learning", os.path.join(REPO_ROOT, "benchmarks", "vision_learning.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _benchmark()


def trained_accuracy(arm: str, steps: int, work) -> dict:
    result = run_exp(bench.training_config(arm, 42, steps, str(work)))
    return bench.accuracy(result.output_dir, arm)


def test_blind_prompts_are_identical_within_a_kind():
    """What the control's chance bound rests on: without the picture, every colour question is one
    prompt and every shape question another."""
    questions = {}
    for kind, messages, images, _ in bench.held_out("blind"):
        assert images == [] and "<image>" not in messages[0]["content"]
        questions.setdefault(kind, set()).add(messages[0]["content"])
    assert {k: len(v) for k, v in questions.items()} == {"colour": 1, "shape": 1}
    assert len(bench.held_out("vision")) == 48


# Measured here (seed 42, 300 steps): the seeing model answers every held-out colour question
# right, the blind one 0.25 (one colour for all); the untrained model answers nothing right.
def test_seeing_model_learns_colours_the_blind_one_cannot(ray_session, tmp_path):
    assert bench.accuracy("tiny:qwen2_vl", "vision")["acc"] == 0.0
    seeing = trained_accuracy("vision", 300, tmp_path / "vision")
    blind = trained_accuracy("blind", 300, tmp_path / "blind")
    print(f"held-out accuracy: seeing {seeing}, blind {blind}")
    assert blind["colour"] <= 0.25 and blind["shape"] <= 1 / 3 + 1e-9
    assert seeing["colour"] >= 0.75


# The benchmark's length (600 steps). Measured (seeds 42, 1, 2): colour 1.0 each, the whole 0.71, 0.67,
# 0.67; shapes are not learned by this tiny tower in that time (0.42, 0.33, 0.33 against 1/3 by
# chance), so the bar is on colour and the whole.
@pytest.mark.slow
def test_seeing_model_at_full_length(ray_session, tmp_path):
    seeing = trained_accuracy("vision", bench.STEPS, tmp_path / "vision")
    print(f"held-out accuracy: {seeing}")
    assert seeing["colour"] >= 0.9
    assert seeing["acc"] >= 0.6
