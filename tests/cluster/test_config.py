"""cluster.config: YAML + overrides -> RunConfig, and one exact error per user mistake."""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml

from cluster.config import ConfigError, key_owners, load_config, parse_override
from cluster.lf_compat import IGNORED_KEYS, MULTIMODAL_KEYS, UNSUPPORTED_KEYS
from cluster.serve.serve_args import ServeArguments
from fabric.ray_args import RayArguments
from registries.datasets.data_args import DataArguments
from stages.run_args import FinetuningArguments, GeneratingArguments, ModelArguments, trainer_fields
from stages.inference.eval_args import EvaluationArguments
from stages.inference.inference_args import ExportArguments, InferenceArguments
from stages.rl.config.rl_args import RLArguments
from tests.cluster.conftest import BASE, error_of, write

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# examples/train_lora/qwen3_lora_sft_ray.yaml from LLaMA-Factory, comments and all, unchanged.
LF_SFT_LORA = """\
### model
model_name_or_path: Qwen/Qwen3-4B-Instruct-2507  # or use local absolute path
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: qwen3_nothink
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-4b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### ray
ray_num_workers: 4  # Number of GPUs to use.

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
"""

pytestmark = pytest.mark.usefixtures("in_tmp")


# --- loading -------------------------------------------------------------------------------


def test_llamafactory_sft_lora_yaml_loads_unchanged(tmp_path):
    run = load_config(write(LF_SFT_LORA))
    assert run.model.model_name_or_path == "Qwen/Qwen3-4B-Instruct-2507"  # a hub id stays as written
    assert run.model.trust_remote_code is True
    assert (run.finetuning.stage, run.finetuning.finetuning_type) == ("sft", "lora")
    assert (run.finetuning.lora_rank, run.finetuning.lora_alpha, run.finetuning.lora_target) == (8, 16, ["all"])
    assert run.finetuning.plot_loss is True
    assert run.finetuning.overwrite_output_dir is True  # honoured, not ignored: cluster/replaced_run.py
    assert run.data.dataset == ["identity", "alpaca_en_demo"]
    assert (run.data.template, run.data.cutoff_len, run.data.max_samples) == ("qwen3_nothink", 2048, 1000)
    assert run.ray.ray_num_workers == 4
    assert run.training.values == {
        "do_train": True,
        "dataloader_num_workers": 4,
        "output_dir": str(tmp_path / "saves/qwen3-4b/lora/sft"),
        "logging_steps": 10,
        "save_steps": 500,
        "save_only_model": False,
        "report_to": "none",
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 8,
        "learning_rate": 1.0e-4,
        "num_train_epochs": 3.0,
        "lr_scheduler_type": "cosine",
        "bf16": True,
        "ddp_timeout": 180000000,
        "resume_from_checkpoint": None,
        "warmup_steps": 0.1,  # transformers 5 has no warmup_ratio: a float below 1 is the ratio
    }
    assert run.notes == [
        "ignored 'preprocessing_num_workers' from cfg.yaml: Ray Data sizes the preprocessing parallelism itself "
        "(see preprocessing_engine).",
        "translated warmup_ratio: 0.1 to warmup_steps: 0.1: transformers 5 reads a warmup_steps below 1 as a fraction "
        "of the total steps, so the warmup is 10% of the training steps, as warmup_ratio meant.",
    ]
    assert run.raw["preprocessing_num_workers"] == 16 and run.raw["warmup_ratio"] == 0.1  # as written
    assert run.training.seed == 42 and run.training.max_steps == -1  # unset fields read transformers' defaults


def test_defaults_follow_llamafactory():
    run = load_config(dict(BASE))
    assert run.finetuning == FinetuningArguments()
    assert (run.finetuning.stage, run.finetuning.finetuning_type, run.finetuning.lora_alpha) == ("sft", "lora", 16)
    assert (run.finetuning.pref_beta, run.finetuning.pref_loss, run.finetuning.simpo_gamma) == (0.1, "sigmoid", 0.5)
    assert run.model.quantization_bit is None and run.model.double_quantization is True
    assert run.generating == GeneratingArguments()
    assert (run.generating.temperature, run.generating.top_p, run.generating.max_new_tokens) == (0.95, 0.7, 1024)
    assert run.ray.resources_per_worker == {"CPU": 1} and run.ray.placement_strategy == "PACK"
    assert run.ray.ray_storage_path == os.path.abspath("out/ray_results")  # inside output_dir
    assert run.training.values == {"output_dir": os.path.abspath("out"), "report_to": "none"}


