"""The memory planner (stages/training/memory_plan.py): gradient checkpointing on exactly when the estimate
needs it, estimates that match real models, and the user's own setting always winning."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from registries.datasets.data_args import DataArguments
from stages.training.adapters import apply_finetuning, count_parameters
from stages.run_args import FinetuningArguments, ModelArguments, TrainingOptions
from stages.job import JobSpec, StageJob
from stages.training.memory_plan import (GIB, HEADROOM, MemoryBudget, ModelShape, TrainingShape, plan_memory,
                                trainable_parameters, training_shape)

LLAMA_7B = ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                      intermediate_size=11008, vocab_size=32000)
GPU_24 = MemoryBudget(24 * GIB, "free GPU memory")


def test_a_tiny_model_trains_without_checkpointing_and_says_why():
    tiny = ModelShape(64, 2, 4, 2, 16, 128, 1024)
    plan = plan_memory(tiny, TrainingShape("full", micro_batch_tokens=8 * 512, sequence_length=512),
                       MemoryBudget(11 * GIB, "available memory"))
    assert plan.gradient_checkpointing is False
    assert plan.without_checkpointing_gib < 0.1 and plan.budget_gib == 11.0
    assert plan.reason == ("memory plan: gradient checkpointing off: weights + gradients + optimizer + activations "
                           "~0.1 GiB fit 9.9 GiB (90% of available memory, 11.0 GiB)")


def test_a_7b_full_fine_tune_on_24_gib_checkpoints_and_warns_it_will_not_fit_anyway():
    plan = plan_memory(LLAMA_7B, TrainingShape("full", 2048, 2048), GPU_24)
    assert plan.gradient_checkpointing is True
    # 6.7B bf16 weights and gradients (12.5 GiB each) and AdamW's two bf16 states (25 GiB)
    assert plan.weights_gib == pytest.approx(12.55, abs=0.01) and plan.gradients_gib == plan.weights_gib
    assert plan.optimizer_gib == pytest.approx(2 * plan.weights_gib)
    assert plan.with_checkpointing_gib > HEADROOM * 24
    assert "still over 21.6 GiB" in plan.reason and "expect running out of memory" in plan.reason


def test_lora_of_the_same_7b_fits_where_full_fine_tuning_does_not():
    lora = plan_memory(LLAMA_7B, TrainingShape("lora", 512, 512), GPU_24)
    assert lora.gradient_checkpointing is False
    assert lora.gradients_gib < 0.1 and lora.optimizer_gib < 0.2  # 20M fp32 adapter parameters
    full = plan_memory(LLAMA_7B, TrainingShape("full", 512, 512), GPU_24)
    assert full.gradient_checkpointing is True and full.without_checkpointing_gib > 3 * lora.without_checkpointing_gib


def test_a_budget_that_only_checkpointing_fits_turns_it_on():
    run = TrainingShape("lora", 2048, 2048)
    plan = plan_memory(LLAMA_7B, run, GPU_24)
    assert plan.with_checkpointing_gib <= HEADROOM * 24 < plan.without_checkpointing_gib
    assert plan.gradient_checkpointing is True
    assert plan.reason == (f"memory plan: gradient checkpointing on: ~{plan.without_checkpointing_gib:.1f} GiB without "
                           f"it > 21.6 GiB (90% of free GPU memory, 24.0 GiB); with it ~{plan.with_checkpointing_gib:.1f} GiB")
    # Activations are what checkpointing saves: every layer keeps its input only, one layer is recomputed.
    assert plan.activations_gib > 10 * plan.checkpointed_activations_gib
    roomy = plan_memory(LLAMA_7B, run, MemoryBudget(48 * GIB, "free GPU memory"))
    assert roomy.gradient_checkpointing is False


def test_eager_attention_adds_the_sequence_squared_scores():
    sdpa = plan_memory(LLAMA_7B, TrainingShape("lora", 4096, 4096, attention="sdpa"), GPU_24)
    eager = plan_memory(LLAMA_7B, TrainingShape("lora", 4096, 4096, attention="eager"), GPU_24)
    # 32 layers x 4096 tokens x 32 heads x 4096 keys x (fp32 softmax + its bf16 copy)
    assert (eager.activations_gib - sdpa.activations_gib) * GIB == 32 * 4096 * 32 * 4096 * 6
    assert eager.weights_gib == sdpa.weights_gib


def test_chunked_loss_shrinks_the_logits_term():
    qwen_7b = ModelShape(3584, 28, 28, 4, 128, 18944, 152064)
    plain = plan_memory(qwen_7b, TrainingShape("lora", 8192, 8192), GPU_24)
    chunked = plan_memory(qwen_7b, TrainingShape("lora", 8192, 8192, chunked_loss=True, chunk_tokens=441), GPU_24)
    assert plain.logits_gib == pytest.approx(8192 * 152064 * 10 / GIB)  # 11.6 GiB: bf16 + fp32 + fp32 grad
    assert chunked.logits_gib < 0.7


def test_freeze_tuning_backpropagates_through_its_layers_only():
    last_two = plan_memory(LLAMA_7B, TrainingShape("freeze", 2048, 2048, freeze_trainable_layers=2), GPU_24)
    first_two = plan_memory(LLAMA_7B, TrainingShape("freeze", 2048, 2048, freeze_trainable_layers=-2), GPU_24)
    assert first_two.activations_gib == pytest.approx(16 * last_two.activations_gib)  # 32 layers vs 2
    assert last_two.gradients_gib == first_two.gradients_gib


# ---------------------------------------------------------------- the estimate against real models

SHAPES = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_the_parameter_estimate_matches_a_real_model_built_from_the_same_config(family, tie):
    torch.manual_seed(0)
    if family == "qwen2":  # q/k/v carry biases the estimate leaves out
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES, tie_word_embeddings=tie))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SHAPES, tie_word_embeddings=tie))
    shape = ModelShape.from_config(model.config)
    real = sum(p.numel() for p in model.parameters())
    assert shape.parameters == pytest.approx(real, rel=0.03)
    assert family == "qwen2" or shape.parameters == real
    # What each finetuning type trains, against the real adapters.
    for kind, options in [("full", {}), ("freeze", {"freeze_trainable_layers": 2}), ("lora", {"lora_rank": 4})]:
        tuning = FinetuningArguments(finetuning_type=kind, **options)
        trained, _ = count_parameters(apply_finetuning(model, tuning, ModelArguments()))
        run = TrainingShape(kind, lora_rank=4, freeze_trainable_layers=2)
        assert trainable_parameters(shape, run) == pytest.approx(trained, rel=0.03), kind
        model.requires_grad_(True)


# ---------------------------------------------------------------- on the worker: StageJob


@pytest.fixture
def model_dir(tmp_path):
    LlamaConfig(**SHAPES).save_pretrained(tmp_path)  # the planner reads config.json only
    return str(tmp_path)


def stage_job(model_dir, tmp_path, budget_bytes, **training):
    spec = JobSpec(model=ModelArguments(model_name_or_path=model_dir), data=DataArguments(dataset="x", cutoff_len=256),
                   finetuning=FinetuningArguments(stage="sft", finetuning_type="full"),
                   training=TrainingOptions({"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4,
                                             **training}))
    return StageJob(spec=spec, training_args=spec.training_arguments(use_cpu=True), train_dataset=None,
                    memory_budget=MemoryBudget(budget_bytes, "the worker's Ray memory resource"))


def test_the_planner_sets_gradient_checkpointing_only_when_the_user_did_not(model_dir, tmp_path):
    roomy, cramped = stage_job(model_dir, tmp_path, 8 * GIB), stage_job(model_dir, tmp_path, 8 * 2**20)
    assert roomy.plan_memory().gradient_checkpointing is False and roomy.training_args.gradient_checkpointing is False
    plan = cramped.plan_memory()
    assert plan.gradient_checkpointing is True and cramped.training_args.gradient_checkpointing is True
    assert cramped.notes == [plan.reason] and "of the worker's Ray memory resource, 0.0 GiB" in plan.reason
    # A value the user set wins, both ways.
    forced_on = stage_job(model_dir, tmp_path, 8 * GIB, gradient_checkpointing=True)
    forced_off = stage_job(model_dir, tmp_path, 8 * 2**20, gradient_checkpointing=False)
    assert forced_on.plan_memory() is None and forced_on.training_args.gradient_checkpointing is True
    assert forced_off.plan_memory() is None and forced_off.training_args.gradient_checkpointing is False
    assert forced_on.notes == forced_off.notes == []


def test_the_run_shape_comes_from_the_config(model_dir, tmp_path):
    job = stage_job(model_dir, tmp_path, GIB, bf16=False)
    shape = training_shape(job.spec, job.training_args, ModelShape.from_config(LlamaConfig(**SHAPES)))
    assert (shape.micro_batch_tokens, shape.sequence_length, shape.finetuning_type) == (4 * 256, 256, "full")
    assert (shape.weight_dtype, shape.mixed_precision, shape.attention) == ("float32", False, "sdpa")
    assert shape.chunked_loss is False and shape.reference_copy is False  # a 512-token vocabulary: auto is off
    dpo = dataclasses.replace(job.spec, finetuning=FinetuningArguments(stage="dpo", finetuning_type="full",
                                                                       chunked_loss=None))
    paired = training_shape(dpo, job.training_args, ModelShape.from_config(LlamaConfig(**SHAPES)))
    assert paired.micro_batch_tokens == 2 * 4 * 256 and paired.reference_copy is True


def test_a_preference_run_chunks_its_log_probs_and_drops_a_precomputed_reference(model_dir, tmp_path):
    job = stage_job(model_dir, tmp_path, GIB, bf16=False)
    shape = ModelShape.from_config(LlamaConfig(**SHAPES))

    def dpo(**tuning):
        spec = dataclasses.replace(job.spec, finetuning=FinetuningArguments(stage="dpo", finetuning_type="full", **tuning))
        return training_shape(spec, job.training_args, shape)

    assert dpo(chunked_loss=True).chunked_loss is True  # the summed log-probs take the head in chunks too
    assert dpo().reference_copy is True  # null decides on the data, after the plan: the copy is counted
    assert dpo(precompute_ref_log_probs=True).reference_copy is False  # freed before the optimizer exists
    kept = plan_memory(shape, dpo(), MemoryBudget(64 * GIB, "test"))
    freed = plan_memory(shape, dpo(precompute_ref_log_probs=True), MemoryBudget(64 * GIB, "test"))
    assert freed.weights_gib == pytest.approx(kept.weights_gib / 2)
