import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from stages.training.collators import NeatPackingCollator, PaddingCollator
from stages.training.preference_collators import KTOCollator, PairwiseCollator
from stages.table import STAGES

M = -100


def rows(*pairs):
    return [{"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels} for ids, labels in pairs]


# ---------------------------------------------------------------- plain padding


def test_right_padding_uses_each_columns_pad_value():
    batch = PaddingCollator(pad_token_id=0)(rows(([5, 6, 7], [M, 6, 7]), ([8], [8])))
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[M, 6, 7], [8, M, M]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_left_padding_and_pad_to_multiple_of():
    collator = PaddingCollator(pad_token_id=3, padding_side="left", pad_to_multiple_of=4)
    batch = collator(rows(([5, 6, 7], [5, 6, 7]), ([8], [8])))
    assert batch["input_ids"].tolist() == [[3, 5, 6, 7], [3, 3, 3, 8]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    assert batch["labels"].tolist() == [[M, 5, 6, 7], [M, M, M, 8]]


def test_ray_style_numpy_columns_collate_like_rows():
    features = rows(([5, 6, 7], [M, 6, 7]), ([8], [8]))
    columns = {k: np.array([np.array(f[k]) for f in features], dtype=object) for k in features[0]}
    expected = PaddingCollator(pad_token_id=0)(features)
    got = PaddingCollator(pad_token_id=0)(columns)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_unknown_list_column_is_a_clear_error():
    with pytest.raises(ValueError, match=r"Do not know how to pad column 'images'.*Drop the column before collating"):
        PaddingCollator(pad_token_id=0)([{"input_ids": [1], "images": [1, 2]}])


def test_padding_side_is_checked():
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right', got 'middle'"):
        PaddingCollator(pad_token_id=0, padding_side="middle")


# ---------------------------------------------------------------- pairwise and kto


def test_pairwise_stacks_all_chosen_then_all_rejected_at_one_length():
    features = [
        {"chosen_input_ids": [1, 2], "chosen_attention_mask": [1, 1], "chosen_labels": [M, 2],
         "rejected_input_ids": [1, 3, 3], "rejected_attention_mask": [1, 1, 1], "rejected_labels": [M, 3, 3]},
        {"chosen_input_ids": [4], "chosen_attention_mask": [1], "chosen_labels": [4],
         "rejected_input_ids": [5, 5], "rejected_attention_mask": [1, 1], "rejected_labels": [5, 5]},
    ]
    batch = PairwiseCollator(pad_token_id=0)(features)
    assert batch["input_ids"].tolist() == [[1, 2, 0], [4, 0, 0], [1, 3, 3], [5, 5, 0]]
    assert batch["labels"].tolist() == [[M, 2, M], [4, M, M], [M, 3, 3], [5, 5, M]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]


def test_kto_pads_examples_and_kl_examples_separately():
    features = [
        {"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1], "labels": [M, 2, 3],
         "kl_input_ids": [1, 9], "kl_attention_mask": [1, 1], "kl_labels": [M, 9], "kto_tags": True},
        {"input_ids": [4], "attention_mask": [1], "labels": [4],
         "kl_input_ids": [4, 8], "kl_attention_mask": [1, 1], "kl_labels": [M, 8], "kto_tags": np.bool_(False)},
    ]
    batch = KTOCollator(pad_token_id=0)(features)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["kl_input_ids"].tolist() == [[1, 9], [4, 8]]
    assert batch["kl_labels"].tolist() == [[M, 9], [M, 8]]
    assert batch["kto_tags"].tolist() == [True, False] and batch["kto_tags"].dtype == torch.bool


# ---------------------------------------------------------------- neat packing


def packed_features():
    # row 0: example A (4 tokens) then example B (3 tokens); row 1: A alone (padded by 3)
    a, b = [5, 6, 7, 8], [9, 10, 11]
    return a, b, [
        {"input_ids": a + b, "attention_mask": [1] * 4 + [2] * 3, "labels": [M] + a[1:] + [M] + b[1:]},
        {"input_ids": a, "attention_mask": [1] * 4, "labels": [M] + a[1:]},
    ]


def test_neat_packing_positions_restart_and_mask_is_block_diagonal_causal():
    _, _, features = packed_features()
    batch = NeatPackingCollator(pad_token_id=0, dtype=torch.bfloat16)(features)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 0, 0, 0]]
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 7, 7) and mask.dtype == torch.bfloat16
    neg = torch.finfo(torch.bfloat16).min
    allowed = (mask[:, 0] == 0).int().tolist()
    assert set(mask.unique().tolist()) == {0.0, neg}
    assert allowed[0] == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0],  # B's first token sees only itself, not A
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1, 1, 1],
    ]
    assert [r[4:] for r in allowed[1]] == [[0, 0, 0]] * 7  # padding is seen by nobody
    assert allowed[1][4:] == [[0] * 7] * 3  # and sees nothing
    assert batch["labels"].tolist()[1] == [M, 6, 7, 8, M, M, M]


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_examples_cannot_attend_to_each_other_in_a_real_model(attn_implementation):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation=attn_implementation,
    )
    model = LlamaForCausalLM(config).eval()
    a, b, features = packed_features()
    batch = NeatPackingCollator(pad_token_id=0)(features)
    with torch.no_grad():
        packed = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
        alone_a = model(input_ids=torch.tensor([a])).logits[0]
        alone_b = model(input_ids=torch.tensor([b])).logits[0]
        naive = model(input_ids=torch.tensor([a + b])).logits[0]  # plain packing: B sees A
    torch.testing.assert_close(packed[0, :4], alone_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[0, 4:], alone_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1, :4], alone_a, atol=1e-5, rtol=0)
    assert torch.isfinite(packed).all()
    assert (naive[4:] - alone_b).abs().max() > 1e-3  # the check above can fail