def test_every_key_belongs_to_exactly_one_group():
    owners = key_owners()  # raises if two groups claim a name
    groups = {"model": ModelArguments, "data": DataArguments, "finetuning": FinetuningArguments,
              "generating": GeneratingArguments, "ray": RayArguments, "rl": RLArguments,
              "inference": InferenceArguments, "export": ExportArguments, "serve": ServeArguments,
              "evaluation": EvaluationArguments}
    for group, cls in groups.items():
        assert all(owners[name] == group for name in cls.__dataclass_fields__)
    assert set(owners) == {n for c in groups.values() for n in c.__dataclass_fields__} | set(trainer_fields())
    # The LLaMA-Factory compatibility tables never shadow a real key.
    assert not (set(IGNORED_KEYS) | set(UNSUPPORTED_KEYS) | set(MULTIMODAL_KEYS)) & set(owners)


def test_overrides_are_yaml_scalars():
    run = load_config(dict(BASE), [
        "lora_rank=16", "dataset=a,b", "learning_rate=1e-4", "bf16=true", "max_samples=",
        "resources_per_worker={CPU: 2, GPU: 1}", "lora_target=[q_proj, v_proj]",
    ])
    assert (run.finetuning.lora_rank, run.finetuning.lora_alpha) == (16, 32)
    assert run.data.dataset == ["a", "b"]
    assert run.training.learning_rate == 1e-4 and isinstance(run.training.learning_rate, float)
    assert run.training.bf16 is True
    assert run.data.max_samples is None
    assert run.ray.resources_per_worker == {"CPU": 2, "GPU": 1} and run.ray.uses_gpu
    assert run.finetuning.lora_target == ["q_proj", "v_proj"]
    assert run.raw["lora_rank"] == 16


def test_override_wins_over_file_and_is_named_in_errors():
    path = write("model_name_or_path: m\noutput_dir: o\nlora_rank: 8\n")
    assert load_config(path, ["lora_rank=4"]).finetuning.lora_rank == 4
    assert error_of(path, ["lora_rank=four"]) == (
        "wrong type for 'lora_rank' in command-line override 'lora_rank=four': got 'four' (a string), "
        "expected an integer."
    )


def test_parse_override_rejects_non_assignments():
    assert parse_override("dataset=a,b") == ("dataset", "a,b")
    assert parse_override("ray_init_kwargs={num_gpus: 0}") == ("ray_init_kwargs", {"num_gpus": 0})
    with pytest.raises(ConfigError, match=r"command-line override '--lora_rank' is not of the form key=value"):
        parse_override("--lora_rank")


def test_qlora_alias_means_lora_with_4_bits_unless_set():
    run = load_config({**BASE, "finetuning_type": "qlora"})
    assert (run.finetuning.finetuning_type, run.model.quantization_bit) == ("lora", 4)
    assert run.notes == ["finetuning_type qlora means lora with quantization_bit 4."]
    run = load_config({**BASE, "finetuning_type": "qlora", "quantization_bit": 8})
    assert (run.finetuning.finetuning_type, run.model.quantization_bit) == ("lora", 8)


def test_flash_attn_translates_to_attn_implementation():
    assert load_config({**BASE, "flash_attn": "fa2"}).model.attn_implementation == "flash_attention_2"
    assert load_config({**BASE, "flash_attn": "auto"}).model.attn_implementation is None


