"""Vision-language training options end to end on a real local Ray, the tiny random-init Qwen2-VL
(``tiny:qwen2_vl``), LLaVA-1.5 (``tiny:llava``) and Gemma 3 (``tiny:gemma3_vl``) on the shapes
pictures: sft with LLaMA-Factory's default freeze_vision_tower leaves the vision tower bit-identical
while the language model learns (and unfreezing it trains it), and dpo on image preference pairs
(``shapes_pref``: the right answer against a wrong one) lowers its loss, the pair's images read by
both of its sequences, for each family."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cluster.driver import run_exp
from stages.loading import resolve_model_path
from stages.training.callbacks import read_log
from tests.e2e.conftest import tiny_sft_config

pytestmark = pytest.mark.ray


@dataclass(frozen=True)
class Family:
    """A tiny vision-language model, its template, and its parts' weight-name prefixes."""

    model: str
    template: str
    cutoff_len: int  # room for the prompt, the answer and the picture's image tokens
    vision: tuple[str, ...]
    projector: tuple[str, ...]


QWEN2_VL = Family("tiny:qwen2_vl", "qwen2_vl", 64, ("model.visual.patch_embed.", "model.visual.blocks."),
                  ("model.visual.merger.",))
# LLaVA (a CLIP tower, 16 image tokens) and Gemma 3 (a SigLIP tower pooled to 4 soft tokens) share
# transformers' layout: model.vision_tower / model.multi_modal_projector / model.language_model.
LLAVA = Family("tiny:llava", "llava", 128, ("model.vision_tower.",), ("model.multi_modal_projector.",))
GEMMA3 = Family("tiny:gemma3_vl", "gemma3", 128, ("model.vision_tower.",), ("model.multi_modal_projector.",))
FAMILIES = [pytest.param(f, id=f.model.split(":")[1]) for f in (QWEN2_VL, LLAVA, GEMMA3)]
# kept for the Qwen2-VL sft tests below
VISION, PROJECTOR = QWEN2_VL.vision, QWEN2_VL.projector
LANGUAGE = ("model.language_model.", "lm_head.")


