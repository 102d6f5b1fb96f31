"""The tiny random-init LLaVA-1.5 (``tiny:llava``): what its processor makes of a shapes picture, what
the llava vision plugin expands each ``<image>`` into, and what the model's forward projects must be
the same count, or the forward refuses the batch. Checked through the sft tokenizer and collator the
training path uses, without Ray."""

from __future__ import annotations

import os

import pytest
import torch

from registries.datasets import DataArguments
from registries.datasets.loading import load_aligned
from registries.models import tiny_model_path
from registries.models.families import family_for_config, get_model_family
from registries.models.tiny import TINY_LLAVA_IMAGE_SIZE
from stages.loading import load_model, load_tokenizer_and_template
from stages.run_args import FinetuningArguments, ModelArguments
from stages.table import STAGES
from stages.training.collators import supervised_collator

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")
TOKENS_PER_IMAGE = (TINY_LLAVA_IMAGE_SIZE // 14) ** 2  # 4x4 patches; the CLS feature is dropped


@pytest.fixture(scope="module")
def llava():
    model_args = ModelArguments(model_name_or_path="tiny:llava")
    data_args = DataArguments(dataset="shapes_train", dataset_dir=DATA_DIR, cutoff_len=128, template="llava",
                              max_samples=4)
    tokenizer, template = load_tokenizer_and_template(model_args, data_args)
    model = load_model(model_args, FinetuningArguments(finetuning_type="full"), tokenizer, is_trainable=False).eval()
    return tokenizer, template, data_args, model


def batch_of(llava, rows):
    tokenizer, template, data_args, model = llava
    columns = STAGES["sft"].preprocess_fn(tokenizer, template, data_args)({k: [r[k] for r in rows] for k in rows[0]})
    features = [dict(zip(columns, values)) for values in zip(*columns.values())]
    return supervised_collator(tokenizer, data_args, model)(features)


def test_tiny_llava_is_a_vision_family_with_the_image_token():
    spec = get_model_family("llava")
    assert spec.vision and spec.template == "llava" and "<image>" in spec.special_tokens
    path = tiny_model_path("llava")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert (path / name).is_file(), name
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    assert family_for_config(config).name == "llava"
    assert config.vision_config.image_size == TINY_LLAVA_IMAGE_SIZE
    assert config.vision_config.patch_size == 14 and config.vision_feature_select_strategy == "default"


def test_plugin_expansion_matches_what_the_forward_projects(llava):
    tokenizer, _, data_args, model = llava
    rows = load_aligned(data_args, "sft").train
    batch = batch_of(llava, rows)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert image_id == model.config.image_token_id
    # every row has one picture, so one crop per row and the plugin's fixed count of tokens
    assert tuple(batch["pixel_values"].shape) == (len(rows), 3, TINY_LLAVA_IMAGE_SIZE, TINY_LLAVA_IMAGE_SIZE)
    assert (batch["input_ids"] == image_id).sum(-1).tolist() == [TOKENS_PER_IMAGE] * len(rows)
    assert "image_grid_thw" not in batch and "mm_token_type_ids" not in batch
    with torch.no_grad():
        out = model(**batch)
        assert torch.isfinite(out.loss)
        # the pictures reach the language model: other pixels, other logits
        other = model(**{**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])})
    assert not torch.allclose(out.logits, other.logits)


def test_a_wrong_token_count_is_refused_by_the_forward(llava):
    """The check above can fail: one <image> token short of the features, and the model says so."""
    tokenizer, _, data_args, model = llava
    batch = batch_of(llava, load_aligned(data_args, "sft").train[:1])
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    ids = batch["input_ids"].clone()
    first = int((ids[0] == image_id).nonzero()[0])
    ids[0, first] = tokenizer.pad_token_id
    with pytest.raises(ValueError, match="(?i)image"), torch.no_grad():
        model(**{**batch, "input_ids": ids})


def test_text_rows_collate_without_pixels(llava):
    tokenizer, template, _, model = llava
    data_args = DataArguments(dataset="identity", dataset_dir=DATA_DIR, cutoff_len=128, template="llava", max_samples=2)
    rows = load_aligned(data_args, "sft").train
    columns = STAGES["sft"].preprocess_fn(tokenizer, template, data_args)({k: [r[k] for r in rows] for k in rows[0]})
    batch = supervised_collator(tokenizer, data_args, model)([dict(zip(columns, v)) for v in zip(*columns.values())])
    assert "pixel_values" not in batch
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)


def test_dpo_pairs_carry_their_picture_for_both_answers(llava):
    """The pairwise path: each pair's crop is stacked once for its chosen and once for its rejected
    sequence, so both halves' <image> runs have their features."""
    tokenizer, template, _, model = llava
    data_args = DataArguments(dataset="shapes_pref", dataset_dir=DATA_DIR, cutoff_len=128, template="llava",
                              max_samples=2)
    stage = STAGES["dpo"]
    rows = load_aligned(data_args, "dpo", stage.dataset_need).train
    columns = stage.preprocess_fn(tokenizer, template, data_args)({k: [r[k] for r in rows] for k in rows[0]})
    collate = stage.load_collator_factory()(tokenizer, data_args, model)
    batch = collate([dict(zip(columns, v)) for v in zip(*columns.values())])
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert batch["pixel_values"].shape[0] == 2 * len(rows) == batch["input_ids"].shape[0]
    assert (batch["input_ids"] == image_id).sum(-1).tolist() == [TOKENS_PER_IMAGE] * (2 * len(rows))
    # the chosen and rejected halves of a pair read the same picture
    assert torch.equal(batch["pixel_values"][0], batch["pixel_values"][len(rows)])
    with torch.no_grad():
        logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values")}).logits
    assert torch.isfinite(logits).all()