def test_resolved_config_round_trips():
    with open("ds.json", "w") as f:
        json.dump({"zero_optimization": {"stage": 2}}, f)
    run = load_config(write(LF_SFT_LORA), ["deepspeed=ds.json", "finetuning_type=qlora", "val_size=0.1"])
    path = run.write_yaml()
    assert path == os.path.join(run.training.output_dir, "rayfactory_config.yaml")
    with open(path) as f:
        assert f.readline() == (
            "# Resolved by RayFactory from cfg.yaml; `rayfactory train rayfactory_config.yaml` repeats it.\n"
        )
        written = yaml.safe_load(f)
    assert written["quantization_bit"] == 4 and written["deepspeed"] == {"zero_optimization": {"stage": 2}}
    again = load_config(path)
    assert again.resolved() == run.resolved()
    assert again.notes == []


def test_training_options_build_the_real_arguments():
    from transformers import Seq2SeqTrainingArguments

    run = load_config(write(LF_SFT_LORA))
    args = run.training.build(bf16=False, use_cpu=True)  # bf16 needs a GPU: workers decide, not the parser
    assert isinstance(args, Seq2SeqTrainingArguments)
    assert (args.learning_rate, args.warmup_steps, args.gradient_accumulation_steps) == (1e-4, 0.1, 8)
    assert args.lr_scheduler_type.value == "cosine"
    assert args.report_to == []  # "none", the default we set, means no reporting integration
    assert args.output_dir == run.training.output_dir


# --- errors: one exact message per mistake -------------------------------------------------


def test_unknown_key_names_file_and_closest_key():
    path = write("model_name_or_path: m\noutput_dir: o\nlora_rnak: 16\n")
    assert error_of(path) == (
        "unknown key 'lora_rnak' in cfg.yaml; did you mean 'lora_rank'? RayFactory reads LLaMA-Factory "
        "option names and transformers' TrainingArguments names; fix the spelling or remove the key."
    )


def test_unknown_key_without_a_close_match():
    assert error_of({**BASE, "zzz_qqq": 1}).startswith("unknown key 'zzz_qqq' in the config dict. RayFactory")


def test_wrong_type_names_key_value_and_expected_type():
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nlora_rank: 8.5\n")) == (
        "wrong type for 'lora_rank' in cfg.yaml: got 8.5 (a number), expected an integer."
    )
    assert error_of({**BASE, "trust_remote_code": "maybe"}) == (
        "wrong type for 'trust_remote_code' in the config dict: got 'maybe' (a string), expected true or false."
    )
    assert error_of({**BASE, "learning_rate": "fast"}) == (
        "wrong type for 'learning_rate' in the config dict: got 'fast' (a string), expected a number."
    )
    assert error_of({**BASE, "resources_per_worker": 4}) == (
        "wrong type for 'resources_per_worker' in the config dict: got 4 (a number), "
        "expected a mapping (e.g. {CPU: 1, GPU: 1})."
    )


def test_data_type_errors_come_from_data_arguments_with_the_file():
    assert error_of(write("model_name_or_path: m\noutput_dir: o\ncutoff_len: long\n")) == (
        "Data arguments: cutoff_len is 'long'; expected a positive integer (the maximum tokens per example). "
        "(in cfg.yaml)"
    )


def test_unknown_stage_suggests_the_closest():
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nstage: sfft\n")) == (
        "invalid stage in cfg.yaml: unknown stage 'sfft'; the stages are pt, sft, rm, dpo, kto, grpo, ppo. "
        "Did you mean 'sft'?"
    )
    # orpo and simpo are objectives inside dpo, and the message says so
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nstage: orpo\n")).endswith(
        "(orpo and simpo are pref_loss values of stage dpo.)"
    )


def test_placement_strategy_is_case_sensitive():
    assert error_of({**BASE, "placement_strategy": "spread"}) == (
        "wrong value for 'placement_strategy' in the config dict: got 'spread' (a string), expected one of "
        "'PACK', 'SPREAD', 'STRICT_PACK', 'STRICT_SPREAD'; did you mean 'SPREAD'?"
    )


