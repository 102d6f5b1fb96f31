"""Pretraining (pt): plain text, each document followed by eos, trained on every token.

With packing (the default for pt) the batch's documents are concatenated and cut into blocks
of exactly ``cutoff_len`` tokens; the tail that does not fill a block is dropped, as in
LLaMA-Factory and Hugging Face's ``run_clm``. Without packing each document is one row,
truncated to ``cutoff_len``.

BOS: families whose tokenizer adds a bos token (``add_bos_token``, e.g. Llama, Gemma) expect
one at the start of every sequence. Each row or block therefore starts with bos. Deliberate
deviation: LLaMA-Factory overwrites the first token of each block with bos, losing one text
token per block; here bos is prepended and the block holds ``cutoff_len - 1`` text tokens.

``labels`` is a copy of ``input_ids`` so the same padding collator serves every stage.
"""

from __future__ import annotations

from typing import Any, MutableMapping

from .common import Batch, SkipCounter, logger, messages, num_rows

# Families whose chat eos is not the end-of-document token a base model was pretrained with.
DOCUMENT_EOS_BY_TEMPLATE = {"llama3": "<|end_of_text|>"}

NOT_TEXT = "not a single text message (pretraining rows need exactly one text, e.g. a `text` column)"
EMPTY_TEXT = "empty text"


def document_eos_id(tokenizer, template) -> int:
    token = DOCUMENT_EOS_BY_TEMPLATE.get(getattr(template, "name", None))
    if token is not None:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is not None and token_id != tokenizer.unk_token_id:
            return token_id
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "The tokenizer has no eos token, so pretraining documents cannot be separated. "
            "Call template.fix_tokenizer(tokenizer) first, or set eos_token in the tokenizer config."
        )
    return tokenizer.eos_token_id


def bos_id(tokenizer) -> int | None:
    """The bos id if this tokenizer adds one on its own, else None."""
    if getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_token_id is not None:
        return tokenizer.bos_token_id
    return None


def preprocess_pretrain(
    batch: Batch, *, tokenizer, template, data_args, packing: bool = True,
    stats: MutableMapping[str, int] | None = None,
) -> dict[str, list[Any]]:
    """Columns ``input_ids``, ``attention_mask``, ``labels``."""
    cutoff_len = data_args.cutoff_len
    eos, bos = document_eos_id(tokenizer, template), bos_id(tokenizer)
    head = [bos] if bos is not None else []
    if cutoff_len <= len(head):
        raise ValueError(f"cutoff_len={cutoff_len} leaves no room for text; set cutoff_len to at least 2.")

    skips = SkipCounter("pt")
    documents: list[list[int]] = []
    for row in range(num_rows(batch)):
        prompt = messages(batch, "_prompt", row)
        text = prompt[0].get("content") if len(prompt) == 1 else None
        if not isinstance(text, str):
            skips.skip(batch, row, "not_text", NOT_TEXT)
        elif not text:
            skips.skip(batch, row, "empty_text", EMPTY_TEXT)
        else:
            documents.append(tokenizer.encode(text, add_special_tokens=False) + [eos])
    skips.report(num_rows(batch), stats)

    if packing:
        rows = _blocks(documents, head, cutoff_len, stats)
    else:
        rows = [(head + doc)[:cutoff_len] for doc in documents]
    return {
        "input_ids": rows,
        "attention_mask": [[1] * len(ids) for ids in rows],
        "labels": [list(ids) for ids in rows],
    }


def _blocks(documents, head, cutoff_len, stats) -> list[list[int]]:
    stream = [token for doc in documents for token in doc]
    size = cutoff_len - len(head)
    full = len(stream) // size * size
    if len(stream) > full:
        logger.warning(
            "pt: dropped the last %d of %d tokens in this batch (they do not fill a block of "
            "cutoff_len=%d). Larger batches or a smaller cutoff_len lose less.",
            len(stream) - full, len(stream), cutoff_len,
        )
        if stats is not None:
            stats["dropped_tail_tokens"] = stats.get("dropped_tail_tokens", 0) + len(stream) - full
    return [head + stream[i : i + size] for i in range(0, full, size)]
