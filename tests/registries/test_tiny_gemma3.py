"""The tiny random-init Gemma 3 with images (``tiny:gemma3_vl``): what its processor makes of a shapes
picture, what the gemma3 vision plugin expands each ``<image>`` into, and what the model's forward
scatters must be the same count, or the forward refuses the batch. Checked through the sft tokenizer
and collator the training path uses, without Ray."""

from __future__ import annotations

import os

import pytest
import torch

from registries.datasets import DataArguments
from registries.datasets.loading import load_aligned
from registries.models import tiny_model_path
from registries.models.families import family_for_config, get_model_family
from registries.models.tiny import TINY_GEMMA3_IMAGE_SIZE, TINY_GEMMA3_TOKENS_PER_IMAGE
from stages.loading import auto_model_class, load_model, load_tokenizer_and_template
from stages.run_args import FinetuningArguments, ModelArguments
from stages.table import STAGES
from stages.training.collators import supervised_collator

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")
MARKERS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")


@pytest.fixture(scope="module")
def gemma3():
    model_args = ModelArguments(model_name_or_path="tiny:gemma3_vl")
    data_args = DataArguments(dataset="shapes_train", dataset_dir=DATA_DIR, cutoff_len=128, template="gemma3",
                              max_samples=4)
    tokenizer, template = load_tokenizer_and_template(model_args, data_args)
    model = load_model(model_args, FinetuningArguments(finetuning_type="full"), tokenizer, is_trainable=False).eval()
    return tokenizer, template, data_args, model


def batch_of(gemma3, rows):
    tokenizer, template, data_args, model = gemma3
    columns = STAGES["sft"].preprocess_fn(tokenizer, template, data_args)({k: [r[k] for r in rows] for k in rows[0]})
    features = [dict(zip(columns, values)) for values in zip(*columns.values())]
    return supervised_collator(tokenizer, data_args, model)(features)


def test_tiny_gemma3_is_a_vision_family_with_the_image_markers():
    spec = get_model_family("gemma3_vl")
    assert spec.vision and spec.template == "gemma3" and set(MARKERS) <= set(spec.special_tokens)
    path = tiny_model_path("gemma3_vl")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert (path / name).is_file(), name
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    assert family_for_config(config).name == "gemma3_vl"
    assert auto_model_class(config) is AutoModelForImageTextToText
    assert config.vision_config.image_size == TINY_GEMMA3_IMAGE_SIZE and config.vision_config.patch_size == 14
    # the plugin's count (the processor's image_seq_length) is the projector's pooled count
    assert AutoImageProcessor.from_pretrained(path).image_seq_length == config.mm_tokens_per_image


def test_plugin_expansion_matches_what_the_forward_scatters(gemma3):
    tokenizer, _, data_args, model = gemma3
    rows = load_aligned(data_args, "sft").train
    batch = batch_of(gemma3, rows)
    image_id = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert image_id == model.config.image_token_id
    assert tuple(batch["pixel_values"].shape) == (len(rows), 3, TINY_GEMMA3_IMAGE_SIZE, TINY_GEMMA3_IMAGE_SIZE)
    assert (batch["input_ids"] == image_id).sum(-1).tolist() == [TOKENS] * len(rows)
    for marker in ("<start_of_image>", "<end_of_image>"):
        assert (batch["input_ids"] == tokenizer.convert_tokens_to_ids(marker)).sum(-1).tolist() == [1] * len(rows)
    # token_type_ids marks exactly the soft tokens, as LLaMA-Factory's Gemma3Plugin does
    assert torch.equal(batch["token_type_ids"], (batch["input_ids"] == image_id).long())
    assert "image_grid_thw" not in batch and "mm_token_type_ids" not in batch
    with torch.no_grad():
        out = model(**batch)
        assert torch.isfinite(out.loss)
        # the pictures reach the language model: other pixels, other logits
        other = model(**{**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])})
        # and token_type_ids reaches the mask: without it an image's tokens attend causally only
        causal = model(**{k: v for k, v in batch.items() if k != "token_type_ids"})
    assert not torch.allclose(out.logits, other.logits)
    assert not torch.allclose(out.logits, causal.logits)


