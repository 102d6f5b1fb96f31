"""Chunked cross-entropy (stages/training/chunked_loss.py): the model's own loss and gradients, without the
micro-batch's full logits, and the plain loss wherever chunking would change the result."""

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer,
                          TrainingArguments)

from stages.recipes.causal_lm import CausalLMTrainer
from stages.training.chunked_loss import (chunk_tokens_for, chunked_head_loss, supports_chunked_loss, use_chunked_loss,
                                 vocab_size_of)
from stages.training.collators import PaddingCollator, PaddingFreeCollator

M = -100
VOCAB = 300


def tiny_llama(vocab=VOCAB, tie=False):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, use_cache=False))


def tiny_lora():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, param in model.named_parameters():  # B starts at zero: move it, so every adapter weight has a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def features():
    """Five sft examples: prompts masked, one of them prompt only (trains on nothing)."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for length, prompt in [(17, 5), (9, 3), (4, 2), (12, 0), (6, 6)]:
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": [M] * prompt + ids[prompt:]})
    return rows


LAYOUTS = {"padded": PaddingCollator(pad_token_id=0), "padding_free": PaddingFreeCollator(pad_token_id=0)}


def loss_and_grads(model, batch, chunk_tokens=None, **loss_kwargs):
    model.zero_grad()
    if chunk_tokens is None:
        loss = model(**batch, **loss_kwargs).loss
    else:
        with chunked_head_loss(model, chunk_tokens):
            loss = model(**batch, **loss_kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [tiny_llama, tiny_lora, lambda: tiny_llama(tie=True)], ids=["full", "lora", "tied"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_items", [None, 61])  # the Trainer's count across gradient accumulation
def test_chunked_loss_and_gradients_equal_the_models_own(build, layout, num_items):
    model = build()
    batch = LAYOUTS[layout](features())
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    plain_loss, plain = loss_and_grads(model, batch, **kwargs)
    labelled = int((batch["labels"][:, 1:] != M).sum())
    assert labelled > 2 * 7  # several chunks of 7, and a last one cut short
    chunked_loss, chunked = loss_and_grads(model, batch, chunk_tokens=7, **kwargs)
    torch.testing.assert_close(chunked_loss, plain_loss, atol=1e-6, rtol=0)
    assert chunked.keys() == plain.keys() and len(plain) > 0
    for name in plain:
        torch.testing.assert_close(chunked[name], plain[name], atol=1e-5, rtol=0, msg=name)
    # The check can fail: dividing by another count moves the loss far beyond the tolerance.
    other, _ = loss_and_grads(model, batch, chunk_tokens=7, num_items_in_batch=torch.tensor(labelled + 9))
    assert abs(other.item() - plain_loss.item()) > 1e-2


def test_the_head_is_restored_after_the_block():
    model = tiny_llama()
    batch = LAYOUTS["padded"](features())
    with chunked_head_loss(model, 7):
        inside = model(**batch)
    assert inside.logits.shape[-1] == 32  # the hidden states: no vocabulary-wide tensor was made
    assert model(**batch).logits.shape[-1] == VOCAB and "forward" not in vars(model.lm_head)
    assert "_loss_function" not in vars(model)


def largest_saved_tensor(model, batch, chunk_tokens=None) -> int:
    """The most elements of any tensor autograd keeps for the backward of the loss's forward."""
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if chunk_tokens is None:
            model(**batch).loss.backward()
        else:
            with chunked_head_loss(model, chunk_tokens):
                model(**batch).loss.backward()
    return max(sizes)


def test_the_backward_keeps_no_logits_of_the_whole_micro_batch():
    model = tiny_llama(vocab=4096)
    batch = LAYOUTS["padded"](features())
    tokens = batch["input_ids"].numel()
    assert largest_saved_tensor(model, batch) >= tokens * 4096
    # The chunked forward keeps nothing wider than the MLP (intermediate_size 64); a chunk's logits
    # exist only while its backward runs.
    assert largest_saved_tensor(model, batch, chunk_tokens=8) <= tokens * 64


def tiny_gemma2(softcap):
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, final_logit_softcapping=softcap,
        use_cache=False))


