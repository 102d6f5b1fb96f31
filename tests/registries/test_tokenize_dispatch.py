import pickle

import pytest
from test_tokenize_common import assistant, batch_of, chatml_setup, data_args, user

from registries import tokenize as tk
from registries.tokenize import get_preprocess_fn, resolve_packing


@pytest.mark.parametrize(
    "stage, options, function",
    [
        ("pt", {}, tk.preprocess_pretrain),
        ("sft", {}, tk.preprocess_supervised),
        ("sft", {"packing": True}, tk.preprocess_packed_supervised),
        ("sft", {"neat_packing": True}, tk.preprocess_packed_supervised),
        ("rm", {}, tk.preprocess_pairwise),
        ("dpo", {}, tk.preprocess_pairwise),
        ("kto", {}, tk.preprocess_feedback),
        ("ppo", {}, tk.preprocess_unsupervised),
        ("predict", {"packing": True}, tk.preprocess_unsupervised),
    ],
)
def test_each_stage_gets_its_function(stage, options, function):
    tokenizer, template = chatml_setup()
    assert get_preprocess_fn(stage, tokenizer, template, data_args(**options)).func is function


def test_packing_defaults_on_for_pt_only():
    assert resolve_packing("pt", data_args()) is True
    assert resolve_packing("pt", data_args(packing=False)) is False
    assert resolve_packing("sft", data_args()) is False
    assert resolve_packing("sft", data_args(neat_packing=True)) is True
    assert get_preprocess_fn("pt", *chatml_setup(), data_args(packing=False)).keywords["packing"] is False


def test_unknown_stage_lists_the_known_ones():
    expected = r"Unknown stage 'orpo' for tokenization; expected one of pt, sft, rm, dpo, kto, ppo, predict"
    with pytest.raises(ValueError, match=expected):
        get_preprocess_fn("orpo", *chatml_setup(), data_args())


def test_preprocess_fn_survives_pickling_like_ray_ships_it():
    fn = get_preprocess_fn("sft", *chatml_setup(), data_args(cutoff_len=64))
    batch = batch_of({"_prompt": [user("hi")], "_response": [assistant("yo")]})
    shipped = pickle.loads(pickle.dumps(fn))
    assert shipped(batch) == fn(batch) and len(fn(batch)["input_ids"][0]) == 25
