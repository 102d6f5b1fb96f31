"""The preference stages' fast paths against the plain padded full-logits path, values and gradients:
chunked log-probs (stages/training/sequence_logps.py), padding-free pairs and kto batches
(stages/training/preference_collators.py), the rm value head on padding-free pairs, and reference
log-probs precomputed before training (stages/training/reference_logps.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from registries.tokenize import IGNORE_INDEX
from stages.recipes.dpo import LENGTH_NORMALIZED, PreferenceTrainer, preference_loss
from stages.recipes.kto import KTOTrainer, kto_loss
from stages.recipes.preference import forward_logps
from stages.training.reference import Reference
from stages.recipes.rm import pairwise_reward_loss
from stages.run_args import FinetuningArguments
from stages.training.collators import PaddingFreeCollator
from stages.training.per_example_attention import PER_EXAMPLE_SDPA, use_attention
from stages.training.preference_collators import KTOCollator, PairwiseCollator
from stages.training.reference_logps import plan_precompute, rows_visited
from stages.training.sequence_logps import sequence_logps
from stages.training.value_head import ValueHeadModel

VOCAB = 97


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def sequence(rng: torch.Generator, prompt: int, answer: int) -> tuple[list[int], list[int]]:
    ids = torch.randint(3, VOCAB, (prompt + answer,), generator=rng).tolist()
    return ids, [IGNORE_INDEX] * prompt + ids[prompt:]


def pairs(count: int = 5, seed: int = 1) -> list[dict]:
    """Pairs whose prompts and answers differ in length (chosen and rejected share a prompt)."""
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        prompt = 3 + i % 4
        chosen_ids, chosen_labels = sequence(rng, prompt, 2 + (i * 3) % 7)
        rejected_ids, rejected_labels = sequence(rng, 0, 1 + (i * 5) % 6)
        rejected_ids = chosen_ids[:prompt] + rejected_ids
        rejected_labels = [IGNORE_INDEX] * prompt + rejected_labels
        rows.append({"chosen_input_ids": chosen_ids, "chosen_attention_mask": [1] * len(chosen_ids),
                     "chosen_labels": chosen_labels, "rejected_input_ids": rejected_ids,
                     "rejected_attention_mask": [1] * len(rejected_ids), "rejected_labels": rejected_labels})
    return rows


def kto_rows(count: int = 6, seed: int = 2) -> list[dict]:
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        ids, labels = sequence(rng, 2 + i % 3, 2 + i % 5)
        kl_ids, kl_labels = sequence(rng, 2 + i % 3, 1 + (i * 2) % 5)
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels, "kl_input_ids": kl_ids,
                     "kl_attention_mask": [1] * len(kl_ids), "kl_labels": kl_labels, "kto_tags": i % 3 != 0})
    return rows


def padded(collator_class, rows):
    return collator_class(pad_token_id=0)(rows)


def padding_free(collator_class, rows):
    rows_layout = PaddingFreeCollator(pad_token_id=0, one_row=True, attention=PER_EXAMPLE_SDPA)
    return collator_class(pad_token_id=0, rows=rows_layout)(rows)


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]  # rm never uses the LM head
    model.zero_grad()
    return out


def assert_same_grads(a, b, atol=1e-5):
    assert [x is None for x in a] == [y is None for y in b]
    for x, y in zip(a, b):
        if x is None:
            continue
        assert torch.allclose(x, y, atol=atol, rtol=1e-4), (x - y).abs().max()


def test_padding_free_pairs_are_one_row_with_each_tokens_sequence_named():
    rows = pairs(2)
    batch = padding_free(PairwiseCollator, rows)
    assert set(batch) == {"input_ids", "labels", "position_ids", "sequence_ids"}
    lengths = [len(r["chosen_input_ids"]) for r in rows] + [len(r["rejected_input_ids"]) for r in rows]
    expected = [s for s, n in enumerate(lengths) for _ in range(n)]  # chosen 0, 1 then rejected 2, 3
    assert batch["sequence_ids"].tolist() == [expected]
    assert batch["position_ids"].tolist() == [[t for n in lengths for t in range(n)]]
    assert batch["input_ids"].tolist() == [sum([r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows], [])]


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
@pytest.mark.parametrize("chunk_tokens", [None, 5])
def test_sequence_logps_equal_the_full_logits_path_in_value_and_gradient(layout, chunk_tokens):
    model = tiny_llama()
    rows = pairs()
    plain = padded(PairwiseCollator, rows)
    weights = torch.linspace(-1, 1, 2 * len(rows))  # a loss that weighs each sequence differently
    expected, expected_lengths = forward_logps(model, plain["input_ids"], plain["attention_mask"], plain["labels"])
    (expected * weights).sum().backward()
    expected_grads = grads(model)

    if layout == "padding_free":
        use_attention(model, PER_EXAMPLE_SDPA)
        batch = padding_free(PairwiseCollator, rows)
    else:
        batch = plain
    logps, lengths = sequence_logps(model, batch, chunk_tokens=chunk_tokens)
    (logps * weights).sum().backward()
    assert lengths.tolist() == expected_lengths.tolist()
    assert torch.allclose(logps, expected, atol=1e-5), (logps - expected).abs().max()
    assert_same_grads(grads(model), expected_grads)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "orpo", "simpo"])
def test_each_pref_loss_is_unchanged_by_chunks_and_padding_free_pairs(loss_type):
    model = tiny_llama()
    reference = tiny_llama(seed=3)
    rows = pairs()

    def loss(logps, lengths, ref_logps):
        if loss_type in LENGTH_NORMALIZED:
            logps, ref_logps = logps / lengths, ref_logps / lengths
        chosen, rejected = logps.chunk(2)
        ref_c, ref_r = ref_logps.chunk(2)
        return preference_loss(loss_type, 0.3, chosen, rejected, ref_c, ref_r).losses.mean()

    plain = padded(PairwiseCollator, rows)
    args = plain["input_ids"], plain["attention_mask"], plain["labels"]
    with torch.no_grad():
        ref_expected, _ = forward_logps(reference, *args)
    expected = loss(*forward_logps(model, *args), ref_expected)
    expected.backward()
    expected_grads = grads(model)

    use_attention(model, PER_EXAMPLE_SDPA)
    use_attention(reference, PER_EXAMPLE_SDPA)
    batch = padding_free(PairwiseCollator, rows)
    with torch.no_grad():
        ref_logps, _ = sequence_logps(reference, batch, chunk_tokens=4)
    value = loss(*sequence_logps(model, batch, chunk_tokens=4), ref_logps)
    value.backward()
    assert value.item() == pytest.approx(expected.item(), abs=1e-6)
    assert_same_grads(grads(model), expected_grads)


def test_kto_loss_is_unchanged_by_chunks_and_padding_free_batches():
    model = tiny_llama()
    reference = tiny_llama(seed=4)
    rows = kto_rows()

    def loss(batch, logps_of):
        logps, _ = logps_of(model, batch, "")
        with torch.no_grad():
            kl, _ = logps_of(model, batch, "kl_")
            ref, _ = logps_of(reference, batch, "")
            ref_kl, _ = logps_of(reference, batch, "kl_")
        return kto_loss(logps, ref, kl, ref_kl, batch["kto_tags"], beta=0.2, undesirable_weight=1.5).loss

    def plain_logps(m, batch, prefix):
        return forward_logps(m, batch[prefix + "input_ids"], batch[prefix + "attention_mask"], batch[prefix + "labels"])

    expected = loss(padded(KTOCollator, rows), plain_logps)
    expected.backward()
    expected_grads = grads(model)
    use_attention(model, PER_EXAMPLE_SDPA)
    use_attention(reference, PER_EXAMPLE_SDPA)
    batch = padding_free(KTOCollator, rows)
    assert {"kl_sequence_ids", "sequence_ids", "kto_tags"} <= set(batch)
    value = loss(batch, lambda m, b, prefix: sequence_logps(m, b, prefix, chunk_tokens=3))
    value.backward()
    assert value.item() == pytest.approx(expected.item(), abs=1e-6)
    assert_same_grads(grads(model), expected_grads)


def test_the_reward_models_pairs_give_the_same_loss_and_gradient_padding_free():
    model = ValueHeadModel(tiny_llama())
    rows = pairs()
    plain = padded(PairwiseCollator, rows)
    expected = pairwise_reward_loss(*model(plain["input_ids"], plain["attention_mask"]).rewards.chunk(2)).mean()
    expected.backward()
    expected_grads = grads(model)
    use_attention(model, PER_EXAMPLE_SDPA)
    batch = padding_free(PairwiseCollator, rows)
    rewards = model(batch["input_ids"], position_ids=batch["position_ids"], sequence_ids=batch["sequence_ids"]).rewards
    assert rewards.shape == (2 * len(rows),)
    value = pairwise_reward_loss(*rewards.chunk(2)).mean()
    value.backward()
    assert value.item() == pytest.approx(expected.item(), abs=1e-6)
    assert_same_grads(grads(model), expected_grads)


# ---------------------------------------------------------------- precomputed reference log-probs


def trainer_for(trainer_class, rows, collator, tmp_path, reference, **tuning):
    import datasets

    model = tiny_llama()
    finetuning = FinetuningArguments(stage="kto" if trainer_class is KTOTrainer else "dpo", **tuning)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, num_train_epochs=1,
                             report_to=[], remove_unused_columns=False, save_strategy="no")
    return trainer_class(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), data_collator=collator,
                         reference=reference, finetuning_args=finetuning)


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_precomputed_reference_logps_give_the_same_losses_and_free_the_reference(stage, tmp_path):
    rows = pairs() if stage == "dpo" else kto_rows()
    trainer_class, collator_class = (PreferenceTrainer, PairwiseCollator) if stage == "dpo" else (KTOTrainer, KTOCollator)
    collator = collator_class(pad_token_id=0)
    reference_model = tiny_llama(seed=5).eval().requires_grad_(False)
    trainer = trainer_for(trainer_class, rows, collator, tmp_path, Reference("model", copy.deepcopy(reference_model)),
                          precompute_ref_log_probs=True)
    per_step = collator(rows[:4])
    expected, _ = trainer.batch_loss(trainer.model, per_step)  # the reference model runs in the step

    trainer.get_train_dataloader()  # plans and runs the pass, as trainer.train() does first
    assert trainer.reference.kind == "precomputed" and trainer.reference.model is None
    columns = {"chosen_ref_logps", "rejected_ref_logps"} if stage == "dpo" else {"ref_logps", "kl_ref_logps"}
    assert columns <= set(trainer.train_dataset.column_names)
    batch = collator([trainer.train_dataset[i] for i in range(4)])
    assert "ref_logps" in batch
    value, _ = trainer.batch_loss(trainer.model, batch)
    assert value.item() == pytest.approx(expected.item(), abs=1e-6)
    with torch.no_grad():  # and the columns are the reference's own log-probs, row by row
        plain = padded(collator_class, rows[:4])
        prefix_logps = forward_logps(reference_model, plain["input_ids"], plain["attention_mask"], plain["labels"])[0]
    assert torch.allclose(batch["ref_logps"], prefix_logps, atol=1e-5)
    # The Trainer's clock starts after the pass: the run's throughput is made to pay for it.
    spent = trainer._reference_pass_s
    assert spent > 0
    metrics = {"train_runtime": 10.0, "train_samples_per_second": 4.0, "train_steps_per_second": 1.0}
    trainer.log(metrics)
    assert metrics["train_runtime"] == pytest.approx(10.0 + spent, abs=1e-3)
    assert metrics["train_samples_per_second"] == pytest.approx(40.0 / (10.0 + spent), abs=1e-3)
    assert metrics["reference_pass_runtime"] == pytest.approx(spent, abs=1e-3)


def test_precompute_is_planned_where_it_saves_reference_forwards():
    import datasets

    data = datasets.Dataset.from_list([{"x": i} for i in range(100)])
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=-1, num_train_epochs=1)
    assert rows_visited(100, args) == 100
    assert plan_precompute(None, "model", data, args)[0] is False  # one visit: the pass saves no forward
    assert plan_precompute(None, "adapter_disabled", data, args)[0] is False
    twice = SimpleNamespace(**{**vars(args), "num_train_epochs": 2})
    assert plan_precompute(None, "adapter_disabled", data, twice)[0] and plan_precompute(None, "model", data, twice)[0]
    short = SimpleNamespace(**{**vars(args), "max_steps": 5})  # 20 of the 100 rows: the pass would cost more
    assert plan_precompute(None, "model", data, short)[0] is False
    assert plan_precompute(True, "adapter_disabled", data, short)[0] is True  # as set
    assert plan_precompute(None, "none", data, args)[0] is False
    two_workers = SimpleNamespace(**{**vars(args), "world_size": 2})  # each holds every row, trains on half
    assert rows_visited(100, two_workers) == 104  # 13 steps of 2 x 4 rows: the last batch is short
    assert plan_precompute(None, "model", data, SimpleNamespace(**{**vars(twice), "world_size": 2}))[0] is True
    with pytest.raises(ValueError, match="streamed"):
        plan_precompute(True, "model", iter([]), args)


def test_under_bf16_a_separate_reference_computes_as_the_policy_does(tmp_path):
    """Mixed precision patches the policy's forward with autocast; the reference copy runs under the
    same autocast, so at step 1 (the same weights) every reward is 0 and the dpo loss is log 2."""
    import datasets

    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=True, per_device_train_batch_size=2,
                             report_to=[], remove_unused_columns=False, save_strategy="no")
    trainer = PreferenceTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs()),
                                data_collator=PairwiseCollator(pad_token_id=0),
                                reference=Reference("model", copy.deepcopy(model).eval().requires_grad_(False)),
                                finetuning_args=FinetuningArguments(stage="dpo", finetuning_type="full"))
    wrapped = trainer.accelerator.prepare_model(trainer.model)  # as train() does: autocast around forward
    loss, metrics = trainer.batch_loss(wrapped, PairwiseCollator(pad_token_id=0)(pairs()))
    assert metrics["rewards/chosen"] == 0.0 and metrics["rewards/rejected"] == 0.0
    assert loss.item() == pytest.approx(0.6931471805599453, abs=1e-7)


def test_sequence_ids_follow_each_example_into_its_row_and_mark_pads():
    ids = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    batch = PaddingFreeCollator(pad_token_id=0, row_width=5).lay_out(ids, ids, number_sequences=True)
    assert batch["input_ids"].tolist() == [[6, 7, 8, 9, 10], [1, 2, 3, 4, 5]]
    assert batch["sequence_ids"].tolist() == [[2, 2, 2, 2, 3], [0, 0, 0, 1, 1]]
    tail = PaddingFreeCollator(pad_token_id=0, row_width=4).lay_out(ids[:2], ids[:2], number_sequences=True)
    assert tail["sequence_ids"].tolist() == [[0, 0, 0], [1, 1, -1]]
    assert "sequence_ids" not in PaddingFreeCollator(pad_token_id=0).lay_out(ids, ids)  # sft's batches go to forward()
