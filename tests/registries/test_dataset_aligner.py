"""The aligner: every format to the ALIGNED schema, and every bad row named by file, row and field."""

import json
import pickle

import pytest

from registries.datasets import (
    DatasetRowError,
    align_batch,
    align_rows,
    aligned_table,
    bad_rows_batch,
    get_dataset_attrs,
    read_rows,
)


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    return tmp_path / "data"


def align(data_dir, rows, entry=None, file_name="my.json", skip=False):
    """Write rows as ``data/<file_name>`` registered as dataset 'my', and align them."""
    (data_dir / file_name).write_text(json.dumps(rows), encoding="utf-8")
    (data_dir / "dataset_info.json").write_text(json.dumps({"my": {"file_name": file_name, **(entry or {})}}))
    [attr] = get_dataset_attrs(["my"], "data")
    return align_rows(read_rows(attr), attr, skip_bad_rows=skip)


def one(data_dir, row, entry=None):
    return strip_source(align(data_dir, [row], entry).examples[0])


def strip_source(example):
    return {k: v for k, v in example.items() if not k.startswith("_source")}


def error(data_dir, row, entry=None, position=2, good=None):
    """The DatasetRowError for ``row`` placed as row ``position`` after good filler rows
    (the format's plain good row, except for ranking and kto entries: then ``good`` or none)."""
    entry = entry or {}
    if good is None and not entry.get("ranking") and "kto_tag" not in entry.get("columns", {}):
        good = _GOOD[entry.get("formatting", "alpaca")]
    rows = [good] * (position - 1) + [row] if good else [row]
    with pytest.raises(DatasetRowError) as info:
        align(data_dir, rows, entry)
    return info.value


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


SHAREGPT = {"formatting": "sharegpt"}
OPENAI = {"formatting": "openai"}
_GOOD = {
    "alpaca": {"instruction": "q", "output": "a"},
    "sharegpt": {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    "openai": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
}
CALL = json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})
TOOLS = json.dumps([{"name": "add", "description": "sum", "parameters": {"type": "object", "properties": {}}}])


# ============================================================== alpaca
def test_alpaca_joins_instruction_and_input_with_newline(data_dir):
    ex = one(data_dir, {"instruction": "Translate", "input": "bonjour", "output": "hello", "system": "ignored"})
    assert ex == {"_prompt": [U("Translate\nbonjour")], "_response": [A("hello")], "_system": "", "_tools": "", "_kto_tag": None,
                  "_extra": '{"system": "ignored"}'}  # alpaca maps no system column by default: it is an extra


def test_alpaca_empty_or_missing_input_is_left_out(data_dir):
    assert one(data_dir, {"instruction": "hi", "input": "", "output": "yo"})["_prompt"] == [U("hi")]
    assert one(data_dir, {"instruction": "hi", "output": "yo"})["_prompt"] == [U("hi")]


def test_alpaca_history_system_and_tools(data_dir):
    entry = {"columns": {"prompt": "instruction", "response": "output", "history": "history", "system": "sys", "tools": "tools"}}
    row = {"instruction": "q3", "output": "a3", "history": [["q1", "a1"], ["q2", "a2"]], "sys": "Be brief.", "tools": TOOLS}
    ex = one(data_dir, row, entry)
    assert ex["_prompt"] == [U("q1"), A("a1"), U("q2"), A("a2"), U("q3")]
    assert ex["_response"] == [A("a3")]
    assert (ex["_system"], ex["_tools"]) == ("Be brief.", TOOLS)


def test_alpaca_tools_given_as_a_list_become_json_text(data_dir):
    tools = [{"name": "add"}]
    ex = one(data_dir, {"instruction": "q", "output": "a", "tools": tools}, {"columns": {"prompt": "instruction", "response": "output", "tools": "tools"}})
    assert ex["_tools"] == '[{"name": "add"}]'


def test_alpaca_without_output_is_prediction_only(data_dir):
    assert one(data_dir, {"instruction": "q"})["_response"] == []
    assert one(data_dir, {"instruction": "q", "output": None})["_response"] == []


