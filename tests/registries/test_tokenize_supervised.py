import logging
from collections import Counter

import numpy as np
import pytest
from test_tokenize_common import (
    EOS,
    IM_END,
    IM_START,
    assistant,
    b,
    batch_of,
    chatml_reply,
    chatml_setup,
    chatml_user,
    data_args,
    default_setup,
    user,
)

from registries.templates.formatters import StringFormatter
from registries.tokenize import IGNORE_INDEX, preprocess_supervised

M = IGNORE_INDEX


def run(tokenizer, template, *rows, stats=None, **args):
    out = preprocess_supervised(
        batch_of(*rows), tokenizer=tokenizer, template=template, data_args=data_args(**args), stats=stats
    )
    assert all(len(m) == len(i) and set(m) == {1} for i, m in zip(out["input_ids"], out["attention_mask"]))
    assert all(len(labels) == len(ids) for ids, labels in zip(out["input_ids"], out["labels"]))
    return out


def conversation(*texts):
    """user, assistant, user, ... -> (prompt messages, [last assistant message])."""
    messages = [user(t) if i % 2 == 0 else assistant(t) for i, t in enumerate(texts)]
    return {"_prompt": messages[:-1], "_response": messages[-1:]}


# ---------------------------------------------------------------- layout and masks


def test_single_turn_chatml_masks_the_prompt():
    tokenizer, template = chatml_setup()
    out = run(tokenizer, template, conversation("hi", "yo"))
    assert out["input_ids"] == [chatml_user("hi") + chatml_reply("yo")]
    assert out["labels"] == [[M] * 21 + b("yo") + [IM_END] + b("\n")]


def test_single_turn_default_template():
    tokenizer, template = default_setup()
    out = run(tokenizer, template, conversation("hi", "yo"))
    prompt = b("Human: hi") + [EOS] + b("\nAssistant:")
    assert out["input_ids"] == [prompt + b("yo") + [EOS] + b("\n")]
    assert out["labels"] == [[M] * len(prompt) + b("yo") + [EOS] + b("\n")]


def test_multi_turn_trains_every_reply_and_system_goes_first():
    tokenizer, template = chatml_setup()
    row = conversation("a", "b", "c", "d") | {"_system": "S"}
    out = run(tokenizer, template, row)
    system = [IM_START] + b("system\nS") + [IM_END] + b("\n")
    first, second = system + chatml_user("a"), chatml_user("c")
    assert out["input_ids"] == [first + chatml_reply("b") + second + chatml_reply("d")]
    assert out["labels"] == [[M] * len(first) + chatml_reply("b") + [M] * len(second) + chatml_reply("d")]


def test_train_on_prompt_labels_everything():
    tokenizer, template = chatml_setup()
    out = run(tokenizer, template, conversation("a", "b", "c", "d"), train_on_prompt=True)
    assert out["labels"] == out["input_ids"]


def test_mask_history_trains_only_the_last_reply_in_original_order():
    tokenizer, template = chatml_setup()
    out = run(tokenizer, template, conversation("a", "b", "c", "d"), mask_history=True)
    assert out["input_ids"] == [chatml_user("a") + chatml_reply("b") + chatml_user("c") + chatml_reply("d")]
    history = chatml_user("a") + chatml_reply("b") + chatml_user("c")
    assert out["labels"] == [[M] * len(history) + chatml_reply("d")]


def test_tool_call_and_observation_turns():
    tokenizer, template = chatml_setup()
    call = {"role": "function", "content": '{"name": "f", "arguments": {"x": 1}}'}
    row = {
        "_prompt": [user("q"), call, {"role": "observation", "content": "42"}],
        "_response": [assistant("ok")],
    }
    out = run(tokenizer, template, row)
    call_ids = b('Action: f\nAction Input: {"x": 1}') + [IM_END] + b("\n")
    observation = [IM_START] + b("tool\n42") + [IM_END] + b("\n") + [IM_START] + b("assistant\n")
    assert out["input_ids"] == [chatml_user("q") + call_ids + observation + chatml_reply("ok")]
    assert out["labels"] == [[M] * 20 + call_ids + [M] * len(observation) + chatml_reply("ok")]


