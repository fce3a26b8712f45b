"""Loss-curve figures for a run directory and for comparison suites (matplotlib, Agg backend)."""

from __future__ import annotations

import io
import math
from pathlib import Path

from .storage import atomic_write

__all__ = ["plot_curves", "plot_run", "plot_trend"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers or in tests
    import matplotlib.pyplot as plt

    return plt


def _step_axis(ax) -> None:
    """Label the x axis in optimizer steps, with integer ticks only (no 2.5 steps on short runs)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step (optimizer updates)")


def _save(plt, fig, path: str | Path) -> None:
    """Write ``fig`` to ``path`` atomically (:func:`~models.storage.atomic_write`: a kill or a
    full disk never leaves half a figure), in the format of its suffix; the figure is closed.

    Raises:
        OSError: naming ``path`` (ENOSPC, EACCES, ...).
    """
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png", dpi=110)
        atomic_write(path, buffer.getvalue())
    finally:
        plt.close(fig)


def _finite(xs: list, ys: list) -> tuple[list, list]:
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_run(rows: list[dict], path: str | Path, title: str = "",
             reference: float | None = None) -> None:
    """Training and validation loss against step, from ``metrics.jsonl`` rows.

    Args:
        rows: metrics rows (``step``, ``train_loss``, optional ``val_loss``).
        path: output PNG.
        title: figure title.
        reference: a horizontal reference line (the corpus's unigram entropy), or None.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    steps, train = _finite([r["step"] for r in rows], [r.get("train_loss") for r in rows])
    ax.plot(steps, train, lw=1, alpha=0.7, label="train")
    steps, val = _finite([r["step"] for r in rows if "val_loss" in r],
                         [r["val_loss"] for r in rows if "val_loss" in r])
    ax.plot(steps, val, "o-", ms=3, label="validation")
    if reference is not None:
        ax.axhline(reference, color="gray", ls="--", lw=1, label="unigram entropy")
    _step_axis(ax)
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save(plt, fig, path)


def plot_curves(curves: dict[str, list[tuple[int, float]]], path: str | Path, title: str = "",
                ylim: tuple[float, float] | None = None) -> None:
    """Validation curves of several runs on one axis (one colour per arm, one line per seed).

    Args:
        curves: ``{"arm/seed": [(step, val_loss), ...]}``; runs of one arm share a colour.
        path: output PNG.
        title: figure title.
        ylim: y range, or None for automatic.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    colours: dict[str, object] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for key, points in curves.items():
        arm = key.rsplit("/", 1)[0]
        new = arm not in colours
        if new:
            colours[arm] = cycle[len(colours) % len(cycle)] if len(colours) < len(cycle) \
                else plt.cm.tab20(len(colours) % 20)
        xs, ys = _finite([p[0] for p in points], [p[1] for p in points])
        ax.plot(xs, ys, color=colours[arm], lw=1.2, alpha=0.85, label=arm if new else None)
    _step_axis(ax)
    ax.set_ylabel("validation loss (nats / token)")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    _save(plt, fig, path)


def plot_trend(sizes, size_name: str, series: dict, baseline: str, path: str | Path) -> None:
    """Each arm's gap to ``baseline`` ± its standard error against size (log scale), to ``path``:
    ``series`` maps an arm to one ``(mean, se, seeds)`` or ``None`` per size."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, points in series.items():
        shown = [(s, g) for s, g in zip(sizes, points) if g is not None]
        ax.errorbar([s for s, _ in shown], [g[0] for _, g in shown], yerr=[g[1] for _, g in shown],
                    marker="o", capsize=3, label=arm)
    ax.axhline(0.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes), [f"{s:g}" for s in sizes])
    ax.set_xlabel(size_name)
    ax.set_ylabel(f"final val loss - {baseline} (± SE)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(plt, fig, path)
