"""The loss plots a run writes (plot_loss: true): readable for a short run and a long one (issue 62).

A single eval point used to be an invisible line of one point, and the training loss a pale line
titled with the full output path, with a legend "original" and no smoothed curve under 5 points."""

from __future__ import annotations

import json
import os

import pytest

from stages.training.callbacks import LOG_FILE
from stages.training.outputs import loss_figure, plot_loss


def lines(figure):
    return [line for line in figure.axes[0].get_lines()]


def test_one_eval_point_is_a_visible_marker():
    figure = loss_figure([40], [6.9], "eval_loss", "run-a")
    (only,) = lines(figure)
    assert only.get_marker() == "o" and only.get_alpha() in (None, 1.0)
    assert figure.axes[0].get_title() == "eval_loss · run-a"


@pytest.mark.parametrize("count,marked", [(5, True), (30, True), (31, False), (400, False)])
def test_a_series_gets_its_smoothed_curve_and_markers_while_short(count, marked):
    values = [7.0 - 0.001 * i + (0.01 if i % 2 else -0.01) for i in range(count)]
    figure = loss_figure(list(range(1, count + 1)), values, "loss", "run-a")
    raw, smooth = lines(figure)
    assert (raw.get_marker() == "o") is marked and smooth.get_marker() in (None, "None", "")
    assert [t.get_text() for t in figure.axes[0].get_legend().get_texts()] == ["loss (raw)", "loss (smoothed)"]
    # the smoothed curve moves less than the raw one, and follows it
    swing = lambda ys: max(abs(a - b) for a, b in zip(ys, ys[1:]))  # noqa: E731
    assert swing(list(smooth.get_ydata())) < swing(list(raw.get_ydata())) / 2
    assert abs(smooth.get_ydata()[-1] - values[-1]) < 0.05


def test_plot_loss_writes_each_logged_key_titled_by_the_run_folder(tmp_path):
    run = tmp_path / "deep" / "path" / "my-run"
    run.mkdir(parents=True)
    records = [{"current_steps": s, "loss": 2.0 / s} for s in range(1, 11)] + [{"current_steps": 10, "eval_loss": 0.5}]
    (run / LOG_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot_loss(str(run))
    assert [os.path.basename(p) for p in written] == ["training_loss.png", "training_eval_loss.png"]
    assert all(os.path.getsize(p) > 5000 for p in written)
