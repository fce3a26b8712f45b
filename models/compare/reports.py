"""The reports of a suite: ``results.csv``, ``sweep.csv``, ``results.md`` (each arm's mean
± std, Welch and paired distances to the baseline, the sweep table) and ``curves.png``."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

from .results import DIAGNOSTIC_FIELDS, by_swept_value, value_label
from .suites import Suite

__all__ = ["CSV_FIELDS", "REPORT_COLUMNS", "write_reports"]


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


#: The columns of ``results.csv`` and ``sweep.csv``, one row per run.
CSV_FIELDS = ("suite", "arm", "seed", "swept", "val_loss", "val_ppl", "diverged", "learned",
              "steps_to_target", "seconds_to_target", "target", "steps", "lr_peak_fraction",
              "warmup_outlasts_run", "sel_anneal_fraction", "wall_time_s", "tokens_per_s",
              *DIAGNOSTIC_FIELDS, "peak_attention_logit", "peak_qk_spectral_norm",
              "min_attention_entropy", "val_rise_max", "unigram_entropy")


def _fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


#: Extra report columns by suite name, else by suite family (the name before any ``-``):
#: ``(header, result key)``, shown as the mean over seeds. A header names one quantity:
#: "final ..." is the last evaluation's, "peak ..." / "... over run" the extreme over every
#: evaluation (``attention_entropy_min`` is the smallest layer's at the last evaluation,
#: ``min_attention_entropy`` its smallest over the run).
REPORT_COLUMNS = {
    "spheret": (("step angle (rad)", "step_angle_mean"), ("max step angle", "step_angle_max"),
                ("final min attn entropy", "attention_entropy_min")),
    # the stress suite's question is saturation and divergence, not step angles alone
    "spheret-stress": (("step angle (rad)", "step_angle_mean"),
                       ("peak attn logit", "peak_attention_logit"),
                       ("final min attn entropy", "attention_entropy_min"),
                       ("Keel branch/highway", "keel_branch_ratio_max"),
                       ("max val rise", "val_rise_max")),
    "manifolds": (("peak q/k σ_max", "peak_qk_spectral_norm"),
                  ("peak attn logit", "peak_attention_logit"),
                  ("min attn entropy over run", "min_attention_entropy"),
                  ("final max attn prob", "attention_max_prob"),
                  ("max val rise", "val_rise_max")),
    # wall-clock to target: training seconds (chart overhead included) until the first evaluation
    # at or below the target; a reading of this machine, only comparable within one quiet run
    "sel": (("train s to target", "seconds_to_target"), ("kurtosis", "weight_kurtosis_mean"),
            ("max|w|/std", "weight_max_over_std")),
}


def _welch(a: list[float], b: list[float]) -> float | None:
    """``(mean(a) - mean(b)) / sqrt(s_a²/n_a + s_b²/n_b)``: how many standard errors apart."""
    if len(a) < 2 or len(b) < 2:
        return None
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return (statistics.fmean(a) - statistics.fmean(b)) / se if se > 0 else None


def _paired(rs: list[dict], base_by_seed: dict[int, float]) -> str:
    """Mean of (arm − baseline) over the seeds both finished, in its standard errors, with how
    many seeds the arm is below: a seed fixes the initialization and the batches, so this
    difference does not carry the seed-to-seed spread that Welch's test does."""
    diffs = [r["val_loss"] - base_by_seed[r["seed"]] for r in rs
             if r["val_loss"] is not None and r["seed"] in base_by_seed]
    if len(diffs) < 2:
        return "—"
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    wins = sum(d < 0 for d in diffs)
    ratio = _fmt(mean / (sd / math.sqrt(len(diffs))), 1) if sd > 0 else "—"
    return f"{mean:+.4f} ({ratio}; {wins}/{len(diffs)} below)"


