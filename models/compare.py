"""Comparison suites: ``python -m models.compare --suite spheret|manifolds|sel [--quick]
[--out DIR] [--seeds 0 1 2] [--key value ...]``.

Each suite trains the reference GPT several times — a set of *arms* (configurations) times a
set of seeds — with :func:`models.train.run_training`, one run directory per arm and seed, and
writes to ``--out``:

- ``results.csv`` — one row per run: final validation loss and perplexity, diverged or not,
  learned or not (final validation loss below the corpus's unigram entropy), steps to reach the
  target, wall time, tokens/s and the last diagnostics;
- ``results.md`` — the same aggregated per arm (mean ± std over seeds) with the exact command;
- ``curves.png`` — the validation curves of every run.

The *target* of "steps to target" is the mean final validation loss of the suite's baseline
arm; the steps are the first evaluation at or below it (evaluations every ``eval_interval``
steps, so the resolution is ``eval_interval``).

Suites:

``spheret``
    The hidden-state connections at a shared learning rate: pre-ln (baseline), peri-ln,
    pre-dyt, keel, geonorm and p-SpheretNorm with :math:`p \\in \\{0.5, 1, 2, 4\\}`, then a
    high-learning-rate stress setting for a subset (the seed reports Pre-LN diverging where
    SpheretNorms converge).
``manifolds``
    ManifoldMuon assignment policies: unconstrained (baseline), all-stiefel, all-dgram, hetero,
    hetero-inv; logs the largest q/k spectral norm and the maximum attention logit.
``sel``
    AdamW baseline against SEL mismatched, SEL congruent and SEL without the linear path;
    reports the steps each needs to reach the baseline's final validation loss.

Full suites are sized for about 30 minutes on a 2-core CPU (measured on a loaded one: sel 22
minutes with three seeds, manifolds 20 with three, spheret 32 with its default two);
``--quick`` is a tiny version (synthetic corpus, one seed, a few dozen steps) for tests.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from .config import ConfigError, build_config, parse_overrides
from .data import CorpusError
from .train import RunError, _import, read_metrics, run_training

__all__ = ["SUITES", "Suite", "main", "run_suite"]

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
    """

    name: str
    arms: tuple[tuple[str, dict], ...]
    baseline: str
    requires: tuple[tuple[str, str], ...] = ()
    full: dict = dataclasses.field(default_factory=dict)
    quick: dict = dataclasses.field(default_factory=dict)
    seeds: tuple[int, ...] = (0, 1, 2)


def _spheret_arms() -> tuple[tuple[str, dict], ...]:
    arms: list[tuple[str, dict]] = [
        (name, {"connection": name}) for name in ("pre-ln", "peri-ln", "pre-dyt", "keel",
                                                  "geonorm")]
    arms += [(f"spheret-p{p:g}", {"connection": "spheret", "retraction": "p", "p": p})
             for p in (0.5, 1.0, 2.0, 4.0)]
    stress = {"lr": 3e-2, "warmup_steps": 0, "grad_clip": 0.0}
    arms += [(f"{name} @stress", {**cfg, **stress}) for name, cfg in arms
             if name in ("pre-ln", "keel", "geonorm", "spheret-p1", "spheret-p2")]
    return tuple(arms)


#: The comparison suites by ``--suite`` name.
SUITES: dict[str, Suite] = {
    # 14 arms: two seeds by default keep it near 30 minutes on a loaded 2-core CPU (measured
    # 32 min); pass --seeds 0 1 2 for a third
    "spheret": Suite(
        name="spheret", arms=_spheret_arms(), baseline="pre-ln", seeds=(0, 1)),
    "manifolds": Suite(
        name="manifolds",
        arms=tuple((policy, {"optimizer": "manifold-muon", "policy": policy})
                   for policy in ("unconstrained", "all-stiefel", "all-dgram", "hetero",
                                  "hetero-inv")),
        baseline="unconstrained",
        requires=(("manifoldlib.optim", "build_optimizer"),),
        # the dual solves of Stiefel / DGram cost ~10x an AdamW step on a CPU: half the depth
        # and 200 steps keep the suite within 30 minutes on 2 cores
        full={"lr": 0.02, "adamw_lr": 3e-3, "n_layer": 2, "steps": 200, "eval_interval": 20,
              "log_interval": 20},
        quick={"lr": 0.02, "adamw_lr": 1e-2}),
    "sel": Suite(
        name="sel",
        arms=(("baseline", {"sel": "none"}), ("sel-mismatched", {"sel": "mismatched"}),
              ("sel-congruent", {"sel": "congruent"}), ("sel-no-linear", {"sel": "no-linear"})),
        baseline="baseline",
        requires=(("manifoldlib.charts", "SEL"), ("manifoldlib.charts", "apply_chart")),
        full={"connection": "pre-ln"}, quick={"connection": "pre-ln"}),
}


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


