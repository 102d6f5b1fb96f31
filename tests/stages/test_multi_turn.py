"""Multi-turn rollouts (stages/rl/agents/multi_turn.py) on the tiny random-init Qwen2 and its template:
token in, token out; the loss mask marks exactly the observation turns; max_turns and the token
budget stop a trajectory; the calculator's result comes back as the template's observation turn;
observation tokens get no gradient."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from registries.datasets import DataArguments
from registries.models import tiny_model_path
from stages.engines.hf_backend import HFEngine
from stages.engines.types import Completion, SamplingSpec
from stages.loading import load_tokenizer_and_template
from stages.rl.algorithms.grpo_math import policy_loss
from stages.rl.agents.environments import Environment, StepResult, ToolEnvironment
from stages.rl.agents.multi_turn import assistant_tail_ids, multi_turn_rollout, observation_ids, rollout_stats
from stages.rl.agents.tools import calculator, tools_json
from stages.rl.algorithms.masks import completion_mask, loss_token_counts, sample_mask
from stages.rl.config.types import RolloutSample

ROWS = [{"prompt": "Count with me.", "reference": ""}, {"prompt": "Say something.", "reference": ""}]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    tokenizer, template = load_tokenizer_and_template(
        SimpleNamespace(model_name_or_path="tiny:qwen2"), DataArguments(template="qwen"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("qwen2")).eval()
    return model, tokenizer, template


class Scripted(Environment):
    """Fixed observations for ``observations`` turns, then done; reward 1 per step."""

    def __init__(self, observations: int = 2):
        self.left = observations
        self.seen: list[str] = []

    def reset(self, row):
        return row["prompt"]

    def step(self, action):
        self.seen.append(action)
        if self.left == 0:
            return StepResult(None, 1.0, True)
        self.left -= 1
        return StepResult(f"observation {self.left}", 1.0, False)


class Recorder:
    """A real HF generate that keeps every call's prompts and replies, to rebuild what was sampled."""

    def __init__(self, model, tokenizer):
        self.engine = HFEngine(model, tokenizer.pad_token_id)
        self.calls: list[tuple[list[list[int]], list[Completion]]] = []

    def __call__(self, prompts, sampling):
        out = self.engine.generate_batch(prompts, sampling)
        self.calls.append((prompts, out))
        return out


def _sampling(template, tokenizer, **kw):
    # Ids 0..499 also stop a turn, so the random model ends its turns within a few tokens (it rarely
    # picks the template's own stop token); the rollout treats every stop id alike.
    stops = tuple(sorted(set(template.stop_token_ids(tokenizer)) | set(range(0, 500))))
    return SamplingSpec(**{"n": 2, "temperature": 1.0, "max_tokens": 24, "stop_token_ids": stops, "seed": 0, **kw})


def test_trajectories_are_the_sampled_ids_plus_the_templates_observation_ids(tiny):
    model, tokenizer, template = tiny
    generate = Recorder(model, tokenizer)
    samples = multi_turn_rollout(ROWS, lambda: Scripted(2), template, tokenizer, generate,
                                 _sampling(template, tokenizer), max_turns=5, max_total_tokens=10_000)
    assert [s.group for s in samples] == [0, 0, 1, 1]
    # Rebuild every trajectory from the generate calls alone: a call's i-th prompt belongs to the
    # i-th still-active trajectory and must be its prompt + everything so far; its reply is what was sampled.
    tail = assistant_tail_ids(template, tokenizer)
    built = [{"ids": [], "mask": [], "turns": 0, "done": False} for _ in samples]
    for prompts, outs in generate.calls:
        active = [(s, b) for s, b in zip(samples, built) if not b["done"]]
        assert len(prompts) == len(active)
        for (s, b), prompt, out in zip(active, prompts, outs):
            assert prompt == s.prompt_ids + b["ids"]
            b["ids"] += out.token_ids
            b["mask"] += [1] * len(out.token_ids)
            b["turns"] += 1
            if out.finish_reason == "stop" and b["turns"] < 3:  # Scripted(2): two observations, then done
                obs = tail + observation_ids(template, tokenizer, f"observation {3 - b['turns'] - 1}")
                b["ids"] += obs
                b["mask"] += [0] * len(obs)
            else:
                b["done"] = True
    assert all(b["done"] for b in built)
    for s, b in zip(samples, built):
        assert s.completion_ids == b["ids"]
        assert s.loss_mask == b["mask"]
        assert s.turns == b["turns"] and len(s.rollout_logprobs) == len(s.completion_ids)
        assert s.tool_calls == sum(1 for a, c in zip([1] + s.loss_mask, s.loss_mask) if (a, c) == (1, 0))
        assert all(math.isnan(lp) == (m == 0) for lp, m in zip(s.rollout_logprobs, s.loss_mask))
    finished = [s for s in samples if not s.truncated]
    assert finished, "no trajectory finished: the stop tokens should end turns quickly"
    for s in finished:
        assert s.turns == 3 and s.tool_calls == 2 and s.environment_reward == 3.0
    assert rollout_stats(samples)["rollout/turns"] == sum(s.turns for s in samples) / 4


