"""LLaMA-Factory's demo dataset names in data/ (registries/synthetic/lf_demos.py): each is declared as
LLaMA-Factory's own data/dataset_info.json declares it, loads through our registry in that format,
holds right answers (and wrong ones where a format wants them), and a row of each tokenizes with the
qwen template (qwen2_vl for the pictures) into a label mask that trains on the answer only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from registries.datasets import DataArguments, align_rows, check_stage_fields, get_dataset_attrs, read_rows
from registries.synthetic import check_answer, shapes
from registries.tokenize import IGNORE_INDEX
from stages.loading import load_tokenizer_and_template
from stages.run_args import ModelArguments
from stages.table import STAGES

DATA = Path(__file__).resolve().parents[2] / "data"
ROLE_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
# LLaMA-Factory's data/dataset_info.json entries of these names, as it declares them.
LF_ENTRIES = {
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "glaive_toolcall_en_demo": {"file_name": "glaive_toolcall_en_demo.json", "formatting": "sharegpt",
                                "columns": {"messages": "conversations", "tools": "tools"}},
    "mllm_demo": {"file_name": "mllm_demo.json", "formatting": "sharegpt",
                  "columns": {"messages": "messages", "images": "images"}, "tags": ROLE_TAGS},
    "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
    "kto_en_demo": {"file_name": "kto_en_demo.json", "formatting": "sharegpt",
                    "columns": {"messages": "messages", "kto_tag": "label"}, "tags": ROLE_TAGS},
    "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},
}
# name -> (stage LLaMA-Factory's examples train it with, rows, formatting, ranking)
EXPECTED = {
    "alpaca_en_demo": ("sft", 200, "alpaca", False),
    "glaive_toolcall_en_demo": ("sft", 100, "sharegpt", False),
    "mllm_demo": ("sft", 96, "sharegpt", False),
    "dpo_en_demo": ("dpo", 200, "sharegpt", True),
    "kto_en_demo": ("kto", 200, "sharegpt", False),
    "c4_demo": ("pt", 100, "alpaca", False),
}


@pytest.fixture(scope="module")
def loaded():
    attrs = get_dataset_attrs(list(EXPECTED), str(DATA))
    return {a.name: (a, align_rows(read_rows(a), a).examples) for a in attrs}


def test_the_entries_are_llamafactorys():
    info = json.loads((DATA / "dataset_info.json").read_text(encoding="utf-8"))
    assert {name: info[name] for name in LF_ENTRIES} == LF_ENTRIES


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_name_loads_in_its_format_and_fits_its_stage(loaded, name):
    stage, rows, formatting, ranking = EXPECTED[name]
    attrs, examples = loaded[name]
    assert (attrs.formatting, attrs.ranking, len(examples)) == (formatting, ranking, rows)
    for fits in (stage, "rm") if stage == "dpo" else (stage,):  # qwen3_lora_reward trains rm on dpo_en_demo
        check_stage_fields([attrs], fits, STAGES[fits].dataset_need)


def test_the_answers_are_right_and_the_rejected_ones_wrong(loaded):
    for e in loaded["alpaca_en_demo"][1]:
        assert check_answer(e["_prompt"][0]["content"], e["_response"][0]["content"])
    for e in loaded["dpo_en_demo"][1]:
        prompt, (chosen, rejected) = e["_prompt"][0]["content"], e["_response"]
        assert check_answer(prompt, chosen["content"]) and not check_answer(prompt, rejected["content"])
    tags = [e["_kto_tag"] for e in loaded["kto_en_demo"][1]]
    assert 60 < tags.count(True) < 140  # both kinds, about evenly
    for e in loaded["kto_en_demo"][1]:
        assert check_answer(e["_prompt"][0]["content"], e["_response"][0]["content"]) is e["_kto_tag"]
    calls = 0
    for e in loaded["glaive_toolcall_en_demo"][1]:
        assert [tool["name"] for tool in json.loads(e["_tools"])] == ["add", "reverse_word"]
        turns = e["_prompt"] + e["_response"]
        if turns[1]["role"] == "function":
            calls += 1
            assert check_answer(turns[0]["content"], turns[1]["content"])
    assert 0 < calls < 100  # calls, and rows that need none
    pictures = {p.file_name: p for p in shapes.plan("shapes_train", shapes.SPLITS["shapes_train"])}
    turns = set()
    for e in loaded["mllm_demo"][1]:
        (image,) = e["_images"]
        picture = pictures[Path(image).relative_to(DATA).as_posix()]  # a shapes_train picture, committed
        assert e["_prompt"][0]["content"].startswith("<image>")
        answers = [m["content"] for m in e["_prompt"][1::2] + e["_response"]]
        assert set(answers) <= {picture.colour, picture.shape} and len(set(answers)) == len(answers)
        turns.add(len(answers))
    assert turns == {1, 2}
    assert all(len(e["_prompt"][0]["content"].split(". ")) >= 4 for e in loaded["c4_demo"][1])


def labelled(ids: list[int], labels: list[int]) -> list[int]:
    assert len(ids) == len(labels)
    return [i for i, label in zip(ids, labels) if label != IGNORE_INDEX]


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer_and_template(ModelArguments(model_name_or_path="tiny:qwen2"), DataArguments(template="qwen"))


def tokenized(name: str, tokenizer, template, stage: str, template_name: str = "qwen", rows: int = 2,
              cutoff_len: int = 2048) -> list[dict]:  # the examples' cutoff_len: the tools' system prompt fits
    args = DataArguments(dataset=name, dataset_dir=str(DATA), cutoff_len=cutoff_len, template=template_name,
                         max_samples=rows)
    return STAGES[stage].tokenize_here(tokenizer, template, args)


def assert_trains_on_the_answer_only(tokenizer, ids, labels, answer: str, prompt: str):
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert prompt in tokenizer.decode(ids[:first])  # the prompt: masked
    trained = tokenizer.decode(labelled(ids, labels))
    assert answer in trained and prompt not in trained


@pytest.mark.parametrize("name", ["alpaca_en_demo", "glaive_toolcall_en_demo", "kto_en_demo", "dpo_en_demo"])
def test_a_row_tokenizes_with_the_qwen_template_into_an_answer_mask(qwen, loaded, name):
    tokenizer, template = qwen
    stage = EXPECTED[name][0]
    (example, *_), (row, *_) = loaded[name][1], tokenized(name, tokenizer, template, stage)
    prompt = example["_prompt"][0]["content"]
    if stage == "dpo":
        chosen, rejected = (m["content"] for m in example["_response"])
        assert_trains_on_the_answer_only(tokenizer, row["chosen_input_ids"], row["chosen_labels"], chosen, prompt)
        assert_trains_on_the_answer_only(tokenizer, row["rejected_input_ids"], row["rejected_labels"], rejected, prompt)
        return
    answer = example["_response"][0]["content"]
    assert_trains_on_the_answer_only(tokenizer, row["input_ids"], row["labels"], answer, prompt)
    if stage == "kto":  # the KL answer: the same prompt with another row's answer
        assert row["kto_tags"] is example["_kto_tag"]
        assert prompt in tokenizer.decode(row["kl_input_ids"]) and labelled(row["kl_input_ids"], row["kl_labels"])


def test_c4_demo_tokenizes_as_pretraining_text(qwen, loaded):
    tokenizer, template = qwen
    # pt lays the documents end to end and cuts blocks of cutoff_len (the last, partial one dropped)
    (row, *_) = tokenized("c4_demo", tokenizer, template, "pt", cutoff_len=32)
    assert len(row["input_ids"]) == 32
    assert labelled(row["input_ids"], row["labels"]) == row["input_ids"]  # every token is trained on
    assert tokenizer.decode(row["input_ids"]) in loaded["c4_demo"][1][0]["_prompt"][0]["content"]


def test_mllm_demo_tokenizes_with_its_pictures(loaded):
    args = DataArguments(template="qwen2_vl")
    tokenizer, template = load_tokenizer_and_template(ModelArguments(model_name_or_path="tiny:qwen2_vl"), args)
    rows = tokenized("mllm_demo", tokenizer, template, "sft", "qwen2_vl", rows=4)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(rows) == 4
    for row, example in zip(rows, loaded["mllm_demo"][1]):
        assert row["image_grid_thw"] and row["input_ids"].count(pad) > 0  # the picture's tokens
        assert pad not in labelled(row["input_ids"], row["labels"])
        trained = tokenizer.decode(labelled(row["input_ids"], row["labels"]))
        assert example["_response"][0]["content"] in trained and "What" not in trained
