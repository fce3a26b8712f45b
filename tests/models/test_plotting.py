"""Figures: integer step ticks on short runs, labelled units, files written."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from models.plotting import _pyplot, _step_axis, plot_curves, plot_run


def test_step_axis_has_integer_ticks_and_a_unit():
    plt = _pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1, 2, 3], [3.0, 2.5, 2.2, 2.0])  # a 3-step run: default ticks would be 0, 0.5, ...
    _step_axis(ax)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if 0 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert ax.get_xlabel() == "step (optimizer updates)"
    plt.close(fig)


def test_plots_are_written(tmp_path):
    plot_curves({"a/0": [(0, 3.0), (1, 2.5), (2, 2.0)], "a/1": [(0, 3.1), (2, 2.1)]}, tmp_path / "c.png")
    plot_run([{"step": 0, "train_loss": 3.0, "val_loss": 3.1}, {"step": 1, "train_loss": 2.0}],
             tmp_path / "r.png", reference=3.26)
    assert (tmp_path / "c.png").stat().st_size > 1000 and (tmp_path / "r.png").stat().st_size > 1000