def test_a_model_that_changes_its_logits_after_the_head_keeps_the_plain_loss():
    assert supports_chunked_loss(tiny_llama()) and supports_chunked_loss(tiny_lora())
    assert supports_chunked_loss(tiny_gemma2(softcap=None))
    assert not supports_chunked_loss(tiny_gemma2(softcap=30.0))  # tanh softcapping after lm_head
    # Why it must: the chunked loss of a softcapping model is not its own loss.
    model, batch = tiny_gemma2(softcap=1.0), LAYOUTS["padded"](features())
    with torch.no_grad():
        model.lm_head.weight.mul_(100)  # logits far beyond the cap (random init leaves them near 0)
    with chunked_head_loss(model, 7):
        wrong = model(**batch).loss
    assert abs(wrong.item() - model(**batch).loss.item()) > 1.0


def test_auto_turns_it_on_for_big_vocabularies_and_sizes_chunks_to_the_vocabulary():
    assert use_chunked_loss(None, 32768) and not use_chunked_loss(None, 32767)
    assert use_chunked_loss(True, 64) and not use_chunked_loss(False, 152064)
    assert chunk_tokens_for(49152) == 1365 and chunk_tokens_for(152064) == 441 and chunk_tokens_for(49152, 256) == 256
    assert vocab_size_of(tiny_lora()) == VOCAB


# ---------------------------------------------------------------- through the Trainer


def trainer(tmp_path, cls=CausalLMTrainer, model=None, **extra):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=5)
    return cls(model=model or tiny_llama(), args=args, **extra)


@pytest.mark.parametrize("build", [tiny_llama, tiny_lora], ids=["full", "lora"])
def test_the_trainers_training_loss_is_the_plain_trainers(tmp_path, build):
    batch = LAYOUTS["padding_free"](features())
    plain = trainer(tmp_path, Trainer, build())
    chunked = trainer(tmp_path, model=build(), chunked_loss=True, chunked_loss_tokens=7)
    n = torch.tensor(50)
    expected = plain.compute_loss(plain.model, dict(batch), num_items_in_batch=n)
    got = chunked.compute_loss(chunked.model, dict(batch), num_items_in_batch=n)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert chunked._chunking == {id(chunked.model): 7}
    # Evaluation asks for the outputs: it gets the real logits, from the plain forward.
    loss, outputs = chunked.compute_loss(chunked.model, dict(batch), return_outputs=True)
    assert outputs.logits.shape[-1] == VOCAB
    torch.testing.assert_close(loss, plain.compute_loss(plain.model, dict(batch)), atol=1e-6, rtol=0)


def test_the_trainer_chunks_only_where_the_setting_and_the_model_allow(tmp_path):
    batch = LAYOUTS["padded"](features())
    off_by_default = trainer(tmp_path)  # null: a 300-token vocabulary keeps the plain loss
    off_by_default.compute_loss(off_by_default.model, dict(batch))
    assert list(off_by_default._chunking.values()) == [None]
    capped = trainer(tmp_path, model=tiny_gemma2(softcap=30.0), chunked_loss=True)
    capped.compute_loss(capped.model, dict(batch))
    assert list(capped._chunking.values()) == [None]


def test_training_with_gradient_accumulation_reaches_the_same_weights(tmp_path):
    """Two optimizer steps of two micro-batches each (num_items_in_batch across them), plain vs chunked."""
    rows = features() * 4

    def train(cls, **extra):
        args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), use_cpu=True, report_to="none",
                                 per_device_train_batch_size=5, gradient_accumulation_steps=2, max_steps=2,
                                 # SGD: updates proportional to the gradients (Adam would magnify float
                                 # noise in the near-zero gradients of never-seen tokens' head rows)
                                 optim="sgd", learning_rate=1.0, save_strategy="no", disable_tqdm=True, seed=0)
        model = tiny_llama()
        trained = cls(model=model, args=args, train_dataset=rows, data_collator=LAYOUTS["padding_free"], **extra)
        trained.train()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, trained.state.log_history[-1]["train_loss"]

    plain, plain_loss = train(Trainer)
    chunked, chunked_loss = train(CausalLMTrainer, chunked_loss=True, chunked_loss_tokens=7)
    assert abs(chunked_loss - plain_loss) < 1e-5
    moved = max((plain[n] - tiny_llama().state_dict()[n]).abs().max().item() for n in plain)
    assert moved > 1e-3  # the steps changed the weights ...
    for name in plain:  # ... the same way
        torch.testing.assert_close(chunked[name], plain[name], atol=1e-5, rtol=0, msg=name)
