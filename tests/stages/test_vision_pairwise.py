"""Preference pairs with images (shapes_pref_eval on the tiny Qwen2-VL): tokenized with each
answer's image tokens and the pair's pixel values once, then batched chosen-then-rejected with every
image counted for both halves, so each sequence reads its own pictures: the pair batch's log-probs
equal each sequence's scored alone with its image."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from registries.datasets import DataArguments
from stages.loading import load_model, load_tokenizer_and_template
from stages.run_args import FinetuningArguments, ModelArguments
from stages.table import STAGES
from stages.training.collators import supervised_collator
from stages.training.preference_collators import PairwiseCollator, pairwise_collator
from stages.training.sequence_logps import sequence_logps
from stages.training.vision_collators import VisionPairwiseCollator

DATA_DIR = str(Path(__file__).resolve().parents[2] / "data")

VL = ModelArguments(model_name_or_path="tiny:qwen2_vl")


def data_args(**overrides) -> DataArguments:
    return DataArguments(**{"dataset": "shapes_pref_eval", "dataset_dir": DATA_DIR, "template": "qwen2_vl",
                            "cutoff_len": 64, **overrides})


@pytest.fixture(scope="module")
def tokenized():
    tokenizer, template = load_tokenizer_and_template(VL, data_args())
    return tokenizer, STAGES["dpo"].tokenize_here(tokenizer, template, data_args())


@pytest.fixture(scope="module")
def model(tokenized):
    model = load_model(VL, FinetuningArguments(stage="dpo", finetuning_type="full"), tokenized[0])
    return model.eval()


def test_pairs_carry_their_images_once_and_both_answers_hold_the_image_tokens(tokenized):
    tokenizer, rows = tokenized
    assert len(rows) == 48  # 24 pictures, a colour and a shape question each
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row in rows:
        (t, h, w), = [list(thw) for thw in row["image_grid_thw"]]
        assert len(row["pixel_values"]) == t * h * w * 3 * 2 * 14 * 14
        for half in ("chosen", "rejected"):
            ids, labels = row[f"{half}_input_ids"], row[f"{half}_labels"]
            assert ids.count(pad) == t * h * w // 4
            assert all(label == -100 for label, token in zip(labels, ids) if token == pad)  # images never trained
        # the two differ only in the answer: the same prompt ids, images included
        prompt = [i for i, label in zip(row["chosen_input_ids"], row["chosen_labels"]) if label == -100]
        assert row["rejected_input_ids"][: len(prompt)] == prompt
    first = rows[0]
    assert tokenizer.decode([i for i in first["chosen_labels"] if i != -100]) == "red<|im_end|>\n"
    assert tokenizer.decode([i for i in first["rejected_labels"] if i != -100]) == "yellow<|im_end|>\n"


def test_each_image_is_counted_for_both_halves_and_each_sequence_reads_its_own(tokenized, model):
    tokenizer, rows = tokenized
    collator = pairwise_collator(tokenizer, data_args(), model)
    assert isinstance(collator, VisionPairwiseCollator)
    picked = [rows[0], rows[2], rows[7]]  # three pictures (rows 0/1 ask about the same one)
    batch = collator(picked)
    grids = [list(row["image_grid_thw"][0]) for row in picked]
    assert batch["image_grid_thw"].tolist() == grids + grids
    assert batch["pixel_values"].shape[0] == 2 * sum(t * h * w for t, h, w in grids)
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == model.config.image_token_id).long())
    with torch.no_grad():
        pair_logps, _ = sequence_logps(model, batch)

    # Each sequence alone, with its own image, through the sft collator.
    single = supervised_collator(tokenizer, data_args(), model)
    alone = []
    for half in ("chosen", "rejected"):
        for row in picked:
            one = single([{"input_ids": row[f"{half}_input_ids"], "attention_mask": row[f"{half}_attention_mask"],
                           "labels": row[f"{half}_labels"], "pixel_values": row["pixel_values"],
                           "image_grid_thw": row["image_grid_thw"]}])
            with torch.no_grad():
                alone.append(sequence_logps(model, one)[0])
    torch.testing.assert_close(pair_logps, torch.cat(alone), rtol=0, atol=1e-4)

    # The images matter: another picture in row 0's place changes row 0's chosen and rejected scores.
    swapped = [dict(picked[0], pixel_values=rows[46]["pixel_values"], image_grid_thw=rows[46]["image_grid_thw"]),
               *picked[1:]]
    with torch.no_grad():
        other, _ = sequence_logps(model, collator(swapped))
    assert other[0] != pair_logps[0] and other[3] != pair_logps[3]
    torch.testing.assert_close(other[[1, 2, 4, 5]], pair_logps[[1, 2, 4, 5]], rtol=0, atol=1e-4)


def test_vision_pairs_are_padded_rows_only(tokenized, model):
    with pytest.raises(ValueError, match="padding_free is on, but a vision-language model's batches are padded rows"):
        pairwise_collator(tokenized[0], data_args(padding_free=True), model)


def test_a_cut_that_would_drop_image_tokens_skips_the_pair(tokenized):
    from registries.datasets import load_aligned

    tokenizer, _ = tokenized
    _, template = load_tokenizer_and_template(VL, data_args())
    short = data_args(cutoff_len=8)  # each picture is 4 image tokens plus the markers and the question
    aligned = load_aligned(short, "dpo", "ranking").train[:4]
    preprocess = STAGES["dpo"].preprocess_fn(tokenizer, template, short)
    out = preprocess({k: [r[k] for r in aligned] for k in aligned[0]})
    assert out["chosen_input_ids"] == [] and out["pixel_values"] == [] and out["image_grid_thw"] == []


def test_text_pairs_have_no_image_columns_and_keep_the_text_collator(tokenized):
    tokenizer, template = load_tokenizer_and_template(ModelArguments(model_name_or_path="tiny:qwen2"),
                                                      DataArguments(template="qwen"))
    rows = STAGES["dpo"].tokenize_here(tokenizer, template, DataArguments(
        dataset="arith_pref_sharegpt", dataset_dir=DATA_DIR, template="qwen", max_samples=4))
    assert rows and "pixel_values" not in rows[0]
    assert type(pairwise_collator(tokenizer, DataArguments())) is PairwiseCollator


def test_image_pairs_are_refused_where_the_images_would_not_reach_the_model(tokenized):
    # rm's value-head model and text models get the plain collator, which must not drop the pictures silently
    with pytest.raises(ValueError, match="These preference pairs have images, but the model being trained"):
        PairwiseCollator(pad_token_id=0)(tokenized[1][:2])
