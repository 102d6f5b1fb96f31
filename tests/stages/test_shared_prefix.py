"""Prompts attended once (stages/training/shared_prefix.py): kto's KL passes attend to the answers'
pass's kept prompt keys, and dpo's rejected answers to their chosen sequence's, in the same row. The
same log-probs, losses and gradients as computing every sequence in full, on fewer tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, TrainingArguments,
)

from registries.tokenize import IGNORE_INDEX
from stages.recipes.dpo import PreferenceTrainer
from stages.recipes.kto import KTOTrainer
from stages.training.reference import Reference
from stages.run_args import FinetuningArguments
from stages.training.collators import PaddingFreeCollator
from stages.training.per_example_attention import PER_EXAMPLE_SDPA, SHORT_EXAMPLE, use_attention
from stages.training.preference_collators import KTOCollator, PairwiseCollator, kto_collator
from stages.training.sequence_logps import sequence_logps
from stages.training.shared_prefix import (
    SHARED_PREFIX_SDPA, SharedPrefixes, lay_out_suffixes, outside_passes, recording, reusing, shared_lengths,
)

VOCAB = 97


def tiny_model(kind: str = "llama", seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa", use_cache=False)
    if kind == "mistral":  # a sliding window far shorter than the sequences: the kept keys must honour it
        return MistralForCausalLM(MistralConfig(sliding_window=5, **common))
    if kind == "qwen2-mixed":  # the first layer attends in full, the others within a window
        return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=5, max_window_layers=1, **common))
    return LlamaForCausalLM(LlamaConfig(**common))


def feedback_rows(count: int = 6, seed: int = 3) -> list[dict]:
    """kto rows as the registries build them: each KL sequence is its row's prompt with the previous
    row's answer. Prompt and answer lengths vary; one row is longer than SHORT_EXAMPLE (attended on
    its own, not in the short examples' padded call), and one KL prompt is cut shorter (as cutoff_len
    does when the borrowed answer is longer), so only part of it matches its answer's prompt."""
    rng = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (3 + 4 * i,), generator=rng).tolist() for i in range(count)]
    prompts[2] = torch.randint(3, VOCAB, (SHORT_EXAMPLE + 10,), generator=rng).tolist()
    answers = [torch.randint(3, VOCAB, (2 + (3 * i) % 7,), generator=rng).tolist() for i in range(count)]
    rows = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        kl_prompt = prompt[:-2] if i == 4 else prompt
        kl_answer = answers[i - 1]
        ids, kl_ids = prompt + answer, kl_prompt + kl_answer
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                     "labels": [IGNORE_INDEX] * len(prompt) + answer,
                     "kl_input_ids": kl_ids, "kl_attention_mask": [1] * len(kl_ids),
                     "kl_labels": [IGNORE_INDEX] * len(kl_prompt) + kl_answer, "kto_tags": i % 3 != 0})
    return rows


def collator(share: bool) -> KTOCollator:
    rows = PaddingFreeCollator(pad_token_id=0, one_row=True, attention=PER_EXAMPLE_SDPA)
    return KTOCollator(pad_token_id=0, rows=rows, share_prompts=share)


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


def test_shared_lengths_end_where_the_sequences_part_or_before_the_kl_answers_last_prompt_token():
    ignore = IGNORE_INDEX
    # The same 4-token prompt: 3 shared, the 4th (whose output predicts the KL answer) recomputed.
    assert shared_lengths([[5, 6, 7, 8, 9, 10]], [[5, 6, 7, 8, 11]], [[ignore] * 4 + [11]]) == [3]
    # The KL prompt was cut differently: only the tokens up to where they part are shared.
    assert shared_lengths([[5, 6, 7, 8, 9, 10]], [[5, 6, 20, 21, 22, 11]], [[ignore] * 5 + [11]]) == [2]
    # Nothing in common, a one-token prompt, or no labelled token at all.
    assert shared_lengths([[5, 6, 7]], [[4, 6, 7, 8]], [[ignore] * 3 + [8]]) == [0]
    assert shared_lengths([[5, 6, 7]], [[5, 8]], [[ignore, 8]]) == [0]
    assert shared_lengths([[5, 6, 7]], [[5, 6, 7]], [[ignore] * 3]) == [2]


