"""Vision-language training options end to end on a real local Ray, the tiny random-init Qwen2-VL
(``tiny:qwen2_vl``) on the shapes pictures: sft with LLaMA-Factory's default freeze_vision_tower
leaves the vision tower bit-identical while the language model learns (and unfreezing it trains it),
and dpo on image preference pairs (``shapes_pref``: the right answer against a wrong one) lowers its
loss, the pair's images read by both of its sequences."""

from __future__ import annotations

import pytest
import torch

from cluster.driver import run_exp
from stages.loading import resolve_model_path
from stages.training.callbacks import read_log
from tests.e2e.conftest import tiny_sft_config

pytestmark = pytest.mark.ray

VISION = ("model.visual.patch_embed.", "model.visual.blocks.")
PROJECTOR = ("model.visual.merger.",)
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
def initial():
    return weights(resolve_model_path("tiny:qwen2_vl"))


def vision_config(output_dir, **overrides) -> dict:
    config = tiny_sft_config(
        output_dir, model_name_or_path="tiny:qwen2_vl", template="qwen2_vl", dataset="shapes_train",
        max_samples=32, cutoff_len=64, per_device_train_batch_size=8, learning_rate=3.0e-3, max_steps=4,
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


def test_dpo_on_image_pairs_lowers_its_loss(ray_session, tmp_path, initial):
    # Full dpo (the reference: a second copy of the start), the vision tower frozen (the default).
    # A pipeline test: the first 64 pairs are mostly about red shapes, an answer prior the random-init
    # model picks up within a few steps (measured: the loss from 0.693 to ~0.45 by step 5, flat after,
    # 0.75 of the pairs' rewards ordered right); that it reads each pair's images for both of its
    # sequences is tests/stages/test_vision_pairwise.py's.
    config = vision_config(
        tmp_path / "dpo", stage="dpo", dataset="shapes_pref", max_samples=64, per_device_train_batch_size=16,
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
    assert not any(changed(initial, weights(result.output_dir), VISION).values())


def test_lora_dpo_with_reference_log_probs_computed_before_training(ray_session, tmp_path):
    # The reference is the base (the adapter off), scored once over the pairs, images included: at step 1
    # the policy equals it, so the loss is exactly -log sigmoid(0) only if both read the same pictures.
    config = vision_config(tmp_path / "lora_dpo", stage="dpo", dataset="shapes_pref", max_samples=16,
                           per_device_train_batch_size=8, finetuning_type="lora", max_steps=2,
                           precompute_ref_log_probs=True)
    records = [r for r in read_log(run_exp(config).output_dir) if "loss" in r]
    assert len(records) == 2 and abs(records[0]["loss"] - 0.693147) < 1e-4, records
    assert (records[0]["rewards/chosen"], records[0]["rewards/rejected"]) == (0.0, 0.0)