@pytest.mark.parametrize("tuning", ["full", "freeze"])
def test_quantization_needs_lora(tuning):
    path = write(f"model_name_or_path: m\noutput_dir: o\nfinetuning_type: {tuning}\nquantization_bit: 4\n")
    assert error_of(path) == (
        f"quantization_bit 4 in cfg.yaml needs finetuning_type lora (that is QLoRA), but finetuning_type is "
        f"'{tuning}': quantized weights cannot be trained directly. Use finetuning_type: lora, "
        "or remove quantization_bit."
    )


def test_quantization_bit_must_be_4_or_8():
    assert error_of({**BASE, "quantization_bit": 3}) == (
        "wrong value for 'quantization_bit' in the config dict: got 3 (a number), expected one of 4, 8 or null."
    )


def test_pref_loss_outside_dpo():
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nstage: kto\npref_loss: orpo\n")) == (
        "invalid pref_loss in cfg.yaml: pref_loss 'orpo' selects a preference objective inside stage dpo, "
        "but stage is 'kto'. Set stage: dpo, or remove pref_loss."
    )


def test_neat_packing_with_packing_off():
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nneat_packing: true\npacking: false\n")) == (
        "Data arguments: neat_packing: true needs packing, but packing is false. Remove packing: false "
        "(neat_packing turns packing on). (in cfg.yaml)"
    )
    assert load_config({**BASE, "neat_packing": True}).data.packing is True  # LLaMA-Factory's meaning


@pytest.mark.parametrize("extra, message", [
    ({"lora_rank": 0}, "invalid lora_rank in the config dict: lora_rank must be at least 1, got 0. Try lora_rank: 8."),
    ({"lora_dropout": 1.0}, "invalid lora_dropout in the config dict: lora_dropout must be in [0, 1), got 1.0."),
    ({"finetuning_type": "full", "use_dora": True},
     "invalid use_dora in the config dict: use_dora is a LoRA option, but finetuning_type is 'full'. Remove use_dora."),
    ({"stage": "dpo", "pref_loss": "ipo", "dpo_label_smoothing": 0.1},
     "invalid dpo_label_smoothing in the config dict: dpo_label_smoothing only applies to pref_loss sigmoid, "
     "not 'ipo'. Remove it."),
    # ppo scores completions with a reward model or reward functions (cluster/rl_checks.py); neither is an error
    ({"stage": "ppo"},
     "stage ppo in the config dict needs something to score completions: reward_model (the output_dir of a "
     "stage rm run) or reward_funcs (e.g. [exact_match] or [my_rewards:score]), or both."),
])
def test_finetuning_rules(extra, message):
    assert error_of({**BASE, **extra}) == message


def test_generate_kwargs():
    assert GeneratingArguments(do_sample=False).to_generate_kwargs() == {
        "do_sample": False, "num_beams": 1, "max_new_tokens": 1024, "repetition_penalty": 1.0, "length_penalty": 1.0,
    }


def test_ray_num_workers_below_one():
    assert error_of(dict(BASE), ["ray_num_workers=0"]) == (
        "invalid ray_num_workers in command-line override 'ray_num_workers=0': ray_num_workers must be at "
        "least 1, got 0. It is the number of Ray Train workers (one per GPU when resources_per_worker has GPU: 1)."
    )


def test_lowercase_gpu_resource():
    assert error_of({**BASE, "resources_per_worker": {"gpu": 1}}) == (
        "invalid resources_per_worker in the config dict: resources_per_worker names 'gpu'; Ray's resource "
        "names are case-sensitive, so this would ask for a custom resource no node has. Write 'GPU'."
    )


def test_num_cpus_with_a_cluster_address():
    assert error_of({**BASE, "ray_address": "10.0.0.1:6379", "ray_num_cpus": 8}).startswith(
        "invalid ray_num_cpus in the config dict: ray_num_cpus sizes a local Ray, but ray_address joins"
    )


def test_threads_per_worker_must_be_positive():
    assert error_of({**BASE, "ray_threads_per_worker": 0}) == (
        "invalid ray_threads_per_worker in the config dict: ray_threads_per_worker must be at least 1, got 0 (or "
        "remove it for the default: every core for a lone worker, its CPU share for each of several)."
    )


