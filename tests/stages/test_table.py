"""The stage table: one declarative entry per stage, read by config checks, data, workers and help."""

from __future__ import annotations

import pytest

from registries.datasets.stage_fields import DATASET_NEEDS
from registries.tokenize import KINDS
from stages.args import FinetuningArguments
from stages.table import STAGES, StageSpec, UnknownStageError, get_stage, register_stage


def test_every_available_stage_resolves_its_recipe_and_collator():
    for spec in STAGES.values():
        assert spec.dataset_need in DATASET_NEEDS and spec.tokenize in KINDS
        assert callable(spec.load_collator_factory())
        if spec.available:
            assert callable(spec.load_runner())
    assert [s.name for s in STAGES.values() if s.available] == ["pt", "sft", "rm", "dpo", "kto", "grpo", "ppo"]
    assert [s.name for s in STAGES.values() if s.launch == "rl_controller"] == ["grpo", "ppo"]


def test_duplicate_stage_is_rejected():
    with pytest.raises(ValueError, match="Stage 'sft' is already registered"):
        register_stage(StageSpec("sft", "again", "plain", "supervised", "collators:supervised_collator", None))
    assert STAGES["sft"].summary.startswith("supervised fine-tuning")


def test_a_spec_must_name_known_data_needs_and_tokenizers():
    with pytest.raises(ValueError, match="dataset_need must be one of"):
        StageSpec("x", "x", "pairs", "pairwise", "collators:pairwise_collator", None)
    with pytest.raises(ValueError, match="pairwise examples cannot be packed"):
        StageSpec("x", "x", "ranking", "pairwise", "collators:pairwise_collator", None, pack_by_default=True)


def test_unknown_and_unavailable_stages_are_user_errors(monkeypatch):
    with pytest.raises(UnknownStageError, match=r"unknown stage 'dop'; the stages are .*Did you mean 'dpo'\?"):
        get_stage("dop")
    # A stage in the table whose recipe is not built yet (every built-in one has its recipe now).
    later = StageSpec("later", "a stage still being built", "prompt_only", "unsupervised",
                      "collators:prompt_collator", None, launch="rl_controller")
    monkeypatch.setitem(STAGES, "later", later)
    with pytest.raises(UnknownStageError, match=r"stage 'later' cannot be trained yet"):
        get_stage("later")
    assert get_stage("later", trainable=False).launch == "rl_controller"


@pytest.mark.parametrize("stage, pref_loss, expected", [
    ("sft", "sigmoid", False), ("rm", "sigmoid", False), ("kto", "sigmoid", True),
    ("dpo", "sigmoid", True), ("dpo", "ipo", True), ("dpo", "hinge", True), ("dpo", "orpo", False),
    ("dpo", "simpo", False),
])
def test_reference_model_need_comes_from_the_table(stage, pref_loss, expected):
    assert FinetuningArguments(stage=stage, pref_loss=pref_loss).use_ref_model is expected


def test_packing_default_is_the_stages():
    from registries.datasets.args import DataArguments
    from registries.tokenize import preprocess_packed_supervised, preprocess_pretrain, preprocess_supervised

    args = DataArguments(dataset="x")
    pt = STAGES["pt"].preprocess_fn(None, None, args)
    assert pt.func is preprocess_pretrain and pt.keywords["packing"] is True
    assert STAGES["sft"].preprocess_fn(None, None, args).func is preprocess_supervised
    neat = DataArguments(dataset="x", neat_packing=True)
    assert STAGES["sft"].preprocess_fn(None, None, neat).func is preprocess_packed_supervised
