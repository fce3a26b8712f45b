"""Running a suite: every arm and seed (each arm first at each swept value on the tuning
seeds, then at its best), one run directory each, finished runs of the same configuration
reused, ``jobs`` processes at a time; then the reports."""

from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
import shutil
import statistics
import time
from pathlib import Path

from ..build import lr_peak_fraction, sel_anneal_fraction, warmup_outlasts_run
from ..config import ConfigError, build_config, inert_settings
from ..data import check_given_tokenizer, load_corpus, resolve_tokenizer
from ..sources import Fingerprint, list_documents
from ..train import read_metrics, run_training
from .reports import write_reports
from .results import by_swept_value, result_row, value_label
from .suites import FULL_BASE, QUICK_BASE, Suite, check_requirements

__all__ = ["run_suite", "suite_configs"]


def _suite_base(suite: Suite, quick: bool) -> dict:
    return {**(QUICK_BASE if quick else FULL_BASE), **(suite.quick if quick else suite.full)}


def _tuning_seeds(suite: Suite, quick: bool) -> tuple[int, ...]:
    """The held-out tuning seeds: the suite's, or under ``--quick`` its
    :attr:`~Suite.quick_tuning_seeds` (seeds given by name), else the first of them."""
    if quick:
        given = suite.quick_tuning_seeds
        return tuple(suite.tuning_seeds[:1] if given is None else given)
    return tuple(suite.tuning_seeds)


