"""The fault drills' last check: a run that recovered from a fault ends on the final weights of the
same run without one (README, "What the tests measure")."""

from __future__ import annotations

import os

from safetensors.torch import load_file

# Measured: recovered runs end on the uninterrupted run's weights exactly (0.0) on CPU; the bar
# leaves room for float noise only, far below what one step more, less or different changes.
WEIGHT_TOL = 1e-6


def final_weights_gap(output_dir, reference_dir) -> float:
    """The largest absolute difference between two runs' final ``model.safetensors``."""
    ours = load_file(os.path.join(output_dir, "model.safetensors"))
    theirs = load_file(os.path.join(reference_dir, "model.safetensors"))
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
