"""Comparison suites: ``python -m models.compare --suite NAME [--quick] [--out DIR]
[--seeds 0 1 2 3 4] [--jobs N] [--arms ARM ...] [--sweep V ...] [--tune_seeds N]
[--key value ...]``.

Each suite trains the reference GPT several times — a set of *arms* (configurations) times a
set of seeds — with :func:`models.train.run_training`, one run directory per arm and seed
(``--jobs N`` trains N at a time, one process each), and writes to ``--out``. ``--key value``
overrides the config of every run, arm settings and the swept value included; one that would
make two arms (or two swept values) the same configuration is refused before anything runs.
Finished runs of the same config already in ``--out`` are reused, whatever code made them: use
a fresh ``--out`` after a change of the code.

A follow-up of one suite narrows it (:func:`narrow_suite`) instead of defining a new one:
``--arms`` runs only the named arms, ``--sweep`` replaces the values of the suite's swept key
and ``--tune_seeds`` sets how many of the first seeds run the whole sweep (e.g. an arm's lr
window on a finer grid and more seeds:
``--arms geonorm-literal --sweep 3e-4 5e-4 1e-3 2e-3 --seeds 0 1 2 3 4 5 6 7 8 9 --tune_seeds 10``).

- ``results.csv`` — one row per run: final validation loss and perplexity, diverged or not,
  learned or not (final validation loss at least :data:`LEARNED_MARGIN` below the corpus's
  unigram entropy: more than the token frequencies were learned), steps to reach the
  target, wall time, tokens/s, the last evaluation's diagnostics (q/k spectral norms, attention
  logit, entropy and max probability, sphere step angles, weight kurtosis and max|w|/std) and
  their extremes over the run;
- ``results.md`` — the same aggregated per arm (mean ± std over seeds, the distance to the
  baseline in standard errors, unpaired (Welch) and paired by seed) with the exact command, and
  the sweep table of a swept suite;
- ``sweep.csv`` — a swept suite's tuning runs (its first ``tune_seeds`` seeds) at every value;
- ``curves.png`` — the validation curves of every reported run.

The *target* of "steps to target" is the mean final validation loss of the suite's baseline
arm; the steps are the first evaluation at or below it (evaluations every ``eval_interval``
steps, so the resolution is ``eval_interval``).

Suites:

``spheret``
    The hidden-state connections: pre-ln (baseline), peri-ln, pre-dyt (with the DyT paper's LLM
    recipe), keel, geonorm, 1- and 2-SpheretNorm with the normalized step, and 1-SpheretNorm with
    the seed's literal step, each at every AdamW learning rate of a grid on all five seeds: the
    seed's protocol (one shared lr) is a column of the sweep table, and each arm is reported at
    its own best.
``spheret-stress``
    A high-learning-rate, no-warmup, no-clipping setting for a subset (the seed reports Pre-LN
    and Keel diverging where SpheretNorms converge). Keel's outcome there is set by its
    highway weight (``keel_alpha``; the report shows ``keel_branch_ratio_max``).
``spheret-retractions``
    The seed's literal step for the exponential map (GeoNorm, baseline), Cayley (p = 2) and
    gnomonic (p = 1), started at angles of 0.17-0.64 rad (``alpha_init`` 100), each at its own
    best lr of a grid (1e-4 to 1, wide enough that every arm's best is inside) run on all
    five seeds: the test of "finite p beats the exponential map" that the normalized step
    cannot be (there every member is a reparametrization of one per-layer angle).
``manifolds``
    ManifoldMuon assignment policies on seed 002's base, a Pre-LN GPT: unconstrained
    (baseline), all-stiefel, all-dgram, hetero, hetero-inv, at a constant learning rate swept per
    arm on three seeds (each policy reported at its own best, over five seeds); logs the q/k
    spectral norms, the attention logit, entropy and max probability at every evaluation.
``manifolds-high-lr``
    The same policies at one large constant learning rate (0.1, three seeds): the regime in which
    the seed's mechanism — DGram lets the attention maps' singular values, hence the logits,
    grow until the softmax saturates — can act.
``sel``
    AdamW baseline against SEL mismatched, SEL congruent and SEL without the linear path, with
    the curvature calibrated from the weights' own initialization and the seed's scale-lr
    annealing (and mismatched without it), each at its own best ``block_lr`` (the attention and
    MLP matrices' lr; everything else at 3e-3) of a grid run on all five seeds; steps to reach
    the baseline's final loss and the effective weights' heavy-tail statistics.
``sel-shared-lr``
    The same at the seed's protocol: one lr for every parameter, swept per arm.

Full suites are sized for about 30 minutes each on a 2-core CPU with ``--jobs 2`` (timings in
``docs/results``); ``--quick`` is a tiny version (synthetic corpus, one seed, a few dozen steps)
for tests.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import json
import math
import multiprocessing
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from .config import ConfigError, build_config, parse_overrides
from .data import CorpusError
from .train import RunError, _import, read_metrics, run_training

__all__ = ["LEARNED_MARGIN", "SUITES", "Suite", "learned", "main", "narrow_suite", "run_suite",
           "suite_configs", "val_rise_max"]

EXIT_USER_ERROR = 2

#: Shared settings of every full suite: byte-level stdlib, a small 4-layer model.
FULL_BASE = dict(corpus="stdlib", block_size=64, n_layer=4, n_head=4, n_embd=64, batch_size=16,
                 steps=300, warmup_steps=20, lr=3e-3, adamw_lr=3e-3, eval_interval=25,
                 eval_batches=4, log_interval=25, sample_tokens=0, checkpoint=False,
                 progress=False, threads=1)
#: ``--quick``: the synthetic corpus and a tiny model, a few seconds per run.
QUICK_BASE = dict(corpus="synthetic:60000", block_size=32, n_layer=2, n_head=2, n_embd=32,
                  batch_size=8, steps=30, warmup_steps=5, lr=1e-2, adamw_lr=1e-2,
                  eval_interval=10, eval_batches=2, log_interval=10, sample_tokens=0,
                  checkpoint=False, progress=False, threads=1)


@dataclasses.dataclass(frozen=True)
class Suite:
    """One comparison: arms (name, config overrides), the baseline arm, what it needs.

    Attributes:
        name: suite name (``--suite``).
        arms: ``[(arm name, overrides of the base config)]`` in report order.
        baseline: arm whose mean final validation loss is the target.
        requires: ``[(module, attribute)]`` that must exist before anything runs.
        full: base overrides of the full suite (on top of :data:`FULL_BASE`).
        quick: base overrides of ``--quick`` (on top of :data:`QUICK_BASE`).
        seeds: default seeds of the full suite (``--quick`` uses the first one).
        sweep: ``(config key, values)`` swept per arm on the first ``tune_seeds`` seeds; each
            arm's remaining seeds run at its best value (lowest mean final validation loss over
            the tuning seeds; a value with a diverged run ranks after every value without one),
            so arms are compared each at its own tuned setting. ``()``: no sweep.
        quick_sweep: the values of the sweep under ``--quick`` (tuned on its one seed).
        tune_seeds: how many of the first seeds the sweep runs on. One seed is cheap but can
            pick a value for an outlier seed; all of them (the whole grid) selects on the
            seeds it reports, a small winner's-curse bias towards the best-looking value.
    """

    name: str
    arms: tuple[tuple[str, dict], ...]
    baseline: str
    requires: tuple[tuple[str, str], ...] = ()
    full: dict = dataclasses.field(default_factory=dict)
    quick: dict = dataclasses.field(default_factory=dict)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    sweep: tuple = ()
    quick_sweep: tuple = ()
    tune_seeds: int = 1


def _spheret_arms() -> tuple[tuple[str, dict], ...]:
    arms: list[tuple[str, dict]] = [
        (name, {"connection": name}) for name in ("pre-ln", "peri-ln", "pre-dyt", "keel",
                                                  "geonorm")]
    arms += [(f"spheret-p{p:g}", {"connection": "spheret", "retraction": "p", "p": p})
             for p in (1.0, 2.0)]
    arms += [("spheret-p1-literal", {"connection": "spheret", "retraction": "p", "p": 1.0,
                                     "sphere_step": "literal", "alpha_init": 1.0})]
    return tuple(arms)


#: The literal step's initial ``alpha_l`` in the retraction suite: at GPT-2's init the sub-layer
#: outputs are small, and ``alpha_l = 100`` starts the angles at 0.17-0.64 rad (the default
#: ``FULL_BASE`` model, layer by layer), where the members' angles
#: :math:`p\arctan(\beta/p)` and :math:`\beta` differ by 1-10 %; at ``alpha_l = 1`` they start at
#: 0.001-0.006 rad, where no retraction can differ from another.
RETRACTION_ALPHA_INIT = 100.0


def _retraction_arms() -> tuple[tuple[str, dict], ...]:
    """The literal step (the angle varies per token, so the retraction's shape can act) for the
    exponential map (GeoNorm, the baseline), Cayley (p = 2) and gnomonic (p = 1)."""
    literal = {"sphere_step": "literal", "alpha_init": RETRACTION_ALPHA_INIT}
    return (("geonorm-literal", {"connection": "geonorm", **literal}),
            ("spheret-p2-literal", {"connection": "spheret", "retraction": "p", "p": 2.0, **literal}),
            ("spheret-p1-literal", {"connection": "spheret", "retraction": "p", "p": 1.0, **literal}))


def _stress_arms() -> tuple[tuple[str, dict], ...]:
    stress = {"lr": 3e-2, "warmup_steps": 0, "grad_clip": 0.0}
    return tuple((f"{name} @stress", {**cfg, **stress}) for name, cfg in _spheret_arms()
                 if name in ("pre-ln", "keel", "geonorm", "spheret-p1", "spheret-p2"))


#: ManifoldMuon policies of the manifolds suite, baseline first.
MANIFOLD_POLICIES = ("unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv")

def _manifolds_suite(name: str, *, lr: float | None = None, **options) -> Suite:
    """The ManifoldMuon policies on a 2-layer Pre-LN GPT at a constant lr (``lr``, or swept)."""
    fixed = {} if lr is None else {"lr": lr}
    return Suite(
        name=name,
        arms=tuple((policy, {"optimizer": "manifold-muon", "policy": policy})
                   for policy in MANIFOLD_POLICIES),
        baseline="unconstrained", requires=(("manifoldlib.optim", "build_optimizer"),),
        full={"connection": "pre-ln", "schedule": "constant", "adamw_lr": 3e-3, "n_layer": 2,
              "steps": 200, "warmup_steps": 10, "eval_interval": 20, "log_interval": 20, **fixed},
        quick={"connection": "pre-ln", "schedule": "constant", "adamw_lr": 1e-2, **fixed},
        **options)


def _sel_suite(name: str, key: str, **full) -> Suite:
    """SEL's variants against the AdamW baseline, ``key`` (``lr`` or ``block_lr``) swept per arm
    on all five seeds."""
    return Suite(
        name=name,
        arms=(("baseline", {"sel": "none"}), ("sel-mismatched", {"sel": "mismatched"}),
              ("sel-congruent", {"sel": "congruent"}), ("sel-no-linear", {"sel": "no-linear"}),
              ("sel-mismatched-no-anneal", {"sel": "mismatched", "sel_anneal_steps": 0})),
        baseline="baseline",
        requires=(("manifoldlib.charts", "SEL"), ("manifoldlib.charts", "apply_chart")),
        full={"connection": "pre-ln", "sel_anneal_steps": 100, **full},
        quick={"connection": "pre-ln", "sel_anneal_steps": 10},
        sweep=(key, (0.0003, 0.001, 0.003, 0.01)), quick_sweep=(key, (0.003, 0.01)),
        tune_seeds=5)


#: The comparison suites by ``--suite`` name.
SUITES: dict[str, Suite] = {
    # hidden-state connections, 5 seeds each, on the whole AdamW lr grid: the seed's protocol
    # (one shared lr, 3e-3) is the grid's column, and each arm is also reported at its own best
    "spheret": Suite(name="spheret", arms=_spheret_arms(), baseline="pre-ln",
                     sweep=("lr", (0.001, 0.003, 0.01, 0.03)), quick_sweep=("lr", (0.01, 0.03)),
                     tune_seeds=5),
    # the seed's stability claim: Pre-LN / Keel diverge at a high lr where SpheretNorms converge
    "spheret-stress": Suite(name="spheret-stress", arms=_stress_arms(), baseline="pre-ln @stress",
                            seeds=(0, 1, 2)),
    # seed 000's "finite p beats the exponential map" where it can show: the literal step, whose
    # angle varies per token, started at angles where the members differ (the normalized step
    # makes them reparametrizations of one per-layer angle)
    "spheret-retractions": Suite(name="spheret-retractions", arms=_retraction_arms(),
                                 baseline="geonorm-literal",
                                 sweep=("lr", (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03,
                                                0.1, 0.3, 1.0)),
                                 quick_sweep=("lr", (0.01, 0.03)), tune_seeds=5),
    # seed 002 on its own base (a Pre-LN GPT), a constant lr whose budget lets singular values
    # grow far past 1 (sum of lr_t = 200 * lr), and a per-arm lr sweep on three seeds: each
    # policy is reported at its own best lr, so no arm is compared at a step size that suits
    # only another (three seeds: the square DGram solves make the whole grid ~1 h on a CPU)
    "manifolds": _manifolds_suite("manifolds", seeds=(0, 1, 2, 3, 4),
                                  sweep=("lr", (0.001, 0.003, 0.01, 0.03, 0.1)),
                                  quick_sweep=("lr", (0.02, 0.1)), tune_seeds=3),
    # the same at one large constant lr (sum of lr_t = 20): the regime where the seed's DGram
    # mechanism (singular values -> attention logits -> saturated softmax) can act
    "manifolds-high-lr": _manifolds_suite("manifolds-high-lr", lr=0.1, seeds=(0, 1, 2)),
    # seed 004: SEL on every block linear map, curvature calibrated from the weights' own
    # init scale, the seed's scale-lr annealing on (first third of the run; one arm without it),
    # and the block matrices' lr (``block_lr``: a chart's raw coordinates, the baseline's plain
    # matrices) swept per arm with everything else at 3e-3, the arms' best shared lr: at one
    # shared lr an Adam step of the raw coordinates changes a weight by a factor of about
    # e^(b lr), tied to its init scale (16-52 % per step at 3e-3), which no other parameter
    # shares. Tuned on all five seeds
    "sel": _sel_suite("sel", "block_lr", lr=3e-3),
    # the seed's protocol: one lr for every parameter, swept per arm
    "sel-shared-lr": _sel_suite("sel-shared-lr", "lr"),
}


def narrow_suite(suite: Suite, *, arms: tuple[str, ...] | None = None,
                 sweep: tuple[float, ...] | None = None, tune_seeds: int | None = None) -> Suite:
    """``suite`` with only ``arms`` (kept in the suite's order), the swept key's values replaced
    by ``sweep`` (under ``--quick`` too) and the sweep run on the first ``tune_seeds`` seeds;
    ``None`` keeps the suite's. The baseline may be left out: its columns then read "—".

    Raises:
        ConfigError: an arm the suite does not have (the message lists its arms), a repeated
            arm, ``sweep`` for a suite without a sweep, an empty or repeated ``sweep``, or a
            ``tune_seeds`` that is not an integer >= 1.
    """
    names = [name for name, _ in suite.arms]
    if arms is not None:
        unknown = [a for a in arms if a not in names]
        if unknown or not arms or len(set(arms)) != len(arms):
            what = f"unknown {unknown!r}" if unknown else f"{list(arms)!r}"
            raise ConfigError(f"suite {suite.name!r}: --arms {what}; give each of its arms at "
                              f"most once: {', '.join(names)}")
        suite = dataclasses.replace(suite, arms=tuple(a for a in suite.arms if a[0] in arms))
    if sweep is not None:
        if not suite.sweep:
            raise ConfigError(f"suite {suite.name!r} sweeps nothing; --sweep is refused")
        if not sweep or len(set(sweep)) != len(sweep):
            raise ConfigError(f"--sweep needs distinct values of {suite.sweep[0]!r}, got "
                              f"{list(sweep)!r}")
        values = tuple(sweep)
        suite = dataclasses.replace(suite, sweep=(suite.sweep[0], values),
                                    quick_sweep=(suite.sweep[0], values))
    if tune_seeds is not None:
        if isinstance(tune_seeds, bool) or not isinstance(tune_seeds, int) or tune_seeds < 1:
            raise ConfigError(f"--tune_seeds must be an integer >= 1, got {tune_seeds!r}")
        suite = dataclasses.replace(suite, tune_seeds=tune_seeds)
    return suite


def check_requirements(suite: Suite) -> None:
    """Raise :class:`~models.train.MissingModuleError` naming the first missing module."""
    for module, attr in suite.requires:
        _import(module, attr, f"suite {suite.name!r}")


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _steps_to(rows: list[dict], target: float) -> int | None:
    for row in rows:
        val = row.get("val_loss")
        if val is not None and val <= target:
            return int(row["step"])
    return None


def _reusable(run_dir: Path, cfg_dict: dict) -> dict | None:
    """The summary of a finished run of the same config in ``run_dir`` (a re-run skips it)."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    finished = summary.get("finished") or summary.get("diverged")
    return summary if saved == cfg_dict and finished else None


def _run_dir(out: Path, arm: str, seed: int, swept: str | None) -> Path:
    name = arm.replace(" @", "-").replace("@", "")
    return out / (f"{name}/{swept}" if swept else name) / f"seed{seed}"


def _train_one(cfg, run_dir: Path) -> dict:
    """One run, reusing a finished run of the same config (a process-pool worker)."""
    summary = _reusable(run_dir, cfg.to_dict())
    if summary is None:
        if run_dir.exists():  # a partial run of an interrupted suite: start it again
            shutil.rmtree(run_dir)
        summary = run_training(cfg, run_dir, echo=False)
    return summary


#: Nats below the unigram entropy a final validation loss must reach to count as "learned":
#: a model at the unigram entropy has learned only the token frequencies (Keel's 3.226 against
#: 3.261 on stdlib bytes); five times the seed-to-seed spread of a learning arm (~0.02).
LEARNED_MARGIN = 0.1


def learned(val_loss: float | None, unigram_entropy: float) -> bool:
    """A final validation loss at least :data:`LEARNED_MARGIN` nats below the unigram entropy."""
    return val_loss is not None and val_loss <= unigram_entropy - LEARNED_MARGIN


def _diagnostic_peaks(rows: list[dict]) -> dict:
    """Largest attention logit and q/k spectral norm, smallest entropy over every evaluation;
    the largest rise of the validation loss above its running minimum (:func:`val_rise_max`)."""
    def over(keys: tuple[str, ...], pick):
        values = [r[k] for r in rows for k in keys if r.get(k) is not None]
        return pick(values) if values else None
    return {"peak_attention_logit": over(("max_attention_logit",), max),
            "peak_qk_spectral_norm": over(("q_spectral_norm_max", "k_spectral_norm_max"), max),
            "min_attention_entropy": over(("attention_entropy_min",), min),
            "val_rise_max": val_rise_max([r["val_loss"] for r in rows
                                          if r.get("val_loss") is not None])}


def val_rise_max(losses: list[float]) -> float | None:
    r"""The largest :math:`v_t - \min_{s \le t} v_s` over a run's validation losses in step
    order (0 for a run that only improves; ``None`` without a finite loss): a loss spike or a
    relapse that the final loss hides once the run recovers. The trainer's rows start with the
    initial model's loss (step 0), so a spike before the first ``eval_interval`` counts too.
    A non-finite loss ends the scan (the run diverged, counted apart)."""
    best, rise = math.inf, None
    for v in losses:
        if not math.isfinite(v):
            break
        best = min(best, v)
        rise = max(rise or 0.0, v - best)
    return rise


def _result(suite: Suite, arm: str, seed: int, swept, summary: dict, rows: list[dict]) -> dict:
    last_eval = next((r for r in reversed(rows) if r.get("val_loss") is not None), {})
    val = summary.get("val_loss")
    diverged = bool(summary.get("diverged"))
    result = {
        "suite": suite.name, "arm": arm, "seed": seed,
        "swept": swept, "val_loss": val if not diverged else None,
        "val_ppl": summary.get("val_ppl") if not diverged else None, "diverged": diverged,
        "learned": not diverged and learned(val, summary["unigram_entropy"]),
        "steps": summary["steps"], "wall_time_s": round(summary["wall_time_s"], 2),
        "tokens_per_s": round(summary["tokens_per_s"], 1),
        "unigram_entropy": summary["unigram_entropy"], "_rows": rows}
    result.update({k: last_eval.get(k) for k in DIAGNOSTIC_FIELDS})
    result.update(_diagnostic_peaks(rows))
    return result


def _execute(jobs: list[tuple], n_jobs: int, echo: bool, label: str, out: Path) -> list[dict]:
    """Run ``[(cfg, run_dir)]`` (``n_jobs`` processes at a time) and return their summaries."""
    started = time.perf_counter()
    summaries: list[dict | None] = [None] * len(jobs)

    def report(i: int) -> None:
        if echo:
            s, (cfg, run_dir) = summaries[i], jobs[i]
            shown = "diverged" if s.get("diverged") else f"val {s['val_loss']:.4f}"
            print(f"[{i + 1}/{len(jobs)}] {label}: {run_dir.parent.relative_to(out)}"
                  f" seed {cfg.seed}: {shown} ({s['wall_time_s']:.1f} s; "
                  f"{time.perf_counter() - started:.0f} s so far)", flush=True)

    if n_jobs <= 1:
        for i, (cfg, run_dir) in enumerate(jobs):
            summaries[i] = _train_one(cfg, run_dir)
            report(i)
        return summaries
    context = multiprocessing.get_context("spawn")  # no forked torch thread pools
    with concurrent.futures.ProcessPoolExecutor(n_jobs, mp_context=context) as pool:
        futures = {pool.submit(_train_one, cfg, run_dir): i for i, (cfg, run_dir) in enumerate(jobs)}
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            summaries[i] = future.result()
            report(i)
    return summaries


def _by_value(results: list[dict]) -> dict:
    """``{swept value: [result rows]}`` in first-seen order."""
    grouped: dict = {}
    for r in results:
        grouped.setdefault(r["swept"], []).append(r)
    return grouped


def _best_value(results: list[dict]) -> object:
    """The swept value with the lowest mean final validation loss over its runs; a value with a
    diverged run ranks after every value without one."""
    def score(rows: list[dict]) -> tuple:
        losses = [r["val_loss"] for r in rows if r["val_loss"] is not None]
        return len(losses) < len(rows), statistics.fmean(losses) if losses else 0.0
    grouped = _by_value(results)
    return min(grouped, key=lambda value: score(grouped[value]))


def _suite_base(suite: Suite, quick: bool) -> dict:
    return {**(QUICK_BASE if quick else FULL_BASE), **(suite.quick if quick else suite.full)}


def _arm_config(base: dict, arm_overrides: dict, seed: int, key, value, overrides):
    swept = {key: value} if key else {}
    return build_config(base={**base, **arm_overrides, **swept, "seed": seed},
                        overrides=overrides or {})


def suite_configs(suite: Suite, *, quick: bool = False, seed: int | None = None,
                  overrides: dict | None = None) -> list[tuple]:
    """``[(arm, swept value or None, TrainConfig)]``: every configuration of the suite's first
    phase (each arm at each swept value) on ``seed`` (default: the suite's first), built as
    :func:`run_suite` builds them; nothing is trained."""
    base = _suite_base(suite, quick)
    key, values = (suite.quick_sweep if quick else suite.sweep) or (None, (None,))
    seed = suite.seeds[0] if seed is None else seed
    return [(arm, value, _arm_config(base, arm_cfg, seed, key, value, overrides))
            for arm, arm_cfg in suite.arms for value in values]


def _check_distinct(suite: Suite, planned: list[tuple], overrides: dict) -> None:
    """Refuse a plan in which two arms (or two swept values) build the same configuration.

    An override of a key that distinguishes the arms (``--policy`` in a manifolds suite,
    ``--connection`` in spheret) or of the swept key (``--lr`` in ``manifolds``) would otherwise
    run one configuration under several names and report their differences as noise.
    """
    seen: dict[str, str] = {}
    for arm, value, cfg in planned:
        name = arm if value is None else f"{arm} at {value:g}"
        fingerprint = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
        if fingerprint in seen:
            given = f" (overrides: {', '.join(f'--{k} {v}' for k, v in overrides.items())})" \
                if overrides else ""
            raise ConfigError(f"suite {suite.name!r}: {seen[fingerprint]!r} and {name!r} build "
                              f"the same configuration{given}; an override of a key that "
                              f"distinguishes the arms or of the swept key makes the "
                              f"comparison empty")
        seen[fingerprint] = name


def run_suite(suite: Suite, out: str | Path, *, quick: bool = False,
              seeds: tuple[int, ...] | None = None, overrides: dict | None = None,
              command: str = "", echo: bool = True, jobs: int = 1) -> list[dict]:
    """Run every arm and seed of ``suite`` into ``out`` and write the reports.

    With a sweep (:attr:`Suite.sweep`), every arm first runs each swept value on the first
    :attr:`Suite.tune_seeds` seeds (``out/<arm>/<key>=<value>/seed<k>``); the remaining seeds
    then run at the arm's best value, and the reports aggregate each arm at that value.

    Args:
        suite: the suite.
        out: output directory (run directories go to ``out/<arm>/seed<k>``).
        quick: the tiny version.
        seeds: seeds to run (default: the suite's, or its first one with ``quick``).
        overrides: config overrides applied to every arm (``--key value``).
        command: the command line, recorded in ``results.md``.
        echo: print one line per run.
        jobs: runs trained at the same time, each in its own process (``threads`` per run
            stays as configured: 1 in the suites).

    Returns:
        One result dict per run at the reported settings (the rows of ``results.csv``).

    Raises:
        ConfigError: a bad ``jobs``, an invalid configuration, or ``overrides`` that make two
            arms (or two swept values) the same configuration (e.g. ``--policy`` in a manifolds
            suite, ``--lr`` in the swept ``manifolds``); nothing is written then.
    """
    check_requirements(suite)
    if not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be an integer >= 1, got {jobs!r}")
    out = Path(out)
    base = _suite_base(suite, quick)
    seeds = tuple(seeds) if seeds else (suite.seeds[:1] if quick else suite.seeds)
    key, values = (suite.quick_sweep if quick else suite.sweep) or (None, (None,))
    started = time.perf_counter()

    def configs(arm_overrides: dict, seed: int, value) -> object:
        return _arm_config(base, arm_overrides, seed, key, value, overrides)

    def label(value) -> str | None:
        return f"{key}={value:g}" if key else None

    # refused before anything is written: two arms (or swept values) that are one configuration
    _check_distinct(suite, suite_configs(suite, quick=quick, seed=seeds[0], overrides=overrides),
                    overrides or {})
    out.mkdir(parents=True, exist_ok=True)

    # phase 1: every arm at every swept value on the tuning seeds (all seeds without a sweep)
    first = [(arm, arm_cfg, value) for arm, arm_cfg in suite.arms for value in values]
    first_seeds = seeds[:suite.tune_seeds] if key else seeds
    plan = [(arm, seed, value, configs(arm_cfg, seed, value))
            for arm, arm_cfg, value in first for seed in first_seeds]
    done = _execute([(cfg, _run_dir(out, arm, seed, label(value))) for arm, seed, value, cfg in plan],
                    jobs, echo, suite.name, out)
    runs = [(arm, seed, value, summary) for (arm, seed, value, _), summary in zip(plan, done)]
    sweep_rows: list[dict] = []
    if key:
        for arm, seed, value, summary in runs:
            rows = read_metrics(_run_dir(out, arm, seed, label(value)) / "metrics.jsonl")
            sweep_rows.append(_result(suite, arm, seed, value, summary, rows))
        best = {arm: _best_value([r for r in sweep_rows if r["arm"] == arm]) for arm, _ in suite.arms}
        plan = [(arm, seed, best[arm], configs(arm_cfg, seed, best[arm]))
                for arm, arm_cfg in suite.arms for seed in seeds[len(first_seeds):]]
        done = _execute([(cfg, _run_dir(out, arm, seed, label(value)))
                         for arm, seed, value, cfg in plan], jobs, echo, suite.name, out)
        runs = [r for r in runs if r[2] == best[r[0]]]
        runs += [(arm, seed, value, summary) for (arm, seed, value, _), summary in zip(plan, done)]
        order = {arm: i for i, (arm, _) in enumerate(suite.arms)}
        runs.sort(key=lambda r: (order[r[0]], seeds.index(r[1])))
    results, curves = [], {}
    for arm, seed, value, summary in runs:
        rows = read_metrics(_run_dir(out, arm, seed, label(value)) / "metrics.jsonl")
        curves[f"{arm}/{seed}"] = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        results.append(_result(suite, arm, seed, value, summary, rows))
    base_vals = [r["val_loss"] for r in results if r["arm"] == suite.baseline
                 and r["val_loss"] is not None]
    target = statistics.fmean(base_vals) if base_vals else None
    for r in results:
        r["target"] = target
        r["steps_to_target"] = _steps_to(r.pop("_rows"), target) if target is not None else None
    for r in sweep_rows:
        r.pop("_rows")
    write_reports(suite, out, results, curves, quick=quick, command=command,
                  elapsed=time.perf_counter() - started, base=base, overrides=overrides or {},
                  sweep=(key, sweep_rows))
    return results


#: Last-evaluation diagnostics carried into every result row (see ``models.train.diagnostics``).
DIAGNOSTIC_FIELDS = ("max_attention_logit", "q_spectral_norm_max", "k_spectral_norm_max",
                     "attention_entropy_min", "attention_max_prob", "step_angle_mean",
                     "step_angle_max", "keel_branch_ratio_max", "weight_kurtosis_mean",
                     "weight_max_over_std")


CSV_FIELDS = ("suite", "arm", "seed", "swept", "val_loss", "val_ppl", "diverged", "learned",
              "steps_to_target", "target", "steps", "wall_time_s", "tokens_per_s",
              *DIAGNOSTIC_FIELDS, "peak_attention_logit", "peak_qk_spectral_norm",
              "min_attention_entropy", "val_rise_max", "unigram_entropy")


def _fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


#: Extra report columns by suite name, else by suite family (the name before any ``-``):
#: ``(header, result key)``, shown as the mean over seeds.
REPORT_COLUMNS = {
    "spheret": (("step angle (rad)", "step_angle_mean"), ("max step angle", "step_angle_max"),
                ("min attn entropy", "attention_entropy_min")),
    # the stress suite's question is saturation and divergence, not step angles alone
    "spheret-stress": (("step angle (rad)", "step_angle_mean"),
                       ("peak attn logit", "peak_attention_logit"),
                       ("min attn entropy", "attention_entropy_min"),
                       ("Keel branch/highway", "keel_branch_ratio_max"),
                       ("max val rise", "val_rise_max")),
    "manifolds": (("peak q/k σ_max", "peak_qk_spectral_norm"),
                  ("peak attn logit", "peak_attention_logit"),
                  ("min attn entropy", "min_attention_entropy"),
                  ("final max attn prob", "attention_max_prob"),
                  ("max val rise", "val_rise_max")),
    "sel": (("kurtosis", "weight_kurtosis_mean"), ("max|w|/std", "weight_max_over_std")),
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
    cells = [arm] + ([f"{rs[0]['swept']:g}" if rs else "—"] if swept else []) + [
        f"{_fmt(mean)} ± {_fmt(std)}" if len(vals) > 1 else _fmt(mean),
        _fmt(math.exp(mean) if vals else None, 2),
        f"{sum(r['diverged'] for r in rs)}/{len(rs)}", f"{sum(r['learned'] for r in rs)}/{len(rs)}",
        f"{_fmt(statistics.fmean(steps), 0) if steps else '—'} ({len(steps)}/{len(rs)})",
        _fmt(welch, 1) if welch is not None else "—", paired,
        _fmt(statistics.fmean(r["wall_time_s"] for r in rs), 1) if rs else "—"]
    for _, key in columns:
        xs = [r[key] for r in rs if r.get(key) is not None]
        cells.append(_fmt(statistics.fmean(xs), 3) if xs else "—")
    return _md_row(cells)


def _md_row(cells) -> str:
    """One Markdown table row; a ``|`` inside a cell is escaped so it does not split it."""
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def write_reports(suite: Suite, out: Path, results: list[dict], curves: dict, *, quick: bool,
                  command: str, elapsed: float, base: dict, overrides: dict,
                  sweep: tuple = (None, [])) -> None:
    """Write ``results.csv``, ``results.md`` (and ``sweep.csv`` for a swept suite) and
    ``curves.png`` into ``out``."""
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
        shown_base[key] = "swept: " + ", ".join(f"{v:g}" for v in sorted(
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
              f"{_fmt(results[0]['target']) if results else '—'}. Δ vs baseline: difference of "
              f"the mean final validation losses in standard errors (Welch); paired Δ: the mean "
              f"of the per-seed differences (same initialization and batches), in its standard "
              f"errors, and on how many seeds the arm is below the baseline. Total time "
              f"{elapsed:.0f} s."), "",
             _md_row(header), "|" + "---|" * len(header)]
    for arm, _ in suite.arms:
        lines.append(_arm_row(arm, [r for r in results if r["arm"] == arm], base_runs, columns,
                              bool(key)))
    if key:
        values = sorted({r["swept"] for r in sweep_rows})
        tuned = sorted({r["seed"] for r in sweep_rows})
        over = "first seed" if len(tuned) == 1 else f"mean over seeds {', '.join(map(str, tuned))}"
        lines += ["", f"Sweep of `{key}` ({over}; final validation loss, or diverged):", "",
                  _md_row(["arm"] + [f"{key}={v:g}" for v in values]),
                  "|---|" + "---|" * len(values)]
        for arm, _ in suite.arms:
            by_value = _by_value([r for r in sweep_rows if r["arm"] == arm])
            lines.append(_md_row([arm] + [_sweep_cell(by_value.get(v, [])) for v in values]))
    lines += ["", "Per-run rows: `results.csv`" + (", sweep: `sweep.csv`" if key else "") +
              "; curves: `curves.png`.", ""]
    (out / "results.md").write_text("\n".join(lines))
    from .plotting import plot_curves

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


def _parser() -> argparse.ArgumentParser:
    from .train import _Parser

    p = _Parser(prog="python -m models.compare", allow_abbrev=False,
                description="Run a comparison suite; extra --key value pairs override the "
                            "config of every run (refused where they would make two arms the "
                            "same configuration).")
    p.add_argument("--suite", required=True, choices=sorted(SUITES))
    p.add_argument("--quick", action="store_true", help="tiny version (seconds per run)")
    p.add_argument("--out", help="output directory (default: runs/compare-<suite>[-quick])")
    p.add_argument("--seeds", type=int, nargs="+",
                   help="seeds (default: the suite's, 0-4 for most; quick: the first)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at the same time, one process each (default 1)")
    p.add_argument("--arms", nargs="+", metavar="ARM",
                   help="run only these arms of the suite (default: all)")
    p.add_argument("--sweep", type=float, nargs="+", metavar="VALUE",
                   help="values of the suite's swept key instead of its grid")
    p.add_argument("--tune_seeds", type=int, metavar="N",
                   help="how many of the first seeds run the whole sweep (default: the suite's)")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad input or missing module)."""
    from .train import _ArgumentError

    argv = sys.argv[1:] if argv is None else argv
    try:
        args, rest = _parser().parse_known_args(argv)
        overrides = parse_overrides(rest)
        suite = narrow_suite(SUITES[args.suite], arms=args.arms,
                             sweep=None if args.sweep is None else tuple(args.sweep),
                             tune_seeds=args.tune_seeds)
        out = Path(args.out) if args.out else \
            Path("runs") / f"compare-{suite.name}{'-quick' if args.quick else ''}"
        command = "python -m models.compare " + " ".join(shlex.quote(a) for a in argv)
        run_suite(suite, out, quick=args.quick, seeds=tuple(args.seeds or ()),
                  overrides=overrides, command=command, jobs=args.jobs)
    except (_ArgumentError, ConfigError, CorpusError, RunError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'}, {out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