# ---------------------------------------------------------------- truncation


def test_truncation_short_response_keeps_it_and_cuts_the_prompt():
    tokenizer, template = chatml_setup()
    long_prompt = chatml_user("x" * 40)  # 59 ids; reply 4 ids: 2 * 4 < 30
    out = run(tokenizer, template, conversation("x" * 40, "ok"), cutoff_len=30)
    assert out["input_ids"] == [long_prompt[:26] + chatml_reply("ok")]
    assert out["labels"] == [[M] * 26 + chatml_reply("ok")]


def test_truncation_short_prompt_keeps_it_and_cuts_the_response():
    tokenizer, template = chatml_setup()
    reply = chatml_reply("y" * 60)  # 62 ids; prompt 21 ids: 2 * 21 < 50
    out = run(tokenizer, template, conversation("hi", "y" * 60), cutoff_len=50)
    assert out["input_ids"] == [chatml_user("hi") + reply[:29]]
    assert out["labels"] == [[M] * 21 + b("y" * 29)]


def test_truncation_both_long_splits_in_proportion():
    tokenizer, template = chatml_setup()
    prompt, reply = chatml_user("x" * 40), chatml_reply("y" * 39)  # 59 and 41 ids
    out = run(tokenizer, template, conversation("x" * 40, "y" * 39), cutoff_len=50)
    # reply share: int(50 * 41 / 100) = 20
    assert out["input_ids"] == [prompt[:30] + reply[:20]]
    assert out["labels"] == [[M] * 30 + b("y" * 20)]


def test_truncation_is_turn_by_turn_and_drops_turns_past_the_budget():
    tokenizer, template = chatml_setup()
    row = conversation("a", "b", "c", "d", "e", "f")  # three turns of 20 + 3 ids
    out = run(tokenizer, template, row, cutoff_len=40)
    # turn 1 fits (23); turn 2 gets 17: reply 3 kept (2*3 < 17), prompt cut to 14; turn 3 gets nothing
    assert out["input_ids"] == [chatml_user("a") + chatml_reply("b") + chatml_user("c")[:14] + chatml_reply("d")]
    assert out["labels"] == [[M] * 20 + chatml_reply("b") + [M] * 14 + chatml_reply("d")]


def test_mask_history_truncation_keeps_the_last_turn_and_cuts_history():
    tokenizer, template = chatml_setup()
    row = conversation("a", "b", "c", "d")
    out = run(tokenizer, template, row, cutoff_len=28, mask_history=True)
    # the last turn (20 + 3 ids) is budgeted first; the first turn gets the 5 left: neither part
    # is short (2*3 >= 5, 2*20 >= 5), so the reply gets int(5 * 3 / 23) = 0 and the prompt 5
    assert out["input_ids"] == [chatml_user("a")[:5] + chatml_user("c") + chatml_reply("d")]
    assert out["labels"] == [[M] * 25 + chatml_reply("d")]
    # without mask_history the first turn is the one that survives whole
    plain = run(tokenizer, template, row, cutoff_len=28)
    assert plain["input_ids"] == [chatml_user("a") + chatml_reply("b") + chatml_user("c")[:5]]
    assert plain["labels"] == [[M] * 20 + chatml_reply("b") + [M] * 5]


# ---------------------------------------------------------------- efficient_eos


def efficient_chatml():
    """chatml without an end token in the reply: the eos comes once, at the very end."""
    return chatml_setup(efficient_eos=True, format_assistant=StringFormatter(("{{content}}",)))