def _arm_config(base: dict, arm_overrides: dict, seed: int, key, value, overrides):
    """The arm's config; an arm's ``schedule_fraction`` runs that fraction of the steps every
    other arm runs (the base's, or ``--steps``), so a shorter schedule stays shorter in ``--quick``.
    Its tokenizer ``auto`` (the default, where no ``--tokenizer`` override names one) is the
    corpus's own (:func:`~models.data.resolve_tokenizer`), as the run saves it."""
    swept = {key: value} if key else {}
    arm = dict(arm_overrides)
    fraction = arm.pop("schedule_fraction", None)
    cfg = build_config(base={**base, **arm, **swept, "seed": seed}, overrides=overrides or {})
    if fraction is not None:
        cfg = build_config(base={**base, **arm, **swept, "seed": seed},
                           overrides={**(overrides or {}),
                                      "steps": str(max(1, round(cfg.steps * fraction)))})
    return resolve_tokenizer(cfg)  # a named one is checked against the shards by _check_read


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
    run one configuration under several names and report their differences as noise. So would
    one that makes what distinguishes them inert (:func:`~models.config.inert_settings`:
    ``--optimizer adamw`` in a manifolds suite, whose arms then differ only in the ``policy``
    that AdamW never reads): configurations are compared without their inert settings.
    """
    seen: dict[str, tuple[str, dict]] = {}
    for arm, value, cfg in planned:
        name = arm if value is None else f"{arm} at {value_label(value)}"
        values, inert = cfg.to_dict(), inert_settings(cfg)
        read = {k: v for k, v in values.items() if k not in inert}
        fingerprint = json.dumps(read, sort_keys=True, default=str)
        if fingerprint in seen:
            first, first_values = seen[fingerprint]
            given = f" (overrides: {', '.join(f'--{k} {v}' for k, v in overrides.items())})" \
                if overrides else ""
            unread = sorted(k for k in values if values[k] != first_values[k])
            only = f", differing only in {', '.join(unread)}, which it never reads" \
                if unread else ""
            raise ConfigError(f"suite {suite.name!r}: {first!r} and {name!r} build "
                              f"the same configuration{given}{only}; an override of a key that "
                              f"distinguishes the arms or of the swept key, or that makes it "
                              f"inert, makes the comparison empty")
        seen[fingerprint] = name, values


def _check_read(suite: Suite, planned: list[tuple], overrides: dict) -> None:
    """Refuse an override that no configuration of the plan reads.

    An override is applied to every arm; one inert in each of them
    (:func:`~models.config.inert_settings`: ``--muon_ns_dtype`` in a suite whose arms all train
    with AdamW) would run the suite unchanged under a command and a ``results.md`` that say
    otherwise. One that some arm reads is kept, inert in the others as it may be (``--sel_kappa``
    in ``sel``: the SEL arms read it, the baseline does not). The error gives each inert
    setting's reasons, with the arms of each where they differ. A ``--tokenizer`` that is not the
    one the ``bin:`` shards were made with is refused as the single-run command line refuses it
    (:func:`~models.data.check_given_tokenizer`).

    Raises:
        ConfigError: one line naming each override no arm reads and why.
        CorpusError: a ``--tokenizer`` that disagrees with the shards' tokenizer.
    """
    inert = [(arm, inert_settings(cfg)) for arm, _, cfg in planned]
    unread = []
    for key in overrides:
        name = key.replace("-", "_")
        if not all(name in settings for _, settings in inert):
            continue
        arms_of: dict[str, list[str]] = {}  # reason -> arms, both in plan order
        for arm, settings in inert:
            if arm not in arms_of.setdefault(settings[name], []):
                arms_of[settings[name]].append(arm)
        reasons = [f"in each: {why}" if len(arms_of) == 1 else f"in {', '.join(arms)}: {why}"
                   for why, arms in arms_of.items()]
        unread.append(f"--{key} does nothing in any arm ({'; '.join(reasons)})")
    if unread:
        raise ConfigError(f"suite {suite.name!r}: " + "; ".join(unread))
    for key in overrides:
        if key.replace("-", "_") == "tokenizer":
            for corpus, tokenizer in dict.fromkeys((c.corpus, c.tokenizer) for _, _, c in planned):
                check_given_tokenizer(corpus, tokenizer, f"--{key}")


def _check_whole_runs(suite: Suite, planned: list[tuple]) -> None:
    """Refuse a plan whose runs stop before their ``steps`` (``--stop_at``).

    A suite reports each run's last evaluation as its final validation loss, beside runs that
    finished; a run stopped at ``stop_at`` of a longer schedule would be reported as one, and
    never reused by a later run of the suite (only finished runs are), which would train it again.

    Raises:
        ConfigError: naming the value, the runs' schedule and what to give instead.
    """
    for arm, _, cfg in planned:
        if cfg.stop_at:
            raise ConfigError(
                f"suite {suite.name!r}: --stop_at {cfg.stop_at} would stop every run at step "
                f"{cfg.stop_at} of its {cfg.steps}-step schedule (arm {arm!r}), and results.md "
                f"would report those truncated runs as finished ones; a suite trains every run "
                f"to its steps: give --steps {cfg.stop_at} for shorter runs (a schedule of that "
                f"length), or leave --stop_at out")


def _check_no_seed_override(suite: Suite, overrides: dict, seeds: tuple[int, ...]) -> None:
    """Refuse a ``--seed`` override: the suite sets each run's seed from its seeds, and an
    override applied on top would train every run at the one seed, so the directories
    ``seed<k>`` of different seeds would hold the same run, reported as that many seeds (a
    standard deviation of 0, paired differences over copies).

    Raises:
        ConfigError: naming the value and the flags that choose the seeds.
    """
    for key, value in overrides.items():
        if key.replace("-", "_") == "seed":
            raise ConfigError(
                f"suite {suite.name!r}: --{key} {value} would train every run at seed {value}, "
                f"so the runs of seeds {list(seeds)} (and of the tuning seeds) would be one run "
                f"reported as several; give the seeds with --seeds (and --tuning_seeds for the "
                f"sweep's), not --{key}")


def _steps_to(rows: list[dict], target: float) -> int | None:
    """The step of the first evaluation at or below ``target`` (``None``: none is). A run that
    diverged after it still has it: "steps to target" is when a run first reached the
    baseline's final loss, whatever happened later (the "diverged" column says that); a run
    that diverged before reaching it has ``None``."""
    for row in rows:
        val = row.get("val_loss")
        if val is not None and val <= target:
            return int(row["step"])
    return None


def _seconds_to(rows: list[dict], target: float) -> float | None:
    """Training seconds until the first evaluation at or below ``target``: each logged interval's
    tokens over its measured tokens/s, summed (evaluations and start-up not counted); a later
    divergence does not remove it, as for :func:`_steps_to`."""
    seconds, tokens = 0.0, 0
    for row in rows:
        if row.get("tokens_per_s"):
            seconds += (row["tokens"] - tokens) / row["tokens_per_s"]
            tokens = row["tokens"]
        val = row.get("val_loss")
        if val is not None and val <= target:
            return round(seconds, 2)
    return None


def _corpus_fingerprint(cfg) -> str:
    """The fingerprint ``cfg``'s corpus has now, as :func:`~models.data.load_corpus` gives it:
    a text corpus's files are read (not tokenized), token shards opened (their scan)."""
    if cfg.corpus.startswith("bin:"):
        return load_corpus(cfg.corpus, tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size or None,
                           shard_dtype=None if cfg.shard_dtype == "meta" else cfg.shard_dtype
                           ).fingerprint
    docs, fingerprint = list_documents(cfg.corpus), Fingerprint()
    for i, name in enumerate(docs.names):
        fingerprint.update(name, docs.read(i))
    return fingerprint.hexdigest()


