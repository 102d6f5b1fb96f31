"""DAPO's dynamic sampling with refill (dynamic_filtering + max_num_gen_batches): groups whose
completions all got the same reward are dropped, and more prompt batches are generated until the
step has rollout_batch_size groups with a signal, or max_num_gen_batches were tried."""

from __future__ import annotations

from cluster.driver import run_exp
from tests.e2e.conftest import example_config
from tests.e2e.test_rl_resume import _steps


def test_uniform_groups_are_refilled_up_to_the_batch_size(ray_session, tmp_path):
    """From random init most groups score all zeros on number_format (no completion is a bare
    number), so the first batch keeps few groups; refills bring more, never more than the batch."""
    config = example_config("grpo_full.yaml", tmp_path, max_steps=3, logging_steps=1, eval_dataset=None,
                            reward_funcs=["digit_ratio"], reward_weights=None, dynamic_filtering=True,
                            max_num_gen_batches=4, num_generations=4)
    result = run_exp(config)

    steps = _steps(result.output_dir)
    assert sorted(steps) == [1, 2, 3]
    refilled = [r for r in steps.values() if r.get("dynamic/gen_batches", 1) > 1]
    assert refilled, "no step needed a refill: the first batches were all informative"
    for r in refilled:
        assert 2 <= r["dynamic/gen_batches"] <= 4
        assert r["dynamic/kept_groups"] <= 8  # trimmed to rollout_batch_size groups
        # Stopped early only once full: a step that ran all 4 batches may still be short.
        assert r["dynamic/kept_groups"] == 8 or r["dynamic/gen_batches"] == 4
        assert r["dynamic/kept_groups"] * 4 / 32 >= r["pass_rate"]  # more kept than the first batch alone gave
