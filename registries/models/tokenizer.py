"""Byte-level BPE tokenizers trained on the spot, and loading any tokenizer folder correctly.

The tiny tokenizers use Qwen2's pre-tokenization (NFC, its split regex, byte-level without
prefix space) for every family. That choice has two reasons: digits are isolated, so numbers
are spelled digit by digit, and it is exactly the pipeline transformers 5 forces on a folder
whose config says qwen2, so even code that calls ``AutoTokenizer`` directly (vLLM, TRL) gets
the same ids for a tiny Qwen2 model. Other families are not that lucky (phi3 is swapped to a
SentencePiece-style class), hence ``load_tokenizer``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from .families import ModelFamily

# Written into tokenizer_config.json of every tokenizer we train. transformers keeps unknown
# keys there as init kwargs and writes them back on save_pretrained, so a checkpoint trained
# from a tiny model still carries it.
TINY_MARKER = "rayfactory_tiny"

# Qwen2's split pattern (contractions, letter runs, single digits, punctuation, whitespace).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(family: ModelFamily, corpus: Iterable[str], vocab_size: int, max_length: int):
    """A PreTrainedTokenizerFast for ``family`` with a BPE vocabulary learned from ``corpus``.

    The family's special tokens get the first ids (in ``family.special_tokens`` order), so
    token ids do not depend on what the corpus happens to contain.
    """
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in family.special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    if family.plain_tokens:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain_tokens])
    if family.add_bos:
        bos = family.bos_token
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=family.bos_token,
        eos_token=family.eos_token,
        pad_token=family.pad_token,
        unk_token=family.unk_token,
        model_max_length=max_length,
    )
    tokenizer.init_kwargs[TINY_MARKER] = family.name
    return tokenizer


def is_tiny_tokenizer(path: str | os.PathLike) -> bool:
    """True for a folder whose tokenizer RayFactory trained (a tiny model or its checkpoints)."""
    config_file = Path(path) / "tokenizer_config.json"
    if not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and TINY_MARKER in config


def load_tokenizer(path: str | os.PathLike, **kwargs):
    """Load the tokenizer of a model folder or hub id, the right way for each.

    A tokenizer we trained is loaded as saved (``PreTrainedTokenizerFast``): ``AutoTokenizer``
    would replace its pipeline with the architecture's own for some model types. Everything
    else (real checkpoints, local or on a hub) goes through ``AutoTokenizer`` as usual.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if is_tiny_tokenizer(path):
        return PreTrainedTokenizerFast.from_pretrained(str(path), **kwargs)
    return AutoTokenizer.from_pretrained(str(path), **kwargs)
