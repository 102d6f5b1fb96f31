"""Padding-free pt/sft batches: the layout, the gradient (equal to the padded batch's) and when
each stage gets them."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from registries.datasets.args import DataArguments
from stages.collators import PaddingCollator, PaddingFreeCollator, supports_padding_free
from stages.table import STAGES

M = -100


def rows(*pairs):
    return [{"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels} for ids, labels in pairs]


def test_one_row_holds_the_batch_with_restarting_positions_and_each_first_label_ignored():
    batch = PaddingFreeCollator(pad_token_id=0, one_row=True)(rows(([5, 6, 7], [M, 6, 7]), ([8, 9], [8, 9]), ([4], [4])))
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no mask: the positions say where examples start
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert batch["labels"].tolist() == [[M, 6, 7, M, 9, M]]


def test_rows_are_as_wide_as_the_longest_example_by_default():
    batch = PaddingFreeCollator(pad_token_id=0)(rows(([1, 2, 3, 4], [1, 2, 3, 4]), ([5, 6], [5, 6]), ([7, 8], [7, 8])))
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]


def test_row_width_packs_first_fit_longest_first_and_pads_the_tails_as_their_own_block():
    features = rows(([1, 2, 3], [1, 2, 3]), ([4, 5], [4, 5]), ([6, 7, 8, 9], [6, 7, 8, 9]), ([10], [10]))
    batch = PaddingFreeCollator(pad_token_id=0, row_width=5)(features)
    # longest first: [6..9] opens row 0, [1,2,3] opens row 1, [4,5] joins row 1, [10] fills row 0;
    # a row keeps its examples in batch order
    assert batch["input_ids"].tolist() == [[6, 7, 8, 9, 10], [1, 2, 3, 4, 5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[M, 7, 8, 9, M], [M, 2, 3, M, 5]]
    tail = PaddingFreeCollator(pad_token_id=0, row_width=4)(rows(([1, 2, 3], [1, 2, 3]), ([4, 5], [4, 5])))
    assert tail["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]  # rows pad to the longest row, not the cap
    assert tail["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert tail["labels"].tolist() == [[M, 2, 3], [M, 5, M]]


def tiny_model(family: str, attn: str):
    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn,
                 use_cache=False)  # as the Trainer sets it: a cache turns off transformers' packed-row masks
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape))
    return LlamaForCausalLM(LlamaConfig(**shape))


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,attn,layout", [
    ("llama", "sdpa", {}), ("llama", "eager", {}), ("qwen2", "sdpa", {}), ("llama", "sdpa", {"row_width": 20}),
    ("llama", "sdpa", {"one_row": True}),
])
def test_padding_free_gradient_equals_the_padded_batch(family, attn, layout):
    generator = torch.Generator().manual_seed(1)
    features = []
    for length, prompt in [(17, 5), (9, 3), (4, 2), (12, 0), (6, 6)]:  # a prompt-only row trains on nothing
        ids = torch.randint(1, 64, (length,), generator=generator).tolist()
        features.append({"input_ids": ids, "attention_mask": [1] * length, "labels": [M] * prompt + ids[prompt:]})
    model = tiny_model(family, attn)
    padded_loss, padded = loss_and_grads(model, PaddingCollator(pad_token_id=0)(features))
    free_batch = PaddingFreeCollator(pad_token_id=0, **layout)(features)
    assert free_batch["input_ids"].numel() < 5 * 17  # fewer tokens than the padded batch
    free_loss, free = loss_and_grads(model, free_batch)
    torch.testing.assert_close(free_loss, padded_loss, atol=1e-6, rtol=0)
    for name in padded:
        torch.testing.assert_close(free[name], padded[name], atol=1e-5, rtol=0, msg=name)
    # The check can fail: the same row without restarting positions lets examples see each other.
    naive = dict(free_batch, position_ids=torch.arange(free_batch["input_ids"].shape[1]).expand_as(free_batch["input_ids"]))
    _, crossed = loss_and_grads(model, naive)
    assert max((crossed[n] - padded[n]).abs().max().item() for n in padded) > 1e-3


# ---------------------------------------------------------------- who gets it


def tokenizer():
    core = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]")


def collator(stage, model, **data):
    return STAGES[stage].load_collator_factory()(tokenizer(), DataArguments(dataset="x", **data), model)


def test_pt_and_sft_are_padding_free_by_default_where_the_model_supports_it():
    model = tiny_model("llama", "sdpa")
    assert supports_padding_free(model)
    assert type(collator("sft", model)) is PaddingFreeCollator
    assert type(collator("pt", model, packing=False)) is PaddingFreeCollator
    # Packed rows are full already: they stay rows.
    assert type(collator("pt", model)) is PaddingCollator
    assert type(collator("sft", model, packing=True)) is PaddingCollator
    # The off switch, and the stages whose losses read whole rows.
    assert type(collator("sft", model, padding_free=False)) is PaddingCollator
    assert type(collator("sft", None)) is PaddingCollator  # no model to ask
    for stage in ("rm", "dpo", "kto"):
        assert not isinstance(collator(stage, model), PaddingFreeCollator), stage


class HandWrittenLM(torch.nn.Module):
    """A model whose module builds no masks with transformers' masking_utils."""

    def __init__(self):
        super().__init__()
        self.config = LlamaConfig(attn_implementation="sdpa")


def test_padding_free_true_on_a_model_that_cannot_isolate_examples_is_a_clear_error():
    assert not supports_padding_free(HandWrittenLM())
    assert type(collator("sft", HandWrittenLM())) is PaddingCollator  # the default falls back quietly
    with pytest.raises(ValueError, match=r"padding_free is true, but this model \(HandWrittenLM, attention 'sdpa'\)"
                                         r".*Set padding_free: false"):
        collator("sft", HandWrittenLM(), padding_free=True)


def test_padding_free_must_be_true_false_or_null():
    from registries.datasets.errors import DataConfigError

    with pytest.raises(DataConfigError, match=r"padding_free is 'yes please'; expected true or false"):
        DataArguments(padding_free="yes please")
