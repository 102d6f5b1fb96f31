"""Each fine-tuning type trains exactly the parameters it promises, end to end through Ray Train.

freeze: only the last N layers move; LoRA: the adapter targets the named modules and carries
rsLoRA/DoRA into adapter_config.json (and into the weights); pt: packed blocks of cutoff_len
from the pretraining text, and the loss falls; a wrong lora_target is one clear error.
"""

from __future__ import annotations

import json
import math
import os

import pyarrow.parquet as pq
import pytest
import ray
import torch
import yaml
from safetensors.torch import load_file

from cluster.cli import main
from cluster.driver import run_exp
from registries.models import load_tokenizer
from registries.templates import get_template
from registries.tokenize.pretrain import bos_id, document_eos_id
from stages.training.callbacks import read_log
from stages.loading import resolve_model_path
from tests.e2e.conftest import own_lines

BASE = "tiny:qwen2"


def base_dir() -> str:
    return resolve_model_path(BASE)


def test_freeze_trains_only_the_last_layer(ray_session, sft_config):
    result = run_exp(sft_config(finetuning_type="freeze", freeze_trainable_layers=1, max_steps=5))

    with open(os.path.join(base_dir(), "config.json"), encoding="utf-8") as f:
        last = json.load(f)["num_hidden_layers"] - 1
    before = load_file(os.path.join(base_dir(), "model.safetensors"))
    after = load_file(os.path.join(result.output_dir, "model.safetensors"))
    assert sorted(after) == sorted(before)
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    expected = sorted(k for k in before if k.startswith(f"model.layers.{last}."))
    assert expected, "the tiny model's layer names changed; update this test"
    # Every parameter of the last layer moved, and nothing else did by a single bit
    # (embeddings, lm_head, the final norm and layers 0..last-1 included).
    assert changed == expected


def test_lora_targets_named_modules_with_rslora_and_dora(ray_session, sft_config):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = run_exp(sft_config(finetuning_type="lora", lora_target="q_proj,v_proj", lora_rank=8,
                                use_rslora=True, use_dora=True, max_steps=3))
    out = result.output_dir

    with open(os.path.join(out, "adapter_config.json"), encoding="utf-8") as f:
        adapter = json.load(f)
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    assert adapter["use_rslora"] is True and adapter["use_dora"] is True
    assert (adapter["r"], adapter["lora_alpha"]) == (8, 16)
    assert not os.path.exists(os.path.join(out, "model.safetensors"))  # an adapter, not a full copy

    weights = load_file(os.path.join(out, "adapter_model.safetensors"))
    modules = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in weights}
    assert modules == {"q_proj", "v_proj"}
    kinds = {k.split(".lora_")[1].split(".")[0] for k in weights}
    assert kinds == {"A", "B", "magnitude_vector"}  # DoRA adds a magnitude vector per module
    # lora_B starts at zero: non-zero means the adapter was trained and saved after training.
    assert all(weights[k].abs().sum() > 0 for k in weights if ".lora_B." in k)

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir()), out)
    scalings = {m.scaling["default"] for name, m in model.named_modules() if name.endswith(("q_proj", "v_proj"))}
    assert len(scalings) == 1 and scalings.pop() == pytest.approx(16 / math.sqrt(8))  # rsLoRA: alpha/sqrt(r), not 2


def test_pt_packs_blocks_of_cutoff_len_and_loss_falls(ray_session, sft_config, tmp_path):
    cutoff = 64
    config = sft_config(stage="pt", dataset="pretrain_jsonl", cutoff_len=cutoff, max_steps=30,
                        tokenized_path=str(tmp_path / "tokenized"))
    result = run_exp(config)

    # The blocks, in file order, are the documents' tokens (each followed by eos) cut every
    # cutoff_len tokens; the tail that fills no block is dropped. 200 rows are one packing window.
    tokenizer = load_tokenizer(base_dir())
    template = get_template("qwen")
    template.fix_tokenizer(tokenizer)
    assert bos_id(tokenizer) is None  # Qwen adds no bos, so a block is all text
    with open(os.path.join(config["dataset_dir"], "pretrain.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    eos = document_eos_id(tokenizer, template)
    stream = [t for text in texts for t in tokenizer.encode(text, add_special_tokens=False) + [eos]]
    n_blocks = len(stream) // cutoff

    blocks = pq.read_table(tmp_path / "tokenized" / "train").to_pydict()
    assert result.data_stats["train_examples"] == n_blocks == len(blocks["input_ids"])
    assert all(len(ids) == cutoff for ids in blocks["input_ids"])
    assert blocks["labels"] == blocks["input_ids"]  # pt trains on every token
    assert [t for ids in blocks["input_ids"] for t in ids] == stream[: n_blocks * cutoff]

    losses = [r["loss"] for r in read_log(result.output_dir) if "loss" in r]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_unknown_lora_target_is_one_clear_error_before_ray_starts(sft_config, tmp_path, capsys):
    path = tmp_path / "bad_target.yaml"
    path.write_text(yaml.safe_dump(sft_config(finetuning_type="lora", lora_target="q_proj,query_proj", max_steps=2)))
    ray_was_up = ray.is_initialized()

    code = main(["train", str(path)])

    err = capsys.readouterr().err
    assert code == 2, err
    assert not any("Traceback" in line for line in own_lines(err))
    assert ray.is_initialized() == ray_was_up  # judged on a meta-device skeleton in the driver
    assert not os.path.exists(tmp_path / "out" / "ray")
    message = [line for line in err.splitlines() if line.startswith("rayfactory: error:")]
    assert message == [
        "rayfactory: error: lora_target ['query_proj'] not found in the model; its linear layers are "
        "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'] (or use lora_target: all)."
    ], err