def test_max_turns_and_the_token_budget_stop_a_trajectory(tiny):
    model, tokenizer, template = tiny
    sampling = _sampling(template, tokenizer, n=1)
    by_turns = multi_turn_rollout(ROWS, lambda: Scripted(100), template, tokenizer,
                                  Recorder(model, tokenizer), sampling, max_turns=2, max_total_tokens=10_000)
    for s in by_turns:
        assert s.turns <= 2 and s.truncated
        if s.turns == 2:  # the second reply ended in a stop: the environment still wanted more
            assert s.tool_calls == 1 and s.loss_mask[-1] == 1  # ends on the policy's turn, not an observation
    budget = 40
    by_budget = multi_turn_rollout(ROWS, lambda: Scripted(100), template, tokenizer,
                                   Recorder(model, tokenizer), sampling, max_turns=50, max_total_tokens=budget)
    for s in by_budget:
        assert len(s.completion_ids) <= budget and s.truncated and s.turns < 50


def test_the_calculator_result_is_appended_as_the_templates_observation_turn(tiny):
    _, tokenizer, template = tiny
    question = "What is 123*45?"
    answer = "It is 5535."
    conversation = [{"role": "user", "content": question},
                    {"role": "function", "content": '[{"name": "calculator", "arguments": {"expression": "123*45"}}]'},
                    {"role": "observation", "content": "5535"},
                    {"role": "assistant", "content": answer}]
    pairs = template.encode_multiturn(tokenizer, conversation, tools=tools_json([calculator]))
    stop = template.stop_token_ids(tokenizer)
    # The deterministic "policy": the template's own tool-call reply, then the answer, each ending at
    # its stop token as an engine's reply does (the turn's newline after it is the template's, not sampled).
    replies = [pairs[0][1][:-1], pairs[1][1][:-1]]
    assert replies[0][-1] in stop and replies[1][-1] in stop
    prompts_seen = []

    def generate(prompts, sampling):
        prompts_seen.append(prompts)
        ids = replies[len(prompts_seen) - 1]
        return [Completion(list(ids), "stop", [-0.5] * len(ids), prompt_index=i) for i in range(len(prompts))]

    (sample,) = multi_turn_rollout(
        [{"prompt": question}], lambda: ToolEnvironment([calculator], template.extract_tool_calls), template, tokenizer,
        generate, SamplingSpec(n=1, max_tokens=64, stop_token_ids=tuple(stop)), max_turns=4, max_total_tokens=512)
    assert sample.prompt_ids == pairs[0][0]
    assert sample.completion_ids == pairs[0][1] + pairs[1][0] + replies[1]
    assert "5535" in tokenizer.decode(pairs[1][0])
    observation = len(pairs[0][1]) - len(replies[0]) + len(pairs[1][0])
    assert sample.loss_mask == [1] * len(replies[0]) + [0] * observation + [1] * len(replies[1])
    assert prompts_seen[1] == [pairs[0][0] + pairs[0][1] + pairs[1][0]]
    assert (sample.turns, sample.tool_calls, sample.truncated) == (2, 1, False)


def _loss(samples, logits, beta=0.0):
    logp_all = torch.log_softmax(logits, dim=-1)
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(s.completion_ids) for s in samples], batch_first=True)
    logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    mask = sample_mask(samples)
    old = logp.detach() + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    ref = logp.detach() - 0.1 if beta else None
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, -0.5]), mask, epsilon_low=0.2, epsilon_high=0.28,
                          loss_type="dapo", max_completion_length=8, ref_logp=ref, beta=beta,
                          normalizer=float(sum(loss_token_counts(samples))))
    return loss


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_observation_tokens_get_zero_gradient(beta):
    torch.manual_seed(0)
    mask = [1, 1, 0, 0, 0, 1, 1]
    samples = [RolloutSample([5], [3, 4, 9, 9, 9, 6, 7], group=0, loss_mask=mask),
               RolloutSample([5], [2, 8, 1], group=0)]
    logits = torch.randn(2, 7, 16, requires_grad=True)
    _loss(samples, logits, beta).backward()
    row = logits.grad[0].abs().sum(-1)
    assert torch.all(row[torch.tensor(mask) == 0] == 0)
    assert torch.all(row[torch.tensor(mask) == 1] > 0)
    assert torch.all(logits.grad[1, :3].abs().sum(-1) > 0)


