"""How a prompt and a response share a length budget when they do not both fit."""

from __future__ import annotations


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """Split ``cutoff_len`` tokens between a prompt (source) and a response (target).

    The rule is LLaMA-Factory's, so truncated examples match what its users expect:

    * a response shorter than half the budget is kept whole; the prompt gets the rest;
    * else a prompt shorter than half the budget is kept whole; the response gets the rest;
    * else both are cut in proportion to their lengths (response share rounded down).

    Returns the lengths to keep, ``(new_source_len, new_target_len)``; neither exceeds the
    original and their sum never exceeds ``cutoff_len`` (for ``cutoff_len >= 0``).
    """
    if source_len + target_len == 0:
        return 0, 0
    if target_len * 2 < cutoff_len:
        target_budget = cutoff_len
    elif source_len * 2 < cutoff_len:
        target_budget = cutoff_len - source_len
    else:
        target_budget = int(cutoff_len * (target_len / (source_len + target_len)))

    new_target_len = min(target_budget, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len
