r"""A claim's gap against model size: several finished suite runs, one per size, read back and plotted.

    python -m models.compare.trend runs/p-d64 runs/p-d128 runs/p-d256 --sizes 64 128 256 \
        --size_name width --arms spheret-p1-literal spheret-p2-literal --baseline pre-ln \
        --out docs/results/figures/spheret-p-trend.png

For each size (one suite output folder: its ``results.csv``) and each arm, the gap to the baseline
is the mean over the seeds both finished of :math:`\ell_{\text{arm}} - \ell_{\text{baseline}}`
(final validation losses; a seed fixes the initialization and the batches), with its standard
error. The trend is the weighted least-squares slope of the gap against :math:`\log_2` size
(weights :math:`1/\mathrm{SE}^2`), with its standard error (widened where the points scatter about the
line by more than their own standard errors): "falls behind" or "gains with size" only where the
slope is more than two standard errors from zero, else "no trend beyond the noise". A figure
of gap ± SE against size (log scale) and a Markdown table are written; extrapolating past the
largest size is a guess, and the table says so.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

__all__ = ["Gap", "gaps", "main", "slope", "trend_table", "verdict"]


class Gap(NamedTuple):
    """One arm's paired gap at one size: its mean, standard error and number of seeds."""

    mean: float
    se: float
    seeds: int


def _finals(folder: Path) -> dict[str, dict[int, float]]:
    """``{arm: {seed: final validation loss}}`` of a suite output folder (diverged runs left out)."""
    path = folder / "results.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: give the --out folder of a finished suite run")
    out: dict[str, dict[int, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("val_loss") not in (None, "") and row.get("diverged") in ("False", "0", ""):
                out.setdefault(row["arm"], {})[int(row["seed"])] = float(row["val_loss"])
    return out


def gaps(folder: str | Path, arms: Sequence[str], baseline: str) -> dict[str, Gap | None]:
    """Each arm's paired gap to ``baseline`` in one suite output folder (``None``: fewer than two
    seeds both finished).

    Raises:
        FileNotFoundError: no ``results.csv`` in ``folder``.
        ValueError: an arm or the baseline is not in it (the message lists what is).
    """
    finals = _finals(Path(folder))
    missing = [a for a in (*arms, baseline) if a not in finals]
    if missing:
        raise ValueError(f"{folder}: no finished runs of {missing}; it has {sorted(finals)}")
    base = finals[baseline]
    out: dict[str, Gap | None] = {}
    for arm in arms:
        diffs = [loss - base[seed] for seed, loss in finals[arm].items() if seed in base]
        out[arm] = Gap(statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs)) \
            if len(diffs) >= 2 else None
    return out


def slope(sizes: Sequence[float], points: Sequence[Gap | None]) -> tuple[float, float] | None:
    r"""``(slope, standard error)`` of the gap per doubling of size: weighted least squares of the
    gaps on :math:`\log_2` size with weights :math:`1/\mathrm{SE}^2` (``None`` with fewer than two
    sizes that have a gap, or a zero standard error). With more than two sizes, where the points
    scatter about the line by more than their standard errors (:math:`\chi^2/(n-2) > 1`), the
    slope's standard error is scaled by :math:`\sqrt{\chi^2/(n-2)}` (as ``numpy.polyfit``'s
    ``cov=True``): a trend is not claimed from points that a line does not fit."""
    pairs = [(math.log2(s), g) for s, g in zip(sizes, points) if g is not None and g.se > 0]
    if len(pairs) < 2:
        return None
    w = [1 / g.se**2 for _, g in pairs]
    x = [x for x, _ in pairs]
    y = [g.mean for _, g in pairs]
    sw = sum(w)
    xm = sum(wi * xi for wi, xi in zip(w, x)) / sw
    ym = sum(wi * yi for wi, yi in zip(w, y)) / sw
    sxx = sum(wi * (xi - xm) ** 2 for wi, xi in zip(w, x))
    if sxx == 0:
        return None
    b = sum(wi * (xi - xm) * (yi - ym) for wi, xi, yi in zip(w, x, y)) / sxx
    se = 1 / math.sqrt(sxx)
    if len(pairs) > 2:  # points farther from the line than their SEs: the line explains less
        chi2 = sum(wi * (yi - ym - b * (xi - xm)) ** 2 for wi, xi, yi in zip(w, x, y))
        se *= math.sqrt(max(1.0, chi2 / (len(pairs) - 2)))
    return b, se


def verdict(fit: tuple[float, float] | None) -> str:
    """What the slope says: the gap "grows" (more positive: the arm falls behind) or "shrinks"
    with size where the slope is more than two standard errors from zero."""
    if fit is None:
        return "not enough sizes"
    b, se = fit
    if abs(b) <= 2 * se:
        return "no trend beyond the noise"
    return "arm falls behind with size" if b > 0 else "arm gains with size"


def trend_table(sizes: Sequence[float], size_name: str, per_size: Sequence[dict[str, Gap | None]],
                arms: Sequence[str], baseline: str) -> str:
    """A Markdown table: per arm the gap ± SE at each size, the slope per doubling and the verdict."""
    head = ["arm"] + [f"{size_name} {s:g}" for s in sizes] + ["slope per doubling (SE)", "trend"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        points = [p[arm] for p in per_size]
        fit = slope(sizes, points)
        cells = [arm] + [f"{g.mean:+.4f} ± {g.se:.4f} (n={g.seeds})" if g else "—" for g in points]
        cells += [f"{fit[0]:+.4f} ({fit[1]:.4f})" if fit else "—", verdict(fit)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", (f"Gap: final validation loss minus `{baseline}`'s, paired by seed (negative: "
                   f"the arm is better). Past the largest {size_name} ({max(sizes):g}) the trend "
                   f"is a guess.")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI: print the table, write the figure; 0 on success, 2 on bad input."""
    p = argparse.ArgumentParser(prog="python -m models.compare.trend", description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", help="suite output folders, one per size, smallest first")
    p.add_argument("--sizes", type=float, nargs="+", required=True, help="the size of each folder")
    p.add_argument("--size_name", default="size", help="what the size is (width, depth, ...)")
    p.add_argument("--arms", nargs="+", required=True)
    p.add_argument("--baseline", required=True)
    p.add_argument("--out", help="figure path (PNG); its table goes next to it as .md")
    args = p.parse_args(argv)
    try:
        if len(args.sizes) != len(args.folders):
            raise ValueError(f"give one size per folder: {len(args.folders)} folders, {len(args.sizes)} sizes")
        if any(s <= 0 for s in args.sizes) or len(set(args.sizes)) != len(args.sizes):
            raise ValueError(f"sizes must be distinct and > 0, got {args.sizes}")
        per_size = [gaps(folder, args.arms, args.baseline) for folder in args.folders]
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = trend_table(args.sizes, args.size_name, per_size, args.arms, args.baseline)
    print(table)
    if args.out:
        out = Path(args.out)
        from ..plotting import plot_trend

        plot_trend(args.sizes, args.size_name, {arm: [p[arm] for p in per_size] for arm in args.arms},
                   args.baseline, out)
        out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
