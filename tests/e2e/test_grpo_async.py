"""Asynchronous rollouts end to end (grpo and ppo): a real vLLM engine generates the next batch
while the policy actor trains on this one (stages/rl/controller/rollouts.py), with rollout correction on by
default.

The schedule and its version stamps are tested in-process against an engine that records the
weights it held (tests/stages/test_async_rollouts.py); here the Ray roles run it for real: the
engine's calls are queued in the order sent, the push is not waited for, and the samples are stale
(the sampler's log-probs differ from the policy's), yet the run learns, and a killed run resumes.
"""

from __future__ import annotations

import pytest

from cluster.driver import run_exp
from tests.e2e.conftest import example_config, kill_run_at_its_stall
from tests.e2e.test_grpo import _rewards, _rises
from tests.e2e.test_rl_resume import _steps


def _one_step_run(tmp_path, max_steps: int, reward: str = "digit_ratio") -> tuple[str, dict]:
    """configs/grpo_full.yaml with async_rollout one_step for ``max_steps``: every batch after the
    first was sampled with weights one update old (the sampler's log-probs visibly differ from the
    policy's, where the synchronous loop's agree to 1e-4), the engine generated it while the policy
    trained, and the importance weights were applied.

    "Applied" is read in the update itself: ``rollout_is_loss_change`` is what the weights changed
    in the policy loss (stages/rl/algorithms/grpo_math.py), so weights computed and logged but never passed
    to the loss (or never multiplied in) leave it absent or 0, and the run's asserts fail."""
    config = example_config("grpo_full.yaml", tmp_path, max_steps=max_steps, logging_steps=1, eval_dataset=None,
                            reward_funcs=[reward], reward_weights=None, async_rollout="one_step", top_k=0)
    result = run_exp(config)

    steps = _steps(result.output_dir)
    assert sorted(steps) == list(range(1, max_steps + 1))
    assert [steps[s]["async/staleness"] for s in range(1, max_steps + 1)] == [0] + [1] * (max_steps - 1)
    later = [steps[s] for s in range(2, max_steps + 1)]
    # the engine worked while the policy trained, on most steps
    assert sum(r["time/overlap"] > 0 for r in later) >= 2 * len(later) // 3, [r["time/overlap"] for r in later]
    assert all(r["time/overlap"] <= r["time/generate_engine"] + 1e-3 for r in later)
    assert max(r["rollout_logprob_diff"] for r in later) > 1e-3  # stale: sampled by older weights
    assert all("rollout_is_ratio_mean" in r and "rollout_is_kl" in r for r in later)  # correction on
    assert all(r["rollout_is_ratio_mean"] != 1.0 and r["rollout_is_weight_mean"] != 1.0 for r in later)
    # The weights reached the loss: wherever a step had advantages (a group with a reward spread),
    # the loss with the weights differs from the loss without them. Steps 1's samples are fresh.
    assert all("rollout_is_loss_change" in r for r in steps.values())
    signal = [r for r in later if r["reward_group_std"] > 0]
    assert len(signal) >= max_steps // 3, [r["reward_group_std"] for r in later]
    assert all(r["rollout_is_loss_change"] > 1e-6 for r in signal), [r["rollout_is_loss_change"] for r in signal]
    return result.output_dir, steps


def test_one_step_async_grpo_trains_on_stale_samples_with_correction(ray_session, tmp_path):
    """The mechanics in 8 steps: stale samples, overlap, and the correction's weights in the loss."""
    _one_step_run(tmp_path, max_steps=8)


def low_token_share(prompts, completions, completion_ids, **kwargs):
    """The share of the completion's tokens whose id is in the vocabulary's lower half: a dense
    token-level reward with a base rate near 0.5 under untruncated sampling. Correction refuses
    top_k > 0 (tests/stages), and among ~1000 near-uniform tokens digit_ratio's base rate is
    0.003: 30 steps showed it no digit to reinforce."""
    return [sum(i < 513 for i in ids) / len(ids) if len(ids) else 0.0 for ids in completion_ids]


@pytest.mark.slow
def test_one_step_async_grpo_learns_from_stale_samples_with_correction(ray_session, tmp_path):
    """The same run for 30 steps, on a reward the untruncated sampler can see: with stale,
    corrected samples it still rises."""
    output_dir, _ = _one_step_run(tmp_path, max_steps=30, reward="tests.e2e.test_grpo_async:low_token_share")
    assert _rises(_rewards(output_dir))


