"""QLoRA on CPU: a bitsandbytes 4-bit base with a LoRA adapter, trained in a Ray Train worker;
and the 8-bit load path, checked in-process (a second Ray run would only add start-up time)."""

from __future__ import annotations

import json
import os
import sys

import ray.cloudpickle
import torch
from transformers import TrainerCallback

from cluster.driver import run_exp
from stages.training.callbacks import read_log

# Ray pickles the callbacks to the workers, which cannot import this test module by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROBE_IDS = [[5, 17, 42, 99, 7, 250, 3, 64]]
STEPS = 15


class InspectModel(TrainerCallback):
    """In the worker: record what the trained model really is, and its logits after training."""

    def __init__(self, path: str):
        self.path = path
        self.facts: dict = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import bitsandbytes as bnb

        linear4 = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        self.facts.update(
            linear4bit=len(linear4),
            plain_linear_in_layers=sum(
                1 for n, m in model.named_modules()
                if type(m) is torch.nn.Linear and ".layers." in n and "lora_" not in n
            ),
            weight_dtypes=sorted({str(m.weight.dtype) for m in linear4}),
            quant_types=sorted({m.weight.quant_state.quant_type for m in linear4}),
            trainable=sorted({n.split(".")[-3] for n, p in model.named_parameters() if p.requires_grad}),
            footprint=model.get_memory_footprint(),
        )

    def on_train_end(self, args, state, control, model=None, **kwargs):
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(PROBE_IDS)).logits
        model.train(was_training)
        self.facts["logits"] = logits.tolist()
        if state.is_world_process_zero:
            with open(self.path, "w", encoding="utf-8") as f:
                json.dump(self.facts, f)


def _load(quantization_bit, adapter=None, is_trainable=False):
    """The project's own load path (stages.loading), as chat/export would reload an adapter."""
    from registries.models import load_tokenizer
    from stages.run_args import FinetuningArguments, ModelArguments
    from stages.loading import load_model, resolve_model_path

    model_args = ModelArguments(model_name_or_path="tiny:qwen2", quantization_bit=quantization_bit,
                                adapter_name_or_path=[adapter] if adapter else None)
    tokenizer = load_tokenizer(resolve_model_path("tiny:qwen2"))
    return load_model(model_args, FinetuningArguments(finetuning_type="lora"), tokenizer, is_trainable=is_trainable)


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE_IDS)).logits


def test_qlora_4bit_trains_in_worker_and_adapter_reloads(ray_session, sft_config, tmp_path):
    facts_path = tmp_path / "facts.json"
    result = run_exp(
        sft_config(finetuning_type="qlora", lora_rank=8, learning_rate=1.0e-2, max_steps=STEPS),
        callbacks=[InspectModel(str(facts_path))],
    )
    out = result.output_dir
    facts = json.loads(facts_path.read_text())

    # The alias became lora + 4-bit, and the resolved config says so.
    resolved = (open(os.path.join(out, "rayfactory_config.yaml")).read())
    assert "quantization_bit: 4" in resolved and "finetuning_type: lora" in resolved

    # The base really is 4-bit NF4: every linear layer of the decoder is a bnb Linear4bit holding
    # packed uint8 weights, only LoRA matrices train, and the model is smaller than in fp32.
    assert facts["linear4bit"] == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    assert facts["plain_linear_in_layers"] == 0
    assert facts["weight_dtypes"] == ["torch.uint8"]
    assert facts["quant_types"] == ["nf4"]
    assert facts["trainable"] == ["lora_A", "lora_B"]
    fp32_footprint = _load(None, is_trainable=False).get_memory_footprint()
    assert facts["footprint"] < 0.85 * fp32_footprint, (facts["footprint"], fp32_footprint)

    # It trains: every step logged, the loss falls.
    records = [r for r in read_log(out) if "loss" in r]
    assert [r["current_steps"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    assert sum(losses[-3:]) / 3 < 0.95 * sum(losses[:3]) / 3, losses

    # The adapter is saved alone (no full weights) and reloads onto a fresh 4-bit base into the
    # very model the worker ended with: same logits; and those differ from the bare base's.
    assert os.path.exists(os.path.join(out, "adapter_model.safetensors"))
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    adapter_config = json.loads(open(os.path.join(out, "adapter_config.json")).read())
    assert adapter_config["r"] == 8
    reloaded = _load(4, adapter=out)
    assert type(reloaded).__name__ == "PeftModelForCausalLM"
    worker_logits = torch.tensor(facts["logits"])
    assert torch.allclose(_logits(reloaded), worker_logits, atol=1e-4)
    assert (_logits(_load(4)) - worker_logits).abs().max() > 1e-2


def test_8bit_base_loads_as_int8_and_lora_trains_on_cpu(tmp_path):
    import bitsandbytes as bnb

    model = _load(8, is_trainable=True)
    linear8 = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert len(linear8) == 2 * 7
    assert {m.weight.dtype for m in linear8} == {torch.int8}
    assert {n.split(".")[-3] for n, p in model.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}

    # A few optimizer steps on one batch: the 8-bit forward/backward reaches the adapter.
    ids = torch.tensor(PROBE_IDS * 4)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses

    model.save_pretrained(tmp_path / "adapter")
    trained = _logits(model)
    reloaded = _load(8, adapter=str(tmp_path / "adapter"))
    assert torch.allclose(_logits(reloaded), trained, atol=1e-4)