def test_the_kl_row_holds_only_the_unshared_tokens_at_their_true_positions():
    batch = lay_out_suffixes([[5, 6, 7, 8, 11], [4, 9, 9]], [[IGNORE_INDEX] * 4 + [11], [IGNORE_INDEX, 9, 9]], [3, 0])
    assert batch["input_ids"].tolist() == [[8, 11, 4, 9, 9]]
    assert batch["position_ids"].tolist() == [[3, 4, 0, 1, 2]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 11, IGNORE_INDEX, 9, 9]]
    assert batch["sequence_ids"].tolist() == [[0, 0, 1, 1, 1]]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2-mixed"])
@pytest.mark.parametrize("chunk_tokens", [None, 4])
def test_kl_logps_after_kept_prompts_equal_the_full_kl_pass(kind, chunk_tokens):
    model = tiny_model(kind)
    rows = feedback_rows()
    use_attention(model, PER_EXAMPLE_SDPA)
    full = collator(share=False)(rows)
    logps, _ = sequence_logps(model, full, chunk_tokens=chunk_tokens)
    logps.sum().backward()
    expected_grads = grads(model)
    with torch.no_grad():
        expected_kl, expected_counts = sequence_logps(model, full, "kl_", chunk_tokens=chunk_tokens)

    use_attention(model, SHARED_PREFIX_SDPA)
    batch = collator(share=True)(rows)
    lengths = batch["shared_prefix_lengths"].tolist()
    prompts = [len(row["kl_labels"]) - sum(label != IGNORE_INDEX for label in row["kl_labels"]) for row in rows]
    assert lengths == [p - 1 for p in prompts[:4]] + [prompts[4] - 1] + [prompts[5] - 1]
    assert batch["kl_input_ids"].numel() == full["kl_input_ids"].numel() - sum(lengths)
    shared = SharedPrefixes.of(batch)
    with recording(shared):
        shared_logps, _ = sequence_logps(model, batch, chunk_tokens=chunk_tokens)
    shared_logps.sum().backward()
    with torch.no_grad(), reusing(shared):
        kl, counts = sequence_logps(model, batch, "kl_", chunk_tokens=chunk_tokens)
    assert torch.equal(counts, expected_counts)
    assert torch.allclose(kl, expected_kl, atol=1e-5, rtol=1e-5), (kl - expected_kl).abs().max()
    assert torch.allclose(shared_logps, logps, atol=1e-6)
    for got, want in zip(grads(model), expected_grads):
        assert torch.allclose(got, want, atol=1e-6)
    # Reusing another model's (here: perturbed) kept keys changes the KL answers' log-probs: they are used.
    for layer in shared.kept:
        layer[0] = (layer[0][0] + 1.0, layer[0][1])
    with torch.no_grad(), reusing(shared):
        wrong, _ = sequence_logps(model, batch, "kl_", chunk_tokens=chunk_tokens)
    assert (wrong[0] - expected_kl[0]).abs() > 1e-3 and torch.allclose(wrong[1:], expected_kl[1:], atol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunked_loss", [None, True])
def test_the_kto_trainers_loss_and_gradients_are_those_of_full_kl_passes(checkpointing, chunked_loss, tmp_path):
    """chunked_loss on: the trainer's first pass of each model probes it with a forward of its own
    (chunked_loss.supports_chunked_loss), inside the recording of the answers' keys; it keeps nothing
    (issue 62: it kept its layers too, and the KL pass then found twice the layers it attends)."""
    import datasets

    rows = feedback_rows()
    losses, gradients = [], []
    for share in (True, False):  # the shared path first: each trainer's first pass is a recording
        model = tiny_model()
        if checkpointing:  # the answers' forward is recomputed in the backward, outside the recording
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        use_attention(model, SHARED_PREFIX_SDPA if share else PER_EXAMPLE_SDPA)
        reference_model = tiny_model(seed=5).eval().requires_grad_(False)
        with torch.no_grad():  # sharper, so random answers score lower than under the policy: a KL above 0
            reference_model.lm_head.weight *= 8
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, report_to=[],
                                 remove_unused_columns=False, save_strategy="no")
        trainer = KTOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             data_collator=collator(share), reference=Reference("model", copy.deepcopy(reference_model)),
                             finetuning_args=FinetuningArguments(stage="kto", finetuning_type="full", pref_beta=0.3,
                                                                 chunked_loss=chunked_loss))
        loss, metrics = trainer.batch_loss(trainer.model, collator(share)(rows))
        loss.backward()
        losses.append((loss.item(), metrics["kl"]))
        gradients.append(grads(model))
        if chunked_loss:  # the probe ran, and passed: the head ran in chunks
            assert trainer._chunking and None not in trainer._chunking.values()
    assert losses[0][1] > 0  # the KL estimate is not clamped to 0: the KL passes count in the loss
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-6)
    for got, want in zip(*gradients):
        assert torch.allclose(got, want, atol=1e-6)


