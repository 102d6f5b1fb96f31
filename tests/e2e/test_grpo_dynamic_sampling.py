"""DAPO's dynamic sampling with refill (dynamic_filtering + max_num_gen_batches): groups whose
completions all got the same reward are dropped, and more prompt batches are generated until the
step has rollout_batch_size groups with a signal, or max_num_gen_batches were tried.

The controller loop runs in the driver (this process), so the test watches it: every batch the
filter sees (its groups' rewards, what it keeps) and the samples each update trains on."""

from __future__ import annotations

import pytest

from cluster.driver import run_exp
from stages.recipes import grpo
from stages.rl.controller.loop import RunProgress
from stages.training.callbacks import read_log
from tests.e2e.conftest import example_config

GROUPS, N, MAX_BATCHES = 8, 4, 4  # rollout_batch_size, num_generations, max_num_gen_batches


def _groups(samples) -> list[tuple[int, list[float]]]:
    """(group, its rewards) per prompt group, in order: a group's N samples lie side by side."""
    assert len(samples) % N == 0, len(samples)
    out = []
    for i in range(0, len(samples), N):
        group = samples[i:i + N]
        assert len({s.group for s in group}) == 1, [s.group for s in group]  # whole groups, never split
        out.append((group[0].group, [s.reward for s in group]))
    return out


def _spread(rewards: list[float]) -> float:
    return max(rewards) - min(rewards)


@pytest.fixture
def watched(monkeypatch):
    """Per step, in order: the filter's batches ({"seen": [(group, rewards)], "kept": [...]}) and
    the groups the update trained on (None: no update)."""
    steps: list[dict] = []
    current = {"batches": [], "updated": None}

    def watched_filter(samples, reward, rl):
        kept = real_filter(samples, reward, rl)
        assert [s.reward for s in samples] == pytest.approx(reward.tolist())  # the rewards it filtered on
        current["batches"].append({"seen": _groups(samples), "kept": _groups(kept)})
        return kept

    def watched_update(roles, samples, rl, temperature, timer):
        current["updated"] = _groups(samples)
        return real_update(roles, samples, rl, temperature, timer)

    def watched_end_step(self, step, values, timer, recipe_state):
        steps.append({"step": step, **current})
        current.update(batches=[], updated=None)
        return real_end_step(self, step, values, timer, recipe_state)

    real_filter, real_update, real_end_step = grpo._filter, grpo._update, RunProgress.end_step
    monkeypatch.setattr(grpo, "_filter", watched_filter)
    monkeypatch.setattr(grpo, "_update", watched_update)
    monkeypatch.setattr(RunProgress, "end_step", watched_end_step)
    return steps


def test_uniform_groups_are_dropped_and_refilled_up_to_the_batch_size(ray_session, tmp_path, watched):
    """From random init most completions hold no digit, so digit_ratio scores most groups all
    zeros: the first batch keeps few groups, and refills bring more, never more than the batch."""
    config = example_config("grpo_full.yaml", tmp_path, max_steps=3, logging_steps=1, eval_dataset=None,
                            reward_funcs=["digit_ratio"], reward_weights=None, dynamic_filtering=True,
                            max_num_gen_batches=MAX_BATCHES, num_generations=N,
                            rollout_backend="hf")  # filtering is the loop's; no vLLM engine to start
    assert config["rollout_batch_size"] == GROUPS
    result = run_exp(config)

    steps = {r["current_steps"]: r for r in read_log(result.output_dir) if r.get("current_steps", 0) > 0}
    assert sorted(steps) == [1, 2, 3]
    assert [w["step"] for w in watched] == [1, 2, 3]
    dropped = 0
    for w in watched:
        record, batches = steps[w["step"]], w["batches"]
        for batch in batches:
            assert len(batch["seen"]) == GROUPS  # every batch generated is a whole prompt batch
            # The filter keeps exactly the groups with a reward spread, in order; the uniform ones go.
            assert batch["kept"] == [(g, r) for g, r in batch["seen"] if _spread(r) > 1e-6], batch
            dropped += sum(_spread(r) <= 1e-6 for _, r in batch["seen"])
        # The refill loop's bounds: it stops at the first batch that fills the step, or after
        # max_num_gen_batches; what it trains on is the first GROUPS kept groups.
        kept = [group for batch in batches for group in batch["kept"]]
        filled = [len([g for b in batches[:i + 1] for g in b["kept"]]) >= GROUPS for i in range(len(batches))]
        assert 1 <= len(batches) <= MAX_BATCHES
        assert len(batches) == MAX_BATCHES or filled[-1], filled
        assert not any(filled[:-1]), f"generated another batch after the step was full: {filled}"
        assert record.get("dynamic/gen_batches", 1) == len(batches)
        assert record["pass_rate"] == pytest.approx(len(batches[0]["kept"]) / GROUPS)
        if len(batches) > 1:
            assert record["dynamic/kept_groups"] == min(len(kept), GROUPS)
        if w["updated"] is None:  # nothing kept: no update, and the log says so
            assert record.get("skipped_update") == 1 and not kept
            continue
        # Every group the update trained on has a reward spread (no uniform group slipped through).
        assert w["updated"] == kept[:GROUPS]
        assert all(_spread(r) > 1e-6 for _, r in w["updated"]), w["updated"]
    assert dropped, "no uniform group was seen: the filter had nothing to drop"
    refilled = [w for w in watched if len(w["batches"]) > 1]
    assert refilled, "no step needed a refill: the first batches were all informative"
