import pytest

from registries.tokenize import infer_seqlen


@pytest.mark.parametrize(
    "source, target, cutoff, expected",
    [
        # short response (2 * 10 < 50): kept whole, the prompt gets the rest
        (100, 10, 50, (40, 10)),
        # short prompt (2 * 10 < 50): kept whole, the response gets the rest
        (10, 100, 50, (10, 40)),
        # both long: the response's share is 50 * 40 / 100 = 20
        (60, 40, 50, (30, 20)),
        # proportional share rounds down: 64 * 40 / 110 = 23.27 -> 23
        (70, 40, 64, (41, 23)),
        # "short" is strict: 2 * 25 == 50 is not short, so the split is proportional (50 * x / 125)
        (100, 25, 50, (40, 10)),
        (25, 100, 50, (10, 40)),
        # everything fits: nothing is cut
        (10, 10, 50, (10, 10)),
        # degenerate budgets
        (0, 0, 0, (0, 0)),
        (5, 3, 0, (0, 0)),
        (0, 7, 4, (0, 4)),
    ],
)
def test_infer_seqlen_branches(source, target, cutoff, expected):
    assert infer_seqlen(source, target, cutoff) == expected


def test_infer_seqlen_never_exceeds_budget_or_originals_and_keeps_what_fits():
    for cutoff in range(1, 24):
        for source in range(0, 30):
            for target in range(0, 30):
                new_source, new_target = infer_seqlen(source, target, cutoff)
                assert 0 <= new_source <= source and 0 <= new_target <= target
                assert new_source + new_target <= cutoff
                if source + target <= cutoff:
                    assert (new_source, new_target) == (source, target)
                else:  # a cut example uses the whole budget
                    assert new_source + new_target == cutoff
