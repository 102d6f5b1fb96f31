"""LoRA sft of the tiny LLaVA-1.5 end to end, from configs/sft_llava_shapes.yaml as shipped (only the
steps and paths changed): its CLIP vision tower has q_proj/k_proj/v_proj like the language model, yet
the saved adapter holds the language model's layers only, and merged into the base it leaves the
vision tower and the projector bit-identical while every adapted projection of the language model
changed. Which modules each lora_target picks is tests/stages/test_vision_lora_targets.py's."""

from __future__ import annotations

import pytest
import torch

from cluster.driver import run_exp
from stages.loading import resolve_model_path
from stages.training.callbacks import read_log
from tests.e2e.conftest import example_config

pytestmark = pytest.mark.ray

LM_LEAVES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
STEPS = 6


def test_lora_sft_on_llava_adapts_the_language_model_and_keeps_the_vision_tower_bit_identical(ray_session, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    result = run_exp(example_config("sft_llava_shapes.yaml", tmp_path, max_steps=STEPS, logging_steps=1))
    out = result.output_dir
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    assert len(losses) == STEPS and all(0 < loss < 100 for loss in losses), losses

    adapted = [f"model.language_model.layers.{i}.{leaf}" for i in (0, 1) for leaf in LM_LEAVES]
    assert sorted(load_file(f"{out}/adapter_model.safetensors")) == sorted(
        f"base_model.model.{m}.lora_{ab}.weight" for m in adapted for ab in "AB")

    base = AutoModelForImageTextToText.from_pretrained(resolve_model_path("tiny:llava"))
    before = {k: v.clone() for k, v in base.state_dict().items()}
    after = PeftModel.from_pretrained(base, out).merge_and_unload().state_dict()
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    # exactly the adapted projections moved: nothing of the tower, the projector, embeddings or norms
    assert changed == {f"{m}.weight" for m in adapted}
    assert [k for k in before if k.startswith("model.vision_tower.")]  # the tower is there, and untouched
    assert [k for k in before if k.startswith("model.multi_modal_projector.")]