def run_suite(suite: Suite, out: str | Path, *, quick: bool = False,
              seeds: tuple[int, ...] | None = None, overrides: dict | None = None,
              command: str = "", echo: bool = True) -> list[dict]:
    """Run every arm and seed of ``suite`` into ``out`` and write the reports.

    Args:
        suite: the suite.
        out: output directory (run directories go to ``out/<arm>/seed<k>``).
        quick: the tiny version.
        seeds: seeds to run (default: the suite's, or its first one with ``quick``).
        overrides: config overrides applied to every arm (``--key value``).
        command: the command line, recorded in ``results.md``.
        echo: print one line per run.

    Returns:
        One result dict per run (the rows of ``results.csv``).
    """
    check_requirements(suite)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = {**(QUICK_BASE if quick else FULL_BASE), **(suite.quick if quick else suite.full)}
    seeds = tuple(seeds) if seeds else (suite.seeds[:1] if quick else suite.seeds)
    configs = []
    for arm, arm_overrides in suite.arms:
        for seed in seeds:
            cfg = build_config(base={**base, **arm_overrides, "seed": seed},
                               overrides=overrides or {})
            configs.append((arm, seed, cfg))
    results, curves = [], {}
    started = time.perf_counter()
    for i, (arm, seed, cfg) in enumerate(configs, 1):
        run_dir = out / arm.replace(" @", "-").replace("@", "") / f"seed{seed}"
        summary = _reusable(run_dir, cfg.to_dict())
        if summary is None:
            if run_dir.exists():  # a partial run of an interrupted suite: start it again
                shutil.rmtree(run_dir)
            summary = run_training(cfg, run_dir, echo=False)
        rows = read_metrics(run_dir / "metrics.jsonl")
        curves[f"{arm}/{seed}"] = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        last_eval = next((r for r in reversed(rows) if r.get("val_loss") is not None), {})
        val = summary.get("val_loss")
        result = {
            "suite": suite.name, "arm": arm, "seed": seed,
            "val_loss": val if not summary.get("diverged") else None,
            "val_ppl": summary.get("val_ppl") if not summary.get("diverged") else None,
            "diverged": bool(summary.get("diverged")),
            "learned": bool(val is not None and not summary.get("diverged")
                            and val < summary["unigram_entropy"]),
            "steps": summary["steps"], "wall_time_s": round(summary["wall_time_s"], 2),
            "tokens_per_s": round(summary["tokens_per_s"], 1),
            "max_attention_logit": last_eval.get("max_attention_logit"),
            "q_spectral_norm_max": last_eval.get("q_spectral_norm_max"),
            "k_spectral_norm_max": last_eval.get("k_spectral_norm_max"),
            "unigram_entropy": summary["unigram_entropy"], "_rows": rows}
        results.append(result)
        if echo:
            shown = "diverged" if result["diverged"] else f"val {val:.4f}"
            print(f"[{i}/{len(configs)}] {suite.name}: {arm} seed {seed}: {shown} "
                  f"({summary['wall_time_s']:.1f} s; {time.perf_counter() - started:.0f} s so far)",
                  flush=True)
    base_vals = [r["val_loss"] for r in results if r["arm"] == suite.baseline
                 and r["val_loss"] is not None]
    target = statistics.fmean(base_vals) if base_vals else None
    for r in results:
        r["target"] = target
        r["steps_to_target"] = _steps_to(r.pop("_rows"), target) if target is not None else None
    write_reports(suite, out, results, curves, quick=quick, command=command,
                  elapsed=time.perf_counter() - started, base=base, overrides=overrides or {})
    return results


