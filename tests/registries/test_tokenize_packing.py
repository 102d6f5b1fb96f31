from collections import Counter

import pytest
from test_tokenize_common import assistant, batch_of, chatml_reply, chatml_setup, chatml_user, data_args, user

from registries.tokenize import IGNORE_INDEX, get_preprocess_fn, greedy_knapsack, pack_examples, resolve_packing

M = IGNORE_INDEX


def test_greedy_knapsack_takes_the_largest_item_that_still_fits():
    # sorted: 2(i3) 3(i1) 5(i0) 7(i4) 8(i2); bin 1: 8 then 2; bin 2: 7 then 3; bin 3: 5
    assert greedy_knapsack([5, 3, 8, 2, 7], 10) == [[2, 3], [4, 1], [0]]
    assert greedy_knapsack([4, 4, 4], 8) == [[2, 1], [0]]  # equal lengths: the later index first
    assert greedy_knapsack([], 8) == []


def test_greedy_knapsack_rejects_items_longer_than_capacity():
    with pytest.raises(ValueError, match=r"Items \[1\] are longer than the capacity 4; drop them before packing"):
        greedy_knapsack([3, 5], 4)


def test_pack_examples_masks_each_examples_first_label_and_numbers_examples_when_neat():
    a = ([1, 2, 3], [1, 2, 3])  # labels as with train_on_prompt
    c = ([7, 8], [M, 8])
    d = ([9, 9, 9, 9], [M, M, 9, 9])
    plain = pack_examples([a, c, d], cutoff_len=6)
    # lengths 3, 2, 4: bin 1 = d (4) + c (2); bin 2 = a
    assert plain["input_ids"] == [[9, 9, 9, 9, 7, 8], [1, 2, 3]]
    assert plain["labels"] == [[M, M, 9, 9, M, 8], [M, 2, 3]]
    assert plain["attention_mask"] == [[1] * 6, [1] * 3]
    neat = pack_examples([a, c, d], cutoff_len=6, neat_packing=True)
    assert neat["input_ids"] == plain["input_ids"] and neat["labels"] == plain["labels"]
    assert neat["attention_mask"] == [[1, 1, 1, 1, 2, 2], [1, 1, 1]]


def conversation(prompt, reply):
    return {"_prompt": [user(prompt)], "_response": [assistant(reply)]}


def test_sft_packing_packs_whole_conversations_within_cutoff():
    tokenizer, template = chatml_setup()
    rows = [conversation("a", "b"), conversation("hi", "yo"), conversation("xyz", "w")]
    rows.append({"_prompt": [user("p")], "_response": []})
    stats = Counter()
    fn = get_preprocess_fn("supervised", tokenizer, template, data_args(cutoff_len=50, train_on_prompt=True), packing=True)
    out = fn.func(batch_of(*rows), stats=stats, **fn.keywords)
    first, second, third = (chatml_user(p) + chatml_reply(r) for p, r in [("a", "b"), ("hi", "yo"), ("xyz", "w")])
    # lengths 23, 25, 25 -> bins [third, second] (50 tokens) and [first]
    assert out["input_ids"] == [third + second, first]
    assert out["labels"] == [[M] + third[1:] + [M] + second[1:], [M] + first[1:]]
    assert out["attention_mask"] == [[1] * 50, [1] * 23]
    assert stats == {"skipped_no_response": 1}


def test_sft_neat_packing_numbers_the_conversations():
    tokenizer, template = chatml_setup()
    rows = [conversation("a", "b"), conversation("hi", "yo"), conversation("xyz", "w")]
    args = data_args(cutoff_len=50, neat_packing=True)
    out = get_preprocess_fn("supervised", tokenizer, template, args, packing=resolve_packing(args, False))(batch_of(*rows))
    assert out["attention_mask"] == [[1] * 25 + [2] * 25, [1] * 23]
    second_labels = [M] * 21 + chatml_reply("yo")
    assert out["labels"][0][25:] == second_labels  # prompt labels are masked anyway