def test_required_keys():
    assert error_of({"output_dir": "o"}) == (
        "model_name_or_path is missing in the config dict. Set it to a model folder (or a hub id), "
        "e.g. model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct."
    )
    assert error_of(write("model_name_or_path: m\n")).startswith("output_dir is missing in cfg.yaml. Set the folder")


def test_unsupported_llamafactory_feature():
    assert load_config({**BASE, "use_galore": False}).notes == []  # listed but off: fine
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nuse_galore: true\n")) == (
        "'use_galore' in cfg.yaml turns on a LLaMA-Factory feature that RayFactory does not support (yet). "
        "Remove use_galore from the config."
    )


def test_video_options_are_ignored_with_a_note_freeze_options_are_finetuning_keys_and_the_image_budget_is_a_data_key():
    # LLaMA-Factory's qwen2vl example sets video_max_pixels on image data: it loads, the key noted and
    # dropped (a dataset with a videos column is refused where its entry is read).
    loaded = load_config({**BASE, "video_max_pixels": 16384, "audio_sampling_rate": 16000})
    assert loaded.notes == [
        "ignored 'video_max_pixels' from the config dict: RayFactory reads images, not video or audio "
        "(a dataset with a videos or audios column is refused).",
        "ignored 'audio_sampling_rate' from the config dict: RayFactory reads images, not video or audio "
        "(a dataset with a videos or audios column is refused).",
    ]
    # LLaMA-Factory's defaults: the vision tower and the projector frozen, the language model trained.
    tuning = load_config(BASE).finetuning
    assert (tuning.freeze_vision_tower, tuning.freeze_multi_modal_projector, tuning.freeze_language_model,
            tuning.train_mm_proj_only) == (True, True, False, False)
    tuning = load_config(write("model_name_or_path: m\noutput_dir: o\nfreeze_vision_tower: false\n"
                               "freeze_multi_modal_projector: false\n")).finetuning
    assert (tuning.freeze_vision_tower, tuning.freeze_multi_modal_projector) == (False, False)
    # LLaMA-Factory 0.9.2's train_mm_proj_only: the projector alone, full fine-tuning only.
    tuning = load_config({**BASE, "finetuning_type": "full", "train_mm_proj_only": True}).finetuning
    assert (tuning.freeze_vision_tower, tuning.freeze_multi_modal_projector, tuning.freeze_language_model) == (
        True, False, True)
    assert "train_mm_proj_only trains a vision-language model's projector alone, which needs finetuning_type full" in (
        error_of(write("model_name_or_path: m\noutput_dir: o\nfinetuning_type: lora\ntrain_mm_proj_only: true\n")))
    data = load_config(write("model_name_or_path: m\noutput_dir: o\nimage_max_pixels: 262144\n")).data
    assert (data.image_max_pixels, data.image_min_pixels) == (262144, 32 * 32)
    assert "image_min_pixels (2000000) is above image_max_pixels (262144)" in error_of(
        write("model_name_or_path: m\noutput_dir: o\nimage_max_pixels: 262144\nimage_min_pixels: 2000000\n"))
    assert "image_max_pixels" in error_of(write("model_name_or_path: m\noutput_dir: o\nimage_max_pixels: 0\n"))


def test_duplicate_yaml_key():
    assert error_of(write("model_name_or_path: m\nlora_rank: 8\noutput_dir: o\nlora_rank: 16\n")) == (
        "key 'lora_rank' appears twice in cfg.yaml (lines 2 and 4); YAML would silently keep only the last one. "
        "Delete one of them."
    )


def test_invalid_yaml():
    assert error_of(write("model_name_or_path: m\nlora_rank: [8\n")) == (
        "cfg.yaml is not valid YAML: expected ',' or ']', but got '<stream end>' at line 3, column 1. "
        "Fix the file's syntax."
    )


def test_missing_file(tmp_path):
    assert error_of("nope.yaml") == (
        f"config file nope.yaml not found (looked for {tmp_path / 'nope.yaml'}). Check the path; relative "
        "paths start from the current directory."
    )