CSV_FIELDS = ("suite", "arm", "seed", "val_loss", "val_ppl", "diverged", "learned",
              "steps_to_target", "target", "steps", "wall_time_s", "tokens_per_s",
              "max_attention_logit", "q_spectral_norm_max", "k_spectral_norm_max",
              "unigram_entropy")


def _fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def write_reports(suite: Suite, out: Path, results: list[dict], curves: dict, *, quick: bool,
                  command: str, elapsed: float, base: dict, overrides: dict) -> None:
    """Write ``results.csv``, ``results.md`` and ``curves.png`` into ``out``."""
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in results:
            writer.writerow({k: r.get(k) for k in CSV_FIELDS})
    arms = [a for a, _ in suite.arms]
    lines = [f"# Suite `{suite.name}`{' (quick)' if quick else ''}", "",
             f"Command: `{command}`" if command else "", "",
             f"Base config: `{json.dumps({**base, **overrides}, sort_keys=True)}`", "",
             (f"Target (steps to target): mean final validation loss of `{suite.baseline}` = "
              f"{_fmt(results[0]['target']) if results else '—'}. Total time {elapsed:.0f} s."),
             "",
             ("| arm | val loss (mean ± std) | val ppl | diverged | learned | steps to target "
              "| wall s | max attn logit | q/k spectral norm |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        rs = [r for r in results if r["arm"] == arm]
        vals = [r["val_loss"] for r in rs if r["val_loss"] is not None]
        mean, std = _mean_std(vals)
        steps = [r["steps_to_target"] for r in rs if r["steps_to_target"] is not None]
        logit = [r["max_attention_logit"] for r in rs if r["max_attention_logit"] is not None]
        qk = [max(r["q_spectral_norm_max"] or 0, r["k_spectral_norm_max"] or 0) for r in rs
              if r["q_spectral_norm_max"] is not None]
        lines.append(
            f"| {arm} | {_fmt(mean)} ± {_fmt(std)} | {_fmt(math.exp(mean) if vals else None, 2)} "
            f"| {sum(r['diverged'] for r in rs)}/{len(rs)} | {sum(r['learned'] for r in rs)}/"
            f"{len(rs)} | {_fmt(statistics.fmean(steps), 0) if steps else '—'} "
            f"({len(steps)}/{len(rs)}) | {_fmt(statistics.fmean(r['wall_time_s'] for r in rs), 1)}"
            f" | {_fmt(statistics.fmean(logit), 2) if logit else '—'} "
            f"| {_fmt(statistics.fmean(qk), 2) if qk else '—'} |")
    lines += ["", "Per-run rows: `results.csv`; curves: `curves.png`.", ""]
    (out / "results.md").write_text("\n".join(lines))
    from .plotting import plot_curves

    finite = [v for pts in curves.values() for _, v in pts if v is not None and math.isfinite(v)]
    ylim = (min(finite) - 0.05, min(max(finite), min(finite) + 3.0) + 0.05) if finite else None
    plot_curves(curves, out / "curves.png",
                title=f"suite {suite.name}{' (quick)' if quick else ''}", ylim=ylim)


def _parser() -> argparse.ArgumentParser:
    from .train import _Parser

    p = _Parser(prog="python -m models.compare", allow_abbrev=False,
                description="Run a comparison suite; extra --key value pairs override the "
                            "config of every run.")
    p.add_argument("--suite", required=True, choices=sorted(SUITES))
    p.add_argument("--quick", action="store_true", help="tiny version (seconds per run)")
    p.add_argument("--out", help="output directory (default: runs/compare-<suite>[-quick])")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds (default: 0 1 2; quick: 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad input or missing module)."""
    from .train import _ArgumentError

    argv = sys.argv[1:] if argv is None else argv
    try:
        args, rest = _parser().parse_known_args(argv)
        overrides = parse_overrides(rest)
        suite = SUITES[args.suite]
        out = Path(args.out) if args.out else \
            Path("runs") / f"compare-{suite.name}{'-quick' if args.quick else ''}"
        command = "python -m models.compare " + " ".join(shlex.quote(a) for a in argv)
        run_suite(suite, out, quick=args.quick, seeds=tuple(args.seeds or ()),
                  overrides=overrides, command=command)
    except (_ArgumentError, ConfigError, CorpusError, RunError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'}, {out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
