"""The weights the rollout engines get, and the log-probs everything is compared with (no Ray).

``export_state_dict`` must give exactly what a fresh ``AutoModelForCausalLM`` of the base loads,
for a full model, a tied one and a LoRA ``PeftModel``, and leave the policy bit-identical;
``completion_logprobs`` must not depend on how sequences are batched and padded.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from registries.models.tiny import tiny_model_path
from stages.rl.workers.logprobs import completion_logprobs, token_logprobs
from stages.rl.workers.weights import bytes_to_state_dict, export_state_dict, state_dict_to_bytes

PROMPTS = [[1, 20, 30, 40, 50], [1, 7], [3, 9, 27]]
COMPLETIONS = [[11, 12, 13], [5, 6, 7, 8, 9, 10], []]


@pytest.fixture(scope="module")
def path():
    return tiny_model_path("qwen2", hidden_size=64, num_heads=2)


def fresh(path, **config_overrides):
    config = AutoConfig.from_pretrained(path, **config_overrides)
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def loaded(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def logits(model, ids=((1, 20, 30, 40, 50, 60),)):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def lora(model, **kwargs):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # init_lora_weights=False: B is random too, so the adapter changes the outputs
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                            **kwargs)).eval()


def test_full_model_exports_every_key_a_fresh_model_loads(path):
    model = loaded(path)
    exported = export_state_dict(model)
    target = fresh(path)
    assert set(exported) == set(target.state_dict())
    target.load_state_dict(exported, strict=True)
    assert torch.equal(logits(target), logits(model))
    # a snapshot: later training steps do not reach into it
    name = "model.norm.weight"
    with torch.no_grad():
        model.get_parameter(name).add_(1.0)
    assert not torch.equal(exported[name], model.get_parameter(name))


def test_tied_embeddings_are_exported_once_and_load_into_a_tied_model(path):
    model = fresh(path, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    exported = export_state_dict(model)
    assert "lm_head.weight" not in exported and "model.embed_tokens.weight" in exported
    target = fresh(path, tie_word_embeddings=True)
    with torch.no_grad():
        target.model.embed_tokens.weight.zero_()
    missing, unexpected = target.load_state_dict(exported, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    assert torch.equal(logits(target), logits(model))


def test_lora_export_is_the_merged_model_and_leaves_the_policy_bit_identical(path):
    model = lora(loaded(path), modules_to_save=["lm_head"])
    with torch.no_grad():  # a trained lm_head copy, so the export must pick it over the original
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out_before = logits(model)

    exported = export_state_dict(model)

    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(logits(model), out_before)
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert not any(layer.merged for layer in model.modules() if isinstance(layer, BaseTunerLayer))
    target = fresh(path)
    assert set(exported) == set(target.state_dict())
    target.load_state_dict(exported, strict=True)
    torch.testing.assert_close(logits(target), out_before, atol=1e-5, rtol=0)
    assert not torch.allclose(logits(loaded(path)), out_before, atol=1e-2)  # the adapter does change things


def test_lora_on_a_tied_model_with_lm_head_trained_apart_is_refused(path):
    from registries.errors import UserError

    model = lora(fresh(path, tie_word_embeddings=True), modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    with pytest.raises(UserError, match="tie_word_embeddings"):
        export_state_dict(model)


def test_bytes_round_trip_keeps_names_dtypes_values_and_unshares_storages(path):
    model = fresh(path, tie_word_embeddings=True)
    state = dict(model.state_dict())  # lm_head.weight and embed_tokens.weight share one storage
    state["half"] = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()  # not contiguous
    back = bytes_to_state_dict(state_dict_to_bytes(state))
    assert back.keys() == state.keys()
    assert all(back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]) for k in state)
    assert export_state_dict(model, dtype=torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16


def reference_logprobs(model, prompt, completion):
    """One sequence, no padding, plain log_softmax: what batching must reproduce."""
    out = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(out, -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("peft", [False, True])
def test_completion_logprobs_do_not_depend_on_batching_and_padding(path, peft):
    model = lora(loaded(path)) if peft else loaded(path)
    batched = completion_logprobs(model, PROMPTS, COMPLETIONS, pad_token_id=0, micro_batch_size=2)
    with torch.no_grad():
        for got, prompt, completion in zip(batched, PROMPTS, COMPLETIONS):
            assert got.dtype == torch.float32 and got.shape == (len(completion),)
            if completion:
                torch.testing.assert_close(got, reference_logprobs(model, prompt, completion), atol=1e-5, rtol=0)
    hot = completion_logprobs(model, PROMPTS, COMPLETIONS, pad_token_id=0, temperature=0.5)
    assert all((h - b).abs().max() > 1e-3 for h, b in zip(hot, batched) if len(b))


def test_completion_logprobs_keep_autograd_for_the_loss(path):
    model = lora(loaded(path))
    out = completion_logprobs(model, PROMPTS, COMPLETIONS, pad_token_id=0)
    torch.cat(out).sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_token_logprobs_matches_log_softmax_in_chunks_and_in_bf16():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 50)
    ids = torch.randint(0, 50, (3, 5))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, ids, temperature=0.7), expected)
    got = token_logprobs(logits.bfloat16(), ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, ids[..., None])[..., 0])
