"""Shared fixtures for the tokenization tests, plus checks that the fixtures are what the other
tests assume.

The tokenizer is byte-level BPE with no merges: every UTF-8 byte is one token whose id is the
byte's value, and the special tokens follow at 256+. Expected ids can then be written from the
text alone (``b("hi") == [104, 105]``), independently of the code under test.
"""

from __future__ import annotations

from dataclasses import replace

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from registries.datasets.data_args import DataArguments
from registries.templates import get_template

BOS, EOS, IM_START, IM_END = 256, 257, 258, 259  # ids before any template adjusts the tokenizer


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return chars


def byte_tokenizer(add_bos_token: bool = False) -> PreTrainedTokenizerFast:
    vocab = {char: byte for byte, char in _byte_chars().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        add_bos_token=add_bos_token,
    )


def b(text: str) -> list[int]:
    """Expected ids of plain text under the byte tokenizer."""
    return list(text.encode("utf-8"))


def chatml_setup(**template_changes):
    """A fresh tokenizer fixed for chatml (eos and pad become <|im_end|>) and the template."""
    template = get_template("chatml")
    if template_changes:
        template = replace(template, **template_changes)
    tokenizer = byte_tokenizer()
    template.fix_tokenizer(tokenizer)
    return tokenizer, template


def default_setup():
    template = get_template("default")
    tokenizer = byte_tokenizer()
    template.fix_tokenizer(tokenizer)
    return tokenizer, template


def data_args(**changes) -> DataArguments:
    return DataArguments(**changes)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def batch_of(*rows: dict) -> dict[str, list]:
    """Aligned rows (dicts with _prompt/_response and optional _system/_tools/_kto_tag/_extra) -> columns."""
    columns = ("_prompt", "_response", "_system", "_tools", "_kto_tag", "_extra")
    defaults = {"_system": "", "_tools": "", "_kto_tag": None, "_extra": "{}"}
    return {c: [row.get(c, defaults.get(c)) for row in rows] for c in columns}


# chatml pieces, as ids
def chatml_user(text: str) -> list[int]:
    return [IM_START] + b(f"user\n{text}") + [IM_END] + b("\n") + [IM_START] + b("assistant\n")


def chatml_reply(text: str) -> list[int]:
    return b(text) + [IM_END] + b("\n")


# ---------------------------------------------------------------- the fixtures themselves


def test_byte_tokenizer_maps_bytes_to_ids_and_keeps_specials_whole():
    tokenizer = byte_tokenizer()
    assert tokenizer.encode("Hi wö", add_special_tokens=False) == [72, 105, 32, 119, 195, 182]
    assert tokenizer.encode("<|im_start|>x<|im_end|>", add_special_tokens=False) == [IM_START, 120, IM_END]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (BOS, EOS, None)


def test_chatml_setup_makes_im_end_the_eos_and_pad():
    tokenizer, template = chatml_setup()
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (IM_END, IM_END)
    prompt, response = template.encode_oneturn(tokenizer, [user("hi"), assistant("yo")])
    assert prompt == chatml_user("hi")
    assert response == chatml_reply("yo")


def test_default_setup_keeps_endoftext_as_eos():
    tokenizer, template = default_setup()
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (EOS, EOS)
    prompt, response = template.encode_oneturn(tokenizer, [user("hi"), assistant("yo")])
    assert prompt == b("Human: hi") + [EOS] + b("\nAssistant:")
    assert response == b("yo") + [EOS] + b("\n")