def test_alpaca_pretraining_text_column(data_dir):
    ex = one(data_dir, {"text": "some document"}, {"columns": {"prompt": "text"}})
    assert ex == {"_prompt": [U("some document")], "_response": [], "_system": "", "_tools": "", "_kto_tag": None,
                  "_extra": "{}"}


def test_alpaca_columns_object_disables_unnamed_defaults(data_dir):
    # LLaMA-Factory semantics: with "columns", an unnamed "input" column is not read.
    ex = one(data_dir, {"q": "hi", "input": "extra", "a": "yo"}, {"columns": {"prompt": "q", "response": "a"}})
    assert ex["_prompt"] == [U("hi")]


def test_alpaca_ranking(data_dir):
    entry = {"ranking": True, "columns": {"prompt": "instruction", "query": "input", "chosen": "good", "rejected": "bad"}}
    ex = one(data_dir, {"instruction": "What is 1+1?", "input": "", "good": "2", "bad": "3"}, entry)
    assert ex["_prompt"] == [U("What is 1+1?")]
    assert ex["_response"] == [A("2"), A("3")]


def test_alpaca_kto(data_dir):
    entry = {"columns": {"prompt": "instruction", "response": "output", "kto_tag": "label"}}
    assert one(data_dir, {"instruction": "q", "output": "a", "label": False}, entry)["_kto_tag"] is False
    ex = one(data_dir, {"instruction": "q", "output": "a", "label": "True"}, entry)  # csv-style string
    assert (ex["_response"], ex["_kto_tag"]) == ([A("a")], True)


def test_source_file_and_row_are_kept(data_dir):
    examples = align(data_dir, [_GOOD["alpaca"]] * 3).examples
    assert [(e["_source_file"], e["_source_row"]) for e in examples] == [("data/my.json", 1), ("data/my.json", 2), ("data/my.json", 3)]


# ============================================================== alpaca errors (one per case)
def test_error_output_is_a_list(data_dir):
    err = error(data_dir, {"instruction": "q", "output": ["a"]}, position=17)
    assert str(err).startswith("row 17 of data/my.json (dataset 'my'): column 'output' is a list, expected a string.")
    assert (err.dataset, err.file, err.row, err.field) == ("my", "data/my.json", 17, "output")
    assert "skip_bad_rows" in str(err)


def test_error_instruction_missing(data_dir):
    err = error(data_dir, {"prompt": "q", "output": "a"})
    assert err.field == "instruction"
    assert "row 2 of data/my.json (dataset 'my'): column 'instruction' is missing (the row has columns: 'prompt', 'output')" in str(err)


def test_error_instruction_is_a_number(data_dir):
    err = error(data_dir, {"instruction": 5, "output": "a"})
    assert "row 2 of data/my.json (dataset 'my'): column 'instruction' is a number, expected a string" in str(err)


def test_error_empty_prompt(data_dir):
    err = error(data_dir, {"instruction": "", "input": "", "output": "a"})
    assert "row 2 of data/my.json (dataset 'my'): the prompt is empty (columns 'instruction' and 'input' have no text)" in str(err)


def test_error_system_not_a_string(data_dir):
    entry = {"columns": {"prompt": "instruction", "response": "output", "system": "system"}}
    err = error(data_dir, {"instruction": "q", "output": "a", "system": {"x": 1}}, entry)
    assert "row 2 of data/my.json (dataset 'my'): column 'system' is an object, expected a string" in str(err)


def test_error_history_not_pairs(data_dir):
    entry = {"columns": {"prompt": "instruction", "response": "output", "history": "history"}}
    err = error(data_dir, {"instruction": "q", "output": "a", "history": [["q1", "a1"], ["only one"]]}, entry)
    assert err.field == "history[1]"
    assert 'row 2 of data/my.json (dataset \'my\'): history item 1 is ["only one"], expected a pair of strings' in str(err)


