"""Vision-language sft end to end: the tiny random-init Qwen2-VL (``tiny:qwen2_vl``) trained on the
shapes pictures through the normal command path (config -> Ray Data decodes and resizes the images
while tokenizing -> a Ray Train worker -> output_dir), and image datasets mixed with text ones."""

from __future__ import annotations

import os

import pytest

from cluster.config import load_config
from cluster.driver import run_exp
from fabric.data.prepare import prepare_datasets
from stages.loading import load_tokenizer_and_template
from stages.training.callbacks import read_log
from tests.e2e.conftest import tiny_sft_config

pytestmark = pytest.mark.ray


def vision_config(output_dir, **overrides) -> dict:
    config = tiny_sft_config(
        output_dir, model_name_or_path="tiny:qwen2_vl", template="qwen2_vl", dataset="shapes_train",
        cutoff_len=64, per_device_train_batch_size=16, learning_rate=3.0e-3, max_steps=20,
    )
    config.update(overrides)
    return config


# Three schemes: Qwen2-VL (dynamic resolution, a grid per image, M-RoPE positions); LLaVA-1.5
# (tiny:llava: a CLIP tower's fixed 56-px crop, 16 <image> tokens, no grid); Gemma 3 (tiny:gemma3_vl:
# SigLIP crops pooled to 4 soft tokens framed by <start_of_image>/<end_of_image>, marked by
# token_type_ids). Each through the tokenizer (Ray Data), its collator and the model's forward.
@pytest.mark.parametrize("model, template, cutoff", [
    ("tiny:qwen2_vl", "qwen2_vl", 64), ("tiny:llava", "llava", 128), ("tiny:gemma3_vl", "gemma3", 128)])
def test_vision_sft_runs_on_ray_and_loss_falls(ray_session, tmp_path, model, template, cutoff):
    result = run_exp(vision_config(tmp_path / "out", preprocessing_engine="ray_data", model_name_or_path=model,
                                   template=template, cutoff_len=cutoff))
    out = result.output_dir
    # preprocessor_config.json: the image processor travels with the trained model
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json", "trainer_log.jsonl"):
        assert os.path.exists(os.path.join(out, name)), name
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    # 96 pictures, 2 questions each; every row kept (a row whose image tokens cutoff_len would cut is skipped)
    assert result.data_stats == {"train_examples": 192, "eval_examples": 0}


@pytest.mark.parametrize("engine", ["ray_data", "driver"])
def test_image_and_text_datasets_mix(ray_session, tmp_path, engine):
    """A text dataset interleaved with an image dataset: one schema (text rows carry empty image
    cells), the same rows by Ray Data and by the driver."""
    cfg = load_config(vision_config(tmp_path / "out", dataset="shapes_train,identity", max_samples=20,
                                    mix_strategy="interleave_under", preprocessing_engine=engine))
    tokenizer, template = load_tokenizer_and_template(cfg.model, cfg.data)
    data = prepare_datasets(cfg.data, cfg.finetuning.spec, cfg.training.seed, tokenizer, template)
    rows = data.train.take_all()
    with_images = [r for r in rows if len(r["image_grid_thw"])]
    without = [r for r in rows if not len(r["image_grid_thw"])]
    assert len(with_images) == 20 and len(without) == 20
    assert all(len(r["pixel_values"]) == 0 for r in without)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row in with_images:
        (t, h, w), = [list(thw) for thw in row["image_grid_thw"]]
        assert list(row["input_ids"]).count(pad) == t * h * w // 4
        assert len(row["pixel_values"]) == t * h * w * 3 * 2 * 14 * 14
    assert all(pad not in list(r["input_ids"]) for r in without)


def test_mixed_rows_split_by_val_size_keep_their_images(ray_session, tmp_path):
    cfg = load_config(vision_config(tmp_path / "out", dataset="shapes_train,identity", max_samples=20,
                                    mix_strategy="interleave_under", val_size=0.25, preprocessing_engine="ray_data"))
    tokenizer, template = load_tokenizer_and_template(cfg.model, cfg.data)
    data = prepare_datasets(cfg.data, cfg.finetuning.spec, cfg.training.seed, tokenizer, template)
    train, evaluation = data.train.take_all(), data.eval.take_all()
    assert (len(train), len(evaluation)) == (30, 10)
    assert sum(len(r["image_grid_thw"]) for r in train + evaluation) == 20


def test_empty_image_table_keeps_the_images_column():
    from fabric.data.ray_data import _concat

    assert "_images" in _concat([], images=True).column_names
    assert "_images" not in _concat([]).column_names
    assert "_extra" in _concat([]).column_names


# ---------------------------------------------------------------------------- learning (slow)

COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle")


def shapes_accuracy(model_path: str, dataset: str = "shapes_eval") -> float:
    """Exact-match accuracy on ``dataset``: for each question the model's answer is the candidate
    (the four colours, or the three shapes) whose tokens it gives the highest log-probability."""
    import torch

    from registries.datasets import DataArguments
    from registries.datasets.loading import load_aligned
    from stages.loading import load_model
    from stages.run_args import FinetuningArguments, ModelArguments
    from stages.table import STAGES
    from stages.training.collators import supervised_collator
    from tests.e2e.conftest import DATA_DIR

    model_args = ModelArguments(model_name_or_path=model_path)
    data_args = DataArguments(dataset=dataset, dataset_dir=DATA_DIR, cutoff_len=64, template="qwen2_vl")
    tokenizer, template = load_tokenizer_and_template(model_args, data_args)
    model = load_model(model_args, FinetuningArguments(finetuning_type="full"), tokenizer, is_trainable=False).eval()
    preprocess, collate = STAGES["sft"].preprocess_fn(tokenizer, template, data_args), supervised_collator(
        tokenizer, data_args, model)
    right = 0
    rows = load_aligned(data_args, "sft").train
    for row in rows:
        answer = row["_response"][0]["content"]
        candidates = COLOURS if answer in COLOURS else SHAPES
        variants = [{**row, "_response": [{"role": "assistant", "content": c}]} for c in candidates]
        columns = preprocess({k: [v[k] for v in variants] for k in variants[0]})
        batch = collate([dict(zip(columns, values)) for values in zip(*columns.values())])
        with torch.no_grad():
            logits = model(**batch).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        mask = labels != -100
        picked = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        scores = (picked * mask).sum(-1)
        right += candidates[int(scores.argmax())] == answer
    return right / len(rows)


@pytest.mark.slow
@pytest.mark.skip(reason=(
    "not yet a reliable learning result: the random-init tiny Qwen2-VL (4 image tokens per 64x64 picture) went "
    "from 0.29 (chance) to 0.50 on shapes_eval after 240 steps but only 0.40 after 480 (seed 42, one run each; "
    "train accuracy equal), so the margin is not stable enough to assert; needs a tuned recipe (more image "
    "tokens via image_min_pixels, a larger vision tower, several seeds) before it can be enabled"))
def test_trained_qwen2_vl_beats_its_untrained_accuracy_on_held_out_pictures(ray_session, tmp_path):
    from stages.loading import resolve_model_path

    before = shapes_accuracy(resolve_model_path("tiny:qwen2_vl"))
    result = run_exp(vision_config(tmp_path / "out", max_steps=240, lr_scheduler_type="cosine", warmup_steps=10,
                                   logging_steps=20))
    after = shapes_accuracy(result.output_dir)
    print(f"shapes_eval accuracy: untrained {before:.3f}, trained {after:.3f}")
    assert after >= before + 0.25, (before, after)
