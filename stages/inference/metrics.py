"""LLaMA-Factory's predict metrics (train/sft/metric.py ``ComputeSimilarity``), without its packages.

Per (prediction, label) pair, each score x100 and rounded to 4 decimals; a run reports the mean:

- ``bleu-4``: nltk ``sentence_bleu([list(label)], list(pred), smoothing_function=method3)``:
  *characters* as tokens, uniform weights over 1- to 4-grams, clipped n-gram counts, NIST
  geometric smoothing (the k-th order with no match gets precision 1 / (2^k * its n-gram
  count), k = 1, 2, ...), nltk's brevity penalty; 0 when not even one character matches.
- ``rouge-1``, ``rouge-2``, ``rouge-l``: rouge_chinese's ``Rouge().get_scores`` f-scores on the
  words of ``jieba.cut`` joined by spaces (0 when either side has no word). rouge_chinese counts
  *distinct* n-grams (sets) for ROUGE-N and takes the LCS of all words for ROUGE-L (summary level,
  sentences chained); both use F = 2PR / (P + R + 1e-8).

The one approximation: jieba is replaced by a rule-based segmenter. For ASCII text it follows
jieba's fallback path, which is what jieba does with text its dictionary has no words for: runs of
letters and digits are words (a decimal part "3.14" and a trailing "%" stay attached), runs of
``+#&._%-`` are one token, every other non-space character is a token by itself, whitespace is
dropped. Chinese (any other script) is cut into single characters, where jieba would find
dictionary words: CJK scores differ from LLaMA-Factory's, ASCII scores match.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Iterable, Sequence

SCORE_KEYS = ("bleu-4", "rouge-1", "rouge-2", "rouge-l")

_WORD = re.compile(r"[A-Za-z0-9]+(?:\.[0-9]+)?%?|[+#&._%\-]+|\S")


def segment(text: str) -> list[str]:
    """Words of ``text`` as jieba's ``cut`` gives them for ASCII text (see the module docstring)."""
    return _WORD.findall(text)


# --- BLEU-4 (nltk sentence_bleu, one reference, method3 smoothing) ------------------------------


def _ngrams(tokens: Sequence, n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def sentence_bleu4(reference: Sequence, hypothesis: Sequence) -> float:
    """nltk's ``sentence_bleu([reference], hypothesis, smoothing_function=SmoothingFunction().method3)``."""
    matches, totals = [], []
    for n in range(1, 5):
        counts, ref_counts = _ngrams(hypothesis, n), _ngrams(reference, n)
        matches.append(sum(min(c, ref_counts[gram]) for gram, c in counts.items()))
        totals.append(max(1, sum(counts.values())))  # nltk: at least 1, for orders longer than the text
    if matches[0] == 0:
        return 0.0
    precisions, k = [], 1
    for matched, total in zip(matches, totals):
        if matched == 0:  # method3: 1/2, 1/4, ... of one n-gram, for each order with no match
            precisions.append(1 / (2**k * total))
            k += 1
        else:
            precisions.append(matched / total)
    hyp_len, ref_len = len(hypothesis), len(reference)
    penalty = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return penalty * math.exp(math.fsum(0.25 * math.log(p) for p in precisions))


# --- ROUGE (rouge_chinese, default settings) ------------------------------------------------------

_SENTENCE_ENDS = (
    (re.compile("([。！？\\?])([^”’])"), r"\1\n\2"),
    (re.compile("(\\.{6})([^”’])"), r"\1\n\2"),
    (re.compile("(\\…{2})([^”’])"), r"\1\n\2"),
    (re.compile("([。！？\\?][”’])([^，。！？\\?])"), r"\1\n\2"),
)


def _rouge_words(joined: str) -> list[str]:
    """rouge_chinese's words of a space-joined text: cut into sentences, then chained again (the
    cut can only split a token such as "......." that holds a sentence end)."""
    for pattern, repl in _SENTENCE_ENDS:
        joined = pattern.sub(repl, joined)
    sentences = [" ".join(s.split()) for s in joined.rstrip().split("\n") if len(s) > 0]
    return [word for sentence in sentences for word in sentence.split(" ")]


def _f1(overlap: int, hyp_count: int, ref_count: int) -> float:
    precision = overlap / hyp_count if hyp_count else 0.0
    recall = overlap / ref_count if ref_count else 0.0
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


def _lcs_length(a: Sequence, b: Sequence) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        previous_diagonal = 0
        for j, y in enumerate(b, start=1):
            previous_diagonal, row[j] = row[j], previous_diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_f(hyp_words: Sequence[str], ref_words: Sequence[str]) -> dict[str, float]:
    """rouge-1, rouge-2 (distinct n-grams) and rouge-l (LCS) f-scores, as rouge_chinese's get_scores."""
    hyp, ref = _rouge_words(" ".join(hyp_words)), _rouge_words(" ".join(ref_words))
    scores = {}
    for n in (1, 2):
        hyp_grams, ref_grams = set(_ngrams(hyp, n)), set(_ngrams(ref, n))
        scores[f"rouge-{n}"] = _f1(len(hyp_grams & ref_grams), len(hyp_grams), len(ref_grams))
    scores["rouge-l"] = _f1(_lcs_length(ref, hyp), len(hyp), len(ref))
    return scores


# --- per pair and per run -------------------------------------------------------------------------


def similarity_scores(pred: str, label: str) -> dict[str, float]:
    """One pair's four scores, x100 and rounded to 4 decimals (LLaMA-Factory's ComputeSimilarity)."""
    hypothesis, reference = segment(pred), segment(label)
    if not hypothesis or not reference:
        rouge = {"rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0}
    else:
        rouge = rouge_f(hypothesis, reference)
    scores = {key: round(value * 100, 4) for key, value in rouge.items()}
    scores["bleu-4"] = round(sentence_bleu4(list(label), list(pred)) * 100, 4)
    return scores


def mean_scores(pairs: Iterable[tuple[str, str]], prefix: str = "predict_") -> dict[str, float]:
    """``{prefix}bleu-4``, ... : the mean of each score over (prediction, label) pairs."""
    columns: dict[str, list[float]] = {key: [] for key in SCORE_KEYS}
    for pred, label in pairs:
        for key, value in similarity_scores(pred, label).items():
            columns[key].append(value)
    return {f"{prefix}{key}": (sum(v) / len(v) if v else 0.0) for key, v in columns.items()}
