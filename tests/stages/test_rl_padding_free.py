"""Padding-free RL forwards: the policy's log-probs (and entropies), the critic's values and both
roles' updates, with each micro-batch's prompt + completion sequences laid end to end, equal the
padded path's; the token budget counts real tokens; multi-turn loss masks still apply; a model
that cannot keep sequences apart falls back, or is refused when asked."""

from __future__ import annotations

import pytest
import torch

from cluster.config import load_config
from registries.datasets.data_args import DataArguments
from stages.rl.workers.critic import CriticWorker, completion_values
from stages.rl.workers.logprobs import budget_slices, completion_logprobs, pack_completions
from stages.rl.workers.trainable import forward_rows
from stages.rl.config.types import RolloutSample
from stages.training import per_example_attention
from stages.training.per_example_attention import PER_EXAMPLE_SDPA, attending, attention_implementation
from stages.training.value_head import ValueHeadModel
from tests.stages.test_padding_free import HandWrittenLM, tiny_model, tokenizer
from tests.stages.test_rl_policy import DATA_DIR, policy

# prompt and completion lengths: a one-token completion, an empty one, sequences of 4 to 40 tokens
SHAPES = [(5, 12), (3, 1), (9, 30), (2, 6), (4, 0), (7, 18), (6, 3)]


def sequences(vocab: int = 64):
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, vocab, (p,), generator=generator).tolist() for p, _ in SHAPES]
    completions = [torch.randint(2, vocab, (c,), generator=generator).tolist() for _, c in SHAPES]
    return prompts, completions


def rows_for(model, **data):
    return forward_rows(tokenizer(), DataArguments(dataset="x", **data), model)


def test_a_padding_free_budget_counts_real_tokens():
    lengths = [5, 9, 3, 12, 4, 4, 20, 2]
    parts = budget_slices(lengths, max_rows=3, max_tokens=18, padded=False)
    assert [i for part in parts for i in range(len(lengths))[part]] == list(range(len(lengths)))
    assert [lengths[p] for p in parts] == [[5, 9, 3], [12, 4], [4], [20], [2]]  # sums within 18, greedily
    # padded, the same budget holds fewer: rows x the longest
    assert [lengths[p] for p in budget_slices(lengths, max_rows=3, max_tokens=18)] == [[5, 9], [3], [12], [4, 4], [20], [2]]


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager")])
def test_log_probs_and_entropies_equal_the_padded_path(family, attn, monkeypatch):
    # sdpa: one row attended per sequence (those under 8 tokens share a padded call, the rest alone);
    # eager: rows as wide as the longest sequence, transformers' block-diagonal masks
    monkeypatch.setattr(per_example_attention, "SHORT_EXAMPLE", 8)
    model = tiny_model(family, attn).eval()
    rows = rows_for(model)
    assert (rows.one_row, rows.attention) == ((True, PER_EXAMPLE_SDPA) if attn == "sdpa" else (False, None))
    prompts, completions = sequences()
    with torch.no_grad():
        padded, padded_entropy = completion_logprobs(model, prompts, completions, 0, temperature=0.7, with_entropy=True)
        with attending(model, rows.attention):
            for budget in (None, 40):  # the whole batch in one micro-batch, or micro-batches of <= 40 real tokens
                free, free_entropy = completion_logprobs(model, prompts, completions, 0, temperature=0.7,
                                                         with_entropy=True, max_tokens=budget, rows=rows)
                for i, c in enumerate(completions):
                    assert free[i].shape == (len(c),) == free_entropy[i].shape
                    torch.testing.assert_close(free[i], padded[i], atol=1e-5, rtol=0)
                    torch.testing.assert_close(free_entropy[i], padded_entropy[i], atol=1e-5, rtol=0)
            assert attention_implementation(model) == (PER_EXAMPLE_SDPA if attn == "sdpa" else attn)
    assert attention_implementation(model) == attn  # its own attention again after the block
    packed = pack_completions(prompts, completions, rows)
    total = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    assert packed.input_ids.numel() == total if rows.one_row else packed.input_ids.numel() < 7 * 39
    assert packed.targets.tolist() == [t for c in completions for t in c]


