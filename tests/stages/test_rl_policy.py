"""The policy role without Ray: an update's gradient does not depend on how the batch is split into
micro-batches (by rows or by a token budget, padded or padding-free), the HF rollout backend reports the model's own log-probs, and tiny-model names carry
shape options (vLLM needs head size >= 32)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from cluster.config import load_config
from registries.errors import UserError
from stages.loading import parse_tiny_name, resolve_model_path
from stages.engines.hf_backend import HFEngine
from stages.rl.workers.logprobs import completion_logprobs
from stages.rl.workers.policy import PolicyWorker
from stages.engines.types import SamplingSpec
from stages.rl.config.types import RolloutSample
from stages.rl.algorithms.grpo_math import loss_normalizer

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")


def policy(tmp_path, **overrides) -> PolicyWorker:
    config = {"model_name_or_path": "tiny:qwen2", "template": "qwen", "stage": "grpo", "finetuning_type": "full",
              "dataset": "arith_train", "dataset_dir": DATA_DIR, "output_dir": str(tmp_path / "out"),
              "reward_funcs": ["exact_match"], "rollout_backend": "hf", "learning_rate": 1e-3,
              "max_grad_norm": 0.0, "seed": 3}
    config.update(overrides)
    worker = PolicyWorker(load_config(config).job_spec())
    worker.setup(0, 1, total_updates=10)
    return worker


def samples() -> list[RolloutSample]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(7):  # 7 does not divide by the micro-batch sizes below: uneven parts
        prompt = torch.randint(5, 200, (3 + i % 3,), generator=generator).tolist()
        completion = torch.randint(5, 200, (2 + i % 4,), generator=generator).tolist()
        out.append(RolloutSample(prompt, completion, group=i // 2, advantage=float(i % 3) - 1.0))
    return out


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_one_update_is_the_same_for_any_micro_batch_size(tmp_path, loss_type):
    """A huge adam_epsilon makes Adam's first step proportional to the gradient, so equal steps
    mean equal gradients (a plain Adam step is sign-like and would hide a wrongly scaled one).
    Agreeing gradients can still leave a weight rounded one way in one run and the other way in
    another: one float32 spacing of the weight (seen in CI: 1.5e-11 at 1e-4, 7e-5 of a 2e-7 step),
    so that much is forgiven; the large learning rate keeps the step far above those spacings."""
    _micro_batch_steps_agree(tmp_path, loss_type=loss_type)


@pytest.mark.parametrize("overrides", [
    {"loss_type": "cispo", "epsilon_high": 5.0},
    {"loss_type": "grpo", "importance_sampling_level": "sequence", "entropy_coef": 0.01},  # GSPO + entropy bonus
    {"loss_type": "dapo", "entropy_coef": 0.05},
])
def test_loss_variants_are_the_same_for_any_micro_batch_size(tmp_path, overrides):
    report = _micro_batch_steps_agree(tmp_path, **overrides)
    assert ("entropy" in report) == ("entropy_coef" in overrides)


def _micro_batch_steps_agree(tmp_path, **overrides) -> dict:
    """The test above for the RL keys in ``overrides``; returns the last update's report. Padded
    and padding-free (the micro-batch's sequences end to end in one row, attended one at a time)
    steps alike must equal the padded whole batch's."""
    batch = samples()
    norm = loss_normalizer(overrides["loss_type"], [len(s.completion_ids) for s in batch], 32)
    steps, splits = [], []
    # by rows (2, 3), by a token budget (7 rows are 5..12 tokens long: 12 fits one row at most of
    # the longest, 30 two or three; padding-free, the budget counts real tokens: 12 fits two short
    # ones), padding-free by rows and by budgets, and the whole batch at once padded last, the reference
    for split in ({"per_device_train_batch_size": 2}, {"per_device_train_batch_size": 3},
                  {"max_tokens_per_micro_batch": 12}, {"max_tokens_per_micro_batch": 30},
                  {"padding_free": True, "per_device_train_batch_size": 3},
                  {"padding_free": True, "max_tokens_per_micro_batch": 12},
                  {"padding_free": True, "max_tokens_per_micro_batch": 30},
                  {"per_device_train_batch_size": 16}):
        worker = policy(tmp_path, **{"padding_free": False, **split}, adam_epsilon=1e3, learning_rate=100.0,
                        **overrides)
        assert (worker.rows is not None) == split.get("padding_free", False)
        before = torch.cat([p.detach().flatten() for p in worker.model.parameters()])
        report = worker.update(batch, norm)
        assert report["num_samples"] == 7
        splits.append(report["micro_batches"])
        after = torch.cat([p.detach().flatten() for p in worker.model.parameters()])
        steps.append(after - before)
    # the splits really differ; padding-free budgets count no pads (12: one sample or two short ones)
    assert splits == [4, 3, 7, splits[3], 3, 6, 2, 1] and 2 < splits[3] < 7, splits
    largest = torch.maximum(before.abs(), after.abs())
    spacing = torch.nextafter(largest, torch.tensor(float("inf"))) - largest  # of the last run's weights
    scale = steps[-1].abs().max()
    assert scale > 0
    for step in steps[:-1]:
        assert ((step - steps[-1]).abs() - 2 * spacing).clamp(min=0).max() / scale < 1e-5
    return report


def test_hf_backend_samples_n_per_prompt_and_reports_the_models_log_probs(tmp_path):
    worker = policy(tmp_path)
    prompts = [[1, 20, 30, 40], [1, 50]]
    stop = worker.template.stop_token_ids(worker.tokenizer)
    completions = HFEngine(worker.model, worker.pad_token_id).generate_batch(
        prompts, SamplingSpec(n=3, temperature=1.0, max_tokens=6, stop_token_ids=tuple(stop)))
    assert [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1]
    assert [c.index for c in completions] == [0, 1, 2, 0, 1, 2]
    assert worker.model.training  # the engine generated in eval mode and gave the policy back as it was
    for c in completions:
        assert 1 <= len(c.token_ids) <= 6 and len(c.logprobs) == len(c.token_ids)
        assert (c.finish_reason == "stop") == (c.token_ids[-1] in stop)
    expected = completion_logprobs(worker.model, [prompts[c.prompt_index] for c in completions],
                                   [c.token_ids for c in completions], worker.pad_token_id)
    for c, e in zip(completions, expected):
        assert torch.allclose(torch.tensor(c.logprobs), e, atol=1e-5)


def test_tiny_names_carry_shape_options():
    assert parse_tiny_name("tiny:qwen2") == ("qwen2", {})
    assert parse_tiny_name("tiny:qwen2,num_heads=2,hidden_size=128") == ("qwen2", {"num_heads": 2, "hidden_size": 128})
    with open(os.path.join(resolve_model_path("tiny:qwen2,num_heads=2"), "config.json")) as f:
        config = json.load(f)
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    with pytest.raises(UserError, match=r"'heads=2' is not a tiny-model option.*num_heads"):
        parse_tiny_name("tiny:qwen2,heads=2")


def test_token_budget_slices_fit_the_budget_and_keep_the_order():
    from stages.rl.workers.logprobs import budget_slices

    lengths = [5, 9, 3, 12, 4, 4, 20, 2]
    parts = budget_slices(lengths, max_rows=3, max_tokens=18)
    assert [i for part in parts for i in range(len(lengths))[part]] == list(range(len(lengths)))
    for part in parts:
        rows = lengths[part]
        assert len(rows) == 1 or max(rows) * len(rows) <= 18  # padded tokens within the budget ...
    assert [lengths[p] for p in parts] == [[5, 9], [3], [12], [4, 4], [20], [2]]  # ... greedily
    assert budget_slices(lengths, max_rows=3) == [slice(0, 3), slice(3, 6), slice(6, 9)]  # no budget: by rows


def test_log_probs_and_values_do_not_depend_on_the_token_budget(tmp_path):
    worker = policy(tmp_path)
    batch = samples()
    prompts, completions = [s.prompt_ids for s in batch], [s.completion_ids for s in batch]
    with torch.no_grad():
        whole = completion_logprobs(worker.model, prompts, completions, 0, micro_batch_size=16)
        budgeted = completion_logprobs(worker.model, prompts, completions, 0, max_tokens=10)
    for a, b in zip(whole, budgeted):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
