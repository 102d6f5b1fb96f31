from collections import Counter

from test_tokenize_common import (
    IM_END,
    assistant,
    b,
    batch_of,
    chatml_reply,
    chatml_setup,
    chatml_user,
    data_args,
    user,
)

from registries.templates.formatters import StringFormatter
from registries.tokenize import IGNORE_INDEX, preprocess_pairwise

M = IGNORE_INDEX


def pair(prompt, chosen, rejected):
    return {"_prompt": [user(prompt)], "_response": [assistant(chosen), assistant(rejected)]}


def run(tokenizer, template, *rows, stats=None, **args):
    out = preprocess_pairwise(
        batch_of(*rows), tokenizer=tokenizer, template=template, data_args=data_args(**args), stats=stats
    )
    for side in ("chosen", "rejected"):
        ids, mask, labels = out[f"{side}_input_ids"], out[f"{side}_attention_mask"], out[f"{side}_labels"]
        assert [len(x) for x in ids] == [len(x) for x in labels] == [len(x) for x in mask]
        assert all(set(x) == {1} for x in mask)
    return out


def test_pairwise_shares_the_prompt_and_trains_only_the_responses():
    tokenizer, template = chatml_setup()
    out = run(tokenizer, template, pair("hi", "good", "bad!!"))
    prompt = chatml_user("hi")
    assert out["chosen_input_ids"] == [prompt + chatml_reply("good")]
    assert out["chosen_labels"] == [[M] * 21 + chatml_reply("good")]
    assert out["rejected_input_ids"] == [prompt + chatml_reply("bad!!")]
    assert out["rejected_labels"] == [[M] * 21 + chatml_reply("bad!!")]


def test_pairwise_truncation_budgets_for_the_longer_response_and_cuts_both_alike():
    tokenizer, template = chatml_setup()
    out = run(tokenizer, template, pair("hi", "y" * 20, "n" * 5), cutoff_len=30)
    # prompt 21, longer response 22: neither short -> response share int(30 * 22 / 43) = 15
    prompt = chatml_user("hi")[:15]
    assert out["chosen_input_ids"] == [prompt + b("y" * 15)]
    assert out["chosen_labels"] == [[M] * 15 + b("y" * 15)]
    assert out["rejected_input_ids"] == [prompt + chatml_reply("n" * 5)]  # 7 ids, under the 15 cap
    assert out["rejected_labels"] == [[M] * 15 + chatml_reply("n" * 5)]


def test_pairwise_efficient_eos_ends_both_responses_with_eos():
    tokenizer, template = chatml_setup(efficient_eos=True, format_assistant=StringFormatter(("{{content}}",)))
    out = run(tokenizer, template, pair("hi", "a", "b"))
    assert out["chosen_input_ids"] == [chatml_user("hi") + b("a") + [IM_END]]
    assert out["rejected_labels"] == [[M] * 21 + b("b") + [IM_END]]


def test_rows_without_a_pair_are_skipped_and_counted():
    tokenizer, template = chatml_setup()
    stats = Counter()
    single = {"_prompt": [user("x")], "_response": [assistant("only one")]}
    out = run(tokenizer, template, single, pair("hi", "a", "b"), stats=stats)
    assert out["chosen_input_ids"] == [chatml_user("hi") + chatml_reply("a")]
    assert stats == {"skipped_not_a_pair": 1}
