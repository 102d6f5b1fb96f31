"""LLaMA-Factory's predict metrics (BLEU-4 with nltk's method3, rouge_chinese's ROUGE), on pairs
worked out by hand below. No Ray, no model."""

from __future__ import annotations

import math

import pytest

from stages.inference.metrics import mean_scores, segment, sentence_bleu4, similarity_scores


def test_segment_follows_jieba_on_ascii_and_cuts_cjk_into_characters():
    # letters+digits runs; "3.14" and "50%" stay whole; "-" between words and a "--" run are tokens;
    # other punctuation one character each; whitespace dropped.
    assert segment("Hello, world! 3.14 is 50% of a-b --x") == [
        "Hello", ",", "world", "!", "3.14", "is", "50%", "of", "a", "-", "b", "--", "x"
    ]
    assert segment("你好ab，再见") == ["你", "好", "ab", "，", "再", "见"]
    assert segment("  \n\t") == []


def test_identical_strings_score_100():
    # Every precision and recall is 1: ROUGE f = 2*1*1/(1+1+1e-8) = 0.999999995 -> x100 -> 100.0 after
    # rounding to 4 decimals; BLEU: every n-gram precision 1, equal lengths -> penalty 1 -> 100.
    assert similarity_scores("the cat sat", "the cat sat") == {
        "rouge-1": 100.0, "rouge-2": 100.0, "rouge-l": 100.0, "bleu-4": 100.0
    }


def test_disjoint_strings_score_0():
    # No word and no character in common.
    assert similarity_scores("abc", "xyz") == {"rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0, "bleu-4": 0.0}


def test_empty_prediction_scores_0():
    # LLaMA-Factory: no word on either side -> ROUGE 0; nltk: no unigram match -> BLEU 0.
    zeros = {"rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0, "bleu-4": 0.0}
    assert similarity_scores("", "the cat") == zeros
    assert similarity_scores("   ", "the cat")["rouge-1"] == 0.0
    assert similarity_scores("the cat", "") == zeros


def test_partial_overlap_exact_values():
    scores = similarity_scores("the cat sat", "the cat ran")
    # words [the cat sat] vs [the cat ran]
    # rouge-1: 2 of 3 distinct words shared: p = r = 2/3, f = 2*(4/9)/(4/3 + 1e-8) = 0.66666666(1) -> 66.6667
    assert scores["rouge-1"] == 66.6667
    # rouge-2: bigrams {the cat, cat sat} vs {the cat, cat ran}: p = r = 1/2, f = 0.5/(1+1e-8) -> 50.0
    assert scores["rouge-2"] == 50.0
    # rouge-l: LCS "the cat" = 2 words: p = r = 2/3 -> 66.6667
    assert scores["rouge-l"] == 66.6667
    # bleu-4 over characters, both 11 long (penalty exp(0) = 1):
    #   1-grams: pred t3 h1 e1 ' '2 c1 a2 s1, label t2 h1 e1 ' '2 c1 a2 r1 n1 -> clipped 2+1+1+2+1+2+0 = 9 of 11
    #   2-grams: th he 'e ' ' c' ca at at 't ' ' s' sa; label has 'at' once -> 7 of 10
    #   3-grams: the 'he ' 'e c' ' ca' cat 'at ' match, 't s' ' sa' sat do not -> 6 of 9
    #   4-grams: 'the ' 'he c' 'e ca' ' cat' 'cat ' match, 'at s' 't sa' ' sat' do not -> 5 of 8
    expected = (9 / 11 * 7 / 10 * 6 / 9 * 5 / 8) ** 0.25  # = (1890/7920)^(1/4) = 0.698931...
    assert scores["bleu-4"] == round(expected * 100, 4) == 69.8931


def test_rouge_counts_distinct_ngrams_and_lcs_over_all_words():
    scores = similarity_scores("a a a b", "a b")
    # rouge-1 on sets: {a, b} vs {a, b} -> p = r = 1 -> 100
    assert scores["rouge-1"] == 100.0
    # rouge-2: {a a, a b} vs {a b}: p = 1/2, r = 1 -> f = 1/(1.5 + 1e-8) = 0.6666666622 -> 66.6667
    assert scores["rouge-2"] == 66.6667
    # rouge-l: LCS("a b", "a a a b") = 2: p = 2/4, r = 2/2 -> 66.6667
    assert scores["rouge-l"] == 66.6667


def test_bleu_smooths_missing_higher_orders_nist_style():
    # "ab" vs "ab": p1 = 2/2, p2 = 1/1; no 3- or 4-gram at all (0 of max(1, 0) = 1):
    # method3 gives the first order without a match 1/(2^1 * 1), the next 1/(2^2 * 1)
    # -> (1 * 1 * 1/2 * 1/4)^(1/4) = 2^(-3/4) = 0.594604 (an exact short reply is not 100)
    assert sentence_bleu4(list("ab"), list("ab")) == pytest.approx(2 ** -0.75, abs=1e-15)
    assert similarity_scores("ab", "ab")["bleu-4"] == 59.4604
    # "abab" vs "ab": p1 = 2/4 (a, b clipped to 1 each), p2 = 1/3 (ab clipped to 1, ba 0),
    # 3-grams aba bab: 0 of 2 -> 1/(2 * 2); 4-gram abab: 0 of 1 -> 1/(4 * 1); longer than the label -> penalty 1
    assert sentence_bleu4(list("ab"), list("abab")) == pytest.approx((1 / 2 * 1 / 3 * 1 / 4 * 1 / 4) ** 0.25, abs=1e-15)
    # "abcx" vs "abcde": p1 = 3/4, p2 = 2/3 (ab bc), p3 = 1/2 (abc), 4-gram abcx: 0 of 1 -> 1/2;
    # shorter than the label: penalty exp(1 - 5/4)
    expected = math.exp(-0.25) * (3 / 4 * 2 / 3 * 1 / 2 * 1 / 2) ** 0.25
    assert sentence_bleu4(list("abcde"), list("abcx")) == pytest.approx(expected, abs=1e-15)
    assert similarity_scores("abcx", "abcde")["bleu-4"] == round(expected * 100, 4) == 46.3078


def test_mean_scores_averages_the_rounded_pair_scores():
    # pair 1 scores 100 everywhere, pair 2 scores 0 everywhere -> 50 each
    means = mean_scores([("the cat sat", "the cat sat"), ("abc", "xyz")])
    assert means == {"predict_bleu-4": 50.0, "predict_rouge-1": 50.0, "predict_rouge-2": 50.0, "predict_rouge-l": 50.0}
    # ("ab","ab") gives bleu 59.4604; with ("abc","xyz") at 0 the mean is 29.7302
    assert mean_scores([("ab", "ab"), ("abc", "xyz")], prefix="")["bleu-4"] == pytest.approx(29.7302)