def _arm_row(arm: str, rs: list[dict], base_runs: list[dict], columns, swept: bool) -> str:
    vals = [r["val_loss"] for r in rs if r["val_loss"] is not None]
    mean, std = _mean_std(vals)
    steps = [r["steps_to_target"] for r in rs if r["steps_to_target"] is not None]
    base_vals = [r["val_loss"] for r in base_runs if r["val_loss"] is not None]
    welch = _welch(vals, base_vals)
    is_baseline = bool(base_runs) and arm == base_runs[0]["arm"]
    paired = "—" if is_baseline else _paired(
        rs, {r["seed"]: r["val_loss"] for r in base_runs if r["val_loss"] is not None})
    cells = [arm] + ([value_label(rs[0]['swept']) if rs else "—"] if swept else []) + [
        f"{_fmt(mean)} ± {_fmt(std)}" if len(vals) > 1 else _fmt(mean),
        _ppl(mean) if vals else "—",
        f"{sum(r['diverged'] for r in rs)}/{len(rs)}", f"{sum(r['learned'] for r in rs)}/{len(rs)}",
        f"{_fmt(statistics.fmean(steps), 0) if steps else '—'} ({len(steps)}/{len(rs)})",
        _fmt(welch, 1) if welch is not None else "—", paired,
        _fmt(statistics.fmean(r["wall_time_s"] for r in rs), 1) if rs else "—"]
    for _, key in columns:
        cells.append(_column_mean(rs, key))
    return _md_row(cells)


def _ppl(mean_loss: float) -> str:
    """``exp`` of a mean loss, ``inf`` past float's range (a mean loss above 709.78)."""
    try:
        ppl = math.exp(mean_loss)
    except OverflowError:
        ppl = math.inf
    return "inf" if ppl == math.inf else _fmt(ppl, 2)


#: Report columns of a run's evaluations (the last one's and the extremes over them), in which a
#: run that diverged is set aside (:func:`_column_mean`): its last evaluation is not the run's
#: final one and its extremes cover only the steps before it left every bound. (``val_rise_max``
#: of such a run is already NaN; "steps to target" counts a run that reached it before.)
EVALUATION_KEYS = frozenset({*DIAGNOSTIC_FIELDS, "peak_attention_logit",
                             "peak_qk_spectral_norm", "min_attention_entropy"})


def _column_mean(rs: list[dict], key: str) -> str:
    """The mean of ``key`` over the runs whose value is finite, with ``(k/n)`` where only ``k``
    of the ``n`` runs have one, and ``m non-finite`` for the runs whose value is NaN or inf (an
    evaluation that went non-finite: the trainer logs it as null); ``non-finite (m/n)`` where no
    run's value is finite, and ``—`` where no run has a value at all (a diagnostic the arm's
    model does not have, a target no run reached). In an evaluation column
    (:data:`EVALUATION_KEYS`) a run that diverged is set aside, counted as ``m diverged`` (or
    ``diverged (m/n)`` where it leaves no value): its finite value is that of an earlier step
    than the other runs' and would be averaged with theirs as if it were comparable.
    ``results.md`` says so (``_LEGEND``).
    """
    xs = [(r[key], key in EVALUATION_KEYS and bool(r.get("diverged")))
          for r in rs if r.get(key) is not None]
    if not xs:
        return "—"
    finite = [x for x, aside in xs if math.isfinite(x) and not aside]
    bad = sum(not math.isfinite(x) for x, _ in xs)
    aside = sum(math.isfinite(x) and cut for x, cut in xs)
    if not finite:
        return "; ".join(f"{label} ({m}/{len(rs)})"
                         for label, m in (("non-finite", bad), ("diverged", aside)) if m)
    counts = ([f"{len(finite)}/{len(rs)}"] if len(finite) < len(rs) else []) + \
        ([f"{bad} non-finite"] if bad else []) + ([f"{aside} diverged"] if aside else [])
    return _fmt(statistics.fmean(finite), 3) + (f" ({'; '.join(counts)})" if counts else "")


#: What ``results.md`` says of the cells of a suite's own columns (:func:`_column_mean`).
_LEGEND = ("Columns after wall s: the mean over the runs whose value is finite; (k/n) where only "
           "k of the n runs have one; \"m non-finite\" counts the runs whose value is NaN or inf "
           "(an evaluation that went non-finite; for the largest val rise, also a run that "
           "diverged); \"m diverged\" counts the runs that diverged, set aside in the columns of "
           "evaluations (final and peak values: a diverged run's are those of its last finite "
           "evaluation, an earlier step than the others'), \"diverged (m/n)\" where that leaves "
           "no value; \"non-finite (m/n)\" where no run's value is finite; — where no run has a "
           "value (a diagnostic the arm's model does not have, a target no run reached).")


