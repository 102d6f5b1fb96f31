"""Image rows through sft's tokenizing and the vision collator, for the tiny Qwen2-VL: the image
tokens per image, the batch's pixel_values / image_grid_thw against the processor's own output for
the same images, and a forward pass of the model on the batch. No Ray."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw

from registries.datasets import DataArguments
from registries.errors import UserError
from registries.multimodal import load_image
from registries.multimodal.qwen2_vl import preprocess
from stages.loading import load_model, load_tokenizer_and_template
from stages.run_args import FinetuningArguments, ModelArguments
from stages.table import STAGES
from stages.training.collators import supervised_collator
from stages.training.vision_collators import VisionCollator

SIZES = [(64, 48), (90, 120), (56, 56)]  # grids (1, 4, 4), (1, 8, 6), (1, 4, 4)


@pytest.fixture
def dataset_dir(tmp_path):
    """Three one-image rows of different sizes, one two-image row and one text-only row."""
    data = tmp_path / "data"
    (data / "pics").mkdir(parents=True)
    for i, size in enumerate(SIZES):
        image = Image.new("RGB", size, "white")
        ImageDraw.Draw(image).ellipse([2, 2, size[0] - 3, size[1] - 3], fill=("red", "blue", "green")[i])
        image.save(data / "pics" / f"{i}.png")

    def row(question, answer, images):
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                "images": images}

    rows = [row(f"<image>What colour? {i}", c, [f"pics/{i}.png"]) for i, c in enumerate(("red", "blue", "green"))]
    rows.append(row("<image> or <image>: which is green?", "the second", ["pics/0.png", "pics/2.png"]))
    rows.append(row("No picture here.", "ok", []))
    (data / "pics.json").write_text(json.dumps(rows))
    entry = {"file_name": "pics.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}
    (data / "dataset_info.json").write_text(json.dumps({"pics": entry}))
    return data


@pytest.fixture(scope="module")
def model_args():
    return ModelArguments(model_name_or_path="tiny:qwen2_vl")


def data_args(dataset_dir, **overrides):
    values = dict(dataset="pics", dataset_dir=str(dataset_dir), cutoff_len=256, template="qwen2_vl")
    values.update(overrides)
    return DataArguments(**values)


def test_image_tokens_and_collated_tensors_match_the_processor(dataset_dir, model_args):
    args = data_args(dataset_dir)
    tokenizer, template = load_tokenizer_and_template(model_args, args)
    assert type(template.image_processor).__name__.startswith("Qwen2VLImageProcessor")
    rows = STAGES["sft"].tokenize_here(tokenizer, template, args)
    assert len(rows) == 5

    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    merge = template.image_processor.merge_size ** 2
    for row in rows:
        tokens_per_image = [t * h * w // merge for t, h, w in row["image_grid_thw"]]
        assert row["input_ids"].count(pad) == sum(tokens_per_image)
        assert all(label == -100 for i, label in zip(row["input_ids"], row["labels"]) if i == pad)
    assert [r["image_grid_thw"] for r in rows] == [
        [[1, 4, 4]], [[1, 8, 6]], [[1, 4, 4]], [[1, 4, 4], [1, 4, 4]], []]
    assert [r["input_ids"].count(pad) for r in rows] == [4, 12, 4, 8, 0]

    model = load_model(model_args, FinetuningArguments(finetuning_type="full"), tokenizer)
    collator = supervised_collator(tokenizer, args, model)
    assert isinstance(collator, VisionCollator)
    batch = collator(rows)

    # The processor on the same images, in batch order: the collator's tensors equal its output.
    paths = [dataset_dir / "pics" / name for name in ("0.png", "1.png", "2.png", "0.png", "2.png")]
    expected = template.image_processor([preprocess(load_image(str(p))) for p in paths], return_tensors="pt")
    assert torch.equal(batch["image_grid_thw"], expected["image_grid_thw"])
    assert batch["pixel_values"].dtype == torch.float32
    assert torch.equal(batch["pixel_values"], expected["pixel_values"])
    assert tuple(batch["pixel_values"].shape) == (int(expected["image_grid_thw"].prod(-1).sum()), 3 * 2 * 14 * 14)
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == pad).long())
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape

    loss = model(**batch).loss
    assert torch.isfinite(loss)
    text_only = collator(rows[-1:])  # a batch without images has no image tensors; the model reads text
    assert "pixel_values" not in text_only and torch.isfinite(model(**text_only).loss)


def test_rows_whose_images_do_not_fit_cutoff_len_are_skipped(dataset_dir, model_args):
    from collections import Counter

    args = data_args(dataset_dir, cutoff_len=20)
    tokenizer, template = load_tokenizer_and_template(model_args, args)
    preprocess_fn = STAGES["sft"].preprocess_fn(tokenizer, template, args)
    from registries.datasets.loading import load_aligned

    aligned = load_aligned(args, "sft").train
    stats = Counter()
    out = preprocess_fn.func({k: [r[k] for r in aligned] for k in aligned[0]}, stats=stats, **preprocess_fn.keywords)
    assert stats["skipped_image_cut"] >= 1  # the 12-token image and the two-image row cannot fit 20 tokens
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for ids, grids in zip(out["input_ids"], out["image_grid_thw"]):
        assert ids.count(pad) == sum(t * h * w // 4 for t, h, w in grids)


def test_image_rows_need_a_vision_template_and_no_packing(dataset_dir, model_args):
    args = data_args(dataset_dir, template="qwen")
    tokenizer, template = load_tokenizer_and_template(model_args, args)
    with pytest.raises(UserError, match=r"Template 'qwen' has no vision plugin"):
        STAGES["sft"].tokenize_here(tokenizer, template, args)
    args = data_args(dataset_dir, packing=True)
    tokenizer, template = load_tokenizer_and_template(model_args, args)
    with pytest.raises(UserError, match=r"packing \(and neat_packing\) cannot take rows with images"):
        STAGES["sft"].tokenize_here(tokenizer, template, args)
