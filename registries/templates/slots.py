"""Slots: the pieces a chat template is written in.

A slot is plain text (which may hold ``{{content}}`` style placeholders), a special token that
the tokenizer defines (``BOS`` / ``EOS``, resolved per tokenizer because families differ), or a
named token looked up by its string (e.g. ``NamedToken("<|im_start|>")``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class SpecialToken:
    """The tokenizer's own bos/eos token, whatever its text is for this family."""

    attr: str  # "bos_token" or "eos_token"


@dataclass(frozen=True)
class NamedToken:
    """One token given by its string; encoded with ``convert_tokens_to_ids``."""

    text: str


BOS = SpecialToken("bos_token")
EOS = SpecialToken("eos_token")

Slot = Union[str, SpecialToken, NamedToken]


def fill(slots: list[Slot], **values: str) -> list[Slot]:
    """Replace ``{{name}}`` placeholders in the text slots with the given values.

    Values are substituted in one pass per slot so content that itself contains "{{content}}"
    is never expanded twice.
    """
    out: list[Slot] = []
    for slot in slots:
        if isinstance(slot, str) and "{{" in slot:
            out.append(_substitute(slot, values))
        else:
            out.append(slot)
    return out


def _substitute(text: str, values: dict[str, str]) -> str:
    pieces: list[str] = []
    i = 0
    while i < len(text):
        start = text.find("{{", i)
        if start == -1:
            pieces.append(text[i:])
            break
        end = text.find("}}", start)
        key = text[start + 2 : end] if end != -1 else None
        if key is not None and key in values:
            pieces.append(text[i:start])
            pieces.append(values[key])
            i = end + 2
        else:
            pieces.append(text[i : start + 2])
            i = start + 2
    return "".join(pieces)


def _special_token_text(tokenizer, slot: SpecialToken) -> str | None:
    token = getattr(tokenizer, slot.attr, None)
    return token if isinstance(token, str) else None


def slots_to_ids(tokenizer, slots: list[Slot]) -> list[int]:
    """Encode slots one by one, the way training sees them.

    Text is encoded without the tokenizer's automatic special tokens: templates place BOS/EOS
    explicitly so one code path serves every family.
    """
    ids: list[int] = []
    for slot in slots:
        if isinstance(slot, str):
            if slot:
                ids += tokenizer.encode(slot, add_special_tokens=False)
        elif isinstance(slot, SpecialToken):
            token_id = getattr(tokenizer, slot.attr + "_id", None)
            if token_id is not None:
                ids.append(token_id)
        elif isinstance(slot, NamedToken):
            token_id = tokenizer.convert_tokens_to_ids(slot.text)
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise ValueError(f"Token {slot.text!r} is not in the tokenizer's vocabulary.")
            ids.append(token_id)
        else:
            raise TypeError(f"Unknown slot type {type(slot).__name__}: {slot!r}")
    return ids


def slots_to_text(tokenizer, slots: list[Slot]) -> str:
    """Render slots as text (for diffs, Jinja export and human inspection)."""
    parts: list[str] = []
    for slot in slots:
        if isinstance(slot, str):
            parts.append(slot)
        elif isinstance(slot, SpecialToken):
            parts.append(_special_token_text(tokenizer, slot) or "")
        else:
            parts.append(slot.text)
    return "".join(parts)
