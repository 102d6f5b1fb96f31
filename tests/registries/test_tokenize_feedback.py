import logging
from collections import Counter

import numpy as np
import pytest
from test_tokenize_common import assistant, batch_of, chatml_reply, chatml_setup, chatml_user, data_args, user

from registries.tokenize import IGNORE_INDEX, preprocess_feedback

M = IGNORE_INDEX


def tagged(prompt, reply, tag):
    return {"_prompt": [user(prompt)], "_response": [assistant(reply)], "_kto_tag": tag}


def run(*rows, stats=None, batch=None, **args):
    tokenizer, template = chatml_setup()
    return preprocess_feedback(
        batch if batch is not None else batch_of(*rows),
        tokenizer=tokenizer, template=template, data_args=data_args(**args), stats=stats,
    )


def example(prompt, reply):
    ids = chatml_user(prompt) + chatml_reply(reply)
    return ids, [M] * len(chatml_user(prompt)) + chatml_reply(reply)


def test_kto_pairs_each_prompt_with_the_previous_rows_response_for_kl():
    out = run(tagged("a", "x", True), tagged("b", "y", False), tagged("c", "z", True))
    assert out["input_ids"] == [example(p, r)[0] for p, r in [("a", "x"), ("b", "y"), ("c", "z")]]
    assert out["labels"] == [example(p, r)[1] for p, r in [("a", "x"), ("b", "y"), ("c", "z")]]
    # mismatched: row 0 borrows row 2's response, row 1 row 0's, row 2 row 1's (no row keeps its own)
    assert out["kl_input_ids"] == [example(p, r)[0] for p, r in [("a", "z"), ("b", "x"), ("c", "y")]]
    assert out["kl_labels"] == [example(p, r)[1] for p, r in [("a", "z"), ("b", "x"), ("c", "y")]]
    assert out["kto_tags"] == [True, False, True]
    assert out["attention_mask"] == [[1] * len(ids) for ids in out["input_ids"]]
    assert out["kl_attention_mask"] == [[1] * len(ids) for ids in out["kl_input_ids"]]


def test_kl_pairing_never_borrows_an_answer_to_the_same_prompt():
    # KTO files often list a prompt's good and bad answer side by side.
    out = run(tagged("a", "good", True), tagged("a", "bad", False), tagged("b", "yes", True), tagged("b", "no", False))
    pairs = [("a", "no"), ("a", "no"), ("b", "bad"), ("b", "bad")]
    assert out["kl_input_ids"] == [example(p, r)[0] for p, r in pairs]


def test_kl_pairing_with_a_single_prompt_falls_back_to_the_previous_row():
    out = run(tagged("a", "x", True), tagged("a", "y", False))
    assert out["kl_input_ids"] == [example("a", "y")[0], example("a", "x")[0]]


def test_kl_pairing_skips_unusable_rows_and_accepts_numpy_bools():
    stats = Counter()
    batch = batch_of(tagged("a", "x", np.bool_(True)), tagged("b", "y", None), tagged("c", "z", np.bool_(False)))
    out = run(batch=batch, stats=stats)
    assert out["kl_input_ids"] == [example("a", "z")[0], example("c", "x")[0]]
    assert out["kto_tags"] == [True, False] and all(type(t) is bool for t in out["kto_tags"])
    assert stats == {"skipped_no_kto_tag": 1}


def test_kto_truncates_example_and_kl_example_separately():
    out = run(tagged("x" * 40, "ok", True), tagged("hi", "y" * 60, False), cutoff_len=30)
    # row 0: response 4 is short -> prompt cut to 26; its KL response (row 1's, 62 ids) vs
    # prompt 59: proportional, int(30 * 62 / 121) = 15 response ids
    assert out["input_ids"][0] == chatml_user("x" * 40)[:26] + chatml_reply("ok")
    assert out["kl_input_ids"][0] == chatml_user("x" * 40)[:15] + chatml_reply("y" * 60)[:15]
    assert out["kl_labels"][0] == [M] * 15 + chatml_reply("y" * 60)[:15]


def test_single_kind_of_tag_warns_and_counts(caplog):
    stats = Counter()
    with caplog.at_level(logging.WARNING, logger="registries.tokenize"):
        run(tagged("a", "x", True), tagged("b", "y", True), stats=stats)
    assert "kto: every row in this batch is desirable" in caplog.text
    assert stats == {"single_tag_batches": 1}


def test_dataset_without_tags_is_a_clear_error():
    with pytest.raises(ValueError, match=r"Stage 'kto' needs a desirable/undesirable tag per row.*\"kto_tag\""):
        run(tagged("a", "x", None), tagged("b", "y", None))


def test_non_boolean_tag_names_the_row():
    batch = batch_of(tagged("a", "x", True), tagged("b", "y", "false"))
    batch |= {"_source_file": ["kto.jsonl", "kto.jsonl"], "_source_row": [4, 5]}
    with pytest.raises(ValueError, match=r"row 5 of kto.jsonl has kto_tag 'false'; it must be true or false"):
        run(batch=batch)


def test_rows_with_images_are_refused_naming_the_row():
    """kto does not expand images: a row with pictures would train on a literal <image> string."""
    batch = batch_of(tagged("<image>what shape?", "circle", True), tagged("b", "y", False))
    batch |= {"_images": [["shapes/0.png"], None], "_source_file": ["kto.jsonl"] * 2, "_source_row": [3, 4]}
    with pytest.raises(ValueError, match=r"Stage 'kto' does not read images yet, but row 3 of kto.jsonl has some "
                                         r"\(1 row\(s\) of this batch do\)\. Train vision-language models with stage "
                                         r"sft or dpo"):
        run(batch=batch)
    batch["_images"] = [None, None]  # an images column without pictures: a text dataset mixed with an image one
    assert len(run(batch=batch)["input_ids"]) == 2