def test_top_level_must_be_a_mapping():
    assert error_of(write("- lora_rank: 8\n")) == (
        "config file cfg.yaml must be a mapping of option: value lines, but its top level is a list. "
        "Write one option per line, e.g. lora_rank: 8."
    )


def test_ray_address_and_storage_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert RayArguments().resolved_address() is None  # start a local Ray
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # what `ray job submit` sets
    assert RayArguments().resolved_address() == "http://127.0.0.1:8265"
    assert RayArguments(ray_address="10.0.0.1:6379").resolved_address() == "10.0.0.1:6379"
    assert RayArguments(ray_storage_path="runs").ray_storage_path == str(tmp_path / "runs")
    assert RayArguments(ray_storage_path="s3://bucket/runs").ray_storage_path == "s3://bucket/runs"
    assert RayArguments().ray_storage_path is None  # output_dir/ray_results, set where the config is read


def test_unknown_stage_is_refused_with_the_table_s_stages():
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nstage: sfft\n")).startswith(
        "invalid stage in cfg.yaml: unknown stage 'sfft'; the stages are pt, sft, rm, dpo, kto, grpo, ppo."
    )


def test_yaml_1_1_words_stay_words_for_choices_and_mean_booleans_for_flags():
    """`save_strategy=no` is the word no (PyYAML would read it as False); do_sample=off is false."""
    cfg = load_config({**BASE, "eval_strategy": "no"}, ["save_strategy=no", "do_sample=off", "packing=yes"])
    assert (cfg.training.save_strategy, cfg.generating.do_sample, cfg.data.packing) == ("no", False, True)
    path = write("model_name_or_path: m\noutput_dir: o\nsave_strategy: no\nbf16: off\ntrain_on_prompt: on\n")
    cfg = load_config(path)
    assert (cfg.training.save_strategy, cfg.training.bf16, cfg.data.train_on_prompt) == ("no", False, True)


def test_llama_factory_ppo_options_are_read_by_stage_ppo():
    """LLaMA-Factory's ppo_* keys were once dropped with a note; stage ppo now reads them as written."""
    cfg = load_config({**BASE, "stage": "ppo", "reward_funcs": ["exact_match"], "ppo_epochs": 2,
                       "ppo_buffer_size": 2, "ppo_target": 3.0, "ppo_score_norm": True, "ppo_whiten_rewards": True})
    rl = cfg.rl
    assert (rl.ppo_epochs, rl.ppo_buffer_size, rl.ppo_target, rl.ppo_score_norm, rl.ppo_whiten_rewards) == (
        2, 2, 3.0, True, True)
    assert cfg.notes == []
    resolved = cfg.resolved()
    assert (resolved["ppo_epochs"], resolved["ppo_buffer_size"], resolved["ppo_target"]) == (2, 2, 3.0)
    # A PPO step is LLaMA-Factory's: per_device_train_batch_size (transformers' default 8) x
    # gradient_accumulation_steps 1 x ppo_buffer_size 2 x 1 worker prompts.
    assert rl.rollout_batch_size == 16


@pytest.mark.parametrize("key, value, module, extra", [
    ("deepspeed", "ds_z2_config.json", "deepspeed", "deepspeed"),
    ("quantization_bit", 4, "bitsandbytes", "qlora"),
])
def test_a_config_needing_a_missing_extra_fails_before_ray(monkeypatch, key, value, module, extra):
    """Without the package the run would die inside every Ray worker with ModuleNotFoundError."""
    from cluster.config import ConfigError

    monkeypatch.setitem(sys.modules, module, None)  # how Python spells "this module is not installed"
    if key == "deepspeed":
        value = os.path.join(REPO, "configs", "deepspeed", value)
    with pytest.raises(ConfigError) as err:
        load_config({**BASE, key: value})
    assert str(err.value) == (
        f"{key} in the config dict needs the Python package {module!r}, which is not installed here. "
        f"Install RayFactory's {extra!r} extra (pip install -e '.[{extra}]' in the RayFactory folder), or remove {key}."
    )