def test_efficient_eos_appends_one_eos_and_labels_it_at_each_later_prompt():
    tokenizer, template = efficient_chatml()
    out = run(tokenizer, template, conversation("a", "b", "c", "d"))
    assert out["input_ids"] == [chatml_user("a") + b("b") + chatml_user("c") + b("d") + [IM_END]]
    assert out["labels"] == [[M] * 20 + b("b") + [IM_END] + [M] * 19 + b("d") + [IM_END]]


def test_efficient_eos_reserves_its_token_in_the_budget():
    tokenizer, template = efficient_chatml()
    out = run(tokenizer, template, conversation("x" * 40, "ok"), cutoff_len=30)
    # 29 left for the turn: reply 2 kept, prompt 27, then the eos
    assert out["input_ids"] == [chatml_user("x" * 40)[:27] + b("ok") + [IM_END]]
    assert out["labels"] == [[M] * 27 + b("ok") + [IM_END]]


def test_efficient_eos_with_mask_history_follows_llamafactory_label_rule():
    tokenizer, template = efficient_chatml()
    out = run(tokenizer, template, conversation("a", "b", "c", "d"), mask_history=True)
    # reversed order: the last turn is turn 0 (no eos label), the first turn gets the eos label
    # on its first prompt position (never a target: nothing precedes it)
    assert out["input_ids"] == [chatml_user("a") + b("b") + chatml_user("c") + b("d") + [IM_END]]
    assert out["labels"] == [[IM_END] + [M] * 19 + [M] + [M] * 20 + b("d") + [IM_END]]


# ---------------------------------------------------------------- skipped and bad rows


def test_rows_without_exactly_one_response_are_skipped_and_counted(caplog):
    tokenizer, template = chatml_setup()
    stats = Counter()
    rows = [
        conversation("hi", "yo"),
        {"_prompt": [user("only a prompt")], "_response": []},
        {"_prompt": [user("pick")], "_response": [assistant("good"), assistant("bad")]},
    ]
    with caplog.at_level(logging.WARNING, logger="registries.tokenize"):
        out = run(tokenizer, template, *rows, stats=stats)
    assert out["input_ids"] == [chatml_user("hi") + chatml_reply("yo")]
    assert stats == {"skipped_no_response": 1, "skipped_many_responses": 1}
    assert "sft: skipped 1 of 3 rows in this batch (row 1 of this batch): no response to train on" in caplog.text
    assert "(row 2 of this batch): more than one response (ranking data" in caplog.text


def test_bad_roles_raise_an_error_that_names_the_source_row():
    tokenizer, template = chatml_setup()
    batch = batch_of({"_prompt": [assistant("who speaks first?")], "_response": [assistant("x")]})
    batch |= {"_source_file": ["data/chat.json"], "_source_row": [np.int64(12)]}
    with pytest.raises(ValueError) as info:
        preprocess_supervised(batch, tokenizer=tokenizer, template=template, data_args=data_args())
    message = str(info.value)
    assert "Tokenizing for stage 'sft' failed on row 12 of data/chat.json" in message
    assert "first prompt message starts 'who speaks first?'" in message
    assert "Message 0 has role 'assistant'" in message
    assert "check that row in the dataset file" in message


def test_numpy_batches_from_ray_give_the_same_result():
    """Ray Data's numpy batches hold message lists as object arrays of dicts."""
    tokenizer, template = chatml_setup()
    rows = [conversation("a", "b", "c", "d") | {"_system": "S"}, {"_prompt": [user("p")], "_response": []}]
    plain = batch_of(*rows)
    as_numpy = {k: np.array([None] * len(v), dtype=object) for k, v in plain.items()}
    for k, v in plain.items():
        for i, cell in enumerate(v):
            as_numpy[k][i] = np.array(cell, dtype=object) if isinstance(cell, list) else cell
    kwargs = dict(tokenizer=tokenizer, template=template, data_args=data_args())
    assert preprocess_supervised(as_numpy, **kwargs) == preprocess_supervised(plain, **kwargs)