TOKENS = TINY_GEMMA3_TOKENS_PER_IMAGE


def test_a_wrong_token_count_is_refused_by_the_forward(gemma3):
    """The check above can fail: one soft token short of the features, and the model says so."""
    tokenizer, _, data_args, model = gemma3
    batch = batch_of(gemma3, load_aligned(data_args, "sft").train[:1])
    image_id = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    ids = batch["input_ids"].clone()
    ids[0, int((ids[0] == image_id).nonzero()[0])] = tokenizer.pad_token_id
    with pytest.raises(ValueError, match="(?i)image"), torch.no_grad():
        model(**{**batch, "input_ids": ids})


def test_text_rows_collate_without_pixels(gemma3):
    tokenizer, template, _, model = gemma3
    data_args = DataArguments(dataset="identity", dataset_dir=DATA_DIR, cutoff_len=128, template="gemma3",
                              max_samples=2)
    rows = load_aligned(data_args, "sft").train
    columns = STAGES["sft"].preprocess_fn(tokenizer, template, data_args)({k: [r[k] for r in rows] for k in rows[0]})
    batch = supervised_collator(tokenizer, data_args, model)([dict(zip(columns, v)) for v in zip(*columns.values())])
    assert "pixel_values" not in batch and not batch["token_type_ids"].any()
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)


def test_dpo_pairs_carry_their_picture_and_token_types_for_both_answers(gemma3):
    tokenizer, template, _, model = gemma3
    data_args = DataArguments(dataset="shapes_pref", dataset_dir=DATA_DIR, cutoff_len=128, template="gemma3",
                              max_samples=2)
    stage = STAGES["dpo"]
    rows = load_aligned(data_args, "dpo", stage.dataset_need).train
    columns = stage.preprocess_fn(tokenizer, template, data_args)({k: [r[k] for r in rows] for k in rows[0]})
    batch = stage.load_collator_factory()(tokenizer, data_args, model)([dict(zip(columns, v))
                                                                        for v in zip(*columns.values())])
    image_id = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert batch["pixel_values"].shape[0] == 2 * len(rows) == batch["input_ids"].shape[0]
    assert batch["token_type_ids"].sum(-1).tolist() == [TOKENS] * (2 * len(rows))
    assert torch.equal(batch["token_type_ids"], (batch["input_ids"] == image_id).long())
    assert torch.equal(batch["pixel_values"][0], batch["pixel_values"][len(rows)])



def test_the_vision_tower_stays_frozen_and_lora_stays_off_it():
    """Gemma 3 is a composite model (stages/training/vision_freeze.py) with LLaMA-Factory's default
    fragments: by default the SigLIP tower and the projector are frozen, and LoRA's q_proj/v_proj skip
    the tower's attention."""
    from stages.loading import model_config
    from stages.training.adapters import apply_finetuning

    model_args = ModelArguments(model_name_or_path="tiny:gemma3_vl")
    config = model_config(model_args)

    def trained(**finetuning):
        model = auto_model_class(config).from_config(config)
        model = apply_finetuning(model, FinetuningArguments(**finetuning), model_args)
        return {name for name, p in model.named_parameters() if p.requires_grad}

    full = trained(finetuning_type="full")  # LLaMA-Factory's defaults: tower and projector frozen
    assert full and all(".language_model." in n or n.startswith("lm_head.") for n in full)
    assert any(".multi_modal_projector." in n for n in trained(finetuning_type="full", train_mm_proj_only=True))
    lora = trained(finetuning_type="lora", lora_target="q_proj,v_proj")
    assert lora and all(".language_model." in n and ".lora_" in n for n in lora)