def _ends_within(summary: dict, steps: int) -> bool:
    """Whether ``summary`` can be the end of a run of ``steps``: a finished run's ``steps`` are
    those, a diverged run's at most those. A resume before d0a9640 rewrote ``config.json`` and,
    interrupted, left the summary of the shorter run it extended beside it."""
    ended = summary.get("steps")
    if not isinstance(ended, int) or isinstance(ended, bool):
        return False
    return ended == steps if summary.get("finished") else ended <= steps


def _reusable(run_dir: Path, cfg, fingerprints: dict) -> dict | None:
    """The summary of a finished run of the same config in ``run_dir`` (a re-run skips it),
    ended at the config's ``steps`` (:func:`_ends_within`), trained on the corpus as it is now: its ``corpus.json`` fingerprint is the corpus's (a
    ``file:`` corpus rewritten, shards prepared again into their folder or ``stdlib`` under
    another Python make the config match a run of other data). ``fingerprints`` caches each
    corpus's, computed only where a run could be reused. A run saved before a field existed
    has a ``config.json`` without it and is trained again: one without ``lr_schedule_version``
    had the cosine that ends above ``min_lr_ratio`` (:func:`~models.build.lr_scale`).

    Raises:
        CorpusError: the corpus of a finished run cannot be read (nothing is deleted).
    """
    try:
        saved = json.loads((run_dir / "config.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    finished = summary.get("finished") or summary.get("diverged")
    if saved != cfg.to_dict() or not finished or not _ends_within(summary, cfg.steps):
        return None
    try:
        trained_on = json.loads((run_dir / "corpus.json").read_text())["fingerprint"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    key = (cfg.corpus, cfg.tokenizer, cfg.vocab_size, cfg.shard_dtype)
    if key not in fingerprints:
        fingerprints[key] = _corpus_fingerprint(cfg)
    if trained_on != fingerprints[key]:
        return None
    # a summary written before the trainer recorded them; the same functions of the same config
    summary.setdefault("lr_peak_fraction", lr_peak_fraction(cfg))
    summary.setdefault("warmup_outlasts_run", warmup_outlasts_run(cfg) is not None)
    summary.setdefault("sel_anneal_fraction", sel_anneal_fraction(cfg))
    return summary


def _run_dir(out: Path, arm: str, seed: int, swept: str | None) -> Path:
    name = arm.replace(" @", "-").replace("@", "")
    return out / (f"{name}/{swept}" if swept else name) / f"seed{seed}"


def _train_one(cfg, run_dir: Path) -> dict:
    """One run (a process-pool worker), in place of whatever ``run_dir`` holds: a partial run
    of an interrupted suite, or a run of another config or corpus."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return run_training(cfg, run_dir, echo=False)


def _execute(jobs: list[tuple], n_jobs: int, echo: bool, label: str, out: Path) -> list[dict]:
    """Run ``[(cfg, run_dir)]`` (``n_jobs`` processes at a time) and return their summaries;
    a finished run of the same config and corpus is reused (:func:`_reusable`)."""
    started = time.perf_counter()
    fingerprints: dict = {}
    summaries: list[dict | None] = [_reusable(run_dir, cfg, fingerprints) for cfg, run_dir in jobs]
    reused = [s is not None for s in summaries]

    def report(i: int) -> None:
        if echo:
            s, (cfg, run_dir) = summaries[i], jobs[i]
            shown = "diverged" if s.get("diverged") else f"val {s['val_loss']:.4f}"
            print(f"[{i + 1}/{len(jobs)}] {label}: {run_dir.parent.relative_to(out)}"
                  f" seed {cfg.seed}: {shown} ({s['wall_time_s']:.1f} s; "
                  f"{time.perf_counter() - started:.0f} s so far)", flush=True)

    if n_jobs <= 1:
        for i, (cfg, run_dir) in enumerate(jobs):
            if not reused[i]:
                summaries[i] = _train_one(cfg, run_dir)
            report(i)
        return summaries
    for i in range(len(jobs)):
        if reused[i]:
            report(i)
    context = multiprocessing.get_context("spawn")  # no forked torch thread pools
    with concurrent.futures.ProcessPoolExecutor(n_jobs, mp_context=context) as pool:
        futures = {pool.submit(_train_one, cfg, run_dir): i
                   for i, (cfg, run_dir) in enumerate(jobs) if not reused[i]}
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            summaries[i] = future.result()
            report(i)
    return summaries


def _best_value(results: list[dict]) -> object:
    """The swept value with the lowest mean final validation loss over its runs; a value with a
    diverged run ranks after every value without one, and among those, by how many of its runs
    diverged (a value none of whose runs finished last), then by the mean of the others."""
    def score(rows: list[dict]) -> tuple:
        losses = [r["val_loss"] for r in rows if r["val_loss"] is not None]
        return len(rows) - len(losses), statistics.fmean(losses) if losses else math.inf
    grouped = by_swept_value(results)
    return min(grouped, key=lambda value: score(grouped[value]))


def run_suite(suite: Suite, out: str | Path, *, quick: bool = False,
              seeds: tuple[int, ...] | None = None, overrides: dict | None = None,
              command: str = "", echo: bool = True, jobs: int = 1) -> list[dict]:
    """Run every arm and seed of ``suite`` into ``out`` and write the reports.

    With a sweep (:attr:`Suite.sweep`), every arm first runs each swept value on the tuning
    seeds (``out/<arm>/<key>=<value>/seed<k>``): the held-out :attr:`Suite.tuning_seeds`, after
    which every reported seed runs at the arm's best value; or, without them, the first
    :attr:`Suite.tune_seeds` seeds, after which the remaining ones do. The reports aggregate each
    arm at its best value over the reported seeds (never over held-out tuning seeds).

    Args:
        suite: the suite.
        out: output directory (run directories go to ``out/<arm>/seed<k>``).
        quick: the tiny version.
        seeds: seeds to report (default: the suite's, or its first one with ``quick``; the
            held-out tuning seeds: the suite's, or with ``quick`` its ``quick_tuning_seeds``,
            which :func:`~models.compare.suites.narrow_suite` sets to the seeds it is given,
            else their first one).
        overrides: config overrides applied to every arm (``--key value``).
        command: the command line, recorded in ``results.md``.
        echo: print one line per run.
        jobs: runs trained at the same time, each in its own process (``threads`` per run
            stays as configured: 1 in the suites).

    Returns:
        One result dict per run at the reported settings (the rows of ``results.csv``).

    Raises:
        ConfigError: a bad ``jobs``, an invalid configuration, an override that no arm reads
            (``--muon_ns_dtype`` in an AdamW-only suite; one that some arms read is kept), or
            ``overrides`` that make two arms (or two swept values) the same configuration (e.g.
            ``--policy`` in a manifolds suite, ``--lr`` in the swept ``manifolds``), a
            ``--stop_at`` (a truncated run would be reported as a finished one), or a ``--seed``
            (every run would train at that seed); nothing is written then.
        CorpusError: a ``--tokenizer`` override that disagrees with the ``bin:`` shards'.
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
        return f"{key}={value_label(value)}" if key else None  # one folder per distinct value

    # refused before anything is written: an override no arm reads, two arms (or swept values)
    # that are one configuration
    _check_no_seed_override(suite, overrides or {}, seeds)
    planned = suite_configs(suite, quick=quick, seed=seeds[0], overrides=overrides)
    _check_read(suite, planned, overrides or {})
    _check_distinct(suite, planned, overrides or {})
    _check_whole_runs(suite, planned)
    out.mkdir(parents=True, exist_ok=True)

    # phase 1: every arm at every swept value on the tuning seeds (all seeds without a sweep)
    first = [(arm, arm_cfg, value) for arm, arm_cfg in suite.arms for value in values]
    held_out = _tuning_seeds(suite, quick) if key else ()
    for name, given in (("seeds", seeds), ("tuning seeds", held_out)):
        repeated = sorted({s for s in given if given.count(s) > 1})
        if repeated:  # one run directory, reported as several runs
            raise ConfigError(f"suite {suite.name!r}: {name} {list(given)} repeat {repeated}; give each seed once")
    if set(held_out) & set(seeds):
        raise ConfigError(f"suite {suite.name!r}: tuning seeds {sorted(set(held_out) & set(seeds))} are also "
                          f"reported seeds; held-out tuning needs disjoint sets")
    if key and not held_out and suite.tune_seeds > len(seeds):  # seeds[:N] would quietly tune on fewer
        raise ConfigError(f"suite {suite.name!r}: --tune_seeds {suite.tune_seeds} tunes on the first "
                          f"{suite.tune_seeds} reported seeds, but there are {len(seeds)} ({list(seeds)}); "
                          f"give at least {suite.tune_seeds} --seeds or a smaller --tune_seeds")
    first_seeds = held_out or (seeds[:suite.tune_seeds] if key else seeds)
    plan = [(arm, seed, value, configs(arm_cfg, seed, value))
            for arm, arm_cfg, value in first for seed in first_seeds]
    done = _execute([(cfg, _run_dir(out, arm, seed, label(value))) for arm, seed, value, cfg in plan],
                    jobs, echo, suite.name, out)
    runs = [(arm, seed, value, summary) for (arm, seed, value, _), summary in zip(plan, done)]
    sweep_rows: list[dict] = []
    if key:
        for arm, seed, value, summary in runs:
            rows = read_metrics(_run_dir(out, arm, seed, label(value)) / "metrics.jsonl")
            sweep_rows.append(result_row(suite, arm, seed, value, summary, rows))
        best = {arm: _best_value([r for r in sweep_rows if r["arm"] == arm]) for arm, _ in suite.arms}
        reported = seeds if held_out else seeds[len(first_seeds):]
        plan = [(arm, seed, best[arm], configs(arm_cfg, seed, best[arm]))
                for arm, arm_cfg in suite.arms for seed in reported]
        done = _execute([(cfg, _run_dir(out, arm, seed, label(value)))
                         for arm, seed, value, cfg in plan], jobs, echo, suite.name, out)
        runs = [] if held_out else [r for r in runs if r[2] == best[r[0]]]
        runs += [(arm, seed, value, summary) for (arm, seed, value, _), summary in zip(plan, done)]
        order = {arm: i for i, (arm, _) in enumerate(suite.arms)}
        runs.sort(key=lambda r: (order[r[0]], seeds.index(r[1])))
    results, curves = [], {}
    for arm, seed, value, summary in runs:
        rows = read_metrics(_run_dir(out, arm, seed, label(value)) / "metrics.jsonl")
        curves[f"{arm}/{seed}"] = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        results.append(result_row(suite, arm, seed, value, summary, rows))
    base_vals = [r["val_loss"] for r in results if r["arm"] == suite.baseline
                 and r["val_loss"] is not None]
    target = statistics.fmean(base_vals) if base_vals else None
    for r in results:
        r["target"] = target
        rows = r.pop("_rows")
        r["steps_to_target"] = _steps_to(rows, target) if target is not None else None
        r["seconds_to_target"] = _seconds_to(rows, target) if target is not None else None
    for r in sweep_rows:
        r.pop("_rows")
    write_reports(suite, out, results, curves, quick=quick, command=command,
                  elapsed=time.perf_counter() - started, base=base, overrides=overrides or {},
                  sweep=(key, sweep_rows), held_out=bool(held_out))
    return results