def test_a_model_whose_attention_does_not_keep_or_reuse_fails_loudly():
    model = tiny_model()
    batch = collator(share=True)(feedback_rows())
    use_attention(model, PER_EXAMPLE_SDPA)  # not the sharing attention: nothing is kept
    with pytest.raises(RuntimeError, match="Nothing was kept"), torch.no_grad(), recording(SharedPrefixes.of(batch)):
        sequence_logps(model, batch)
    use_attention(model, SHARED_PREFIX_SDPA)
    shared = SharedPrefixes.of(batch)
    with torch.no_grad(), recording(shared):
        sequence_logps(model, batch)
    shared.kept.append(shared.kept[-1])  # one layer more kept than the KL pass attends
    with pytest.raises(RuntimeError, match="attended 3 layer"), torch.no_grad(), reusing(shared):
        sequence_logps(model, batch, "kl_")
    del shared.kept[-2:]  # one fewer
    with pytest.raises(RuntimeError, match="more attention layers"), torch.no_grad(), reusing(shared):
        sequence_logps(model, batch, "kl_")


def test_only_the_answers_forward_keeps_keys_inside_a_recording():
    model = tiny_model()
    use_attention(model, SHARED_PREFIX_SDPA)
    batch = collator(share=True)(feedback_rows())
    probe = {"input_ids": torch.arange(1, 5)[None], "labels": torch.arange(1, 5)[None]}
    shared = SharedPrefixes.of(batch)
    with pytest.raises(RuntimeError, match="A forward of 4 tokens ran inside the recording"), torch.no_grad():
        with recording(shared):
            sequence_logps(model, probe)
    with torch.no_grad(), recording(shared):
        with outside_passes():  # e.g. chunked_loss's probe of a model at its first pass: plain attention
            sequence_logps(model, probe)
        assert shared.kept == []
        sequence_logps(model, batch)
    assert len(shared.kept) == model.config.num_hidden_layers


# ---------------------------------------------------------------- dpo: rejected answers borrow the chosen's prompt


def preference_pairs() -> list[dict]:
    """dpo pairs from the kto rows: chosen the answer, rejected the KL sequence (the same prompt, one of
    them cut shorter, with another answer)."""
    return [{"chosen_input_ids": row["input_ids"], "chosen_attention_mask": row["attention_mask"],
             "chosen_labels": row["labels"], "rejected_input_ids": row["kl_input_ids"],
             "rejected_attention_mask": row["kl_attention_mask"], "rejected_labels": row["kl_labels"]}
            for row in feedback_rows()]


def pair_collator(share: bool) -> PairwiseCollator:
    rows = PaddingFreeCollator(pad_token_id=0, one_row=True, attention=PER_EXAMPLE_SDPA)
    return PairwiseCollator(pad_token_id=0, rows=rows, share_prompts=share)