def test_error_history_not_a_list(data_dir):
    entry = {"columns": {"prompt": "instruction", "response": "output", "history": "history"}}
    err = error(data_dir, {"instruction": "q", "output": "a", "history": 3}, entry)
    assert "column 'history' is a number, expected a list of [prompt, response] pairs" in str(err)


def test_error_tools_not_json(data_dir):
    entry = {"columns": {"prompt": "instruction", "response": "output", "tools": "tools"}}
    err = error(data_dir, {"instruction": "q", "output": "a", "tools": "[{oops"}, entry)
    assert "row 2 of data/my.json (dataset 'my'): column 'tools' is not valid JSON" in str(err)


def test_error_tool_without_name(data_dir):
    entry = {"columns": {"prompt": "instruction", "response": "output", "tools": "tools"}}
    err = error(data_dir, {"instruction": "q", "output": "a", "tools": [{"description": "x"}]}, entry)
    assert err.field == "tools[0]"
    assert "tool 0 in column 'tools' is not a function schema with a 'name'" in str(err)


def test_error_ranking_rejected_missing(data_dir):
    entry = {"ranking": True, "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}}
    err = error(data_dir, {"instruction": "q", "chosen": "a"}, entry)
    assert "row 1 of data/my.json (dataset 'my'): column 'rejected' is missing" in str(err)


def test_error_kto_tag_not_boolean(data_dir):
    entry = {"columns": {"prompt": "instruction", "response": "output", "kto_tag": "label"}}
    err = error(data_dir, {"instruction": "q", "output": "a", "label": "maybe"}, entry, good={"instruction": "q", "output": "a", "label": True})
    assert "row 2 of data/my.json (dataset 'my'): column 'label' is 'maybe', expected true or false" in str(err)


def test_error_kto_tag_null(data_dir):
    entry = {"columns": {"prompt": "instruction", "response": "output", "kto_tag": "label"}}
    err = error(data_dir, {"instruction": "q", "output": "a", "label": None}, entry)
    assert "row 1 of data/my.json (dataset 'my'): column 'label' is null" in str(err)


def test_error_row_not_an_object(data_dir):
    err = error(data_dir, ["q", "a"])
    assert str(err).startswith("row 2 of data/my.json (dataset 'my'): the row is a list, expected an object of columns.")


def test_error_jsonl_line_not_json(data_dir):
    (data_dir / "my.jsonl").write_text('{"instruction": "q", "output": "a"}\n\n{"instruction": "q", \n')
    (data_dir / "dataset_info.json").write_text(json.dumps({"my": {"file_name": "my.jsonl"}}))
    [attr] = get_dataset_attrs(["my"], "data")
    with pytest.raises(DatasetRowError, match=r"^row 3 of data/my.jsonl \(dataset 'my'\): the row is not valid JSON"):
        align_rows(read_rows(attr), attr)


# ============================================================== sharegpt
def msg(role, value):
    return {"from": role, "value": value}


def test_sharegpt_multi_turn(data_dir):
    row = {"conversations": [msg("human", "q1"), msg("gpt", "a1"), msg("human", "q2"), msg("gpt", "a2")]}
    ex = one(data_dir, row, SHAREGPT)
    assert ex == {"_prompt": [U("q1"), A("a1"), U("q2")], "_response": [A("a2")], "_system": "", "_tools": "", "_kto_tag": None,
                  "_extra": "{}"}


def test_sharegpt_leading_system_message_overrides_system_column(data_dir):
    entry = {"formatting": "sharegpt", "columns": {"messages": "conversations", "system": "system"}}
    row = {"conversations": [msg("system", "from message"), msg("human", "q"), msg("gpt", "a")], "system": "from column"}
    assert one(data_dir, row, entry)["_system"] == "from message"
    row = {"conversations": [msg("human", "q"), msg("gpt", "a")], "system": "from column"}
    assert one(data_dir, row, entry)["_system"] == "from column"


def test_sharegpt_function_call_and_observation(data_dir):
    entry = {"formatting": "sharegpt", "columns": {"messages": "conversations", "tools": "tools"}}
    row = {
        "conversations": [msg("human", "add 1 and 2"), msg("function_call", CALL), msg("observation", '{"result": 3}'), msg("gpt", "3")],
        "tools": TOOLS,
    }
    ex = one(data_dir, row, entry)
    assert ex["_prompt"] == [U("add 1 and 2"), {"role": "function", "content": CALL}, {"role": "observation", "content": '{"result": 3}'}]
    assert ex["_response"] == [A("3")]
    assert ex["_tools"] == TOOLS


def test_sharegpt_custom_tags(data_dir):
    entry = {"formatting": "sharegpt", "columns": {"messages": "dialog"}, "tags": {"role_tag": "who", "content_tag": "text", "user_tag": "me", "assistant_tag": "bot"}}
    ex = one(data_dir, {"dialog": [{"who": "me", "text": "q"}, {"who": "bot", "text": "a"}]}, entry)
    assert (ex["_prompt"], ex["_response"]) == ([U("q")], [A("a")])


def test_sharegpt_ranking(data_dir):
    entry = {"formatting": "sharegpt", "ranking": True, "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}
    row = {"conversations": [msg("human", "q1"), msg("gpt", "a1"), msg("human", "q2")], "chosen": msg("gpt", "good"), "rejected": msg("gpt", "bad")}
    ex = one(data_dir, row, entry)
    assert ex["_prompt"] == [U("q1"), A("a1"), U("q2")]
    assert ex["_response"] == [A("good"), A("bad")]


def test_sharegpt_kto(data_dir):
    entry = {"formatting": "sharegpt", "columns": {"messages": "conversations", "kto_tag": "kto_tag"}}
    ex = one(data_dir, {"conversations": [msg("human", "q"), msg("gpt", "a")], "kto_tag": False}, entry)
    assert (ex["_prompt"], ex["_response"], ex["_kto_tag"]) == ([U("q")], [A("a")], False)


def test_sharegpt_messages_as_json_text(data_dir):
    # csv files can only hold the conversation as JSON text.
    ex = one(data_dir, {"conversations": json.dumps(_GOOD["sharegpt"]["conversations"])}, SHAREGPT)
    assert ex["_response"] == [A("a")]


# ============================================================== sharegpt errors
def test_error_sharegpt_unknown_role(data_dir):
    err = error(data_dir, {"conversations": [msg("human", "q"), msg("bot", "a")]}, SHAREGPT, position=17)
    assert err.field == "conversations[1].from"
    assert str(err).startswith(
        "row 17 of data/my.json (dataset 'my'): message 1 has role 'bot', expected one of "
        "'human', 'gpt', 'observation', 'function_call', 'system'."
    )


def test_error_sharegpt_roles_do_not_alternate(data_dir):
    err = error(data_dir, {"conversations": [msg("human", "q"), msg("human", "q again"), msg("gpt", "a")]}, SHAREGPT)
    assert err.field == "conversations[1].from"
    assert "message 1 has role 'human' where 'gpt' or 'function_call' is expected (prompt and response turns must alternate" in str(err)


def test_error_sharegpt_starts_with_assistant(data_dir):
    err = error(data_dir, {"conversations": [msg("gpt", "a"), msg("human", "q")]}, SHAREGPT)
    assert "message 0 has role 'gpt' where 'human' or 'observation' is expected" in str(err)


def test_error_sharegpt_ends_on_prompt(data_dir):
    err = error(data_dir, {"conversations": [msg("human", "q"), msg("gpt", "a"), msg("human", "q2")]}, SHAREGPT)
    assert err.field == "conversations[2]"
    assert "the conversation ends on a 'human' message; it must end with a 'gpt' or 'function_call' message" in str(err)


def test_error_sharegpt_system_not_first(data_dir):
    err = error(data_dir, {"conversations": [msg("human", "q"), msg("system", "s"), msg("gpt", "a")]}, SHAREGPT)
    assert err.field == "conversations[1]"
    assert "message 1 is a system message; only the first message may be one" in str(err)


def test_error_sharegpt_content_not_string(data_dir):
    err = error(data_dir, {"conversations": [msg("human", "q"), msg("gpt", 42)]}, SHAREGPT)
    assert err.field == "conversations[1].value"
    assert "message 1 content is a number, expected a string" in str(err)


def test_error_sharegpt_message_without_role_key(data_dir):
    err = error(data_dir, {"conversations": [{"value": "q"}, msg("gpt", "a")]}, SHAREGPT)
    assert "message 0 has no 'from' key (it has: 'value')" in str(err)


def test_error_sharegpt_message_not_an_object(data_dir):
    err = error(data_dir, {"conversations": ["q", "a"]}, SHAREGPT)
    assert "message 0 is a string, expected an object with 'from' and 'value'" in str(err)


def test_error_sharegpt_messages_column_missing(data_dir):
    err = error(data_dir, {"messages": []}, SHAREGPT)
    assert "row 2 of data/my.json (dataset 'my'): column 'conversations' is missing (the row has columns: 'messages')" in str(err)


def test_error_sharegpt_empty_conversation(data_dir):
    err = error(data_dir, {"conversations": []}, SHAREGPT)
    assert "column 'conversations' has no user/assistant messages" in str(err)


def test_error_sharegpt_bad_function_call(data_dir):
    err = error(data_dir, {"conversations": [msg("human", "q"), msg("function_call", "add(1, 2)"), msg("observation", "3"), msg("gpt", "3")]}, SHAREGPT)
    assert err.field == "conversations[1].value"
    assert "function call content is not valid: A function-call turn must be JSON" in str(err)


def test_error_sharegpt_ranking_ends_with_response(data_dir):
    entry = {"formatting": "sharegpt", "ranking": True, "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}
    err = error(data_dir, {"conversations": [msg("human", "q"), msg("gpt", "a")], "chosen": msg("gpt", "g"), "rejected": msg("gpt", "b")}, entry)
    assert "the conversation ends with a response; in a ranking dataset it ends on the prompt and the two answers go in columns 'chosen' and 'rejected'" in str(err)


def test_error_sharegpt_ranking_answer_has_prompt_role(data_dir):
    entry = {"formatting": "sharegpt", "ranking": True, "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}
    err = error(data_dir, {"conversations": [msg("human", "q")], "chosen": msg("gpt", "g"), "rejected": msg("human", "b")}, entry)
    assert err.field == "rejected.from"
    assert "column 'rejected' has role 'human', expected 'gpt' or 'function_call'" in str(err)


# ============================================================== openai
def test_openai_system_and_turns(data_dir):
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    ex = one(data_dir, row, OPENAI)
    assert ex == {"_prompt": [U("q")], "_response": [A("a")], "_system": "Be brief.", "_tools": "", "_kto_tag": None,
                  "_extra": "{}"}


def test_unmapped_columns_travel_as_extra_json_and_mapped_ones_do_not(data_dir):
    row = {"q": "2+2", "a": "4", "level": 3, "tests": ["assert f() == 4"], "meta": {"id": "x1"}}
    ex = one(data_dir, row, {"columns": {"prompt": "q", "response": "a"}})
    assert json.loads(ex["_extra"]) == {"level": 3, "tests": ["assert f() == 4"], "meta": {"id": "x1"}}
    assert list(json.loads(ex["_extra"])) == ["level", "tests", "meta"]  # the row's order


def test_openai_tool_calls_and_tool_results(data_dir):
    calls = [
        {"id": "1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
        {"id": "2", "type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}},
    ]
    row = {
        "messages": [
            {"role": "user", "content": "two sums"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "1", "content": "3"},
            {"role": "tool", "tool_call_id": "2", "content": "7"},
            {"role": "assistant", "content": [{"type": "text", "text": "3 and "}, {"type": "text", "text": "7"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
    }
    ex = one(data_dir, row, {"formatting": "openai", "columns": {"messages": "messages", "tools": "tools"}})
    expected_call = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]'
    assert ex["_prompt"] == [
        U("two sums"),
        {"role": "function", "content": expected_call},
        {"role": "observation", "content": "3\n</tool_response>\n<tool_response>\n7"},
    ]
    assert ex["_response"] == [A("3 and 7")]
    assert json.loads(ex["_tools"])[0]["function"]["name"] == "add"


def test_error_openai_tool_call_arguments_not_json(data_dir):
    calls = [{"type": "function", "function": {"name": "add", "arguments": "{a: 1}"}}]
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": calls}, {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]}
    err = error(data_dir, row, OPENAI)
    assert err.field == "messages[1].tool_calls[0].function.arguments"
    assert "row 2 of data/my.json (dataset 'my'): tool call 0 arguments are not valid JSON" in str(err)


def test_error_openai_unknown_role(data_dir):
    err = error(data_dir, {"messages": [{"role": "human", "content": "q"}, {"role": "assistant", "content": "a"}]}, OPENAI)
    assert err.field == "messages[0].role"
    assert "message 0 has role 'human', expected one of 'user', 'assistant', 'tool', 'function', 'system'" in str(err)


def test_error_openai_image_content_part(data_dir):
    row = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, {"role": "assistant", "content": "a"}]}
    err = error(data_dir, row, OPENAI)
    assert err.field == "messages[0].content[0]"
    assert "only text is supported" in str(err)


# ============================================================== skip_bad_rows and Ray-shaped batches
BAD_THEN_GOOD = [
    {"instruction": "q1", "output": "a1"},
    {"instruction": "q2", "output": ["x"]},
    {"instruction": "q3", "output": "a3"},
    {"output": "a4"},
    {"instruction": "q5", "output": "a5"},
]


def test_skip_bad_rows_counts_and_reports(data_dir):
    result = align(data_dir, BAD_THEN_GOOD, skip=True)
    assert [e["_source_row"] for e in result.examples] == [1, 3, 5]
    assert [(e.row, e.field) for e in result.skipped] == [(2, "output"), (4, "instruction")]
    assert result.report() == (
        "skipped 2 of 5 rows (skip_bad_rows is on): "
        "row 2 of data/my.json (dataset 'my'): column 'output' is a list, expected a string; "
        "row 4 of data/my.json (dataset 'my'): column 'instruction' is missing (the row has columns: 'output')."
    )


def test_without_skip_the_first_bad_row_raises(data_dir):
    with pytest.raises(DatasetRowError) as info:
        align(data_dir, BAD_THEN_GOOD)
    assert info.value.row == 2


def test_align_batch_on_column_batch(data_dir):
    (data_dir / "my.json").write_text(json.dumps(BAD_THEN_GOOD))
    (data_dir / "dataset_info.json").write_text(json.dumps({"my": {"file_name": "my.json"}}))
    [attr] = get_dataset_attrs(["my"], "data")
    rows = read_rows(attr)
    batch = {k: [r[k] for r in rows] for k in rows[0]}
    out = align_batch(batch, attr, skip_bad_rows=True)
    assert out["_prompt"] == [[U("q1")], [U("q3")], [U("q5")]]
    assert out["_source_row"] == [1, 3, 5]
    bad = bad_rows_batch(batch, attr)
    assert bad["_source_row"] == [2, 4]
    assert bad["_error"][0] == "row 2 of data/my.json (dataset 'my'): column 'output' is a list, expected a string"
    with pytest.raises(DatasetRowError):
        align_batch(batch, attr, skip_bad_rows=False)
    table = aligned_table(out)
    assert table.num_rows == 3 and str(table.schema.field("_response").type) == "list<item: struct<role: string, content: string>>"


def test_aligned_table_types_an_all_empty_response_batch(data_dir):
    examples = align(data_dir, [{"instruction": "q"}]).examples
    table = aligned_table({k: [e[k] for e in examples] for k in examples[0]})
    assert table.column("_response").to_pylist() == [[]]
    assert str(table.schema.field("_response").type) == "list<item: struct<role: string, content: string>>"


def test_row_error_survives_pickling():
    err = DatasetRowError("my", "data/my.json", 17, "output", "column 'output' is a list, expected a string")
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.row, back.field) == (str(err), 17, "output")