def _per_arm(suite: Suite, flagged: list[dict], rows: list[dict], key: str) -> str:
    """``"`arm` k/n at v1, v2"`` for each arm with runs in ``flagged`` (``k`` of its ``n`` in
    ``rows``), the ``v`` the distinct values of ``key`` among them, arms joined by ``"; "``."""
    per_arm = []
    for arm, _ in suite.arms:
        values = sorted({r[key] for r in flagged if r["arm"] == arm})
        if values:
            k, n = sum(r["arm"] == arm for r in flagged), sum(r["arm"] == arm for r in rows)
            per_arm.append(f"`{arm}` {k}/{n} at {', '.join(f'{v:.3g}' for v in values)}")
    return "; ".join(per_arm)


def _short_warmup_note(suite: Suite, rows: list[dict], which: str) -> str | None:
    """A line on the runs of ``rows`` whose warm-up lasted as long as them or longer
    (``warmup_outlasts_run``, as each run's ``summary.json`` records it and the trainer
    warned), per arm with ``k/n`` and their ``lr_peak_fraction``; None where there is none.
    Their learning rates peaked at their last step (below the configured ones where the
    warm-up is longer) and their schedules never acted, which no cell of a table shows."""
    short = [r for r in rows if r.get("warmup_outlasts_run")
             or (r.get("lr_peak_fraction") is not None and r["lr_peak_fraction"] < 1.0)]
    if not short:
        return None
    return (f"Warm-up as long as the run or longer in {len(short)}/{len(rows)} {which} "
            f"(warmup_steps at or above steps; the trainer warned, `warnings` in their "
            f"`summary.json`): the learning rate warmed up for the whole run and peaked at its "
            f"last step at lr_peak_fraction of each configured rate, and the schedule never "
            f"acted: {_per_arm(suite, short, rows, 'lr_peak_fraction')}. Give --steps above "
            f"warmup_steps to compare at the configured rates.")


def _short_sel_anneal_note(suite: Suite, rows: list[dict], which: str) -> str | None:
    """A line on the runs of ``rows`` whose SEL scale annealing outlasted them
    (``sel_anneal_fraction`` below 1: ``sel_anneal_steps`` at or above ``steps``, as under
    ``--steps 60`` with the ``sel`` suites' 100), per arm with ``k/n`` and the fraction; None
    where there is none. Their scales' learning rates were still annealing at the end."""
    short = [r for r in rows if r.get("sel_anneal_fraction") is not None
             and r["sel_anneal_fraction"] < 1.0]
    if not short:
        return None
    return (f"SEL scale annealing longer than the run in {len(short)}/{len(rows)} {which} "
            f"(sel_anneal_steps at or above steps; the trainer warned, `warnings` in their "
            f"`summary.json`): the e_w and m learning rates were still annealing at the last "
            f"update, sel_anneal_fraction of the way: "
            f"{_per_arm(suite, short, rows, 'sel_anneal_fraction')}. Give --steps above "
            f"sel_anneal_steps (or a smaller --sel_anneal_steps) to compare annealed runs.")


def _schedule_notes(suite: Suite, rows: list[dict], which: str) -> list[str]:
    """The lines under a table on its runs whose schedules outlasted them, each after a blank
    line."""
    notes = (_short_warmup_note(suite, rows, which), _short_sel_anneal_note(suite, rows, which))
    return [line for note in notes if note for line in ("", note)]


