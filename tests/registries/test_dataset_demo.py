"""The committed demo data in data/: every dataset loads, fits its stage, is correct, and eval is held out."""

from pathlib import Path

import pytest

from registries.datasets import align_rows, check_stage_fields, get_dataset_attrs, load_dataset_info, read_rows
from registries.synthetic import check_answer, task_for_prompt
from stages.table import STAGES

DATA = Path(__file__).resolve().parents[2] / "data"
COUNTS = {
    "identity": 24, "identity_demo": 24, "arith_train": 320, "reverse_train": 104, "copy_train": 480,
    "arith_eval": 80, "reverse_eval": 26, "copy_eval": 120,
    "tasks_sharegpt": 400, "tasks_openai": 400, "tasks_sharegpt_eval": 100, "tasks_openai_eval": 100,
    "arith_pref": 320, "arith_pref_eval": 80, "arith_pref_sharegpt": 320, "arith_kto": 640, "arith_kto_eval": 160,
    "pretrain_txt": 424, "pretrain_jsonl": 200, "tool_calls": 300, "tool_calls_eval": 60,
    "arith_format_pref": 320, "arith_format_pref_eval": 80,
    "shapes_train": 192, "shapes_eval": 48, "shapes_pref": 192, "shapes_pref_eval": 48, "calc_tool_sft": 500, "calc_prompts": 500, "calc_eval": 100,
    # LLaMA-Factory's demo names (registries/synthetic/lf_demos.py; tests/registries/test_dataset_lf_demos.py)
    "alpaca_en_demo": 200, "glaive_toolcall_en_demo": 100, "mllm_demo": 96, "dpo_en_demo": 200, "kto_en_demo": 200,
    "c4_demo": 100,
}
STAGE = {"arith_pref": "dpo", "arith_pref_eval": "rm", "arith_format_pref": "rm", "arith_format_pref_eval": "rm", "arith_pref_sharegpt": "dpo", "arith_kto": "kto", "arith_kto_eval": "kto", "pretrain_txt": "pt", "pretrain_jsonl": "pt", "calc_prompts": "grpo", "calc_eval": "grpo", "shapes_pref": "dpo", "shapes_pref_eval": "dpo", "dpo_en_demo": "dpo", "kto_en_demo": "kto", "c4_demo": "pt"}


@pytest.fixture(scope="module")
def demo():
    names = list(load_dataset_info(str(DATA)))
    attrs = get_dataset_attrs(names, str(DATA))
    return {a.name: (a, align_rows(read_rows(a), a).examples) for a in attrs}


def test_every_demo_dataset_is_registered_and_aligns(demo):
    assert {name: len(examples) for name, (_, examples) in demo.items()} == COUNTS


@pytest.mark.parametrize("name", list(COUNTS))
def test_demo_dataset_fits_its_stage(demo, name):
    stage = STAGE.get(name, "sft")
    check_stage_fields([demo[name][0]], stage, STAGES[stage].dataset_need)


def user_turns(examples):
    # A multimodal prompt is its text and its pictures: the shapes eval set asks the same questions
    # about pictures no training row shows.
    return {
        (m["content"], tuple(e.get("_images", ()))) for e in examples for m in e["_prompt"] if m["role"] == "user"
    }


def test_eval_sets_share_no_prompt_with_any_training_set(demo):
    train = set().union(*(user_turns(ex) for name, (_, ex) in demo.items() if not name.endswith("_eval")))
    for name, (_, examples) in demo.items():
        if name.endswith("_eval"):
            assert not user_turns(examples) & train, name


def test_task_answers_are_correct(demo):
    for name in ("arith_train", "reverse_eval", "copy_train", "tasks_sharegpt", "tasks_openai_eval"):
        for e in demo[name][1]:
            turns = e["_prompt"] + e["_response"]
            for question, answer in zip(turns[::2], turns[1::2]):
                assert check_answer(question["content"], answer["content"]), (name, question, answer)


def test_preference_pairs_and_kto_labels_follow_correctness(demo):
    for name in ("arith_pref", "arith_pref_sharegpt", "arith_pref_eval"):
        for e in demo[name][1]:
            prompt, (chosen, rejected) = e["_prompt"][0]["content"], e["_response"]
            assert check_answer(prompt, chosen["content"]) and not check_answer(prompt, rejected["content"])
    labels = [e["_kto_tag"] for e in demo["arith_kto"][1]]
    assert labels.count(True) == labels.count(False) == 320
    for e in demo["arith_kto"][1]:
        assert check_answer(e["_prompt"][0]["content"], e["_response"][0]["content"]) is e["_kto_tag"]


def test_tool_calls_have_tools_and_correct_calls(demo):
    kinds = set()
    for e in demo["tool_calls"][1]:
        assert '"name": "add"' in e["_tools"] and '"name": "reverse_word"' in e["_tools"]
        turns = e["_prompt"] + e["_response"]
        kinds.add(tuple(m["role"] for m in turns))
        if turns[1]["role"] == "function":
            assert task_for_prompt(turns[0]["content"]).check(turns[0]["content"], turns[1]["content"])
    assert kinds == {("user", "assistant"), ("user", "function", "observation", "assistant")}


def test_systems_and_multi_turn_are_present(demo):
    for name in ("tasks_sharegpt", "tasks_openai"):
        examples = demo[name][1]
        assert {e["_system"] for e in examples} == {"", "You are a careful assistant. Reply with the answer only."}
        assert {len(e["_prompt"]) for e in examples} == {1, 3}


def test_identity_has_placeholders(demo):
    texts = [e["_response"][0]["content"] for e in demo["identity"][1]]
    assert all("{{name}}" in t or "{{author}}" in t for t in texts)


def test_data_dir_is_small():
    assert sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file()) < 2_000_000