def test_killed_bounded_async_run_resumes_with_auto_and_logs_every_step_once(ray_session, tmp_path):
    """async_rollout bounded (k = 2), killed while step 3 is scored (after checkpoint-2) with step
    4's batch in flight: resuming with auto drops the queue, starts again from checkpoint-2's
    weights (staleness 0, then 1, then 2) and logs each of the 5 steps once."""
    out = tmp_path / "b"

    def config(**overrides):  # stalling_digit_ratio: digits per character, and the stall of the kill
        return example_config("grpo_lora.yaml", tmp_path, output_dir=str(out), max_steps=5, save_steps=2,
                              logging_steps=1, eval_dataset=None, max_samples=24,
                              reward_funcs=["tests.e2e.test_rl_resume:stalling_digit_ratio"], reward_weights=None,
                              async_rollout="bounded", max_staleness=2, top_k=0, **overrides)

    kill_run_at_its_stall(ray_session, config(), 3, tmp_path)
    killed = _steps(out)
    assert sorted(killed) == [1, 2]
    assert [killed[s]["async/staleness"] for s in (1, 2)] == [0, 1]

    resumed = run_exp(config(resume_from_checkpoint="auto"))
    steps = _steps(resumed.output_dir)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert [steps[s]["async/staleness"] for s in (3, 4, 5)] == [0, 1, 2]
    elapsed = [steps[s]["elapsed_time"] for s in range(1, 6)]  # goes on from the killed run's clock
    assert all(later > earlier for earlier, later in zip(elapsed, elapsed[1:])), elapsed


def test_ppo_trains_its_policy_and_critic_on_one_step_old_samples(ray_session, tmp_path):
    """Stage ppo (critic, GAE, KL in the reward) through the same asynchronous rollouts: stale
    samples (staleness 1, a visible sampler/policy gap) re-weighted by the correction, while the
    critic learns its values (its loss falls)."""
    from tests.e2e.test_rl_resume import ppo_config

    config = ppo_config(tmp_path / "out", rollout_backend="vllm", model_name_or_path="tiny:qwen2,num_heads=2",
                        reward_funcs=["digit_ratio"], async_rollout="one_step", temperature=1.0, top_k=0, max_steps=5,
                        rollout_num_engines=1, rollout_resources={"CPU": 1})
    result = run_exp(config)

    steps = _steps(result.output_dir)
    assert [steps[s]["async/staleness"] for s in range(1, 6)] == [0, 1, 1, 1, 1]
    later = [steps[s] for s in range(2, 6)]
    assert all(r["rollout_logprob_diff"] > 1e-3 and r["rollout_is_ratio_mean"] != 1.0 for r in later)
    assert steps[5]["value_loss"] < steps[1]["value_loss"]


def test_partial_rollout_pushes_land_inside_the_generation_in_flight(ray_session, tmp_path):
    """partial_rollout on one_step, with completions long enough (96 tokens, no stop) that the
    engine is still generating step t + 1's batch when step t's push is sent: the push is loaded
    between two decoding steps instead of after the batch, so part of each such batch's tokens come
    from the newer weights (``async/tokens_after_push``), the staleness stamp (its oldest tokens)
    stays 1, the correction weighs the mixed samples, and the run still trains. How the switch
    itself works, token by token, is tests/e2e/test_partial_rollout.py's."""
    config = example_config("grpo_full.yaml", tmp_path, max_steps=8, logging_steps=1, eval_dataset=None,
                            reward_funcs=["digit_ratio"], reward_weights=None, async_rollout="one_step",
                            partial_rollout=True, max_completion_length=96, top_k=0)
    result = run_exp(config)

    steps = _steps(result.output_dir)
    assert sorted(steps) == list(range(1, 9))
    assert [steps[s]["async/staleness"] for s in range(1, 9)] == [0] + [1] * 7
    later = [steps[s] for s in range(2, 9)]
    shares = [r["async/tokens_after_push"] for r in later]
    assert all(0.0 <= share < 1.0 for share in shares), shares
    assert sum(share > 0.0 for share in shares) >= 4, shares  # most pushes landed mid-batch
    assert all(r["rollout_is_ratio_mean"] != 1.0 for r in later)  # correction on, samples stale
    assert all(abs(r["loss"]) < 1e3 for r in later)
