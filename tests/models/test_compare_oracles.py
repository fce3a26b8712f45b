"""models.compare against hand-computed oracles: no training (``run_training`` is a stub writing
the metrics and summary a test chooses), so every number a report gives can be checked."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re

import pytest

from models.build import lr_peak_fraction, sel_anneal_fraction, warmup_outlasts_run
from models.compare import Suite, run_suite
from models.config import ConfigError
from models.data import load_corpus


def _stub_training(monkeypatch, curve, diagnostics=None):
    """``run_training`` replaced: ``curve(cfg)`` gives the run's validation losses at steps 0,
    eval_interval, 2 eval_interval, ... (``None``: the run diverged there; ``"train"``: its
    training loss went non-finite in the step after the previous evaluation); the metrics rows,
    ``config.json``, ``corpus.json`` and ``summary.json`` are written as the trainer writes them
    (``diagnostics(cfg, i)``: the diagnostics of the ``i``-th evaluation, a value that is not
    finite logged as null, as the trainer logs it). Returns the list of ``(arm settings...,
    seed)`` trained, in order."""
    trained = []

    def run_training(cfg, run_dir, echo=False):
        trained.append((cfg.lr, cfg.seed))
        run_dir.mkdir(parents=True, exist_ok=True)
        losses = curve(cfg)
        rows, diverged, last = [], False, None
        for i, v in enumerate(losses):
            step = i * cfg.eval_interval
            if v == "train":  # as the trainer logs a step whose training loss is not finite
                step = rows[-1]["step"] + 1
                rows.append({"step": step, "train_loss": None, "lr": cfg.lr,
                             "tokens": rows[-1]["tokens"], "diverged": True})
                diverged = True
                break
            if v is None:
                rows.append({"step": step, "tokens": step * 100, "val_loss": None, "diverged": True})
                diverged = True
                break
            row = {"step": step, "tokens": step * 100, "val_loss": v}
            if diagnostics is not None:
                row.update({k: x if math.isfinite(x) else None
                            for k, x in diagnostics(cfg, i).items()})
            if step:
                row.update(train_loss=v, tokens_per_s=1000.0)
            rows.append(row)
            last = v
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
        (run_dir / "corpus.json").write_text(json.dumps(
            {"spec": cfg.corpus, "fingerprint": load_corpus(cfg.corpus).fingerprint}))
        summary = {"val_loss": None if diverged else last, "val_ppl": None, "diverged": diverged,
                   "finished": not diverged,
                   # a finished run ends at its steps (the reuse check reads them)
                   "steps": cfg.steps if not diverged else
                   rows[-1]["step"] - (rows[-1].get("train_loss", 0) is None), "wall_time_s": 1.0,
                   "tokens_per_s": 1000.0, "unigram_entropy": 4.0,
                   "lr_peak_fraction": lr_peak_fraction(cfg),
                   "warmup_outlasts_run": warmup_outlasts_run(cfg) is not None,
                   "sel_anneal_fraction": sel_anneal_fraction(cfg)}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr("models.compare.runner.run_training", run_training)
    return trained


def _csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _swept_suite(values, **kwargs) -> Suite:
    return Suite(name="mini", baseline="a", arms=(("a", {}),), seeds=(0, 1),
                 sweep=("lr", values), quick_sweep=("lr", values), tuning_seeds=(7, 8, 9), **kwargs)


def test_a_swept_value_whose_every_tuning_run_diverged_is_never_chosen(tmp_path, monkeypatch):
    """lr 0.1 diverges on all three tuning seeds, lr 0.01 on one of them (the others end at 2.5
    and 2.6): 0.01 is the best value. The old score gave an all-diverged value a mean of 0.0, so
    among values that each have a diverged run it won, and the arm was reported (5/5 diverged
    in a real suite) at a value that never finished."""
    def curve(cfg):
        if cfg.lr == 0.1 or (cfg.lr == 0.01 and cfg.seed == 7):
            return [4.0, None]
        return [4.0, 3.0, 2.5 if cfg.seed != 9 else 2.6]
    _stub_training(monkeypatch, curve)
    results = run_suite(_swept_suite((0.01, 0.1)), tmp_path, seeds=(0, 1), echo=False)
    assert [r["swept"] for r in results] == [0.01, 0.01]
    assert not any(r["diverged"] for r in results)
    assert "| a | 0.01 | 2.5000 ± 0.0000 |" in (tmp_path / "results.md").read_text()


def test_a_swept_value_with_fewer_diverged_tuning_runs_ranks_first(tmp_path, monkeypatch):
    """lr 0.01: one of three tuning runs diverged, the others 2.6; lr 0.03: two diverged, the
    third 2.5. The value that finished on two seeds is chosen, not the one whose mean rests on
    the single seed that survived."""
    def curve(cfg):
        if (cfg.lr == 0.01 and cfg.seed == 7) or (cfg.lr == 0.03 and cfg.seed != 9):
            return [4.0, None]
        return [4.0, 2.6 if cfg.lr == 0.01 else 2.5]
    _stub_training(monkeypatch, curve)
    results = run_suite(_swept_suite((0.01, 0.03)), tmp_path, seeds=(0, 1), echo=False)
    assert [r["swept"] for r in results] == [0.01, 0.01]


@pytest.mark.parametrize("seeds, tuning", [((0, 0, 1), (7, 8, 9)), ((0, 1), (7, 7))])
def test_a_repeated_seed_is_refused(tmp_path, monkeypatch, seeds, tuning):
    """``--seeds 0 0 1`` ran seed 0 once (one run directory, reused) and reported it twice: the
    arm's mean weighted it double and its std and standard errors were those of three seeds
    (mean ± std over [2.0, 2.0, 2.3]: 2.1000 ± 0.1732, against 2.1500 ± 0.2121 over its two
    seeds)."""
    trained = _stub_training(monkeypatch, lambda cfg: [4.0, 2.0 + 0.3 * (cfg.seed == 1)])
    suite = dataclasses.replace(_swept_suite((0.01,)), tuning_seeds=tuning)
    name, given, repeated = ("seeds", seeds, 0) if seeds[0] == seeds[1] else ("tuning seeds", tuning, 7)
    with pytest.raises(ConfigError, match=re.escape(f"{name} {list(given)} repeat [{repeated}]; give each seed once")):
        run_suite(suite, tmp_path, seeds=seeds, echo=False)
    assert trained == [] and not tmp_path.joinpath("results.md").exists()


def test_swept_values_that_print_alike_train_and_report_apart(tmp_path, monkeypatch):
    """0.01 and 0.01000001 are one name under ``:g`` ("lr=0.01"): both trained into one run
    directory, the second (0.01000001, a loss of 3.0) over the first (0.01, 2.5), so the
    reported seeds 0 and 1 at the chosen 0.01 read 0.01000001's curve: the baseline missed its
    own target (2.5) on them, "25 (1/3)" steps to target instead of "25 (3/3)", and a re-run
    trained the overwritten runs again. Each value now has its own folder (``repr`` where
    ``:g`` loses digits); ordinary values keep their ``:g`` names."""
    trained = _stub_training(monkeypatch, lambda cfg: [4.0, 2.5 if cfg.lr == 0.01 else 3.0])
    suite = dataclasses.replace(_swept_suite((0.01, 0.01000001)), seeds=(0, 1, 2), tuning_seeds=(),
                                tune_seeds=2)
    results = run_suite(suite, tmp_path, seeds=(0, 1, 2), echo=False)
    assert [(r["swept"], r["val_loss"], r["steps_to_target"]) for r in results] == [(0.01, 2.5, 25)] * 3
    for folder, lr in (("lr=0.01", 0.01), ("lr=0.01000001", 0.01000001)):
        for seed in (0, 1):
            run_dir = tmp_path / "a" / folder / f"seed{seed}"
            assert json.loads((run_dir / "config.json").read_text())["lr"] == lr
    md = (tmp_path / "results.md").read_text()
    assert "| a | 0.01 | 2.5000 ± 0.0000 |" in md and "| 25 (3/3) |" in md
    assert "| arm | lr=0.01 | lr=0.01000001 |" in md
    del trained[:]
    run_suite(suite, tmp_path, seeds=(0, 1, 2), echo=False)
    assert trained == []  # every run found again
    # ordinary values keep the names of existing --out folders
    from models.compare.results import value_label
    assert [value_label(v) for v in (0.003, 0.01, 1e-4, 3e-4, 1e-5, 1.0, 0.1)] == [
        "0.003", "0.01", "0.0001", "0.0003", "1e-05", "1", "0.1"]


def test_each_attention_entropy_header_names_its_quantity(tmp_path, monkeypatch):
    """"min attn entropy" headed the last evaluation's smallest layer entropy in the spheret
    suites (``attention_entropy_min``: 1.5 here) and the smallest over the whole run in the
    manifolds suite (``min_attention_entropy``: 0.5 here, at the middle evaluation): one header,
    two quantities. Each header now says which (and no header names two result keys)."""
    from models.compare.reports import REPORT_COLUMNS
    keys_of: dict = {}
    for columns in REPORT_COLUMNS.values():
        for header, key in columns:
            keys_of.setdefault(header, set()).add(key)
    assert {h: k for h, k in keys_of.items() if len(k) > 1} == {}
    _stub_training(monkeypatch, lambda cfg: [4.0, 3.0, 2.5],
                   diagnostics=lambda cfg, i: {"attention_entropy_min": (3.0, 0.5, 1.5)[i]})
    for name, header, cell in (("spheret-mini", "final min attn entropy", "1.500"),
                               ("manifolds-mini", "min attn entropy over run", "0.500")):
        suite = Suite(name=name, baseline="a", arms=(("a", {}),), seeds=(0, 1))
        run_suite(suite, tmp_path / name, echo=False)
        lines = (tmp_path / name / "results.md").read_text().splitlines()
        head, row = ([c.strip() for c in next(x for x in lines if x.startswith(start)).strip("| ").split("|")]
                     for start in ("| arm |", "| a |"))
        assert header in head and row[head.index(header)] == cell


def test_a_mean_over_fewer_seeds_than_the_arm_ran_says_how_many(tmp_path, monkeypatch):
    """Seed 1's step angle at the last evaluation was NaN (logged as null), and the column's
    mean (0.2 and 0.4: 0.300) silently averaged 2 of the 3 seeds the row reports. The cell now
    reads "0.300 (2/3; 1 non-finite)"; a column every seed has reads as before, one no seed has
    (this model has no attention statistics) "—"."""
    def diagnostics(cfg, i):
        angle = (0.2, math.nan, 0.4)[cfg.seed] if i == 2 else 0.1
        return {"step_angle_mean": angle, "step_angle_max": 0.5}
    _stub_training(monkeypatch, lambda cfg: [4.0, 3.0, 2.5], diagnostics=diagnostics)
    suite = Suite(name="spheret-mini", baseline="a", arms=(("a", {}),), seeds=(0, 1, 2))
    run_suite(suite, tmp_path, echo=False)
    assert [r["step_angle_mean"] for r in _csv(tmp_path / "results.csv")] == ["0.2", "nan", "0.4"]
    assert "| 0.300 (2/3; 1 non-finite) | 0.500 | — |" in (tmp_path / "results.md").read_text()


def test_the_trainer_logs_a_non_finite_diagnostic_as_measured(tmp_path):
    """The trainer's half of the reports' marks: diagnostics() dropped a value that was not
    finite, so metrics.jsonl could not tell "NaN at this evaluation" from "this model has no
    such statistic". With q and k maps scaled by 1e20 (finite norms) the attention logits
    overflow: the largest logit and the smallest entropy are None (null in metrics.jsonl); a
    pre-LN model still has no step angles."""
    import torch

    from models.config import build_config
    from models.data import load_corpus
    from models.evaluation import diagnostics
    from models.gpt import GPT

    cfg = build_config("smoke", overrides={"corpus": "synthetic:20000", "connection": "pre-ln"})
    model = GPT(dataclasses.replace(cfg.model, vocab_size=256))
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q.weight.mul_(1e20)
            block.attn.k.weight.mul_(1e20)
    out = diagnostics(model, load_corpus(cfg.corpus), cfg, torch.device("cpu"))
    for key in ("max_attention_logit", "attention_entropy_min"):
        assert key in out and out[key] is None, key
    assert math.isfinite(out["q_spectral_norm_max"]) and "step_angle_mean" not in out


def test_a_column_no_seed_has_a_finite_value_of_reads_apart_from_one_never_recorded(
        tmp_path, monkeypatch):
    """Every seed's step angle at the last evaluation was NaN: the cell read "—", as the column
    of a statistic the model does not have (this stub's attention entropy) reads. It now reads
    "non-finite (2/2)", and results.md says what each mark means."""
    def diagnostics(cfg, i):
        return {"step_angle_mean": math.nan if i == 2 else 0.1, "step_angle_max": 0.5}
    _stub_training(monkeypatch, lambda cfg: [4.0, 3.0, 2.5], diagnostics=diagnostics)
    suite = Suite(name="spheret-mini", baseline="a", arms=(("a", {}),), seeds=(0, 1))
    run_suite(suite, tmp_path, echo=False)
    md = (tmp_path / "results.md").read_text()
    assert "| non-finite (2/2) | 0.500 | — |" in md
    assert ("\"non-finite (m/n)\" where no run's value is finite; — where no run has a value (a "
            "diagnostic the arm's model does not have, a target no run reached)") in md
    assert [r["step_angle_mean"] for r in _csv(tmp_path / "results.csv")] == ["nan", "nan"]


def test_a_mean_loss_past_exps_range_reports_an_infinite_perplexity(tmp_path, monkeypatch):
    """A finished run (not diverged: its loss is finite) ending at 800 nats: math.exp(800)
    raised OverflowError in the report, after results.csv was written and before results.md.
    The "val ppl" cell now reads "inf"; the other arm's 2.5 reads exp(2.5) = 12.18."""
    _stub_training(monkeypatch, lambda cfg: [4.0, 800.0 if cfg.lr == 1.0 else 2.5])
    suite = Suite(name="mini", baseline="a", arms=(("a", {}), ("b", {"lr": 1.0})), seeds=(0, 1))
    results = run_suite(suite, tmp_path, echo=False)
    assert [r["diverged"] for r in results] == [False] * 4
    md = (tmp_path / "results.md").read_text()
    assert "| a | 2.5000 ± 0.0000 | 12.18 |" in md and "| b | 800.0000 ± 0.0000 | inf |" in md


def test_steps_to_target_count_a_run_that_diverged_after_reaching_it(tmp_path, monkeypatch):
    """Kept semantics, now stated: the baseline ends at 2.5 (the target); arm b reaches 2.4 at
    step 25 on both seeds, and seed 1 then diverges at step 50. Its steps to target are 25 on
    both seeds ("25 (2/2)", with "1/2" diverged beside it); results.md says a run that diverged
    after reaching the target is included. A run that diverged before reaching it has none."""
    def curve(cfg):
        if cfg.lr == 1.0:
            return [4.0, 2.4, None] if cfg.seed == 1 else [4.0, 2.4, 2.3]
        if cfg.lr == 2.0:
            return [4.0, None]
        return [4.0, 3.0, 2.5]
    _stub_training(monkeypatch, curve)
    suite = Suite(name="mini", baseline="a", arms=(("a", {}), ("b", {"lr": 1.0}), ("c", {"lr": 2.0})),
                  seeds=(0, 1))
    results = run_suite(suite, tmp_path, echo=False)
    assert [(r["arm"], r["diverged"], r["steps_to_target"]) for r in results] == [
        ("a", False, 50), ("a", False, 50), ("b", False, 25), ("b", True, 25), ("c", True, None),
        ("c", True, None)]
    md = (tmp_path / "results.md").read_text()
    assert "| b | 2.3000 | 9.97 | 1/2 | 1/2 | 25 (2/2) |" in md
    assert "a run that diverged after reaching it included" in md


def test_an_extreme_over_a_run_with_a_non_finite_evaluation_is_marked(tmp_path, monkeypatch):
    """The extremes over a run skipped an evaluation whose value was not finite: seed 0's
    attention logit overflowed at step 25 (logged as null) and its peak read 6.0, the largest
    finite one, so arm a's "peak attn logit" read 6.500, a bounded run; arm b's validation loss
    went NaN at step 50 and its "max val rise" read 0.000 (the rise before it). Such an extreme
    is now NaN ("nan" in results.csv) and its cell says so; other columns are unchanged."""
    def diagnostics(cfg, i):
        logit = (5.0, math.inf if cfg.seed == 0 else 7.0, 6.0)[i]
        return {"max_attention_logit": logit, "attention_entropy_min": (3.0, 0.5, 1.5)[i]}
    _stub_training(monkeypatch, lambda cfg: [4.0, 3.0, None] if cfg.lr == 1.0 else [4.0, 3.0, 2.5],
                   diagnostics=diagnostics)
    suite = Suite(name="manifolds-mini", baseline="a", arms=(("a", {}), ("b", {"lr": 1.0})),
                  seeds=(0, 1))
    run_suite(suite, tmp_path, echo=False)
    lines = (tmp_path / "results.md").read_text().splitlines()
    head, a, b = ([c.strip() for c in next(x for x in lines if x.startswith(start)).strip("| ").split("|")]
                  for start in ("| arm |", "| a |", "| b |"))
    assert a[head.index("peak attn logit")] == "7.000 (1/2; 1 non-finite)"
    assert a[head.index("min attn entropy over run")] == "0.500"
    assert a[head.index("max val rise")] == "0.000"
    assert b[head.index("max val rise")] == "non-finite (2/2)" and b[head.index("diverged")] == "2/2"
    rows = _csv(tmp_path / "results.csv")
    assert [(r["arm"], r["peak_attention_logit"], r["val_rise_max"]) for r in rows] == [
        ("a", "nan", "0.0"), ("a", "7.0", "0.0"), ("b", "nan", "nan"), ("b", "7.0", "nan")]


def test_a_run_that_diverged_between_evaluations_has_no_bounded_val_rise(tmp_path, monkeypatch):
    """The trainer stops a run whose training loss goes non-finite at that step, with a row
    ``{"train_loss": null, "diverged": true}`` and no evaluation: arm b's seed 1 evaluated 4.0
    and 3.0, then diverged at step 26 (between evaluations, where a run evaluated every few
    steps is most often caught). Its val_rise_max read 0.0, the rise of its finite evaluations,
    so the stress suite's "max val rise" read "0.000" for b as for the healthy arm a, beside
    "1/2" diverged. A diverged run's rise is now NaN (its loss left every bound after its last
    evaluation): the cell reads "0.000 (1/2; 1 non-finite)"."""
    _stub_training(monkeypatch, lambda cfg: [4.0, 3.0, "train"] if (cfg.lr, cfg.seed) == (1.0, 1)
                   else [4.0, 3.0, 2.5])
    suite = Suite(name="spheret-stress", baseline="a", arms=(("a", {}), ("b", {"lr": 1.0})),
                  seeds=(0, 1))
    run_suite(suite, tmp_path, echo=False)
    lines = (tmp_path / "results.md").read_text().splitlines()
    head, a, b = ([c.strip() for c in next(x for x in lines if x.startswith(start)).strip("| ").split("|")]
                  for start in ("| arm |", "| a |", "| b |"))
    assert a[head.index("max val rise")] == "0.000" and b[head.index("diverged")] == "1/2"
    assert b[head.index("max val rise")] == "0.000 (1/2; 1 non-finite)"
    assert [(r["arm"], r["seed"], r["val_rise_max"]) for r in _csv(tmp_path / "results.csv")] == [
        ("a", "0", "0.0"), ("a", "1", "0.0"), ("b", "0", "0.0"), ("b", "1", "nan")]


def test_a_diverged_runs_evaluation_values_are_set_aside_from_the_arms_mean(tmp_path, monkeypatch):
    """Arm b's seed 1 evaluated at steps 0 and 25 (attention logit 5.0, 9.0; max attention
    probability 0.9 at step 25) and then diverged between evaluations; seed 0 finished (peak
    logit 7.0, final probability 0.5 at step 50). The "peak attn logit" cell averaged the two,
    8.000, and "final max attn prob" 0.700: a peak over half the run and a step-25 value taken
    for a final one, beside the healthy arm's, with only "1/2" diverged to say so. The diverged
    run is now set aside in those columns ("7.000 (1/2; 1 diverged)", "0.500 (1/2; 1
    diverged)"); arm c, diverged on both seeds, reads "diverged (2/2)"; results.csv keeps
    every run's own value."""
    def curve(cfg):
        if cfg.lr == 2.0 or (cfg.lr == 1.0 and cfg.seed == 1):
            return [4.0, 3.0, "train"]
        return [4.0, 3.0, 2.5]

    def diagnostics(cfg, i):
        bad = cfg.lr == 2.0 or (cfg.lr == 1.0 and cfg.seed == 1)
        return {"max_attention_logit": ((5.0, 9.0) if bad else (5.0, 6.0, 7.0))[i],
                "attention_max_prob": ((0.3, 0.9) if bad else (0.3, 0.4, 0.5))[i]}
    _stub_training(monkeypatch, curve, diagnostics=diagnostics)
    suite = Suite(name="manifolds-mini", baseline="a",
                  arms=(("a", {}), ("b", {"lr": 1.0}), ("c", {"lr": 2.0})), seeds=(0, 1))
    run_suite(suite, tmp_path, echo=False)
    md = (tmp_path / "results.md").read_text()
    lines = md.splitlines()
    head, a, b, c = ([x.strip() for x in next(y for y in lines if y.startswith(s)).strip("| ").split("|")]
                     for s in ("| arm |", "| a |", "| b |", "| c |"))
    assert (a[head.index("peak attn logit")], a[head.index("final max attn prob")]) == ("7.000", "0.500")
    assert b[head.index("diverged")] == "1/2"
    assert b[head.index("peak attn logit")] == "7.000 (1/2; 1 diverged)"
    assert b[head.index("final max attn prob")] == "0.500 (1/2; 1 diverged)"
    assert c[head.index("peak attn logit")] == "diverged (2/2)"
    assert c[head.index("max val rise")] == "non-finite (2/2)"  # NaN for a diverged run, as before
    assert "\"m diverged\" counts the runs that diverged" in md
    rows = _csv(tmp_path / "results.csv")
    assert [(r["arm"], r["peak_attention_logit"]) for r in rows] == [
        ("a", "7.0"), ("a", "7.0"), ("b", "7.0"), ("b", "9.0"), ("c", "9.0"), ("c", "9.0")]


def test_stop_at_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """``--stop_at 1`` ran every arm to step 1 of its 50-step schedule and results.md reported
    those runs' losses as the arms' final ones (nothing said they were cut short); a second run
    of the suite trained them all again (only finished runs are reused). Now refused, naming
    the value, the schedule and --steps, before anything is trained or written."""
    trained = _stub_training(monkeypatch, lambda cfg: [4.0, 3.0, 2.5])
    suite = Suite(name="mini", baseline="a", arms=(("a", {}), ("b", {"lr": 1.0})), seeds=(0,))
    with pytest.raises(ConfigError, match=r"suite 'mini': --stop_at 1 would stop every run at step "
                       r"1 of its 300-step schedule .*give --steps 1 for shorter runs"):
        run_suite(suite, tmp_path / "out", overrides={"stop_at": "1"}, echo=False)
    assert trained == [] and not (tmp_path / "out").exists()
    from models.compare import main as compare_main
    assert compare_main(["--suite", "manifolds-high-lr", "--out", str(tmp_path / "cli"),
                         "--stop_at", "5"]) == 2
    assert "--stop_at 5 would stop every run at step 5" in capsys.readouterr().err
    assert trained == [] and not (tmp_path / "cli").exists()
    run_suite(suite, tmp_path / "out", overrides={"stop_at": "0"}, echo=False)  # the default
    assert len(trained) == 2


@pytest.mark.parametrize("version", [None, 1])
def test_a_finished_run_of_the_old_lr_schedule_is_trained_again(tmp_path, monkeypatch, version):
    """A run finished before ``lr_schedule_version`` (its config.json has none: the cosine
    that repeats its peak and ends above ``min_lr_ratio``) matched a new request of the same
    settings and was reported as its result. Its saved configuration now reads as version 1,
    not the request's 2: that run is trained again (and saved at 2), the other arm reused."""
    trained = _stub_training(monkeypatch, lambda cfg: [4.0, 3.0])
    monkeypatch.setattr("models.plotting.plot_curves", lambda *args, **kwargs: None)  # not read
    small = {"corpus": "synthetic:20000"}
    suite = Suite(name="mini", baseline="a", arms=(("a", {}), ("b", {"lr": 0.02})), seeds=(0,))
    run_suite(suite, tmp_path, echo=False, overrides=small)
    path = tmp_path / "a" / "seed0" / "config.json"
    saved = {k: v for k, v in json.loads(path.read_text()).items() if k != "lr_schedule_version"}
    path.write_text(json.dumps(saved if version is None else {**saved, "lr_schedule_version": 1}))
    del trained[:]
    run_suite(suite, tmp_path, echo=False, overrides=small)
    assert trained == [(saved["lr"], 0)]
    assert json.loads(path.read_text())["lr_schedule_version"] == 2
