import logging
from collections import Counter
from dataclasses import replace

import pytest
from test_tokenize_common import BOS, EOS, b, batch_of, byte_tokenizer, data_args, default_setup, user

from registries.templates import get_template
from registries.tokenize import get_preprocess_fn, preprocess_pretrain, resolve_packing


def texts(*docs):
    return batch_of(*({"_prompt": [user(d)], "_response": []} for d in docs))


def run(tokenizer, template, batch, stats=None, **args):
    options = data_args(**args)
    fn = get_preprocess_fn("pretrain", tokenizer, template, options, packing=resolve_packing(options, default=True))
    out = fn.func(batch, stats=stats, **fn.keywords)
    assert out["labels"] == out["input_ids"]
    assert out["attention_mask"] == [[1] * len(ids) for ids in out["input_ids"]]
    return out


def test_pt_packs_by_default_into_full_blocks_and_drops_the_tail(caplog):
    tokenizer, template = default_setup()
    stats = Counter()
    with caplog.at_level(logging.WARNING, logger="registries.tokenize"):
        out = run(tokenizer, template, texts("abc", "de", "fghij"), stats=stats, cutoff_len=5)
    # stream: a b c E d e E f g h i j E (13 tokens) -> two blocks of 5, 3 tokens dropped
    assert out["input_ids"] == [b("abc") + [EOS] + b("d"), b("e") + [EOS] + b("fgh")]
    assert stats == {"dropped_tail_tokens": 3}
    assert "pt: dropped the last 3 of 13 tokens in this batch" in caplog.text


def test_pt_packing_starts_every_block_with_bos_when_the_tokenizer_adds_one():
    tokenizer = byte_tokenizer(add_bos_token=True)
    template = get_template("default")
    template.fix_tokenizer(tokenizer)
    out = run(tokenizer, template, texts("abc", "de", "fghij"), cutoff_len=5)
    # bos is prepended, not written over a text token: 4 text tokens per block
    assert out["input_ids"] == [
        [BOS] + b("abc") + [EOS],
        [BOS] + b("de") + [EOS] + b("f"),
        [BOS] + b("ghij"),
    ]


def test_pt_without_packing_truncates_each_document():
    tokenizer, template = default_setup()
    out = run(tokenizer, template, texts("abc", "fghij"), cutoff_len=5, packing=False)
    assert out["input_ids"] == [b("abc") + [EOS], b("fghij")]
    bos_tokenizer = byte_tokenizer(add_bos_token=True)
    template.fix_tokenizer(bos_tokenizer)
    out = run(bos_tokenizer, template, texts("abc", "fghij"), cutoff_len=5, packing=False)
    assert out["input_ids"] == [[BOS] + b("abc") + [EOS], [BOS] + b("fghi")]


def test_pt_llama3_documents_end_with_end_of_text_not_the_chat_eos():
    tokenizer, _ = default_setup()
    tokenizer.add_tokens(["<|end_of_text|>"], special_tokens=True)
    end_of_text = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    llama3_like = replace(get_template("default"), name="llama3")
    out = run(tokenizer, llama3_like, texts("ab", "cd"), cutoff_len=3, packing=False)
    assert end_of_text == 260 and out["input_ids"] == [b("ab") + [260], b("cd") + [260]]


def test_pt_skips_rows_that_are_not_one_nonempty_text():
    tokenizer, template = default_setup()
    batch = batch_of(
        {"_prompt": [user("ok")], "_response": []},
        {"_prompt": [user("")], "_response": []},
        {"_prompt": [user("q"), {"role": "assistant", "content": "a"}], "_response": []},
    )
    stats = Counter()
    out = run(tokenizer, template, batch, stats=stats, cutoff_len=8, packing=False)
    assert out["input_ids"] == [b("ok") + [EOS]]
    assert stats == {"skipped_empty_text": 1, "skipped_not_text": 1}


def test_pt_cutoff_that_leaves_no_room_for_text_is_a_clear_error():
    tokenizer = byte_tokenizer(add_bos_token=True)
    template = get_template("default")
    template.fix_tokenizer(tokenizer)
    with pytest.raises(ValueError, match="cutoff_len=1 leaves no room for text; set cutoff_len to at least 2"):
        preprocess_pretrain(texts("abc"), tokenizer=tokenizer, template=template, data_args=data_args(cutoff_len=1))
