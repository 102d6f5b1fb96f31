"""LLaMA-Factory's examples/train_lora YAMLs, their keys as they are, on a tiny: model and our data/:
each loads, names datasets our data/ has under LLaMA-Factory's demo names, and those datasets fit
the stage (config level, no Ray, no model). One of them trains for real in
tests/e2e/test_llamafactory_example_runs.py, the kto one on Qwen3's genuine tokenizer."""

from __future__ import annotations

import pytest

from cluster.config import load_config
from fabric.data.prepare import check_data
from tests.llamafactory import LF_LORA_EXAMPLES, lf_example

# Keys of LLaMA-Factory's that we read differently, as the notes of load_config say; anything
# else in a note would be a key these examples lose.
EXPECTED_NOTES = ("ignored 'preprocessing_num_workers'", "translated warmup_ratio",
                  "ignored 'video_max_pixels'")
STAGES = {"qwen3_lora_sft": "sft", "qwen3_lora_dpo": "dpo", "qwen3_lora_kto": "kto", "qwen3_lora_reward": "rm",
          "qwen3_lora_pretrain": "pt", "llama3_lora_sft": "sft", "qwen2vl_lora_sft": "sft"}


@pytest.mark.parametrize("name", list(LF_LORA_EXAMPLES))
def test_llamafactory_example_loads_with_our_data_under_its_names(name, tmp_path):
    config = lf_example(name, output_dir=str(tmp_path / "out"))
    cfg = load_config(config)
    spec = cfg.job_spec()
    assert spec.stage.name == STAGES[name] and cfg.finetuning.finetuning_type == "lora"
    assert cfg.training.values["per_device_train_batch_size"] == 1
    assert cfg.training.values["gradient_accumulation_steps"] == 8 and cfg.training.values["bf16"] is True
    for note in cfg.notes:
        assert note.startswith(EXPECTED_NOTES), note
    check_data(cfg.data, spec.stage)  # every name is in data/dataset_info.json, its file exists, and it fits