def test_neat_packing_for_flash_attention_sends_positions_and_no_mask():
    _, _, features = packed_features()
    batch = NeatPackingCollator(pad_token_id=0, four_d_mask=False)(features)
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist()[0] == [0, 1, 2, 3, 0, 1, 2]


# ---------------------------------------------------------------- choosing a collator


def tiny_tokenizer(pad: bool = True):
    core = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "a": 2}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", **({"pad_token": "[PAD]"} if pad else {}))


class Args:
    neat_packing = False


class NeatArgs:
    neat_packing = True


def test_each_stage_gets_its_collator_from_the_table():
    tokenizer = tiny_tokenizer()
    expect = {
        "pt": (PaddingCollator, "right"), "sft": (PaddingCollator, "right"), "rm": (PairwiseCollator, "right"),
        "dpo": (PairwiseCollator, "right"), "kto": (KTOCollator, "right"), "ppo": (PaddingCollator, "left"),
        "grpo": (PaddingCollator, "left"),
    }
    assert set(expect) == set(STAGES)  # a new stage must say which collator it gets
    for stage, (cls, side) in expect.items():
        collator = STAGES[stage].load_collator_factory()(tokenizer, Args())
        assert type(collator) is cls and collator.padding_side == side and collator.pad_token_id == 0, stage
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, attn_implementation="sdpa")).to(torch.bfloat16)
    neat = STAGES["sft"].load_collator_factory()(tokenizer, NeatArgs(), model)
    assert type(neat) is NeatPackingCollator and neat.dtype == torch.bfloat16 and neat.four_d_mask
    # neat_packing is an sft option: pt's packed blocks keep plain padding
    assert type(STAGES["pt"].load_collator_factory()(tokenizer, NeatArgs(), model)) is PaddingCollator


def test_tokenizer_without_pad_token_is_a_clear_error():
    with pytest.raises(ValueError, match=r"The tokenizer has no pad token.*template.fix_tokenizer\(tokenizer\)"):
        PaddingCollator.from_tokenizer(tiny_tokenizer(pad=False))