def test_an_all_ones_loss_mask_changes_nothing():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 16)
    plain = [RolloutSample([5], [3, 4, 9, 1], group=0), RolloutSample([5], [2, 8], group=0)]
    ones = [RolloutSample([5], [3, 4, 9, 1], group=0, loss_mask=[1, 1, 1, 1]),
            RolloutSample([5], [2, 8], group=0, loss_mask=[1, 1])]
    assert torch.equal(sample_mask(plain), completion_mask([s.completion_ids for s in plain]))
    assert torch.equal(sample_mask(ones), sample_mask(plain))
    assert loss_token_counts(ones) == loss_token_counts(plain) == [4, 2]
    assert torch.equal(_loss(plain, logits), _loss(ones, logits))
    with pytest.raises(ValueError, match="align"):
        sample_mask([RolloutSample([5], [3, 4], group=0, loss_mask=[1])])


def test_advantages_skip_observation_tokens_as_if_they_were_not_there():
    """GAE and REINFORCE++ over a row with an observation gap equal them over the row with the
    gap cut out (the same tokens, the same values), and are 0 in the gap."""
    from stages.rl.algorithms.ppo_math import gae
    from stages.rl.algorithms.reinforce_pp import reinforce_pp_advantages

    torch.manual_seed(0)
    gapped = torch.tensor([[1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    rewards, values = torch.randn(2, 7), torch.randn(2, 7)
    keep = gapped[0] > 0
    dense_mask = torch.ones(2, 5)
    cut = lambda x: torch.stack([x[0][keep], x[1, :5]])  # noqa: E731 - row 0 without its gap, row 1 unpadded
    for kwargs in (dict(gamma=0.9, lam=0.8), dict(gamma=1.0, lam=1.0)):
        adv, ret = gae(rewards, values, gapped, whiten_advantages=False, **kwargs)
        adv_d, ret_d = gae(cut(rewards), cut(values), dense_mask, whiten_advantages=False, **kwargs)
        assert torch.allclose(cut(adv), adv_d) and torch.allclose(cut(ret), ret_d)
        assert torch.all(adv[0, 2:4] == 0) and torch.all(ret[0, 2:4] == 0)
    pp = reinforce_pp_advantages("reinforce_plus_plus", rewards, gapped, 2, gamma=0.9)
    pp_d = reinforce_pp_advantages("reinforce_plus_plus", cut(rewards), dense_mask, 2, gamma=0.9)
    assert torch.allclose(cut(pp), pp_d) and torch.all(pp[0, 2:4] == 0)


def test_a_reply_cut_by_the_turn_cap_goes_to_the_environment_and_its_turn_is_closed_for_it(tiny):
    """max_tokens caps one turn: a reply that hit it is still the policy's turn; when the episode
    goes on, the stop token it did not sample (then the template's newline) precedes the
    observation, masked out with it. The trajectory's budget still ends everything."""
    _, tokenizer, template = tiny
    stop = template.stop_token_ids(tokenizer)
    replies = [[51, 52, 53], [54, 55, stop[0]]]  # cut by the turn cap, then one that stops
    calls = []

    def generate(prompts, sampling):
        calls.append(prompts)
        ids = replies[len(calls) - 1]
        reason = "length" if ids[-1] not in stop else "stop"
        return [Completion(list(ids), reason, [-0.5] * len(ids), prompt_index=i) for i in range(len(prompts))]

    env = Scripted(1)
    (sample,) = multi_turn_rollout([ROWS[0]], lambda: env, template, tokenizer, generate,
                                   SamplingSpec(n=1, max_tokens=3, stop_token_ids=tuple(stop)),
                                   max_turns=4, max_total_tokens=200)
    closing = [stop[0]] + assistant_tail_ids(template, tokenizer)
    observation = observation_ids(template, tokenizer, "observation 0")
    assert sample.completion_ids == [51, 52, 53] + closing + observation + [54, 55, stop[0]]
    assert sample.loss_mask == [1, 1, 1] + [0] * (len(closing) + len(observation)) + [1, 1, 1]
    assert env.seen == [tokenizer.decode([51, 52, 53], skip_special_tokens=True),
                        tokenizer.decode([54, 55], skip_special_tokens=True)]
    assert sample.turns == 2 and not sample.truncated and sample.answer_start == len(sample.completion_ids) - 3
