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
from registries.tokenize import preprocess_unsupervised


def run(*rows, setup=chatml_setup, **args):
    tokenizer, template = setup()
    out = preprocess_unsupervised(batch_of(*rows), tokenizer=tokenizer, template=template, data_args=data_args(**args))
    assert out["attention_mask"] == [[1] * len(ids) for ids in out["input_ids"]]
    return out


def test_prompt_ends_with_the_generation_prompt_and_labels_hold_the_reference():
    out = run(
        {"_prompt": [user("hi")], "_response": [assistant("yo")]},
        {"_prompt": [user("a"), assistant("b"), user("c")], "_response": []},
        {"_prompt": [user("pick")], "_response": [assistant("good"), assistant("bad")]},
    )
    assert out["input_ids"] == [
        chatml_user("hi"),
        chatml_user("a") + chatml_reply("b") + chatml_user("c"),
        chatml_user("pick"),
    ]
    assert out["labels"] == [chatml_reply("yo"), [], []]


def test_prompt_and_reference_share_the_budget():
    out = run({"_prompt": [user("x" * 40)], "_response": [assistant("ok")]}, cutoff_len=30)
    assert out["input_ids"] == [chatml_user("x" * 40)[:26]]
    assert out["labels"] == [chatml_reply("ok")]


def test_efficient_eos_reference_ends_with_eos():
    def setup():
        return chatml_setup(efficient_eos=True, format_assistant=StringFormatter(("{{content}}",)))

    out = run({"_prompt": [user("hi")], "_response": [assistant("yo")]}, setup=setup)
    assert out["input_ids"] == [chatml_user("hi")] and out["labels"] == [b("yo") + [IM_END]]


def test_the_row_travels_as_text_for_environments_and_reward_functions():
    import json

    out = run(
        {"_prompt": [user("a"), assistant("b"), user("c")], "_response": [assistant("d")], "_system": "S",
         "_tools": '[{"name": "add"}]', "_extra": '{"level": 3}'},
        {"_prompt": [user("hi")], "_response": []},
    )
    assert [json.loads(m) for m in out["messages"]] == [[user("a"), assistant("b"), user("c")], [user("hi")]]
    assert out["system"] == ["S", ""] and out["tools"] == ['[{"name": "add"}]', ""]
    assert [json.loads(c) for c in out["columns"]] == [{"level": 3}, {}]