def test_the_shared_row_is_what_the_restarting_positions_keep_apart():
    """The check above can fail: the same one-row layout with positions running on through the
    row lets every sequence after the first see the ones before it."""
    model = tiny_model("llama", "sdpa").eval()
    prompts, completions = sequences()
    packed = pack_completions(prompts, completions, rows_for(model))
    with torch.no_grad():
        padded = torch.cat(completion_logprobs(model, prompts, completions, 0))
        # plain sdpa, one row, one long sequence: no restart, no isolation
        logits = model(input_ids=packed.input_ids, logits_to_keep=0, use_cache=False).logits[0]
        crossed = torch.log_softmax(logits.float(), -1)[packed.before, packed.targets]
    first = len(completions[0])
    assert torch.allclose(crossed[:first], padded[:first], atol=1e-5)  # the first sequence sees only itself
    assert (crossed[first:] - padded[first:]).abs().max() > 1e-3


def test_an_update_runs_per_sequence_attention_and_equals_the_padded_one_with_checkpointing(tmp_path, monkeypatch):
    """Gradient checkpointing recomputes attention in the backward: that must run per sequence too.
    The policy generates (HF backend) with padded batches, so its attention is sdpa outside its passes."""
    batch = [RolloutSample(p, c, group=i // 2, advantage=float(i % 3) - 1.0)
             for i, (p, c) in enumerate(zip(*sequences(vocab=200))) if c]
    calls = []
    attend = per_example_attention.per_example_sdpa
    monkeypatch.setattr(per_example_attention, "per_example_sdpa",
                        lambda *a, **k: calls.append(a[1].shape) or attend(*a, **k))
    steps = []
    for padding_free in (False, True):
        worker = policy(tmp_path, padding_free=padding_free, gradient_checkpointing=True, adam_epsilon=1e3,
                        learning_rate=100.0, per_device_train_batch_size=4)
        before = torch.cat([p.detach().flatten() for p in worker.model.parameters()])
        report = worker.update(batch, float(sum(len(s.completion_ids) for s in batch)))
        assert attention_implementation(worker.model) == "sdpa"
        steps.append(torch.cat([p.detach().flatten() for p in worker.model.parameters()]) - before)
    assert report["micro_batches"] == 2
    layers = worker.model.config.num_hidden_layers
    # 2 micro-batches x layers, forward and the checkpointed recompute, each over one row of its micro-batch
    assert len(calls) == 2 * layers * 2 and all(shape[0] == 1 for shape in calls), calls
    assert {shape[2] for shape in calls} == {sum(len(s.prompt_ids) + len(s.completion_ids) for s in part)
                                             for part in (batch[:4], batch[4:])}
    torch.testing.assert_close(steps[1], steps[0], atol=1e-5 * steps[0].abs().max().item(), rtol=0)


def test_observation_tokens_stay_out_of_a_padding_free_update(tmp_path):
    """Multi-turn samples: the loss_mask's zeros (observation tokens) get no gradient padding-free
    too (perturbing their advantages changes nothing), its ones do, and the step equals the padded one."""
    prompts, completions = sequences(vocab=200)
    masks = [[1] * len(c) if i % 2 else [int(j < 2 or j >= len(c) - 2) for j in range(len(c))]
             for i, c in enumerate(completions)]

    def batch(noise_at_observations: float, noise_at_samples: float = 0.0):
        out = []
        for i, (p, c, m) in enumerate(zip(prompts, completions, masks)):
            if c:
                adv = [float(i % 3) - 1.0 + (noise_at_samples if keep else noise_at_observations) for keep in m]
                out.append(RolloutSample(p, c, group=i // 2, token_advantages=adv, loss_mask=m))
        return out

    def step(padding_free: bool, samples) -> torch.Tensor:
        worker = policy(tmp_path, padding_free=padding_free, adam_epsilon=1e3, learning_rate=100.0)
        before = torch.cat([p.detach().flatten() for p in worker.model.parameters()])
        worker.update(samples, float(sum(sum(m) for m in masks)))
        return torch.cat([p.detach().flatten() for p in worker.model.parameters()]) - before

    assert any(0 in m for m in masks)
    free = step(True, batch(0.0))
    tolerance = 1e-5 * free.abs().max().item()
    torch.testing.assert_close(step(True, batch(5.0)), free, atol=tolerance, rtol=0)
    torch.testing.assert_close(step(False, batch(0.0)), free, atol=tolerance, rtol=0)
    assert (step(True, batch(0.0, noise_at_samples=5.0)) - free).abs().max() > 100 * tolerance


def critic(tmp_path, **overrides) -> CriticWorker:
    config = {"model_name_or_path": "tiny:qwen2", "template": "qwen", "stage": "ppo", "finetuning_type": "full",
              "dataset": "arith_train", "dataset_dir": DATA_DIR, "output_dir": str(tmp_path / "out"),
              "reward_funcs": ["exact_match"], "rollout_backend": "hf", "learning_rate": 100.0, "adam_epsilon": 1e3,
              "max_grad_norm": 0.0, "seed": 3, **overrides}
    worker = CriticWorker(load_config(config).job_spec())
    worker.setup(0, 1, total_updates=10)
    return worker


def test_critic_values_and_update_equal_the_padded_path(tmp_path):
    prompts, completions = sequences(vocab=200)
    values, steps = [], []
    for padding_free in (False, True):
        worker = critic(tmp_path, padding_free=padding_free, max_tokens_per_micro_batch=40)
        assert (worker.rows is not None) == padding_free
        samples = [RolloutSample(p, c, group=i) for i, (p, c) in enumerate(zip(prompts, completions))]
        values.append(worker.values(samples))
        generator = torch.Generator().manual_seed(5)
        for i, s in enumerate(samples):  # the rollout's values (the padded pass's, in both runs), returns to learn
            s.values = [v + 0.1 for v in values[0][i]]
            s.returns = torch.randn(len(s.completion_ids), generator=generator).tolist()
        before = torch.cat([p.detach().flatten() for p in worker.model.parameters()])
        worker.update(samples, float(sum(len(c) for c in completions)))
        steps.append(torch.cat([p.detach().flatten() for p in worker.model.parameters()]) - before)
        assert attention_implementation(worker.model.pretrained_model) == "sdpa"
    for padded, free, c in zip(*values, completions):
        assert len(free) == len(c)
        torch.testing.assert_close(torch.tensor(free), torch.tensor(padded), atol=1e-5, rtol=0)
    torch.testing.assert_close(steps[1], steps[0], atol=1e-5 * steps[0].abs().max().item(), rtol=0)


def test_value_head_values_equal_the_padded_path_with_their_gradient():
    model = ValueHeadModel(tiny_model("qwen2", "sdpa"))
    rows = rows_for(model)
    prompts, completions = sequences()
    weights = torch.randn(sum(len(c) for c in completions), generator=torch.Generator().manual_seed(6))
    out = []
    for layout in (None, rows):
        model.zero_grad()
        with attending(model.pretrained_model, layout.attention if layout else None):
            values = torch.cat(completion_values(model, prompts, completions, 0, rows=layout))
            (values * weights).sum().backward()
        out.append((values.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-5, rtol=0)
    assert out[1][1].keys() == out[0][1].keys() and "v_head.weight" in out[0][1]
    for name, grad in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], grad, atol=1e-5, rtol=0, msg=name)


def test_a_model_that_cannot_keep_sequences_apart_falls_back_or_is_refused():
    assert rows_for(tiny_model("llama", "sdpa")).attention == PER_EXAMPLE_SDPA  # null: on where the model can
    assert rows_for(HandWrittenLM()) is None  # ... and padded micro-batches, quietly, where it cannot
    assert rows_for(tiny_model("llama", "sdpa"), padding_free=False) is None
    with pytest.raises(ValueError, match=r"padding_free is true, but this model \(HandWrittenLM, attention 'sdpa'\)"
                                         r".*Set padding_free: false"):
        rows_for(HandWrittenLM(), padding_free=True)