def _md_row(cells) -> str:
    """One Markdown table row; a ``|`` inside a cell is escaped so it does not split it."""
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def write_reports(suite: Suite, out: Path, results: list[dict], curves: dict, *, quick: bool,
                  command: str, elapsed: float, base: dict, overrides: dict,
                  sweep: tuple = (None, []), held_out: bool = False) -> None:
    """Write ``results.csv``, ``results.md`` (and ``sweep.csv`` for a swept suite) and
    ``curves.png`` into ``out``; ``held_out``: the sweep ran on seeds that are not reported."""
    key, sweep_rows = sweep
    for name, rows in (("results.csv", results), ("sweep.csv", sweep_rows)):
        if rows or name == "results.csv":
            with open(out / name, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
                writer.writeheader()
                for r in rows:
                    writer.writerow({k: r.get(k) for k in CSV_FIELDS})
    # a suite's own columns, else its family's (the name before any ``-``)
    columns = REPORT_COLUMNS.get(suite.name) or REPORT_COLUMNS.get(suite.name.split("-")[0], ())
    shown_base = {**base, **overrides}
    if key:  # every run sets the swept key itself; the base's value is never used
        shown_base[key] = "swept: " + ", ".join(value_label(v) for v in sorted(
            {r["swept"] for r in sweep_rows}))
    base_runs = [r for r in results if r["arm"] == suite.baseline]
    header = (["arm"] + ([f"best {key}"] if key else []) +
              ["val loss (mean ± std)", "val ppl", "diverged", "learned", "steps to target",
               "Δ vs baseline (SE)", "paired Δ (SE; seeds below)", "wall s"] +
              [h for h, _ in columns])
    lines = [f"# Suite `{suite.name}`{' (quick)' if quick else ''}", "",
             f"Command: `{command}`" if command else "", "",
             f"Base config: `{json.dumps(shown_base, sort_keys=True)}`", "",
             (f"Target (steps to target): mean final validation loss of `{suite.baseline}` = "
              f"{_fmt(results[0]['target']) if results else '—'}; steps to target: the first "
              f"evaluation at or below it, mean over the runs that reach it (k/n), a run that "
              f"diverged after reaching it included (see diverged). Δ vs baseline: difference of "
              f"the mean final validation losses in standard errors (Welch); paired Δ: the mean "
              f"of the per-seed differences (same initialization and batches), in its standard "
              f"errors, and on how many seeds the arm is below the baseline. Total time "
              f"{elapsed:.0f} s."), "", *([_LEGEND, ""] if columns else []),
             _md_row(header), "|" + "---|" * len(header)]
    for arm, _ in suite.arms:
        lines.append(_arm_row(arm, [r for r in results if r["arm"] == arm], base_runs, columns,
                              bool(key)))
    lines += _schedule_notes(suite, results, "runs above")
    if key:
        values = sorted({r["swept"] for r in sweep_rows})
        tuned = sorted({r["seed"] for r in sweep_rows})
        over = f"seed {tuned[0]}" if len(tuned) == 1 else f"mean over seeds {', '.join(map(str, tuned))}"
        reported = sorted({r["seed"] for r in results})
        protocol = (f"Held-out tuning: each arm's `{key}` was chosen on seeds {', '.join(map(str, tuned))} and is "
                    f"reported above on seeds {', '.join(map(str, reported))}, none of them used for the choice."
                    if held_out else f"The `{key}` was chosen on seeds that are also reported above.")
        lines += ["", protocol, "", f"Sweep of `{key}` ({over}; final validation loss, or diverged):", "",
                  _md_row(["arm"] + [f"{key}={value_label(v)}" for v in values]),
                  "|---|" + "---|" * len(values)]
        for arm, _ in suite.arms:
            by_value = by_swept_value([r for r in sweep_rows if r["arm"] == arm])
            lines.append(_md_row([arm] + [_sweep_cell(by_value.get(v, [])) for v in values]))
        lines += _schedule_notes(suite, sweep_rows, "tuning runs above")
    lines += ["", "Per-run rows: `results.csv`" + (", sweep: `sweep.csv`" if key else "") +
              "; curves: `curves.png`.", ""]
    (out / "results.md").write_text("\n".join(lines))
    from ..plotting import plot_curves

    finite = [v for pts in curves.values() for _, v in pts if v is not None and math.isfinite(v)]
    ylim = (min(finite) - 0.05, min(max(finite), min(finite) + 3.0) + 0.05) if finite else None
    plot_curves(curves, out / "curves.png",
                title=f"suite {suite.name}{' (quick)' if quick else ''}", ylim=ylim)


def _sweep_cell(rows: list[dict]) -> str:
    """Mean final validation loss of one swept value's runs, with how many diverged."""
    if not rows:
        return "—"
    losses = [r["val_loss"] for r in rows if not r["diverged"] and r["val_loss"] is not None]
    if not losses:
        return "diverged"
    n_div = len(rows) - len(losses)
    return _fmt(statistics.fmean(losses)) + (f" ({n_div}/{len(rows)} diverged)" if n_div else "")
