"""Slots: the pieces a chat template is written in.

A slot is plain text (which may hold ``{{content}}`` style placeholders), a special token that
the tokenizer defines (``BOS`` / ``EOS``, resolved per tokenizer because families differ), or a
named token looked up by its string (e.g. ``NamedToken("<|im_start|>")``).

Text a caller wrote (a user's or a tool's message, when the template escapes it) is carried as
``CallerText``: a string that knows which of its characters came from the caller, so that a
special token spelled there is encoded as plain text while the template's own markers around it
stay special tokens.
"""

from __future__ import annotations

import re
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


class CallerText(str):
    """Text whose ``spans`` ((start, end) pairs) were written by a caller, not by the template."""

    spans: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, spans=None):
        obj = super().__new__(cls, text)
        obj.spans = tuple(spans) if spans is not None else (((0, len(text)),) if text else ())
        return obj


def join_text(*parts: str) -> str:
    """Concatenate strings, keeping the caller spans of any ``CallerText`` among them."""
    spans, offset = [], 0
    for part in parts:
        spans += [(offset + a, offset + b) for a, b in getattr(part, "spans", ())]
        offset += len(part)
    text = "".join(parts)
    return CallerText(text, spans) if spans else text


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
    pieces: list[str] = []  # joined by join_text, so caller spans in the values survive
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
    return join_text(*pieces)


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
                ids += _encode_text(tokenizer, slot)
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


def _encode_text(tokenizer, text: str) -> list[int]:
    """``text`` as the tokenizer encodes it; where a caller's span spells a special token, that
    spelling is encoded as plain text and only the template's own special tokens stay special."""
    spans = getattr(text, "spans", ())
    specials = _specials(tokenizer) if spans else None
    if specials is None or not _caller_spells_special(text, spans, *specials):
        return tokenizer.encode(text, add_special_tokens=False)  # the common case: exactly as training encodes
    ids: list[int] = []
    done = 0
    for match in specials[0].finditer(text):  # leftmost-longest, as the tokenizer's own split finds them
        if _overlaps(match, spans):
            continue  # the caller wrote (part of) it: it stays text
        ids += _encode_plain(tokenizer, text[done : match.start()])
        ids.append(tokenizer.convert_tokens_to_ids(match.group()))
        done = match.end()
    return ids + _encode_plain(tokenizer, text[done:])


def _caller_spells_special(text: str, spans, pattern: re.Pattern, longest: int) -> bool:
    """Whether a special token lies in a caller's span, or across its edge with the template's text."""
    for a, b in spans:
        window = (max(0, a - longest + 1), min(len(text), b + longest - 1))
        if any(_overlaps(m, spans) for m in pattern.finditer(text, *window)):
            return True
    return False


def _overlaps(match: re.Match, spans) -> bool:
    return any(match.start() < b and a < match.end() for a, b in spans)


def _encode_plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []


def _specials(tokenizer) -> tuple[re.Pattern, int] | None:
    """(a regex of the tokenizer's special tokens, longest first; the longest's length), cached on
    the tokenizer for as long as its special tokens stay the same."""
    names = sorted({str(t) for t in tokenizer.all_special_tokens}
                   | {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special},
                   key=len, reverse=True)
    names = tuple(n for n in names if n)
    cached = getattr(tokenizer, "_rayfactory_specials", None)
    if cached is None or cached[0] != names:
        compiled = (re.compile("|".join(map(re.escape, names))), len(names[0])) if names else None
        cached = (names, compiled)
        tokenizer._rayfactory_specials = cached
    return cached[1]


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
