"""bf16 on a CPU worker (stages/training/cpu_precision.py): what loads in which dtype, when the
worker falls back to float32, and the loss-agreement bound the default rests on."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from registries.tokenize import IGNORE_INDEX
from stages.run_args import ModelArguments
from stages.training import cpu_precision
from stages.training.cpu_precision import bf16_note, training_load_dtype

# The stated tolerance (benchmarks/README.md, "bf16 on a CPU worker"): over the first steps of
# training, bf16 autocast over float32 weights stays within 1% of float32's loss at every step.
LOSS_AGREEMENT = 0.01


def test_a_cpu_worker_keeps_the_weights_that_train_in_float32():
    auto = ModelArguments(model_name_or_path="m")
    assert training_load_dtype(auto, "full", bf16=True, fp16=False, use_cpu=True) == "float32"
    assert training_load_dtype(auto, "freeze", bf16=True, fp16=False, use_cpu=True) == "float32"
    assert training_load_dtype(auto, "lora", bf16=True, fp16=False, use_cpu=True) == "bfloat16"  # frozen base
    assert training_load_dtype(auto, "full", bf16=True, fp16=False, use_cpu=False) == "bfloat16"  # GPUs unchanged
    assert training_load_dtype(auto, "full", bf16=False, fp16=False, use_cpu=True) == "float32"
    explicit = ModelArguments(model_name_or_path="m", torch_dtype="bfloat16")
    assert training_load_dtype(explicit, "full", bf16=True, fp16=False, use_cpu=True) == "bfloat16"  # as set


def test_a_cpu_without_native_bf16_trains_in_float32_and_says_why(monkeypatch):
    monkeypatch.setattr(cpu_precision, "cpu_has_bf16", lambda: False)
    note = bf16_note(True, use_cpu=True)
    assert note and "avx512_bf16" in note and "float32" in note
    assert bf16_note(True, use_cpu=False) is None and bf16_note(False, use_cpu=True) is None
    monkeypatch.setattr(cpu_precision, "cpu_has_bf16", lambda: True)
    assert bf16_note(True, use_cpu=True) is None


def test_the_job_turns_bf16_off_only_where_the_cpu_lacks_it(monkeypatch):
    from stages.job import JobSpec
    from stages.run_args import FinetuningArguments, TrainingOptions
    from registries.datasets.data_args import DataArguments

    spec = JobSpec(model=ModelArguments(model_name_or_path="m"), data=DataArguments(),
                   finetuning=FinetuningArguments(stage="sft"),
                   training=TrainingOptions({"output_dir": "/tmp/x", "bf16": True}))
    monkeypatch.setattr(cpu_precision, "cpu_has_bf16", lambda: False)
    assert spec.training_arguments(use_cpu=True).bf16 is False
    monkeypatch.setattr(cpu_precision, "cpu_has_bf16", lambda: True)
    assert spec.training_arguments(use_cpu=True).bf16 is True


def train_losses(autocast: bool, steps: int = 16) -> list[float]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (8, 24), generator=gen) for _ in range(2)]
    losses = []
    for step in range(steps):
        prompt = prompts[step % 2]  # two batches seen again and again: the loss falls within a few steps
        ids = torch.cat([prompt, prompt.flip(-1)], dim=1)
        labels = ids.clone()
        labels[:, :24] = IGNORE_INDEX
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_autocast_over_float32_weights_keeps_the_loss_within_the_stated_bound():
    fp32, bf16 = train_losses(False), train_losses(True)
    assert fp32[-1] < fp32[0] - 0.5  # the run learns, so the curves are compared while they move
    worst = max(abs(a - b) / a for a, b in zip(fp32, bf16))
    assert worst < LOSS_AGREEMENT, f"bf16 autocast strays {worst:.2%} from float32"
    assert worst > 0  # and autocast did change the arithmetic (a run that ignored it would match exactly)
