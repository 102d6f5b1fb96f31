import pickle

import pytest
from test_tokenize_common import assistant, batch_of, chatml_setup, data_args, user

from registries import tokenize as tk
from registries.tokenize import get_preprocess_fn, resolve_packing


@pytest.mark.parametrize(
    "kind, packing, function",
    [
        ("pretrain", False, tk.preprocess_pretrain),
        ("supervised", False, tk.preprocess_supervised),
        ("supervised", True, tk.preprocess_packed_supervised),
        ("pairwise", False, tk.preprocess_pairwise),
        ("feedback", False, tk.preprocess_feedback),
        ("unsupervised", False, tk.preprocess_unsupervised),
        ("unsupervised", True, tk.preprocess_unsupervised),  # prompts are never packed
    ],
)
def test_each_kind_gets_its_function(kind, packing, function):
    tokenizer, template = chatml_setup()
    assert get_preprocess_fn(kind, tokenizer, template, data_args(), packing).func is function


def test_packing_null_takes_the_default_and_neat_packing_implies_it():
    assert resolve_packing(data_args(), default=True) is True
    assert resolve_packing(data_args(packing=False), default=True) is False
    assert resolve_packing(data_args(), default=False) is False
    assert resolve_packing(data_args(neat_packing=True), default=False) is True
    assert get_preprocess_fn("pretrain", *chatml_setup(), data_args(), packing=False).keywords["packing"] is False


def test_unknown_kind_lists_the_known_ones():
    expected = r"Unknown tokenization kind 'orpo'; expected one of pretrain, supervised, pairwise, feedback, unsupervised"
    with pytest.raises(ValueError, match=expected):
        get_preprocess_fn("orpo", *chatml_setup(), data_args())


def test_preprocess_fn_survives_pickling_like_ray_ships_it():
    fn = get_preprocess_fn("supervised", *chatml_setup(), data_args(cutoff_len=64))
    batch = batch_of({"_prompt": [user("hi")], "_response": [assistant("yo")]})
    shipped = pickle.loads(pickle.dumps(fn))
    assert shipped(batch) == fn(batch) and len(fn(batch)["input_ids"][0]) == 25
