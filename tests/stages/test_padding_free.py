"""Padding-free pt/sft batches: the layout, the gradient (equal to the padded batch's), when each
stage gets them, and sdpa attending one row per example (stages/training/per_example_attention.py)."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from registries.datasets.data_args import DataArguments
from stages.training import per_example_attention
from stages.training.collators import PaddingCollator, PaddingFreeCollator, supports_padding_free
from stages.training.per_example_attention import (PER_EXAMPLE_SDPA, ExamplePlan, per_example_sdpa, supports_per_example_sdpa,
                                      use_attention)
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
    if family == "mistral":  # a window shorter than some examples: the per-example path masks those
        return MistralForCausalLM(MistralConfig(sliding_window=5, **shape))
    if family == "gemma3":  # sliding and full layers, its own scaling
        return Gemma3ForCausalLM(Gemma3TextConfig(sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                                  head_dim=8, **shape))
    if family == "qwen3":  # q/k norms; a real sliding layer
        return Qwen3ForCausalLM(Qwen3Config(use_sliding_window=True, sliding_window=7, max_window_layers=1, **shape))
    if family == "phi3":  # fused qkv projection
        return Phi3ForCausalLM(Phi3Config(pad_token_id=0, **shape))
    return LlamaForCausalLM(LlamaConfig(**shape))


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def per_example(short: int) -> dict:
    """One row attended per example; examples under ``short`` tokens share one padded call."""
    return {"one_row": True, "attention": PER_EXAMPLE_SDPA, "short": short}


@pytest.mark.parametrize("family,attn,layout", [
    ("llama", "sdpa", {}), ("llama", "eager", {}), ("qwen2", "sdpa", {}), ("llama", "sdpa", {"row_width": 20}),
    ("llama", "sdpa", {"one_row": True}),
    # examples of 17, 9, 4, 12 and 6 tokens: all in one padded call, each alone, or both kinds
    ("llama", "sdpa", per_example(64)), ("llama", "sdpa", per_example(0)), ("llama", "sdpa", per_example(8)),
    ("qwen2", "sdpa", per_example(8)), ("mistral", "sdpa", per_example(8)), ("mistral", "sdpa", per_example(64)),
    ("gemma3", "sdpa", per_example(8)), ("qwen3", "sdpa", per_example(8)), ("phi3", "sdpa", per_example(8)),
    ("llama", "sdpa", {**per_example(8), "checkpointing": True}),  # attention again in the backward
])
def test_padding_free_gradient_equals_the_padded_batch(family, attn, layout, monkeypatch):
    layout = dict(layout)
    if "short" in layout:
        monkeypatch.setattr(per_example_attention, "SHORT_EXAMPLE", layout.pop("short"))
    checkpointing = layout.pop("checkpointing", False)
    generator = torch.Generator().manual_seed(1)
    features = []
    # a prompt-only example trains on nothing; a one-token one has nothing to predict
    for length, prompt in [(17, 5), (9, 3), (4, 2), (1, 0), (12, 0), (6, 6)]:
        ids = torch.randint(1, 64, (length,), generator=generator).tolist()
        features.append({"input_ids": ids, "attention_mask": [1] * length, "labels": [M] * prompt + ids[prompt:]})
    model = tiny_model(family, attn)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    padded_loss, padded = loss_and_grads(model, PaddingCollator(pad_token_id=0)(features))
    free_batch = PaddingFreeCollator(pad_token_id=0, **layout)(features)
    if layout.get("attention"):
        use_attention(model, layout["attention"])
    assert free_batch["input_ids"].numel() < 6 * 17  # fewer tokens than the padded batch
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


# ---------------------------------------------------------------- sdpa one example at a time


def test_sdpa_models_get_one_row_attended_per_example_and_the_rest_keep_their_attention():
    per_example = collator("sft", tiny_model("llama", "sdpa"))
    assert (per_example.one_row, per_example.attention) == (True, PER_EXAMPLE_SDPA)
    eager = collator("sft", tiny_model("llama", "eager"))
    assert (eager.one_row, eager.attention) == (False, None)  # rows as wide as the longest example
    softcapped = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=8, attn_implementation="sdpa"))
    assert supports_padding_free(softcapped) and not supports_per_example_sdpa(softcapped)  # sdpa cannot softcap
    assert collator("sft", softcapped).attention is None


def test_per_example_attention_refuses_what_is_not_a_padding_free_training_row():
    model = tiny_model("llama", "sdpa")
    q = torch.zeros(2, 4, 5, 8)
    with pytest.raises(RuntimeError, match=r"got a batch of 2, 5 queries over 5 keys, position ids given, mask none"):
        per_example_sdpa(model.model.layers[0].self_attn, q, q, q, None,
                         position_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"position ids missing"):
        per_example_sdpa(model.model.layers[0].self_attn, q[:1], q[:1], q[:1], None)


def test_per_example_attention_refuses_a_padding_mask_and_runs_under_inference_mode():
    model = tiny_model("llama", "sdpa")
    model.eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    plain = model(input_ids=ids[:, :4]).logits  # the first example alone
    use_attention(model, PER_EXAMPLE_SDPA)
    with pytest.raises(RuntimeError, match=r"this batch has a padding mask"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
    with torch.inference_mode():  # inference tensors have no version counter for the plan's cache
        row = model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1]])).logits
    torch.testing.assert_close(row[:, :4], plain, atol=1e-6, rtol=0)


def test_a_stage_job_trains_one_row_batches_per_example_and_saves_a_plain_sdpa_config(tmp_path):
    import datasets

    from stages.run_args import FinetuningArguments, ModelArguments, TrainingOptions
    from stages.recipes.causal_lm import CausalLMTrainer
    from stages.job import JobSpec, StageJob

    model, tok = tiny_model("llama", "sdpa"), tokenizer()
    spec = JobSpec(model=ModelArguments(model_name_or_path=str(tmp_path)), data=DataArguments(dataset="x"),
                   finetuning=FinetuningArguments(stage="sft", finetuning_type="full"),
                   training=TrainingOptions({"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 3,
                                             "max_steps": 2, "report_to": "none", "learning_rate": 1e-3}))
    generator = torch.Generator().manual_seed(2)
    lengths = [7, 3, 11, 5, 9, 4]
    data = datasets.Dataset.from_list([{"input_ids": (ids := torch.randint(2, 64, (n,), generator=generator).tolist()),
                                        "attention_mask": [1] * n, "labels": ids} for n in lengths])
    job = StageJob(spec=spec, training_args=spec.training_arguments(use_cpu=True), train_dataset=data)
    calls = []
    trainer = job.build_trainer(CausalLMTrainer, model, tok)
    assert model.config._attn_implementation == PER_EXAMPLE_SDPA
    assert trainer.data_collator.one_row and trainer.args.use_cache is False
    from transformers import AttentionInterface

    seen = AttentionInterface()[PER_EXAMPLE_SDPA]
    AttentionInterface.register(PER_EXAMPLE_SDPA, lambda *a, **k: calls.append(a[1].shape) or seen(*a, **k))
    try:
        trainer.train()
    finally:
        AttentionInterface.register(PER_EXAMPLE_SDPA, seen)
    # 2 steps x 2 layers (autograd runs the backward), each over one row: a whole batch of 3, with
    # the two batches together holding all 6 examples once (every token, no pad)
    assert len(calls) == 4 and {shape[0] for shape in calls} == {1}
    assert sum(shape[2] for shape in calls) == 2 * sum(lengths)
    model.save_pretrained(tmp_path / "saved")
    assert PER_EXAMPLE_SDPA not in (tmp_path / "saved" / "config.json").read_text()


def test_the_plan_gathers_short_examples_into_padded_slots_and_puts_every_token_back_in_row_order(monkeypatch):
    monkeypatch.setattr(per_example_attention, "SHORT_EXAMPLE", 4)
    # a long example (7 tokens), then two short ones (2 and 3): the short ones go first in the call order
    plan = ExamplePlan.build([0, 7, 9, 12], "cpu")
    assert plan.long_spans == [(0, 7)] and plan.short_shape == (2, 3)
    assert plan.short_tokens.tolist() == [7, 8, 9, 10, 11] and plan.short_slots.tolist() == [0, 1, 3, 4, 5]
    assert plan.row_order.tolist() == [5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4]
    in_order = ExamplePlan.build([0, 2, 5, 12], "cpu")
    assert in_order.row_order is None and in_order.long_spans == [(5, 12)]  # short ones first already
    lone = ExamplePlan.build([0, 2, 12], "cpu")
    assert lone.short_slots is None and lone.long_spans == [(0, 2), (2, 12)]  # one short example: no padded call


def test_a_plan_is_made_once_per_forward_and_anew_for_other_position_ids(monkeypatch):
    monkeypatch.setattr(per_example_attention, "SHORT_EXAMPLE", 0)  # every example alone: the spans show the plan
    first = torch.tensor([[0, 1, 2, 0, 1]])
    plan = ExamplePlan.of(first)
    assert ExamplePlan.of(first) is plan  # the next layer of the same forward
    assert ExamplePlan.of(torch.tensor([[0, 1, 2, 0, 1]])) is not plan  # the next batch
    first[0, 2] = 0  # changed in place: its version moves on
    assert plan.long_spans == [(0, 3), (3, 5)] and ExamplePlan.of(first).long_spans == [(0, 2), (2, 3), (3, 5)]
