"""Asynchronous rollouts (stages/rl/controller/rollouts.py): the schedule, the version stamps and the bound.

The roles here are an in-process engine with the property the Ray roles rely on: one worker thread
runs its calls (generations and weight pushes) in the order they were sent. Every completion
records the weights the engine actually held when it was generated, so the tests check the stamp
against what happened, not against the schedule's own arithmetic. The real Ray roles with a vLLM
engine are exercised end to end in tests/e2e/test_grpo_async.py.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from cluster.config import ConfigError, load_config
from stages.engines.types import Completion, SamplingSpec
from stages.rl.config.rl_args import RLArguments
from stages.rl.controller.roles import Generation, PromptRow
from stages.rl.controller.rollouts import RolloutSource
from stages.rl.controller.steplog import PhaseTimer
from tests.stages.test_rl_loss_variants import GRPO

N = 2  # completions per prompt


class FuturePending:
    def __init__(self, future: Future):
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def result(self):
        return self.future.result()


class InProcessEngine:
    """Roles whose engine is one worker thread: calls run in the order sent. A completion's first
    token is the weights version the engine held while generating it."""

    def __init__(self, generate_s: float = 0.0):
        self.engine = ThreadPoolExecutor(max_workers=1)
        self.weights = 0  # the version the engine holds
        self.trained = 0  # the version the policy holds
        self.generate_s = generate_s
        self.sent_ahead: list[int] = []  # generations queued or running when each push was sent
        self._queued = 0
        self._lock = threading.Lock()

    def generate_async(self, prompt_ids, sampling: SamplingSpec):
        with self._lock:
            self._queued += 1

        def run():
            time.sleep(self.generate_s)
            start = time.time()
            out = [Completion([self.weights, *ids], "stop", None, None, i, p)
                   for p, ids in enumerate(prompt_ids) for i in range(sampling.n)]
            with self._lock:
                self._queued -= 1
            return Generation(out, (start, time.time()))

        return FuturePending(self.engine.submit(run))

    def push_weights(self):
        version = self.trained
        with self._lock:
            self.sent_ahead.append(self._queued)

        def load():
            self.weights = version
            return {"time/sync_load": 0.0}

        return FuturePending(self.engine.submit(load))

    def sync_weights(self):
        return self.push_weights().result()

    def generate(self, prompt_ids, sampling):
        return self.generate_async(prompt_ids, sampling).result().completions


def run_steps(mode: str, steps: int, *, staleness=None, update_s: float = 0.0, generate_s: float = 0.0,
              tamper=None):
    """A run's loop as RunProgress drives it: take, (slow) update, publish. Returns each step's
    figures and the versions its samples were really generated with."""
    rl = RLArguments(reward_funcs=["exact_match"], async_rollout=mode, max_staleness=staleness, num_generations=N)
    roles = InProcessEngine(generate_s)
    run = SimpleNamespace(spec=SimpleNamespace(rl=rl, training=SimpleNamespace(seed=0)), roles=roles)
    batches = {s: [PromptRow([100 + s], f"prompt {s}")] for s in range(1, steps + 1)}
    sampling = SamplingSpec(n=N, max_tokens=4)
    source = RolloutSource(run, sampling, lambda s: batches[s], steps, version=0)
    figures, generated_with = [], []
    for step in range(1, steps + 1):
        timer = PhaseTimer()
        samples, values = source.take(step, batches[step], timer)
        assert [s.prompt_ids for s in samples] == [[100 + step]] * N  # this step's prompts, not another's
        generated_with.append(samples[0].completion_ids[0])
        if tamper is not None:
            tamper(step, source, roles)
        with timer("update"):
            time.sleep(update_s)
            roles.trained = step
        values.update(source.publish(step, timer))
        figures.append(values)
    source.drain()
    return figures, generated_with, roles


def test_off_is_the_synchronous_loop():
    figures, generated_with, roles = run_steps("off", 5)
    assert generated_with == [0, 1, 2, 3, 4]  # step t samples with the weights of step t - 1
    assert all("async/staleness" not in f for f in figures)
    assert roles.sent_ahead == [0] * 5  # each push found the engine idle


def test_one_step_samples_the_next_batch_with_weights_one_version_old():
    figures, generated_with, roles = run_steps("one_step", 6)
    assert [f["async/staleness"] for f in figures] == [0, 1, 1, 1, 1, 1]
    assert generated_with == [0, 0, 1, 2, 3, 4]  # stamped versions are the ones the engine really held
    assert [t - 1 - f["async/staleness"] for t, f in enumerate(figures, 1)] == generated_with


def test_bounded_runs_k_batches_ahead_and_never_beyond_with_a_slow_policy():
    """A policy ten times slower than the engine: the engine would run arbitrarily far ahead if
    let, but at most k batches are ever in flight, and no sample is more than k versions old."""
    figures, generated_with, roles = run_steps("bounded", 8, staleness=2, update_s=0.05, generate_s=0.005)
    staleness = [f["async/staleness"] for f in figures]
    assert staleness == [0, 1, 2, 2, 2, 2, 2, 2]
    assert max(staleness) <= 2
    assert [t - 1 - s for t, s in enumerate(staleness, 1)] == generated_with
    assert max(roles.sent_ahead) <= 2
    assert all("async/dropped_stale" not in f for f in figures)


def test_generation_overlaps_a_slow_update():
    """The engine works on the next batch during the update: the overlap it reports is most of
    its generation time (a synchronous loop would report none)."""
    figures, _, _ = run_steps("one_step", 5, update_s=0.1, generate_s=0.0)
    later = figures[2:]
    assert all(f["time/overlap"] > 0 for f in later), later
    assert all(f["time/overlap"] <= f["time/generate_engine"] + 1e-6 for f in later)


def test_a_batch_older_than_the_bound_is_generated_again():
    """The schedule never queues a batch beyond the bound; the guard behind it is tested by
    marking step 4's queued batch (sent during step 3) as sampled five versions earlier: it is
    dropped, generated again from the current weights, and counted."""
    def age(step, source, roles):
        if step == 3:
            source.in_flight[4].version -= 5

    figures, generated_with, _ = run_steps("one_step", 5, tamper=age)
    assert figures[3]["async/dropped_stale"] == 1  # step 4's batch (1 prompt) was dropped ...
    assert figures[3]["async/staleness"] == 0 and generated_with[3] == 3  # ... and sampled with step 3's weights
    assert all("async/dropped_stale" not in f for i, f in enumerate(figures) if i != 3)


def test_keys_and_their_mistakes():
    assert RLArguments(reward_funcs=["x"]).max_staleness == 0
    assert RLArguments(reward_funcs=["x"], async_rollout="one_step").max_staleness == 1
    assert RLArguments(reward_funcs=["x"], async_rollout="bounded").max_staleness == 2
    async_rl = RLArguments(reward_funcs=["x"], async_rollout="bounded", max_staleness=3)
    assert async_rl.vllm_importance_sampling_correction is True  # on by default when asynchronous ...
    assert async_rl.vllm_importance_sampling_mode == "token_truncate"  # ... as TIS (sync's default: sequence_mask)
    assert RLArguments(reward_funcs=["x"]).vllm_importance_sampling_mode == "sequence_mask"
    assert RLArguments(reward_funcs=["x"], async_rollout="one_step",
                       vllm_importance_sampling_mode="token_mask").vllm_importance_sampling_mode == "token_mask"
    assert RLArguments(reward_funcs=["x"], async_rollout="one_step",
                       vllm_importance_sampling_correction=False).vllm_importance_sampling_correction is False
    with pytest.raises(ConfigError, match="max_staleness 2 does not apply"):
        load_config({**GRPO, "async_rollout": "one_step", "max_staleness": 2})
    with pytest.raises(ConfigError, match="at least 1"):
        load_config({**GRPO, "async_rollout": "bounded", "max_staleness": 0})
    with pytest.raises(ConfigError, match="rollout_backend hf"):
        load_config({**GRPO, "async_rollout": "one_step", "rollout_backend": "hf"})
    with pytest.raises(ConfigError, match="turns rollout correction on by default"):
        load_config({**GRPO, "async_rollout": "one_step", "temperature": 0.7})
    assert load_config({**GRPO, "async_rollout": "one_step", "temperature": 0.7,
                        "vllm_importance_sampling_correction": False}).rl.async_rollout == "one_step"


@pytest.mark.parametrize("overrides, words", [
    ({"finetuning_type": "full"}, "no adapter to push"),
    ({"use_dora": True}, "plain LoRA adapters only"),
    ({"additional_target": "embed_tokens"}, "whole modules beside the adapter"),
    ({"rollout_backend": "hf"}, "nothing is pushed"),
])
def test_adapter_only_sync_is_refused_where_vllm_cannot_serve_the_adapter(overrides, words):
    assert load_config({**GRPO, "rollout_lora_sync": "adapter"}).rl.rollout_lora_sync == "adapter"
    with pytest.raises(ConfigError, match=words) as caught:
        load_config({**GRPO, "rollout_lora_sync": "adapter", **overrides})
    assert "rollout_lora_sync: merged" in str(caught.value)


@pytest.mark.parametrize("overrides, words", [
    ({"rollout_backend": "hf"}, "nothing is pushed"),
    ({"rollout_lora_sync": "adapter"}, "go through the object store"),
])
def test_collective_sync_is_refused_where_there_is_no_full_push(overrides, words):
    assert load_config({**GRPO, "rollout_weight_sync": "collective"}).rl.rollout_weight_sync == "collective"
    with pytest.raises(ConfigError, match=words) as caught:
        load_config({**GRPO, "rollout_weight_sync": "collective", **overrides})
    assert "rollout_weight_sync: object_store" in str(caught.value)
    with pytest.raises(ConfigError, match="rollout_weight_sync"):
        load_config({**GRPO, "rollout_weight_sync": "nccl"})


class TwoTurns:
    """A custom environment (module:Class in a config): one observation, then done."""

    def __init__(self, word: str = "again"):
        self.word, self.steps = word, 0

    def reset(self, row):
        return row["prompt"]

    def step(self, action):
        self.steps += 1
        return (self.word, 0.0, False) if self.steps == 1 else (None, 1.0, True)


def test_multi_turn_episodes_run_ahead_on_the_rollout_thread_and_keep_each_turns_version():
    """one_step with an environment: a batch's episodes are played while the policy trains; the
    batch is stamped with the version its first turn used, and each token keeps the one it was
    sampled with (a second turn may come after the next push)."""
    from types import SimpleNamespace as NS

    from registries.datasets import DataArguments
    from stages.loading import load_tokenizer_and_template

    tokenizer, template = load_tokenizer_and_template(NS(model_name_or_path="tiny:qwen2"), DataArguments(template="qwen"))
    stop = template.stop_token_ids(tokenizer)[0]
    rl = RLArguments(reward_funcs=["exact_match"], async_rollout="one_step", num_generations=N, max_completion_length=64,
                     environment="tests.stages.test_async_rollouts:TwoTurns", max_turns=3)
    roles = InProcessEngine()
    inner = roles.generate_async
    roles.generate_async = lambda prompts, sampling: _short_replies(inner(prompts, sampling), stop)
    run = SimpleNamespace(spec=SimpleNamespace(rl=rl, training=SimpleNamespace(seed=0)), roles=roles,
                          template=template, tokenizer=tokenizer)
    batches = {s: [PromptRow([1], f"p{s}", messages=[{"role": "user", "content": f"question {s}"}])] for s in range(1, 5)}
    source = RolloutSource(run, SamplingSpec(n=N, max_tokens=64, stop_token_ids=(stop,)), lambda s: batches[s], 4, 0)
    stamps = []
    for step in range(1, 5):
        timer = PhaseTimer()
        samples, figures = source.take(step, batches[step], timer)
        assert len(samples) == N and all(s.turns == 2 and s.tool_calls == 1 for s in samples)
        assert figures["rollout/turns"] == 2.0 and 0 < figures["rollout/observation_token_fraction"] < 1
        first, second = samples[0].completion_ids[0], samples[0].completion_ids[samples[0].answer_start]
        stamps.append((figures["async/staleness"], first, second))
        assert samples[0].loss_mask[0] == 1 and samples[0].loss_mask[2] == 0  # reply, then the observation
        roles.trained = step
        source.publish(step, timer)
    source.drain()
    # Stamped with the version read as its first turn went out (a push sent in between can only
    # make it fresher): never staler than one_step allows, never fresher than the stamp says.
    assert all(staleness in (0, 1) for staleness, _, _ in stamps) and stamps[0][0] == 0, stamps
    assert all(first >= step - 1 - staleness for step, (staleness, first, _) in enumerate(stamps, 1)), stamps
    assert all(second >= first for _, first, second in stamps)


def _short_replies(pending, stop):
    """The engine's completion as [version, stop]: a short turn that ends at the stop token."""
    generation = pending.result()
    for c in generation.completions:
        c.token_ids = [c.token_ids[0], stop]
    return SimpleNamespace(done=lambda: True, result=lambda: generation)


def test_dynamic_sampling_refills_draw_seeded_prompts_and_sample_them_now():
    """RolloutSource.refill: the k-th extra batch of a step is the same prompts in every run with
    that seed (a resumed run draws them again), other prompts for another k, sampled right away."""
    rl = RLArguments(reward_funcs=["exact_match"], num_generations=N, rollout_batch_size=3)
    prompts = [PromptRow([100 + i], f"p{i}") for i in range(10)]

    def source(seed):
        run = SimpleNamespace(spec=SimpleNamespace(rl=rl, training=SimpleNamespace(seed=seed)), roles=InProcessEngine(),
                              prompts=prompts)
        return RolloutSource(run, SamplingSpec(n=N, max_tokens=4), lambda s: prompts[:3], 5, 0)

    batch, samples = source(1).refill(2, 1, PhaseTimer())
    again, _ = source(1).refill(2, 1, PhaseTimer())
    other, _ = source(1).refill(2, 2, PhaseTimer())
    assert [p.prompt_text for p in batch] == [p.prompt_text for p in again] != [p.prompt_text for p in other]
    assert len(set(p.prompt_text for p in batch)) == 3
    assert [s.prompt_ids for s in samples] == [p.input_ids for p in batch for _ in range(N)]