def weights(folder: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    return {k: v.clone() for k, v in AutoModelForImageTextToText.from_pretrained(folder).state_dict().items()}


def changed(before: dict, after: dict, prefixes) -> dict[str, bool]:
    """Each weight under ``prefixes``: whether training changed any of its bits."""
    names = [n for n in before if n.startswith(prefixes)]
    assert names, prefixes
    return {n: not torch.equal(before[n], after[n]) for n in names}


@pytest.fixture(scope="module")
def initial_of():
    """The untrained weights of a tiny model, each loaded once per module."""
    loaded: dict[str, dict[str, torch.Tensor]] = {}

    def load(model: str) -> dict[str, torch.Tensor]:
        if model not in loaded:
            loaded[model] = weights(resolve_model_path(model))
        return loaded[model]

    return load


@pytest.fixture(scope="module")
def initial(initial_of):
    return initial_of("tiny:qwen2_vl")


def vision_config(output_dir, family: Family = QWEN2_VL, **overrides) -> dict:
    config = tiny_sft_config(
        output_dir, model_name_or_path=family.model, template=family.template, dataset="shapes_train",
        max_samples=32, cutoff_len=family.cutoff_len, per_device_train_batch_size=8, learning_rate=3.0e-3,
        max_steps=4,
    )
    config.update(overrides)
    return config


def test_sft_keeps_the_frozen_vision_tower_bit_identical_and_trains_it_when_unfrozen(ray_session, tmp_path, initial):
    frozen = weights(run_exp(vision_config(tmp_path / "frozen")).output_dir)
    assert not any(changed(initial, frozen, VISION).values())  # freeze_vision_tower: true, LLaMA-Factory's default
    assert not any(changed(initial, frozen, PROJECTOR).values())  # freeze_multi_modal_projector: true, likewise
    assert all(changed(initial, frozen, ("model.language_model.layers.",)).values())

    unfrozen = weights(run_exp(vision_config(
        tmp_path / "unfrozen", freeze_vision_tower=False, freeze_multi_modal_projector=False)).output_dir)
    assert all(changed(initial, unfrozen, ("model.visual.blocks.",) + PROJECTOR).values())


def test_lora_sft_adapts_the_language_model_only(ray_session, tmp_path):
    from safetensors.torch import load_file

    out = run_exp(vision_config(tmp_path / "lora", finetuning_type="lora", max_steps=2)).output_dir
    keys = list(load_file(f"{out}/adapter_model.safetensors"))
    assert keys and all(".language_model.layers." in key for key in keys), keys
    # LLaMA-Factory's lora_target all: every projection of both layers, nothing of the vision tower
    assert len(keys) == 2 * 7 * 2  # layers x (q, k, v, o, gate, up, down) x (lora_A, lora_B)


@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_on_image_pairs_lowers_its_loss(ray_session, tmp_path, initial_of, family):
    # Full dpo (the reference: a second copy of the start), the vision tower frozen (the default).
    # A pipeline test: the first 64 pairs are mostly about red shapes, an answer prior the random-init
    # model picks up within a few steps (measured on Qwen2-VL: the loss from 0.693 to ~0.45 by step 5,
    # flat after, 0.75 of the pairs' rewards ordered right; LLaVA and Gemma 3: the last 12 steps' mean
    # loss 0.43 and 0.39, accuracy 0.78 and 0.76, seed 42); that it reads each pair's images for both
    # of its sequences is tests/stages/test_vision_pairwise.py's.
    config = vision_config(
        tmp_path / "dpo", family, stage="dpo", dataset="shapes_pref", max_samples=64, per_device_train_batch_size=16,
        learning_rate=1.0e-3, max_steps=24, pref_beta=1.0,
    )
    result = run_exp(config)
    records = [r for r in read_log(result.output_dir) if "loss" in r]
    losses = [r["loss"] for r in records]
    assert len(losses) == 24
    assert abs(losses[0] - 0.6931) < 0.01, losses  # policy == reference at step 1: -log sigmoid(0)
    late = records[-12:]
    assert sum(r["loss"] for r in late) / len(late) < 0.8 * losses[0], losses
    assert sum(r["rewards/accuracies"] for r in late) / len(late) > 0.6, late
    assert result.data_stats == {"train_examples": 64, "eval_examples": 0}
    before, after = initial_of(family.model), weights(result.output_dir)
    assert not any(changed(before, after, family.vision).values())
    assert not any(changed(before, after, family.projector).values())  # freeze_multi_modal_projector: true
    assert all(changed(before, after, ("model.language_model.layers.",)).values())


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_dpo_with_reference_log_probs_computed_before_training(ray_session, tmp_path, family):
    from safetensors.torch import load_file

    # The reference is the base (the adapter off), scored once over the pairs, images included: at step 1
    # the policy equals it, so the loss is exactly -log sigmoid(0) only if both read the same pictures.
    config = vision_config(tmp_path / "lora_dpo", family, stage="dpo", dataset="shapes_pref", max_samples=16,
                           per_device_train_batch_size=8, finetuning_type="lora", max_steps=2,
                           precompute_ref_log_probs=True)
    out = run_exp(config).output_dir
    records = [r for r in read_log(out) if "loss" in r]
    assert len(records) == 2 and abs(records[0]["loss"] - 0.693147) < 1e-4, records
    # Zero up to float32 rounding: the reference pass and the policy's first pass batch the pairs
    # differently, and on some CPUs the last bits of a log-prob differ (1e-7 measured here; exactly
    # 0 on others). The tolerance is a hundred times that rounding.
    assert records[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-5), records[0]
    assert records[0]["rewards/rejected"] == pytest.approx(0.0, abs=1e-5), records[0]
    # lora_target all: the language model's 7 projections in both layers, none in the vision tower
    keys = list(load_file(f"{out}/adapter_model.safetensors"))
    assert len(keys) == 2 * 7 * 2 and all(".language_model.layers." in key for key in keys), keys
