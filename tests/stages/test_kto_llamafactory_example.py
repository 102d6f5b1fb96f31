"""LLaMA-Factory's examples/train_lora/qwen3_lora_kto.yaml (LoRA, so the reference is the policy with
its adapter off; batch 1 with 8 accumulation steps; bf16; qwen3_nothink; kto_en_demo) on a 2-layer
Qwen3 with Qwen3's genuine tokenizer, in process: the trainer the run builds, with prompts attended
once (shared_prefix.py), gives the losses, KL estimates and gradients of the full KL passes.

Issue 62: this run died at its first step ("The KL pass attended 2 layer(s) ... but 4 were kept").
Qwen3's 151,669-id vocabulary turns chunked_loss on, whose probe of a model it meets for the first
time (a forward of four tokens) ran inside the recording of the answers' prompt keys, and kept its
layers too. A small vocabulary (tiny:qwen3's own tokenizer) never probes, so it never showed there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cluster.config import load_config
from stages.job import StageJob
from stages.loading import load_tokenizer_and_template
from stages.recipes.kto import KTOTrainer
from stages.training.reference import disable_dropout
from stages.training.per_example_attention import PER_EXAMPLE_SDPA, use_attention
from stages.training.shared_prefix import SHARED_PREFIX_SDPA
from tests.llamafactory import lf_example, tiny_qwen3_with_its_tokenizer

ACCUMULATION = 8  # the example's gradient_accumulation_steps, each of one row


def trainer_as_the_run_builds_it(cfg, tokenizer, rows):
    from datasets import Dataset

    spec = cfg.job_spec()
    job = StageJob(spec, spec.training_arguments(use_cpu=True), train_dataset=Dataset.from_list(rows))
    model = job.load_model(tokenizer)
    disable_dropout(model)
    reference = job.build_reference(model, tokenizer)
    # LoRA starts as its base (B = 0): every reward would be 0. Seeded A and B move the policy away
    # from its reference, the same in both trainers.
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
    return job.build_trainer(KTOTrainer, model, tokenizer, finetuning_args=spec.finetuning, reference=reference)


def accumulated_step(trainer, rows):
    """As one optimizer step of the example: each row a batch, its loss / 8 backpropagated."""
    losses, kl_logps = [], []
    with trainer.accelerator.autocast():
        for row in rows:
            batch = trainer.data_collator([row])
            loss, _ = trainer.batch_loss(trainer.model, batch)
            (loss / ACCUMULATION).backward()
            losses.append(loss.item())
            with torch.no_grad():  # the KL answers' log-probs under the policy and the reference, before clamping
                _, _, policy = trainer.answer_and_kl_logps(trainer.model, batch)
                reference = trainer.reference_columns(trainer.model, batch)["kl_ref_logps"]
            kl_logps.append((policy.item(), reference.item()))
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return losses, kl_logps, grads


def test_llamafactory_kto_example_on_qwen3_attends_prompts_once_with_the_full_passes_losses(tmp_path):
    model_dir = tiny_qwen3_with_its_tokenizer()
    cfg = load_config(lf_example("qwen3_lora_kto", model=str(model_dir), output_dir=str(tmp_path / "out"),
                                 max_samples=ACCUMULATION))
    tokenizer, template = load_tokenizer_and_template(cfg.model, cfg.data)
    assert len(tokenizer) == 151669 and template.name == "qwen3_nothink"
    cfg = cfg.with_template(template.name)
    rows = cfg.job_spec().stage.tokenize_here(tokenizer, template, dataclasses.replace(cfg.data))
    assert len(rows) == ACCUMULATION

    results = {}
    for share in (True, False):  # the shared path first: its trainer's first pass (and probe) is a recording
        trainer = trainer_as_the_run_builds_it(cfg, tokenizer, rows)
        collator = trainer.data_collator
        assert collator.share_prompts  # what the run chooses: one padding-free row on sdpa
        if not share:  # the switch: the KL answers in full, their prompts attended again
            collator.share_prompts = False
            use_attention(trainer.model, PER_EXAMPLE_SDPA)
        assert trainer.model.config._attn_implementation == (SHARED_PREFIX_SDPA if share else PER_EXAMPLE_SDPA)
        results[share] = accumulated_step(trainer, rows)
        assert trainer.reference.kind == "adapter_disabled"
        assert None not in trainer._chunking.values()  # the head ran in chunks: the probe ran
        bf16 = trainer.accelerator.mixed_precision == "bf16"  # autocast where the CPU has bf16 (cpu_precision.py)

    (shared_losses, shared_kl, shared_grads), (losses, kl, grads) = results[True], results[False]
    assert len(set(losses)) > 1  # policy and reference differ
    assert any(policy > reference for policy, reference in kl)  # a KL estimate above 0: the KL passes count
    # Under bf16 autocast too: the kept keys are the answers' pass's own, rounded as the full pass rounds them.
    tolerance = dict(rel=1e-4, abs=1e-5) if bf16 else dict(rel=1e-5, abs=1e-6)
    assert shared_losses == pytest.approx(losses, **tolerance)
    assert [v for pair in shared_kl for v in pair] == pytest.approx([v for pair in kl for v in pair], **tolerance)
    assert shared_grads.keys() == grads.keys() and grads
    for name, grad in grads.items():
        assert torch.allclose(shared_grads[name], grad, rtol=tolerance["rel"], atol=tolerance["abs"]), name