def test_a_shared_pair_row_holds_each_rejected_answer_after_its_chosen_sequences_prompt():
    pairs = preference_pairs()
    full, shared = pair_collator(False)(pairs), pair_collator(True)(pairs)
    lengths = shared["borrowed_lengths"].tolist()
    assert lengths[:6] == [0] * 6 and min(lengths[6:]) > 0
    assert shared["borrowed_from"].tolist() == [-1] * 6 + list(range(6))
    assert shared["input_ids"].numel() == full["input_ids"].numel() - sum(lengths)
    # The second rejected answer starts at its prompt's last token, at its true position.
    owners, positions = shared["sequence_ids"][0], shared["position_ids"][0]
    second = positions[owners == 7]
    assert second[0].item() == lengths[7] and len(second) == len(pairs[1]["rejected_input_ids"]) - lengths[7]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2-mixed"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_borrowed_prompts_give_the_pairs_log_probs_and_gradients_of_full_sequences(kind, checkpointing):
    pairs = preference_pairs()
    results = []
    for share in (False, True):
        model = tiny_model(kind)
        if checkpointing:  # the recompute in the backward must borrow too: the keyword travels with it
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        use_attention(model, SHARED_PREFIX_SDPA if share else PER_EXAMPLE_SDPA)
        logps, counts = sequence_logps(model, pair_collator(share)(pairs), chunk_tokens=5)
        chosen, rejected = logps.chunk(2)
        (chosen - 0.5 * rejected).sum().backward()
        results.append((logps.detach(), counts, grads(model)))
    (want, want_counts, want_grads), (got, got_counts, got_grads) = results
    assert torch.equal(got_counts, want_counts)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_the_dpo_trainers_loss_is_that_of_full_pairs(loss_type, tmp_path):
    import datasets

    pairs = preference_pairs()
    values = []
    for share in (False, True):
        model = tiny_model()
        use_attention(model, SHARED_PREFIX_SDPA if share else PER_EXAMPLE_SDPA)
        reference_model = tiny_model(seed=5).eval().requires_grad_(False)
        use_attention(reference_model, SHARED_PREFIX_SDPA if share else PER_EXAMPLE_SDPA)
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, report_to=[],
                                 remove_unused_columns=False, save_strategy="no")
        reference = Reference("none" if loss_type == "simpo" else "model", None if loss_type == "simpo" else reference_model)
        trainer = PreferenceTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs),
                                    data_collator=pair_collator(share), reference=reference,
                                    finetuning_args=FinetuningArguments(stage="dpo", finetuning_type="full",
                                                                        pref_loss=loss_type, pref_beta=2.0))
        loss, metrics = trainer.batch_loss(trainer.model, pair_collator(share)(pairs))
        loss.backward()
        values.append((loss.item(), metrics["rewards/margins"], grads(model)))
    assert values[1][:2] == pytest.approx(values[0][:2], rel=1e-5, abs=1e-6)
    assert values[0][0] != pytest.approx(0.693147, abs=1e-3)  # policy and reference differ: not a trivial log 2
    for a, b in zip(values[1][2], values[0][2]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_a_model_that_does_not_borrow_is_refused():
    model = tiny_model()
    use_attention(model, PER_EXAMPLE_SDPA)  # ignores the borrowed prompts: the rejected answers would miss them
    with pytest.raises(RuntimeError, match="never read them"), torch.no_grad():
        sequence_logps(model, pair_collator(True)(preference_pairs()))


def test_kto_and_dpo_share_prompts_only_in_one_row_attended_per_example_and_rm_never():
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from stages.training.preference_collators import dpo_pair_collator, pairwise_collator

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "a": 1}, "<pad>")),
                                        pad_token="<pad>")
    data_args = SimpleNamespace(padding_free=None)
    for factory in (kto_collator, dpo_pair_collator):
        shared = factory(tokenizer, data_args, tiny_model())
        assert shared.share_prompts and shared.attention == SHARED_PREFIX_SDPA
        eager = tiny_model()
        eager.config._attn_implementation = "eager"  # rows as wide as the longest example: no sharing
        assert not factory(tokenizer, data_args, eager).share_prompts
        assert not factory(tokenizer, SimpleNamespace(padding_free=False), tiny_model()).share_prompts
    assert not pairwise_collator(tokenizer, data_args, tiny_model()).share_prompts  # rm's value head
