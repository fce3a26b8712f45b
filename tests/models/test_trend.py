"""models.compare.trend: gaps paired by seed, the weighted slope on log size, its verdict, the CLI."""

from __future__ import annotations

import csv
import math

import pytest

from models.compare.trend import Gap, gaps, main, slope, verdict


def _suite(folder, losses: dict[str, list[float | None]]) -> None:
    folder.mkdir(parents=True)
    with open(folder / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["arm", "seed", "val_loss", "diverged"])
        writer.writeheader()
        for arm, values in losses.items():
            for seed, v in enumerate(values):
                writer.writerow({"arm": arm, "seed": seed, "val_loss": "" if v is None else v,
                                 "diverged": v is None})


def test_gaps_are_paired_by_seed_and_skip_diverged_runs(tmp_path):
    _suite(tmp_path / "a", {"base": [2.0, 2.2, 2.4, 2.6], "arm": [1.9, 2.0, None, 2.5]})
    g = gaps(tmp_path / "a", ["arm"], "base")["arm"]
    diffs = [-0.1, -0.2, -0.1]  # seed 2 diverged: left out
    assert g.seeds == 3 and g.mean == pytest.approx(sum(diffs) / 3)
    assert g.se == pytest.approx(0.057735026918962 / math.sqrt(3), rel=1e-9)  # stdev of the diffs / sqrt(n)
    with pytest.raises(ValueError, match=r"no finished runs of \['other'\]; it has \['arm', 'base'\]"):
        gaps(tmp_path / "a", ["other"], "base")
    with pytest.raises(FileNotFoundError, match="results.csv does not exist"):
        gaps(tmp_path / "missing", ["arm"], "base")


def test_the_slope_is_per_doubling_and_weighted_by_precision():
    points = [Gap(0.0, 0.01, 5), Gap(0.1, 0.01, 5), Gap(0.2, 0.01, 5)]
    b, se = slope([64, 128, 256], points)
    assert b == pytest.approx(0.1) and se == pytest.approx(0.01 / math.sqrt(2))
    assert verdict((b, se)) == "arm falls behind with size"
    assert verdict((-b, se)) == "arm gains with size"
    # a noisy point barely moves a weighted fit
    noisy = [Gap(0.0, 0.01, 5), Gap(5.0, 100.0, 5), Gap(0.2, 0.01, 5)]
    assert slope([64, 128, 256], noisy)[0] == pytest.approx(0.1, rel=1e-3)
    assert verdict((0.01, 0.02)) == "no trend beyond the noise"
    assert slope([64, 128], [Gap(0.0, 0.01, 5), None]) is None and verdict(None) == "not enough sizes"


def test_the_cli_writes_the_table_and_the_figure(tmp_path, capsys):
    for size, gap in ((64, 0.0), (128, 0.05), (256, 0.1)):
        _suite(tmp_path / f"d{size}", {"base": [2.0, 2.1, 2.2], "arm": [2.0 + gap, 2.1 + gap + 0.01, 2.2 + gap - 0.01]})
    out = tmp_path / "trend.png"
    assert main([str(tmp_path / f"d{s}") for s in (64, 128, 256)] + [
        "--sizes", "64", "128", "256", "--size_name", "width", "--arms", "arm", "--baseline", "base",
        "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| arm | +0.0000 ± 0.0058 (n=3) | +0.0500 ± 0.0058 (n=3) | +0.1000 ± 0.0058 (n=3) | +0.0500" in table
    assert "arm falls behind with size" in table and "Past the largest width (256) the trend is a guess" in table
    assert out.stat().st_size > 1000 and out.with_suffix(".md").read_text().startswith("| arm | width 64")
    assert main([str(tmp_path / "d64"), "--sizes", "64", "128", "--arms", "arm", "--baseline", "base"]) == 2
    assert "one size per folder" in capsys.readouterr().err


def test_points_a_line_does_not_fit_widen_the_slopes_standard_error():
    """docs/results' SEL no-linear gaps (−0.065, −0.051, −0.080 at widths 32, 64, 128; SEs
    0.0078, 0.0041, 0.0039) scatter about their weighted line by 3.6 of their SEs (chi²/dof
    12.8): the slope's standard error is numpy.polyfit's scaled one, 0.0141, not 0.0039, and the
    verdict is no trend (1.0 SE), not "arm gains with size" (3.7 SE)."""
    np = pytest.importorskip("numpy")
    sizes, means, ses = [32, 64, 128], [-0.065, -0.051, -0.080], [0.0078, 0.0041, 0.0039]
    b, se = slope(sizes, [Gap(m, s, 5) for m, s in zip(means, ses)])
    (want_b, _), cov = np.polyfit(np.log2(sizes), means, 1, w=1 / np.array(ses), cov=True)
    assert b == pytest.approx(want_b, rel=1e-9) and se == pytest.approx(math.sqrt(cov[0, 0]), rel=1e-9)
    assert se == pytest.approx(0.0141, abs=5e-5) and verdict((b, se)) == "no trend beyond the noise"
    # points within their SEs of the line keep the unscaled error (chi²/dof < 1 is not a gain)
    close = [Gap(0.0, 0.01, 5), Gap(0.101, 0.01, 5), Gap(0.2, 0.01, 5)]
    assert slope([64, 128, 256], close)[1] == pytest.approx(0.01 / math.sqrt(2), rel=1e-12)
