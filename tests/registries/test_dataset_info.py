"""dataset_info.json parsing (DatasetAttr) and the per-stage field checks."""

import json

import pytest

from registries.datasets import DataConfigError, check_stage_fields, get_dataset_attrs
from stages.table import STAGES


@pytest.fixture
def write_info(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()

    def write(info):
        (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(info))
        return "data"

    return write


def attr_of(write_info, entry, name="my"):
    return get_dataset_attrs([name], write_info({name: entry}))[0]


def test_alpaca_defaults(write_info):
    attr = attr_of(write_info, {"file_name": "my.json"})
    assert (attr.name, attr.load_from, attr.source, attr.formatting, attr.ranking, attr.split) == ("my", "file", "data/my.json", "alpaca", False, "train")
    assert attr.columns == {"prompt": "instruction", "query": "input", "response": "output"}
    assert attr.column("history") is None and not attr.has_kto_tag


def test_sharegpt_default_tags(write_info):
    attr = attr_of(write_info, {"file_name": "my.json", "formatting": "sharegpt"})
    assert attr.column("messages") == "conversations"
    assert attr.tags == {
        "role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
        "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system",
    }


def test_openai_default_tags_and_messages_column(write_info):
    attr = attr_of(write_info, {"file_name": "my.json", "formatting": "openai"})
    assert attr.column("messages") == "messages"
    assert attr.tags == {
        "role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
        "observation_tag": "tool", "function_tag": "function", "system_tag": "system",
    }


def test_partial_tags_fall_back_to_format_defaults(write_info):
    attr = attr_of(write_info, {"file_name": "my.json", "formatting": "sharegpt", "tags": {"role_tag": "role", "user_tag": "user"}})
    assert (attr.tag("role_tag"), attr.tag("user_tag"), attr.tag("content_tag"), attr.tag("assistant_tag")) == ("role", "user", "value", "gpt")


def test_columns_object_leaves_unnamed_columns_unused(write_info):
    attr = attr_of(write_info, {"file_name": "c4.jsonl", "columns": {"prompt": "text"}})
    assert attr.column("prompt") == "text"
    assert attr.column("query") is None and attr.column("response") is None


def test_sharegpt_messages_column_keeps_default_when_columns_omit_it(write_info):
    attr = attr_of(write_info, {"file_name": "my.json", "formatting": "sharegpt", "columns": {"tools": "tools"}})
    assert (attr.column("messages"), attr.column("tools")) == ("conversations", "tools")


def test_everything_parsed(write_info):
    entry = {
        "file_name": "d", "formatting": "sharegpt", "ranking": True, "subset": "s", "split": "test", "folder": "f",
        "num_samples": 10, "columns": {"messages": "m", "chosen": "c", "rejected": "r", "system": "sy"},
    }
    attr = attr_of(write_info, entry)
    assert (attr.ranking, attr.subset, attr.split, attr.folder, attr.num_samples) == (True, "s", "test", "f", 10)
    assert (attr.column("chosen"), attr.column("rejected"), attr.column("system")) == ("c", "r", "sy")


def test_hub_and_script_sources(write_info, monkeypatch):
    monkeypatch.delenv("USE_MODELSCOPE_HUB", raising=False)
    info = {
        "hf": {"hf_hub_url": "org/ds", "file_name": "ignored.json"},
        "both": {"hf_hub_url": "org/ds", "ms_hub_url": "ms/ds"},
        "ms": {"ms_hub_url": "ms/ds"},
        "script": {"script_url": "my_script"},
    }
    attrs = get_dataset_attrs(list(info), write_info(info))
    assert [(a.load_from, a.source) for a in attrs] == [
        ("hf_hub", "org/ds"), ("hf_hub", "org/ds"), ("ms_hub", "ms/ds"), ("script", "data/my_script"),
    ]
    monkeypatch.setenv("USE_MODELSCOPE_HUB", "1")
    assert get_dataset_attrs(["both"], "data")[0].load_from == "ms_hub"


def test_only_named_entries_are_parsed(write_info):
    info = {"good": {"file_name": "a.json"}, "multimodal": {"file_name": "b.json", "columns": {"images": "images"}}}
    assert [a.name for a in get_dataset_attrs(["good"], write_info(info))] == ["good"]


# ---------------------------------------------------------------- errors
def test_error_unknown_dataset_lists_close_names(write_info):
    info = {"arith_train": {"file_name": "a.json"}, "arith_eval": {"file_name": "b.json"}, "identity": {"file_name": "c.json"}}
    with pytest.raises(DataConfigError) as err:
        get_dataset_attrs(["arith_trian"], write_info(info))
    assert str(err.value) == "Dataset 'arith_trian' is not defined in data/dataset_info.json. Did you mean: arith_train, arith_eval?"


def test_error_unknown_dataset_without_close_names_lists_defined_ones(write_info):
    with pytest.raises(DataConfigError, match=r"^Dataset 'zzz' is not defined in data/dataset_info.json. It defines: a, b.$"):
        get_dataset_attrs(["zzz"], write_info({"b": {"file_name": "x"}, "a": {"file_name": "y"}}))


def test_error_missing_info_file(tmp_path):
    with pytest.raises(DataConfigError, match="No dataset_info.json in dataset_dir .* Set dataset_dir to the folder"):
        get_dataset_attrs(["x"], str(tmp_path / "nowhere"))


def test_error_info_not_json(write_info, tmp_path):
    write_info({})
    (tmp_path / "data" / "dataset_info.json").write_text('{"a": {"file_name": "x",}}')
    with pytest.raises(DataConfigError, match=r"^data/dataset_info.json is not valid JSON: .* at line 1, column 25\.$"):
        get_dataset_attrs(["a"], "data")


def test_error_unknown_entry_key(write_info):
    with pytest.raises(DataConfigError) as err:
        attr_of(write_info, {"file_name": "x", "formating": "sharegpt"})
    assert str(err.value).startswith(
        "Dataset 'my' in data/dataset_info.json has unknown key(s) 'formating' (did you mean 'formatting'?). Known: file_name,"
    )


def test_error_unknown_column_key(write_info):
    with pytest.raises(DataConfigError, match=r"has unknown column key\(s\) 'reponse' \(did you mean 'response'\?\)"):
        attr_of(write_info, {"file_name": "x", "columns": {"prompt": "q", "reponse": "a"}})


def test_error_unknown_tag(write_info):
    with pytest.raises(DataConfigError, match=r"has unknown tag\(s\) 'human_tag'"):
        attr_of(write_info, {"file_name": "x", "formatting": "sharegpt", "tags": {"human_tag": "user"}})


def test_error_unknown_formatting(write_info):
    with pytest.raises(DataConfigError, match=r"^Dataset 'my' in data/dataset_info.json: formatting is 'chatml'; expected one of alpaca, sharegpt, openai\.$"):
        attr_of(write_info, {"file_name": "x", "formatting": "chatml"})


def test_error_no_source(write_info):
    with pytest.raises(DataConfigError, match=r"^Dataset 'my' in data/dataset_info.json says nowhere to load from"):
        attr_of(write_info, {"formatting": "alpaca"})


def test_ranking_answers_default_to_chosen_and_rejected_columns(write_info):
    attr = attr_of(write_info, {"file_name": "x", "ranking": True, "columns": {"prompt": "q", "chosen": "good"}})
    assert (attr.column("prompt"), attr.column("chosen"), attr.column("rejected"), attr.column("response")) == ("q", "good", "rejected", None)
    assert attr_of(write_info, {"hf_hub_url": "org/pairs", "ranking": True}).column("chosen") == "chosen"


def test_unsupported_source_is_ignored_next_to_a_supported_one(write_info):
    attr = attr_of(write_info, {"hf_hub_url": "org/ds", "om_hub_url": "om/ds"})
    assert (attr.load_from, attr.source) == ("hf_hub", "org/ds")


def test_error_ranking_not_bool(write_info):
    with pytest.raises(DataConfigError, match=r"ranking is 'yes'; expected true or false"):
        attr_of(write_info, {"file_name": "x", "ranking": "yes"})


def test_error_num_samples_not_positive(write_info):
    with pytest.raises(DataConfigError, match=r"num_samples is 0; expected a positive integer"):
        attr_of(write_info, {"file_name": "x", "num_samples": 0})


def test_error_video_and_audio_columns(write_info):
    for key in ("videos", "audios"):
        with pytest.raises(DataConfigError, match=rf"has a '{key}' column; only image columns .* not {key}"):
            attr_of(write_info, {"file_name": "x", "formatting": "sharegpt", "columns": {"messages": "m", key: key}})


def test_images_column_is_kept_only_when_named(write_info):
    attr = attr_of(write_info, {"file_name": "x", "formatting": "sharegpt", "columns": {"messages": "m", "images": "pics"}})
    assert (attr.column("images"), attr.has_images, attr.dataset_dir) == ("pics", True, "data")
    assert "images" not in attr_of(write_info, {"file_name": "x", "columns": {"prompt": "p"}}).columns


def test_error_unsupported_source(write_info):
    with pytest.raises(DataConfigError, match=r"uses 'cloud_file_name' \(s3/gcs files\), which RayFactory does not load yet"):
        attr_of(write_info, {"cloud_file_name": "s3://b/x.json"})


def test_error_duplicate_role_tags(write_info):
    with pytest.raises(DataConfigError, match=r"two roles share one tag value"):
        attr_of(write_info, {"file_name": "x", "formatting": "sharegpt", "tags": {"user_tag": "gpt"}})


# ---------------------------------------------------------------- stage checks
@pytest.fixture
def stage_attrs(write_info):
    info = {
        "plain": {"file_name": "p.json"},
        "pairs": {"file_name": "r.json", "ranking": True, "columns": {"prompt": "instruction", "chosen": "c", "rejected": "r"}},
        "rated": {"file_name": "k.json", "columns": {"prompt": "instruction", "response": "output", "kto_tag": "label"}},
    }
    return dict(zip(info, get_dataset_attrs(list(info), write_info(info))))


NEEDS = {name: spec.dataset_need for name, spec in STAGES.items()}  # the stage table's word


@pytest.mark.parametrize("stage,name", [("sft", "plain"), ("pt", "plain"), ("ppo", "plain"), ("rm", "pairs"), ("dpo", "pairs"), ("kto", "rated")])
def test_stage_accepts_matching_dataset(stage_attrs, stage, name):
    check_stage_fields([stage_attrs[name]], stage, NEEDS[stage])


def test_dpo_rejects_non_ranking_dataset(stage_attrs):
    with pytest.raises(DataConfigError) as err:
        check_stage_fields([stage_attrs["pairs"], stage_attrs["plain"]], "dpo", NEEDS["dpo"])
    assert str(err.value) == (
        "Stage 'dpo' trains on preference pairs, but dataset 'plain' (in data/dataset_info.json) is not a ranking "
        "dataset: it lacks \"ranking\": true and the columns \"chosen\" and \"rejected\". Use a ranking dataset or add them."
    )


def test_rm_rejects_non_ranking_dataset(stage_attrs):
    with pytest.raises(DataConfigError, match=r"^Stage 'rm' trains on preference pairs, but dataset 'rated'"):
        check_stage_fields([stage_attrs["rated"]], "rm", NEEDS["rm"])


def test_kto_rejects_dataset_without_kto_tag(stage_attrs):
    with pytest.raises(DataConfigError) as err:
        check_stage_fields([stage_attrs["plain"]], "kto", NEEDS["kto"])
    assert str(err.value).startswith(
        "Stage 'kto' needs a true/false label per answer, but dataset 'plain' (in data/dataset_info.json) has no kto_tag column."
    )


def test_kto_rejects_ranking_dataset(stage_attrs):
    with pytest.raises(DataConfigError, match=r"^Stage 'kto' needs a true/false label per answer, but dataset 'pairs'"):
        check_stage_fields([stage_attrs["pairs"]], "kto", NEEDS["kto"])


def test_sft_rejects_ranking_dataset(stage_attrs):
    with pytest.raises(DataConfigError, match=r"^Stage 'sft' takes one answer per prompt, but dataset 'pairs' .* is a ranking dataset"):
        check_stage_fields([stage_attrs["pairs"]], "sft", NEEDS["sft"])


def test_sft_rejects_kto_dataset(stage_attrs):
    with pytest.raises(DataConfigError, match=r"^Stage 'sft' would train on every answer, but dataset 'rated' .* has a kto_tag column"):
        check_stage_fields([stage_attrs["rated"]], "sft", NEEDS["sft"])


def test_error_alpaca_kto_without_response_column(write_info):
    with pytest.raises(DataConfigError) as err:
        attr_of(write_info, {"file_name": "x", "columns": {"prompt": "q", "kto_tag": "label"}})
    assert str(err.value) == (
        "Dataset 'my' in data/dataset_info.json has a kto_tag column but no response column, so there is no answer "
        "to label. Add \"response\": \"<column>\" to its columns."
    )


def test_error_ranking_and_kto_tag_together(write_info):
    entry = {"file_name": "x", "ranking": True, "columns": {"prompt": "q", "chosen": "c", "rejected": "r", "kto_tag": "k"}}
    with pytest.raises(DataConfigError, match=r"has both \"ranking\": true and a kto_tag column"):
        attr_of(write_info, entry)
