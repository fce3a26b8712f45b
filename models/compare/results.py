"""One run's result row: the final loss, whether the run learned, the last evaluation's
diagnostics and their extremes over the run (:func:`val_rise_max` among them)."""

from __future__ import annotations

import math

from .suites import Suite

__all__ = ["DIAGNOSTIC_FIELDS", "LEARNED_MARGIN", "by_swept_value", "learned", "result_row",
           "val_rise_max", "value_label"]


#: Last-evaluation diagnostics carried into every result row (see ``models.evaluation.diagnostics``).
DIAGNOSTIC_FIELDS = ("max_attention_logit", "q_spectral_norm_max", "k_spectral_norm_max",
                     "attention_entropy_min", "attention_max_prob", "step_angle_mean",
                     "step_angle_max", "keel_branch_ratio_max", "weight_kurtosis_mean",
                     "weight_max_over_std")


#: Nats below the unigram entropy a final validation loss must reach to count as "learned":
#: a model at the unigram entropy has learned only the token frequencies (Keel's 3.226 against
#: 3.261 on stdlib bytes); five times the seed-to-seed spread of a learning arm (~0.02).
LEARNED_MARGIN = 0.1


def learned(val_loss: float | None, unigram_entropy: float) -> bool:
    """A final validation loss at least :data:`LEARNED_MARGIN` nats below the unigram entropy."""
    return val_loss is not None and val_loss <= unigram_entropy - LEARNED_MARGIN


def _logged(row: dict, key: str) -> float | None:
    """``row``'s ``key``: NaN where the trainer logged null (measured, not finite:
    :func:`models.evaluation.diagnostics`), ``None`` where it logged none (a statistic the model
    does not have)."""
    if key not in row:
        return None
    return math.nan if row[key] is None else row[key]


def _diagnostic_peaks(rows: list[dict]) -> dict:
    """Largest attention logit and q/k spectral norm, smallest entropy over every evaluation;
    the largest rise of the validation loss above its running minimum (:func:`val_rise_max`).
    An evaluation whose value was not finite (logged as null) makes the extreme NaN: that of
    the finite values alone would read as a bounded run."""
    def over(keys: tuple[str, ...], pick):
        values = [_logged(r, k) for r in rows for k in keys if k in r]
        if not values:
            return None
        return pick(values) if all(math.isfinite(v) for v in values) else math.nan
    return {"peak_attention_logit": over(("max_attention_logit",), max),
            "peak_qk_spectral_norm": over(("q_spectral_norm_max", "k_spectral_norm_max"), max),
            "min_attention_entropy": over(("attention_entropy_min",), min),
            "val_rise_max": val_rise_max([_logged(r, "val_loss") for r in rows
                                          if "val_loss" in r])}


def val_rise_max(losses: list[float]) -> float | None:
    r"""The largest :math:`v_t - \min_{s \le t} v_s` over a run's validation losses in step
    order (0 for a run that only improves; ``None`` without a loss): a loss spike or a relapse
    that the final loss hides once the run recovers. The trainer's rows start with the initial
    model's loss (step 0), so a spike before the first ``eval_interval`` counts too. A
    non-finite loss (the run diverged there) ends the scan with a non-finite rise, ``inf`` for
    an infinite loss and NaN for a NaN one (the trainer logs either as null, read as NaN),
    never the largest finite rise before it, which would read as a bounded run."""
    best, rise = math.inf, None
    for v in losses:
        if not math.isfinite(v):
            return math.inf if v == math.inf else math.nan
        best = min(best, v)
        rise = max(rise or 0.0, v - best)
    return rise


def result_row(suite: Suite, arm: str, seed: int, swept, summary: dict, rows: list[dict]) -> dict:
    """One run's result: its summary's final loss (``None`` when diverged), whether it
    :func:`learned`, the last evaluation's :data:`DIAGNOSTIC_FIELDS` (NaN where the value was
    not finite, ``None`` where the model has none) and their extremes over the run;
    ``lr_peak_fraction`` the largest learning-rate multiplier of its schedule (below 1 where the
    warm-up outlasts the run), ``warmup_outlasts_run`` (``warmup_steps >= steps``) and
    ``sel_anneal_fraction`` (below 1 where SEL's scale annealing outlasts the run; None where
    nothing anneals): the reports say so; ``_rows``
    keeps the metrics rows for the caller (steps to target). A diverged run's ``val_rise_max``
    is NaN (inf where its validation loss went infinite) even when every evaluation it logged
    was finite: the trainer stops a run at the step whose training loss or gradient goes
    non-finite, most often between evaluations, and the rise of the finite ones would read as a
    bounded run."""
    last_eval = next((r for r in reversed(rows) if r.get("val_loss") is not None), {})
    val = summary.get("val_loss")
    diverged = bool(summary.get("diverged"))
    result = {
        "suite": suite.name, "arm": arm, "seed": seed,
        "swept": swept, "val_loss": val if not diverged else None,
        "val_ppl": summary.get("val_ppl") if not diverged else None, "diverged": diverged,
        "learned": not diverged and learned(val, summary["unigram_entropy"]),
        "steps": summary["steps"], "lr_peak_fraction": summary["lr_peak_fraction"],
        "warmup_outlasts_run": summary["warmup_outlasts_run"],
        "sel_anneal_fraction": summary["sel_anneal_fraction"],
        "wall_time_s": round(summary["wall_time_s"], 2),
        "tokens_per_s": round(summary["tokens_per_s"], 1),
        "unigram_entropy": summary["unigram_entropy"], "_rows": rows}
    result.update({k: _logged(last_eval, k) for k in DIAGNOSTIC_FIELDS})
    result.update(_diagnostic_peaks(rows))
    if diverged and result["val_rise_max"] is not None and math.isfinite(result["val_rise_max"]):
        # its loss went non-finite after the last evaluation (the trainer stops a run at the
        # step whose training loss or gradient does, with no evaluation): not a bounded rise
        result["val_rise_max"] = math.nan
    return result


def value_label(value) -> str:
    """A swept value as run directory names and reports spell it: ``:g`` (``0.003``, ``1e-05``)
    where that reads back as the value, else ``repr`` (``0.01000001``, which ``:g`` rounds to
    ``0.01``): distinct values get distinct names, and ordinary values keep the ``:g`` names
    of earlier suites (whose finished runs are found and reused)."""
    short = f"{value:g}"
    try:
        exact = float(short) == value
    except (TypeError, ValueError):
        exact = False
    return short if exact else repr(value)


def by_swept_value(results: list[dict]) -> dict:
    """``{swept value: [result rows]}`` in first-seen order."""
    grouped: dict = {}
    for r in results:
        grouped.setdefault(r["swept"], []).append(r)
    return grouped
