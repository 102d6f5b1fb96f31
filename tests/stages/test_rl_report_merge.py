"""How the policy's per-rank update reports become one step's metrics (fabric/rl_roles.py)."""

from fabric.rl_roles import _merge_reports


def test_ranks_merge_means_by_samples_maxima_by_max_and_loss_by_mean():
    reports = [
        {"loss": 0.4, "num_samples": 3, "lr": 1e-3, "grad_norm": 2.0, "rollout_logprob_diff": 1e-6,
         "rollout_logprob_diff_max": 5e-6, "clip_fraction": 0.0},
        {"loss": 0.2, "num_samples": 1, "lr": 1e-3, "grad_norm": 2.0, "rollout_logprob_diff": 5e-6,
         "rollout_logprob_diff_max": 9e-6, "clip_fraction": 0.4},
    ]
    merged = _merge_reports(reports)
    assert abs(merged["loss"] - 0.3) < 1e-12
    assert merged["rollout_logprob_diff_max"] == 9e-6  # the largest gap anywhere, not an average of maxima
    assert abs(merged["rollout_logprob_diff"] - (3 * 1e-6 + 5e-6) / 4) < 1e-18
    assert abs(merged["clip_fraction"] - 0.1) < 1e-12
    assert merged["lr"] == 1e-3 and merged["grad_norm"] == 2.0
    assert "num_samples" not in merged
