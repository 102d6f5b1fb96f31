"""The stage table: one declarative entry per stage, read by config checks, data, workers and help."""

from __future__ import annotations

import pytest

from registries.datasets.stage_fields import DATASET_NEEDS
from registries.tokenize import KINDS
from stages.run_args import FinetuningArguments
from stages.table import STAGES, StageSpec, UnknownStageError, get_stage, register_stage


def test_every_stage_resolves_its_recipe_collator_and_checks():
    for spec in STAGES.values():
        assert spec.dataset_need in DATASET_NEEDS and spec.tokenize in KINDS
        assert callable(spec.load_collator_factory())
        assert callable(spec.load_runner())
        if spec.rl is not None:
            assert all(callable(check) for check in spec.rl.load_checks())
            assert spec.rl.rl_defaults is None or callable(spec.rl.load_rl_defaults())
    assert list(STAGES) == ["pt", "sft", "rm", "dpo", "kto", "grpo", "ppo"]
    assert [s.name for s in STAGES.values() if s.launch == "rl_controller"] == ["grpo", "ppo"]


def test_rl_entries_say_roles_updates_and_where_the_kl_goes():
    from stages.rl.config.rl_args import RLArguments

    grpo, ppo = STAGES["grpo"].rl, STAGES["ppo"].rl
    rl = RLArguments(num_iterations=3, ppo_epochs=2, ppo_buffer_size=4)
    assert (grpo.updates_per_step(rl), ppo.updates_per_step(rl)) == (3, 8)
    assert (grpo.kl_in_loss, ppo.kl_in_loss) == (True, False)
    tuning = FinetuningArguments(stage="ppo", reward_model="saves/rm")
    gae = RLArguments(advantage_estimator="gae", num_generations=1, rollout_backend="hf")
    assert ppo.roles(tuning, gae) == ("policy", "critic", "reward")
    assert grpo.roles(FinetuningArguments(stage="grpo"), RLArguments()) == ("policy", "rollout")
    assert grpo.roles(FinetuningArguments(stage="grpo"), RLArguments(beta=0.1)) == ("policy", "reference", "rollout")
    with pytest.raises(ValueError, match="RLSpec is given exactly for launch rl_controller"):
        StageSpec("x", "x", "prompt_only", "unsupervised", "collators:prompt_collator", "grpo:run_grpo",
                  launch="rl_controller")


def test_duplicate_stage_is_rejected():
    with pytest.raises(ValueError, match="Stage 'sft' is already registered"):
        register_stage(StageSpec("sft", "again", "plain", "supervised", "collators:supervised_collator", "x:y"))
    assert STAGES["sft"].summary.startswith("supervised fine-tuning")


def test_a_spec_must_name_known_data_needs_and_tokenizers():
    with pytest.raises(ValueError, match="dataset_need must be one of"):
        StageSpec("x", "x", "pairs", "pairwise", "collators:pairwise_collator", "x:y")
    with pytest.raises(ValueError, match="pairwise examples cannot be packed"):
        StageSpec("x", "x", "ranking", "pairwise", "collators:pairwise_collator", "x:y", pack_by_default=True)


def test_unknown_stages_are_user_errors():
    with pytest.raises(UnknownStageError, match=r"unknown stage 'dop'; the stages are .*Did you mean 'dpo'\?"):
        get_stage("dop")


@pytest.mark.parametrize("stage, pref_loss, expected", [
    ("sft", "sigmoid", False), ("rm", "sigmoid", False), ("kto", "sigmoid", True),
    ("dpo", "sigmoid", True), ("dpo", "ipo", True), ("dpo", "hinge", True), ("dpo", "orpo", False),
    ("dpo", "simpo", False),
])
def test_reference_model_need_comes_from_the_table(stage, pref_loss, expected):
    assert FinetuningArguments(stage=stage, pref_loss=pref_loss).use_ref_model is expected


def test_packing_default_is_the_stages():
    from registries.datasets.data_args import DataArguments
    from registries.tokenize import preprocess_packed_supervised, preprocess_pretrain, preprocess_supervised

    args = DataArguments(dataset="x")
    pt = STAGES["pt"].preprocess_fn(None, None, args)
    assert pt.func is preprocess_pretrain and pt.keywords["packing"] is True
    assert STAGES["sft"].preprocess_fn(None, None, args).func is preprocess_supervised
    neat = DataArguments(dataset="x", neat_packing=True)
    assert STAGES["sft"].preprocess_fn(None, None, neat).func is preprocess_packed_supervised
