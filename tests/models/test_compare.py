"""Comparison suites: arm definitions, reports, missing modules; ``--quick`` end to end (slow)."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from models import compare
from models.compare import SUITES, Suite, run_suite
from models.compare.suites import REFERENCE_POLICIES, SEL_SHORT_SCHEDULES
from models.config import ConfigError
from models.train import MissingModuleError

REPO = Path(__file__).resolve().parents[2]


def test_suites_cover_the_arms_of_the_issue():
    spheret = dict(SUITES["spheret"].arms)
    for name in ("pre-ln", "peri-ln", "pre-dyt", "keel", "geonorm"):
        assert spheret[name] == {"connection": name}
    assert sorted(a["p"] for n, a in spheret.items() if a.get("retraction") == "p") == [1.0, 1.0, 2.0]
    assert spheret["spheret-p1-literal"]["sphere_step"] == "literal"  # the seed's own update
    stress = dict(SUITES["spheret-stress"].arms)
    assert "pre-ln @stress" in stress and "spheret-p1 @stress" in stress
    assert all(a["lr"] > compare.FULL_BASE["lr"] for a in stress.values())
    manifolds = SUITES["manifolds"]
    assert [(n, a["policy"], a.get("muon_recipe", "library")) for n, a in manifolds.arms] == [
        (p, p, "library") for p in ("unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv")] + [
        (f"{p}-reference", p, "reference") for p in ("all-dgram", "hetero", "hetero-inv")]  # the paper's code
    # seed 002's base and an lr budget in which singular values can grow far past 1
    assert manifolds.full["connection"] == "pre-ln" and manifolds.full["schedule"] == "constant"
    key, lrs = manifolds.sweep
    assert key == "lr" and max(lrs) * manifolds.full["steps"] >= 10
    # tuned on three held-out seeds (one seed's best lr can be an outlier seed's), none reported
    assert len(manifolds.tuning_seeds) >= 3 and not set(manifolds.tuning_seeds) & set(manifolds.seeds)
    high = SUITES["manifolds-high-lr"]
    assert high.full["lr"] * high.full["steps"] >= 10 and high.arms == manifolds.arms
    sel_suite = SUITES["sel"]
    assert [a["sel"] for _, a in sel_suite.arms] == [
        "none", "none", "none", "none", "mismatched", "congruent", "no-linear", "mismatched"]
    # the baseline also on shorter cosine schedules, each shorter than the full run
    short = [a["schedule_fraction"] for n, a in sel_suite.arms if n.endswith(" schedule")]
    assert short and all(0 < f < 1 for f in short)
    assert sel_suite.full["sel_anneal_steps"] > 0  # the seed's scale-lr annealing is on...
    assert dict(sel_suite.arms)["sel-mismatched-no-anneal"]["sel_anneal_steps"] == 0  # ...but one
    # each arm at its own block-matrix lr, bracketing the shared lr everything else takes
    key, lrs = sel_suite.sweep
    assert key == "block_lr" and min(lrs) < sel_suite.full["lr"] < max(lrs)
    assert sel_suite.full["lr"] in lrs      # the seed's one shared lr is a column of the grid
    shared = SUITES["sel-shared-lr"]        # the seed's protocol: the same arms, one lr for all
    assert shared.arms == sel_suite.arms and shared.sweep == ("lr", lrs)
    assert "lr" not in shared.full and "block_lr" not in shared.full
    for suite in SUITES.values():           # every arm is a valid configuration
        assert suite.baseline in dict(suite.arms)
        assert len(suite.seeds) >= 3
        values = (suite.sweep or (None, (None,)))[1]
        assert len(compare.suite_configs(suite)) == len(suite.arms) * len(values)  # each builds as run


def test_val_rise_max_is_the_largest_relapse_above_the_running_minimum():
    assert compare.val_rise_max([3.0, 2.5, 2.7, 2.2, 2.9, 2.1]) == pytest.approx(0.7)
    assert compare.val_rise_max([3.0, 2.5, 2.0]) == 0.0          # only improving
    # a loss that went non-finite: no bounded rise (0.4, the rise before it, read as one)
    assert math.isnan(compare.val_rise_max([2.0, 2.4, math.nan, 9.0]))
    assert compare.val_rise_max([2.0, 2.4, math.inf]) == compare.val_rise_max([math.inf]) == math.inf
    assert compare.val_rise_max([]) is None


def test_a_result_row_reads_the_summary_and_the_runs_evaluations():
    from models.compare.results import by_swept_value, result_row

    suite = Suite(name="mini", arms=(("a", {}),), baseline="a")
    rows = [{"step": 0, "val_loss": 5.5, "max_attention_logit": 1.0},   # the initial model
            {"step": 5, "train_loss": 4.0},                            # a training row
            {"step": 10, "val_loss": 6.0, "max_attention_logit": 9.0},  # a spike above it
            {"step": 20, "val_loss": 2.5, "max_attention_logit": 4.0}]
    summary = {"val_loss": 2.5, "val_ppl": 12.2, "unigram_entropy": 3.26, "steps": 20,
               "lr_peak_fraction": 0.5, "warmup_outlasts_run": True, "sel_anneal_fraction": 0.25,
               "wall_time_s": 1.234, "tokens_per_s": 99.96}
    r = result_row(suite, "a", 7, 0.01, summary, rows)
    assert (r["suite"], r["arm"], r["seed"], r["swept"]) == ("mini", "a", 7, 0.01)
    assert r["val_loss"] == 2.5 and r["learned"] and not r["diverged"]
    assert (r["lr_peak_fraction"], r["warmup_outlasts_run"], r["sel_anneal_fraction"]) == (0.5, True, 0.25)
    assert r["max_attention_logit"] == 4.0 and r["peak_attention_logit"] == 9.0  # last, peak
    assert r["val_rise_max"] == pytest.approx(0.5) and r["_rows"] is rows
    gone = result_row(suite, "a", 7, 0.01, {**summary, "diverged": True}, rows)
    assert gone["val_loss"] is None and gone["val_ppl"] is None and not gone["learned"]
    grouped = by_swept_value([{"swept": 0.1, "k": 1}, {"swept": 0.01, "k": 2},
                              {"swept": 0.1, "k": 3}])
    assert list(grouped) == [0.1, 0.01] and [r["k"] for r in grouped[0.1]] == [1, 3]


def test_learned_means_clearly_below_the_unigram_entropy():
    # Keel's 3.226 on stdlib bytes (unigram entropy 3.261) learned the token frequencies only
    assert not compare.learned(3.226, 3.261)
    assert compare.learned(3.261 - compare.LEARNED_MARGIN, 3.261) and compare.learned(2.3, 3.261)
    assert not compare.learned(None, 3.261)


def test_sweep_tuned_on_several_seeds_picks_by_their_mean(tmp_path):
    suite = Suite(name="mini", baseline="pre-ln", seeds=(0, 1, 2), tune_seeds=2,
                  sweep=("lr", (1e-5, 2e-2)), quick_sweep=("lr", (1e-5, 2e-2)),
                  arms=(("pre-ln", {"connection": "pre-ln"}),))
    overrides = {"steps": "12", "eval_interval": "6", "n_layer": "1"}
    results = run_suite(suite, tmp_path / "a", quick=True, seeds=(0, 1, 2), echo=False,
                        overrides=overrides)
    with open(tmp_path / "a" / "sweep.csv") as f:
        sweep = [(r["seed"], float(r["swept"]), float(r["val_loss"])) for r in csv.DictReader(f)]
    assert sorted((seed, lr) for seed, lr, _ in sweep) == [
        ("0", 1e-5), ("0", 2e-2), ("1", 1e-5), ("1", 2e-2)]
    # the tuning seeds' runs at the chosen value are reported, the third seed runs only there
    assert [(r["seed"], r["swept"]) for r in results] == [(0, 2e-2), (1, 2e-2), (2, 2e-2)]
    assert not (tmp_path / "a" / "pre-ln" / "lr=1e-05" / "seed2").exists()
    md = (tmp_path / "a" / "results.md").read_text()
    mean = statistics.fmean(v for _, lr, v in sweep if lr == 2e-2)
    assert "Sweep of `lr` (mean over seeds 0, 1;" in md and f"| {mean:.4f} |" in md


def test_held_out_tuning_reports_only_seeds_the_choice_did_not_see(tmp_path):
    suite = Suite(name="mini", baseline="pre-ln", seeds=(0, 1), tuning_seeds=(5, 6),
                  sweep=("lr", (1e-5, 2e-2)), quick_sweep=("lr", (1e-5, 2e-2)),
                  arms=(("pre-ln", {"connection": "pre-ln"}),))
    overrides = {"steps": "12", "eval_interval": "6", "n_layer": "1"}
    results = run_suite(suite, tmp_path / "a", quick=False, seeds=(0, 1), echo=False,
                        overrides={**overrides, "corpus": "synthetic:20000", "n_embd": "16", "n_head": "2",
                                   "block_size": "16", "batch_size": "4"})
    with open(tmp_path / "a" / "sweep.csv") as f:
        sweep = sorted((r["seed"], float(r["swept"])) for r in csv.DictReader(f))
    assert sweep == [("5", 1e-5), ("5", 2e-2), ("6", 1e-5), ("6", 2e-2)]  # the tuning seeds only
    assert [(r["seed"], r["swept"]) for r in results] == [(0, 2e-2), (1, 2e-2)]  # reported: the others
    md = (tmp_path / "a" / "results.md").read_text()
    assert "chosen on seeds 5, 6 and is reported above on seeds 0, 1" in md
    with pytest.raises(ConfigError, match=r"tuning seeds \[1\] are also reported seeds"):
        run_suite(dataclasses.replace(suite, tuning_seeds=(1, 6)), tmp_path / "b", seeds=(0, 1), echo=False,
                  overrides=overrides)


def test_more_tuning_seeds_than_reported_seeds_is_refused(tmp_path):
    # --tune_seeds 3 with two reported seeds used to tune on two (seeds[:3]) without a word
    suite = Suite(name="mini", baseline="pre-ln", seeds=(0, 1), tune_seeds=3,
                  sweep=("lr", (1e-5, 2e-2)), quick_sweep=("lr", (1e-5, 2e-2)),
                  arms=(("pre-ln", {"connection": "pre-ln"}),))
    with pytest.raises(ConfigError, match=r"--tune_seeds 3 tunes on the first 3 reported seeds, but there are 2 "
                                          r"\(\[0, 1\]\); give at least 3 --seeds"):
        run_suite(suite, tmp_path / "c", quick=False, seeds=(0, 1), echo=False,
                  overrides={"steps": "4", "corpus": "synthetic:20000"})
    assert not list((tmp_path / "c").rglob("summary.json"))  # refused before any run


@pytest.mark.filterwarnings("ignore:warmup_steps 5 >= steps 4:RuntimeWarning")
def test_results_md_says_which_runs_never_reached_their_learning_rate(tmp_path):
    """``--steps 4`` under the quick base's ``warmup_steps`` 5: every run warned on stderr and
    recorded ``lr_peak_fraction`` 0.8, while results.md showed their losses beside nothing that
    said so. Now a line under each table names the arms, k/n and the fraction (arm ``b``, with a
    warm-up of 2, reached its rates and is not named), and results.csv has the column; a reused
    run whose summary predates the field gets it from its config."""
    suite = Suite(name="mini", baseline="a", seeds=(0,), tuning_seeds=(5,),
                  sweep=("lr", (1e-3, 1e-2)), quick_sweep=("lr", (1e-3, 1e-2)),
                  arms=(("a", {}), ("b", {"warmup_steps": 2})))
    overrides = {"steps": "4", "eval_interval": "2", "n_layer": "1"}
    run_suite(suite, tmp_path, quick=True, echo=False, overrides=overrides)
    for again in (False, True):
        lines = (tmp_path / "results.md").read_text().splitlines()
        notes = [i for i, line in enumerate(lines) if line.startswith("Warm-up as long as the run")]
        assert len(notes) == 2, lines                  # one under each table
        reported, tuning = (lines[i] for i in notes)
        assert reported.startswith("Warm-up as long as the run or longer in 1/2 runs above")
        assert tuning.startswith("Warm-up as long as the run or longer in 2/4 tuning runs above")
        assert "`a` 1/1 at 0.8." in reported and "`a` 2/2 at 0.8." in tuning
        assert "`b`" not in reported + tuning
        for i in notes:                                 # right under its table
            assert lines[i - 1] == "" and lines[i - 2].startswith("| ")
        if not again:
            for path in tmp_path.glob("*/*/seed*/summary.json"):  # as written before the field
                summary = json.loads(path.read_text())
                del summary["lr_peak_fraction"]
                path.write_text(json.dumps(summary))
            mtime = (tmp_path / "a" / "lr=0.01" / "seed0" / "summary.json").stat().st_mtime_ns
            run_suite(suite, tmp_path, quick=True, echo=False, overrides=overrides)
            assert (tmp_path / "a" / "lr=0.01" / "seed0" / "summary.json").stat().st_mtime_ns \
                == mtime                                # reused, not trained again
    with open(tmp_path / "results.csv") as f:
        assert [(r["arm"], float(r["lr_peak_fraction"])) for r in csv.DictReader(f)] == [
            ("a", 0.8), ("b", 1.0)]


@pytest.mark.filterwarnings("ignore:warmup_steps 4 >= steps 4:RuntimeWarning")
def test_results_md_says_which_runs_warmed_up_for_their_whole_length(tmp_path):
    """``warmup_steps`` equal to ``steps``: the trainer warned (the rate peaks at the last step,
    a cosine schedule never decays) but ``lr_peak_fraction`` is 1, so results.md, which named
    only runs below it, said nothing. summary.json now records ``warmup_outlasts_run`` and the
    line under the table names such runs too (at 1); a reused run whose summary predates the
    field gets it from its config."""
    suite = Suite(name="mini", baseline="a", seeds=(0,),
                  arms=(("a", {"warmup_steps": 4}), ("b", {"warmup_steps": 2})))
    overrides = {"steps": "4", "eval_interval": "2", "n_layer": "1"}
    run_suite(suite, tmp_path, quick=True, echo=False, overrides=overrides)
    summary = tmp_path / "a" / "seed0" / "summary.json"
    assert json.loads(summary.read_text())["warmup_outlasts_run"] is True
    for again in (False, True):
        lines = (tmp_path / "results.md").read_text().splitlines()
        notes = [line for line in lines if line.startswith("Warm-up as long as the run")]
        assert len(notes) == 1, lines
        assert notes[0].startswith("Warm-up as long as the run or longer in 1/2 runs above")
        assert "`a` 1/1 at 1." in notes[0] and "`b`" not in notes[0]
        if not again:  # as written before the field
            saved = json.loads(summary.read_text())
            del saved["warmup_outlasts_run"]
            summary.write_text(json.dumps(saved))
            mtime = summary.stat().st_mtime_ns
            run_suite(suite, tmp_path, quick=True, echo=False, overrides=overrides)
            assert summary.stat().st_mtime_ns == mtime  # reused, not trained again
    with open(tmp_path / "results.csv") as f:
        assert [(r["arm"], r["lr_peak_fraction"], r["warmup_outlasts_run"])
                for r in csv.DictReader(f)] == [("a", "1.0", "True"), ("b", "1.0", "False")]


@pytest.mark.filterwarnings("ignore:sel_anneal_steps 10 >= steps 8:RuntimeWarning")
def test_results_md_says_which_runs_ended_before_their_sel_anneal(tmp_path):
    """The sel suites' ``sel_anneal_steps`` (100, or 10 under ``--quick``) does not follow
    ``--steps`` (nor does ``warmup_steps``): ``--quick --steps 8`` annealed the SEL scales' rates
    over 10 steps, past the run's end, with no word anywhere. The trainer now warns, summary.json
    records ``sel_anneal_fraction`` (7/10: the last update reads the ramp at step 7), and a line
    under each table names the arms, k/n and the fraction; the baseline (no SEL) and the
    no-anneal arm are not named."""
    suite = compare.narrow_suite(SUITES["sel"], sweep=(3e-3,), arms=(
        "baseline", "sel-mismatched", "sel-mismatched-no-anneal"))
    overrides = {"steps": "8", "warmup_steps": "2", "eval_interval": "4", "n_layer": "1"}
    with pytest.warns(RuntimeWarning, match=r"^sel_anneal_steps 10 >= steps 8: .* 7/10 = 0\.7 "):
        run_suite(suite, tmp_path, quick=True, echo=False, overrides=overrides)
    summary = json.loads((tmp_path / "sel-mismatched" / "block_lr=0.003" / "seed0"
                          / "summary.json").read_text())
    assert summary["sel_anneal_fraction"] == pytest.approx(0.7)
    assert summary["warnings"][0].startswith("sel_anneal_steps 10 >= steps 8: ")
    lines = (tmp_path / "results.md").read_text().splitlines()
    notes = [i for i, line in enumerate(lines) if line.startswith("SEL scale annealing longer")]
    assert [lines[i].split(" (")[0] for i in notes] == [
        "SEL scale annealing longer than the run in 1/3 runs above",
        "SEL scale annealing longer than the run in 1/3 tuning runs above"]
    for i in notes:
        assert "`sel-mismatched` 1/1 at 0.7." in lines[i] and "`baseline`" not in lines[i]
        assert "no-anneal" not in lines[i] and lines[i - 1] == ""
    assert not any(line.startswith("Warm-up") for line in lines)
    with open(tmp_path / "results.csv") as f:
        assert [(r["arm"], r["sel_anneal_fraction"]) for r in csv.DictReader(f)] == [
            ("baseline", ""), ("sel-mismatched", "0.7"), ("sel-mismatched-no-anneal", "")]


@pytest.mark.slow  # about 15 s: a sweep of two arms, run twice (one and two jobs)
def test_sweep_runs_each_arm_at_its_best_value_and_jobs_do_not_change_results(tmp_path):
    suite = Suite(name="mini", baseline="pre-ln", seeds=(0, 1), sweep=("lr", (1e-5, 2e-2)),
                  quick_sweep=("lr", (1e-5, 2e-2)),
                  arms=(("pre-ln", {"connection": "pre-ln"}), ("spheret", {"connection": "spheret"})))
    overrides = {"steps": "12", "eval_interval": "6", "n_layer": "1"}
    results = run_suite(suite, tmp_path / "a", quick=True, seeds=(0, 1), echo=False,
                        overrides=overrides)
    # 1e-5 barely moves in 12 steps: both arms pick 2e-2, and both seeds are reported at it
    assert [(r["arm"], r["seed"], r["swept"]) for r in results] == [
        ("pre-ln", 0, 2e-2), ("pre-ln", 1, 2e-2), ("spheret", 0, 2e-2), ("spheret", 1, 2e-2)]
    with open(tmp_path / "a" / "sweep.csv") as f:
        sweep = list(csv.DictReader(f))
    assert sorted((r["arm"], float(r["swept"])) for r in sweep) == [
        ("pre-ln", 1e-5), ("pre-ln", 2e-2), ("spheret", 1e-5), ("spheret", 2e-2)]
    assert not (tmp_path / "a" / "pre-ln" / "lr=1e-05" / "seed1").exists()  # losers: one seed
    md = (tmp_path / "a" / "results.md").read_text()
    assert "Sweep of `lr`" in md and "| best lr |" in md
    # diagnostics of every evaluation reach the rows
    for r in results:
        assert r["weight_kurtosis_mean"] > 0 and r["weight_max_over_std"] > 1
        assert 0 < r["attention_entropy_min"] and 0 < r["attention_max_prob"] <= 1
    assert results[2]["step_angle_mean"] > 0 and results[0]["step_angle_mean"] is None
    parallel = run_suite(suite, tmp_path / "b", quick=True, seeds=(0, 1), echo=False,
                         overrides=overrides, jobs=2)
    assert [r["val_loss"] for r in parallel] == [r["val_loss"] for r in results]
    with pytest.raises(ConfigError, match="jobs must be an integer >= 1, got 0"):
        run_suite(suite, tmp_path / "c", quick=True, jobs=0)


def test_missing_module_fails_before_running_anything(tmp_path, capsys, monkeypatch):
    suite = Suite(name="future", arms=(("a", {}),), baseline="a",
                  requires=(("manifoldlib.not_written_yet", "Thing"),))
    with pytest.raises(MissingModuleError, match="manifoldlib.not_written_yet.Thing"):
        run_suite(suite, tmp_path / "out", quick=True)
    assert not (tmp_path / "out").exists()
    monkeypatch.setitem(SUITES, "sel", dataclasses.replace(SUITES["sel"],
                                                           requires=suite.requires))
    assert compare.main(["--suite", "sel", "--quick", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: suite 'sel' needs manifoldlib.not_written_yet.Thing")


def test_reports_and_steps_to_target(tmp_path):
    suite = Suite(name="mini", baseline="slow",
                  arms=(("slow", {"lr": 1e-3}), ("fast", {"lr": 1e-2})))
    results = run_suite(suite, tmp_path, quick=True, echo=False,
                        overrides={"steps": "20", "eval_interval": "5"})
    assert [(r["arm"], r["seed"]) for r in results] == [("slow", 0), ("fast", 0)]
    slow, fast = results
    assert slow["target"] == fast["target"] == slow["val_loss"]
    assert slow["steps_to_target"] == 20           # the baseline reaches its own final loss
    assert fast["val_loss"] < slow["val_loss"] and fast["steps_to_target"] < 20
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["arm"] for r in rows] == ["slow", "fast"]
    assert float(rows[1]["val_loss"]) == fast["val_loss"]
    md = (tmp_path / "results.md").read_text()
    assert "| slow |" in md and "| fast |" in md and "mean final validation loss" in md
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    for r in results:  # the rise is read from the run's own evaluations
        with open(tmp_path / r["arm"] / "seed0" / "metrics.jsonl") as f:
            vals = [row["val_loss"] for row in map(json.loads, f) if "val_loss" in row]
        want = max(v - min(vals[:i + 1]) for i, v in enumerate(vals))
        assert len(vals) == 5 and r["val_rise_max"] == pytest.approx(want, abs=1e-12)
    for r in results:  # training seconds to the target: the logged intervals' tokens / tokens_per_s
        with open(tmp_path / r["arm"] / "seed0" / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        seconds, tokens = 0.0, 0
        for row in rows:
            if row.get("tokens_per_s"):
                seconds, tokens = seconds + (row["tokens"] - tokens) / row["tokens_per_s"], row["tokens"]
            if row.get("val_loss") is not None and row["step"] == r["steps_to_target"]:
                break
        assert r["seconds_to_target"] == pytest.approx(seconds, abs=0.01)
        assert 0 < r["seconds_to_target"] <= r["wall_time_s"]
    # a second call reuses the finished runs instead of training again
    mtime = (tmp_path / "fast" / "seed0" / "summary.json").stat().st_mtime_ns
    again = run_suite(suite, tmp_path, quick=True, echo=False,
                      overrides={"steps": "20", "eval_interval": "5"})
    assert [r["val_loss"] for r in again] == [r["val_loss"] for r in results]
    assert (tmp_path / "fast" / "seed0" / "summary.json").stat().st_mtime_ns == mtime


def _available(suite: Suite) -> bool:
    for module, attr in suite.requires:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return False
        try:
            mod = __import__(module, fromlist=[attr])
        except ImportError:
            return False
        if not hasattr(mod, attr):
            return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SUITES))
def test_quick_suite_end_to_end(tmp_path, name):
    suite = SUITES[name]
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "models.compare", "--suite", name, "--quick",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=900, check=False)
    if not _available(suite):
        assert proc.returncode == 2 and "not available yet" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["arm"] for r in rows] == [a for a, _ in suite.arms for _ in suite.seeds[:1]]
    # the arm that must learn even in the tiny run: the baseline, except where the baseline is
    # built to struggle — the stress suite's (Pre-LN at lr 3e-2, no warmup, no clipping; the
    # seed's claim is that a SpheretNorm still converges) and the retraction suite's (the
    # exponential map under a large literal step, which fails to learn in the full suite too)
    must_learn = {"spheret-stress": "spheret-p1 @stress",
                  "spheret-retractions": "spheret-p2-literal"}.get(name, suite.baseline)
    reference = next(r for r in rows if r["arm"] == must_learn)
    assert reference["diverged"] == "False" and reference["learned"] == "True"
    md = (out / "results.md").read_text()
    assert all(f"| {arm} |" in md for arm, _ in suite.arms)
    assert (out / "curves.png").is_file()


def _cfgs(name: str, quick: bool = False) -> dict:
    return {(arm, value): cfg.to_dict()
            for arm, value, cfg in compare.suite_configs(SUITES[name], quick=quick)}


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("name", sorted(SUITES))
def test_arms_differ_exactly_in_what_they_name(name, quick):
    # built as run_suite builds them (no training): no two arms or swept values are one
    # configuration, and two arms differ only in keys their own overrides (or the sweep) set
    suite = SUITES[name]
    named = dict(suite.arms)
    sweep = suite.quick_sweep if quick else suite.sweep
    sweep_key = sweep[0] if sweep else None
    cfgs = _cfgs(name, quick)
    dumped = [json.dumps(c, sort_keys=True) for c in cfgs.values()]
    assert len(set(dumped)) == len(dumped)
    for (arm_a, val_a), a in cfgs.items():
        for (arm_b, val_b), b in cfgs.items():
            differing = {k for k in a if a[k] != b[k]}
            allowed = set(named[arm_a]) | set(named[arm_b]) | ({sweep_key} if sweep_key else set())
            if "schedule_fraction" in allowed:  # a shorter schedule: fewer steps
                allowed.add("steps")
            assert differing <= allowed, (arm_a, arm_b, differing - allowed)


def test_arm_configs_are_what_the_suites_say():
    spheret = _cfgs("spheret")
    shared = compare.FULL_BASE["lr"]                       # the seed's protocol: one shared lr
    for arm in ("geonorm", "spheret-p1", "spheret-p2"):   # the normalized step, alpha 0.5
        assert spheret[(arm, shared)]["sphere_step"] == "normalized"
        assert spheret[(arm, shared)]["alpha_init"] == 0.5
    literal = spheret[("spheret-p1-literal", shared)]
    assert (literal["sphere_step"], literal["alpha_init"], literal["p"]) == ("literal", 1.0, 1.0)
    assert {c["optimizer"] for c in spheret.values()} == {"adamw"}
    # the grid holds the shared lr, brackets it, and is run on every seed
    lrs = {c["lr"] for c in spheret.values()}
    assert shared in lrs and min(lrs) < shared < max(lrs)
    assert SUITES["spheret"].tuning_seeds == compare.TUNING_SEEDS
    for (arm, _), cfg in _cfgs("spheret-stress").items():
        plain = spheret[(arm.removesuffix(" @stress"), shared)]
        assert {k for k in cfg if cfg[k] != plain[k]} == {"lr", "warmup_steps", "grad_clip",
                                                           "eval_interval", "log_interval"}
        assert (cfg["lr"], cfg["warmup_steps"], cfg["grad_clip"]) == (3e-2, 0, 0.0)
        # a blow-up in the first steps is seen: evaluated at step 0 and every 5 steps
        assert (cfg["eval_interval"], cfg["log_interval"]) == (5, 5)
    for name, lrs in (("manifolds", {0.001, 0.003, 0.01, 0.03, 0.1}), ("manifolds-high-lr", {0.1})):
        cfgs = _cfgs(name)
        assert {c["optimizer"] for c in cfgs.values()} == {"manifold-muon"}
        assert {c["schedule"] for c in cfgs.values()} == {"constant"}
        assert {c["lr"] for c in cfgs.values()} == lrs
        assert {(arm, c["policy"], c["muon_recipe"]) for (arm, _), c in cfgs.items()} == {
            (p, p, "library") for p in compare.MANIFOLD_POLICIES} | {
            (f"{p}-reference", p, "reference") for p in REFERENCE_POLICIES}
    sel = _cfgs("sel")
    assert {c["optimizer"] for c in sel.values()} == {"adamw"}   # SEL is refused with Muon
    assert {(arm, c["sel"]) for (arm, _), c in sel.items()} == {
        ("baseline", "none"), ("sel-mismatched", "mismatched"), ("sel-congruent", "congruent"),
        ("sel-no-linear", "no-linear"), ("sel-mismatched-no-anneal", "mismatched")} | {
        (f"baseline {name} schedule", "none") for name, _ in SEL_SHORT_SCHEDULES}
    steps = {arm: c["steps"] for (arm, _), c in sel.items()}
    assert [steps[f"baseline {name} schedule"] for name, _ in SEL_SHORT_SCHEDULES] == [150, 200, 250]  # of 300
    assert steps["baseline"] == steps["sel-mismatched"] == compare.FULL_BASE["steps"]
    assert {c["block_lr"] for c in sel.values()} == set(SUITES["sel"].sweep[1])
    assert {c["lr"] for c in sel.values()} == {SUITES["sel"].full["lr"]}


@pytest.mark.parametrize("name, overrides", [("manifolds-high-lr", {"policy": "hetero"}),
                                             ("manifolds", {"lr": "0.05"}),
                                             ("spheret", {"connection": "pre-ln"})])
def test_an_override_that_collapses_arms_is_refused_before_anything_runs(tmp_path, name,
                                                                          overrides):
    with pytest.raises(ConfigError, match="build the same configuration"):
        run_suite(SUITES[name], tmp_path / "out", quick=True, overrides=overrides, echo=False)
    assert not (tmp_path / "out").exists()


def test_report_tables_are_well_formed(tmp_path):
    # a `|` in a column header (SEL's max|w|/std) must not split its cell, and a small swept
    # value is printed as itself, not rounded to 0.0000
    suite = dataclasses.replace(SUITES["sel"], sweep=("lr", (1e-5, 3e-3)))
    results, sweep_rows = [], []
    for i, (arm, _) in enumerate(suite.arms):
        for lr in (1e-5, 3e-3):
            row = {"arm": arm, "seed": 0, "swept": lr, "val_loss": 2.0 + i / 10 + lr,
                   "diverged": False, "learned": True, "steps_to_target": 20, "target": 2.0,
                   "wall_time_s": 1.0, "weight_kurtosis_mean": 3.0, "weight_max_over_std": 5.0}
            sweep_rows.append(row)
            if lr == 1e-5:
                results.append(row)
    compare.write_reports(suite, tmp_path, results, {f"{a}/0": [(10, 2.5), (20, 2.0)]
                                                     for a, _ in suite.arms},
                          quick=True, command="cmd", elapsed=1.0,
                          base={"lr": 1e-2, "steps": 20}, overrides={},
                          sweep=("lr", sweep_rows))
    md = (tmp_path / "results.md").read_text()
    tables, current = [], None
    for line in md.splitlines():
        if line.startswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
            if current is None:
                current = []
                tables.append(current)
            current.append(len(cells))
        else:
            current = None
    assert len(tables) == 2 and all(len(set(t)) == 1 for t in tables), tables
    assert "max\\|w\\|/std" in md and "| baseline | 1e-05 |" in md
    assert '"lr": "swept: 1e-05, 0.003"' in md        # the base's lr is not what ran


def test_the_retraction_suite_starts_where_the_members_differ():
    """Seed 000's "finite p beats the exponential map" needs per-token angles (the literal step)
    large enough for arctan-type angles to differ from the exponential map's: the suite's arms
    start at a mean angle of at least 0.1 rad (at alpha_init 1 it would be ~0.003)."""
    import torch

    from models.build import build_model
    from models.compare import suite_configs

    suite = SUITES["spheret-retractions"]
    assert suite.baseline == "geonorm-literal"
    # each retraction at its own lr (the exponential map's uncapped angles may want a smaller one)
    assert suite.sweep[0] == "lr" and suite.tuning_seeds == compare.TUNING_SEEDS
    assert min(suite.sweep[1]) < compare.FULL_BASE["lr"] < max(suite.sweep[1])
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    for arm, _, cfg in suite_configs(suite):
        assert cfg.model.sphere_step == "literal", arm
        torch.manual_seed(0)
        angles = build_model(cfg, 256).step_angles(ids)
        assert sum(angles) / len(angles) >= 0.1, (arm, angles)


def test_narrow_suite_keeps_the_named_arms_in_order_and_replaces_the_sweep():
    suite = SUITES["spheret-retractions"]
    narrow = compare.narrow_suite(suite, arms=("spheret-p1-literal", "geonorm-literal"),
                                  sweep=(5e-4, 2e-3), tune_seeds=10)
    assert [a for a, _ in narrow.arms] == ["geonorm-literal", "spheret-p1-literal"]
    assert dict(narrow.arms) == {a: c for a, c in suite.arms if a != "spheret-p2-literal"}
    assert narrow.sweep == ("lr", (5e-4, 2e-3)) == narrow.quick_sweep
    assert narrow.tune_seeds == 10 and narrow.baseline == suite.baseline
    assert narrow.tuning_seeds == ()  # --tune_seeds: tuned on the first reported seeds instead
    held = compare.narrow_suite(suite, tuning_seeds=(7, 8))
    assert held.tuning_seeds == (7, 8) and held.tune_seeds == suite.tune_seeds
    assert held.quick_tuning_seeds == (7, 8)  # given by name: all of them under --quick too
    assert compare.narrow_suite(held, tune_seeds=2).quick_tuning_seeds is None
    assert compare.narrow_suite(suite) == suite                 # nothing given: the suite itself
    lrs = sorted({v for _, v, _ in compare.suite_configs(narrow)})
    assert lrs == [5e-4, 2e-3] and len(compare.suite_configs(narrow)) == 4


@pytest.mark.parametrize("name, kwargs, match", [
    ("spheret-retractions", {"arms": ("cayley",)}, r"unknown \['cayley'\].*geonorm-literal"),
    ("spheret-retractions", {"arms": ("geonorm-literal", "geonorm-literal")}, "at most once"),
    ("spheret-retractions", {"arms": ()}, "at most once"),
    ("spheret-stress", {"sweep": (0.1,)}, "sweeps nothing"),
    ("sel", {"sweep": (1e-3, 1e-3)}, r"distinct values of 'block_lr', got \[0.001, 0.001\]"),
    ("sel", {"sweep": ()}, "distinct values"),
    ("sel", {"tune_seeds": 0}, "integer >= 1, got 0"),
    ("sel", {"tune_seeds": True}, "integer >= 1, got True"),
    ("sel", {"tune_seeds": 2, "tuning_seeds": (7,)}, "not both"),
    ("sel", {"tuning_seeds": (7, 7)}, r"distinct seeds, got \[7, 7\]"),
])
def test_narrow_suite_refuses_what_it_cannot_run_by_name(name, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        compare.narrow_suite(SUITES[name], **kwargs)


def test_cli_runs_a_narrowed_suite_and_records_the_command(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--suite", "spheret-retractions", "--quick", "--arms", "geonorm-literal",
            "--sweep", "0.01", "0.02", "--out", str(out)]
    assert compare.main(argv) == 0
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["arm"], float(r["swept"])) for r in rows) == [
        ("geonorm-literal", 0.01), ("geonorm-literal", 0.02)]
    md = (out / "results.md").read_text()
    assert "--arms geonorm-literal --sweep 0.01 0.02" in md and "spheret-p2-literal" not in md
    assert compare.main(["--suite", "spheret-retractions", "--arms", "exp",
                         "--out", str(tmp_path / "refused")]) == compare.EXIT_USER_ERROR
    assert "unknown ['exp']" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_quick_runs_every_tuning_seed_given_by_name(tmp_path):
    """``--quick --tuning_seeds 7 8`` tuned on seed 7 alone (``--quick``'s default, the first of
    the suite's tuning seeds, applied to the given ones too), and results.md said "chosen on
    seeds 7": an explicit flag half ignored. Seeds given by name now run as given, as
    ``--seeds`` and ``--sweep`` do under ``--quick``; without the flag ``--quick`` still tunes on
    the first of the suite's."""
    common = ["--suite", "spheret-retractions", "--quick", "--arms", "geonorm-literal",
              "--sweep", "0.01", "--steps", "6", "--eval_interval", "3", "--n_layer", "1"]
    for given, tuned in ((["--tuning_seeds", "7", "8"], ["7", "8"]), ([], ["100"])):
        out = tmp_path / "-".join(tuned)
        assert compare.main([*common, *given, "--out", str(out)]) == 0
        with open(out / "sweep.csv") as f:
            assert sorted(r["seed"] for r in csv.DictReader(f)) == tuned
        assert f"chosen on seeds {', '.join(tuned)} and is reported above on seeds 0" in \
            (out / "results.md").read_text()


def test_reports_give_the_paired_difference_per_seed(tmp_path):
    """Seeds fix the initialization and batches: an arm 0.02 below the baseline on every seed is
    3.5 paired standard errors away while Welch's test, which carries the seed-to-seed spread of
    0.1, sees 0.3."""
    suite = dataclasses.replace(SUITES["sel"], arms=SUITES["sel"].arms[:2], sweep=())
    arm = suite.arms[1][0]
    results = []
    for seed, (b, a) in enumerate([(2.0, 1.98), (2.1, 2.09), (2.2, 2.17)]):
        for name, loss in ((suite.baseline, b), (arm, a)):
            results.append({"arm": name, "seed": seed, "swept": None, "val_loss": loss,
                            "diverged": False, "learned": True, "steps_to_target": None,
                            "target": 2.1, "wall_time_s": 1.0})
    curves = {f"{a}/0": [(10, 2.5), (20, 2.0)] for a, _ in suite.arms}
    compare.write_reports(suite, tmp_path, results, curves, quick=True, command="cmd",
                          elapsed=1.0, base={"lr": 1e-2}, overrides={})
    rows = {line.split("|")[1].strip(): line for line in
            (tmp_path / "results.md").read_text().splitlines() if line.startswith("| ")}
    assert "| -0.0200 (-3.5; 3/3 below) |" in rows[arm]
    assert "| -0.3 |" in rows[arm]                          # Welch, unpaired
    assert "paired Δ (SE; seeds below)" in rows["arm"]
    assert rows[suite.baseline].count("| — |") >= 2          # no difference to itself



class _Ran(Exception):
    """Raised in place of training: the suite got past its checks."""


def _no_training(monkeypatch) -> None:
    def execute(*args, **kwargs):
        raise _Ran
    monkeypatch.setattr("models.compare.runner._execute", execute)


MUON_ONLY = "only --optimizer manifold-muon reads it"


@pytest.mark.parametrize("argv, line", [
    (["--suite", "spheret", "--muon_ns_dtype", "float32"],
     (f"suite 'spheret': --muon_ns_dtype does nothing in any arm (in each: does nothing with "
      f"optimizer=adamw: {MUON_ONLY})")),
    (["--suite", "manifolds", "--quick", "--block-lr", "0.1"],
     ("suite 'manifolds': --block-lr does nothing in any arm (in each: does nothing with "
      "optimizer=manifold-muon: only --optimizer adamw reads it (ManifoldMuon steps the block "
      "matrices at --lr))")),
    # read by the SEL arms, but --arms leaves only the baseline
    (["--suite", "sel", "--arms", "baseline", "--sel_kappa", "3", "--temperature", "0.5"],
     ("suite 'sel': --sel_kappa does nothing in any arm (in each: does nothing with sel=none: "
      "only --sel mismatched, congruent or no-linear reads it); --temperature does nothing in "
      "any arm (in each: does nothing with sample_tokens=0: only --sample_tokens N > 0 reads "
      "it)")),
])
def test_an_override_no_arm_reads_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch,
                                                                   argv, line):
    """Such an override ran the suite unchanged under a command (recorded in results.md) that
    said otherwise."""
    _no_training(monkeypatch)
    out = tmp_path / "out"
    assert compare.main([*argv, "--out", str(out)]) == compare.EXIT_USER_ERROR
    assert capsys.readouterr().err == f"error: {line}\n"
    assert not out.exists()


def test_an_override_is_refused_with_each_arms_reason_and_kept_where_an_arm_reads_it(
        tmp_path, monkeypatch):
    _no_training(monkeypatch)
    suite = Suite(name="mini", baseline="pre-ln",
                  arms=(("pre-ln", {"connection": "pre-ln"}), ("keel", {"connection": "keel"}),
                        ("gnomonic", {"connection": "spheret", "retraction": "gnomonic"})))
    spheret = "only --connection spheret reads it (geonorm is spheret with the exponential map)"
    with pytest.raises(ConfigError, match=re.escape(
            f"suite 'mini': --p does nothing in any arm (in pre-ln: does nothing with "
            f"connection=pre-ln: {spheret}; in keel: does nothing with connection=keel: "
            f"{spheret}; in gnomonic: does nothing with retraction=gnomonic: only --retraction "
            f"p reads it)")):
        run_suite(suite, tmp_path / "a", quick=True, overrides={"p": "2"}, echo=False)
    assert not (tmp_path / "a").exists()
    # read by one arm (keel's keel_alpha, the SEL arms' sel_kappa), inert in the others: kept
    with pytest.raises(_Ran):
        run_suite(suite, tmp_path / "b", quick=True, overrides={"keel_alpha": "3"}, echo=False)
    with pytest.raises(_Ran):
        run_suite(SUITES["sel"], tmp_path / "c", quick=True, overrides={"sel_kappa": "3"},
                  echo=False)


@pytest.mark.parametrize("name, overrides, unread", [
    ("manifolds", {"optimizer": "adamw"}, "policy"),
    ("spheret-p", {"retraction": "cayley"}, "p"),
])
def test_an_override_that_makes_the_arms_differences_inert_is_refused(tmp_path, monkeypatch,
                                                                       name, overrides, unread):
    """--optimizer adamw in manifolds ran its 8 arms as one AdamW configuration (the policy they
    differ in is read by manifold-muon only), reported under 8 policy names."""
    _no_training(monkeypatch)
    with pytest.raises(ConfigError, match=f"build the same configuration .*differing only in "
                                          f"{unread}, which it never reads"):
        run_suite(SUITES[name], tmp_path / "out", quick=True, overrides=overrides, echo=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["--suite", "spheret", "--quick", "--seeds", "0", "1"],
                                  ["--suite", "manifolds", "--quick", "--seeds", "0", "1"]])
def test_a_seed_override_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch, argv):
    """--seed 7 replaced the seed of every run: seed0/ and seed1/ (and the tuning seeds') all
    trained at seed 7, and results.md reported one run as two seeds."""
    _no_training(monkeypatch)
    out = tmp_path / "out"
    assert compare.main([*argv, "--seed", "7", "--out", str(out)]) == compare.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"error: suite '{argv[1]}': --seed 7 would train every run at seed 7, "
                          f"so the runs of seeds [0, 1] ") and "give the seeds with --seeds" in err
    assert not out.exists()


def test_a_tokenizer_override_the_shards_were_not_made_with_is_refused(tmp_path, capsys,
                                                                       monkeypatch):
    from models.prepare import prepare

    _no_training(monkeypatch)
    shards, out = tmp_path / "bytes", tmp_path / "out"
    prepare("synthetic:20000", shards)
    argv = ["--suite", "spheret", "--quick", "--arms", "pre-ln", "--corpus", f"bin:{shards}",
            "--out", str(out)]
    assert compare.main([*argv, "--tokenizer", "bpe"]) == compare.EXIT_USER_ERROR
    assert capsys.readouterr().err == (
        f"error: tokenizer 'bpe' (--tokenizer) disagrees with the token shards {shards}: they "
        f"were made with the 'byte' tokenizer (their meta.json says so), which a run on them "
        f"always uses; drop --tokenizer, or use shards made with the 'bpe' tokenizer\n")
    assert not out.exists()
    with pytest.raises(_Ran):  # the shards' own tokenizer, given or not
        compare.main([*argv, "--tokenizer", "byte"])


def _recorded_as_bpe(folder: Path) -> Path:
    """Shards whose meta.json records the BPE tokenizer (no tokenizer.json: nothing is opened
    while a suite is planned)."""
    from models.shards import META_FILE, SHARD_FORMAT

    folder.mkdir(parents=True)
    for split, n in (("train", 4000), ("val", 400)):
        (folder / f"{split}.bin").write_bytes(b"\0\0" * n)
    (folder / META_FILE).write_text(json.dumps({
        "format": SHARD_FORMAT, "version": 1, "tokenizer": "bpe", "vocab_size": 300,
        "dtype": "uint16", "train_tokens": 4000, "val_tokens": 400, "sha256": {}, "source": {}}))
    return folder


def test_planned_arms_on_shards_take_the_tokenizer_the_shards_record(tmp_path, monkeypatch):
    """Every arm said byte (the default) on BPE shards, as the runs' config.json did; a
    --tokenizer override is kept as given (and checked); bpe_vocab_size stays refused."""
    bpe = _recorded_as_bpe(tmp_path / "bpe")
    for overrides in ({"corpus": f"bin:{bpe}"}, {"corpus": f"bin:{bpe}", "tokenizer": "bpe"}):
        planned = compare.suite_configs(SUITES["sel"], quick=True, overrides=overrides)
        assert len(planned) > 1 and {cfg.tokenizer for _, _, cfg in planned} == {"bpe"}
    planned = compare.suite_configs(SUITES["sel"], quick=True)
    assert {cfg.tokenizer for _, _, cfg in planned} == {"byte"}  # a text corpus: as built
    _no_training(monkeypatch)
    with pytest.raises(ConfigError, match=re.escape(
            f"suite 'spheret': --bpe_vocab_size does nothing in any arm (in each: does nothing "
            f"with corpus=bin:{bpe}: token shards carry their tokenizer and their split; only a "
            f"text corpus reads it)")):
        run_suite(SUITES["spheret"], tmp_path / "out", quick=True, echo=False,
                  overrides={"corpus": f"bin:{bpe}", "bpe_vocab_size": "512"})


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                    reason="needs the optional tokenizers package")
def test_a_run_on_bpe_shards_saves_the_planned_configuration_and_is_reused(tmp_path):
    from models.prepare import prepare

    shards, out = tmp_path / "bpe", tmp_path / "out"
    prepare("synthetic:20000", shards, tokenizer="bpe", vocab_size=300)
    suite = Suite(name="mini", arms=(("a", {}),), baseline="a")
    overrides = {"corpus": f"bin:{shards}", "steps": "4", "eval_interval": "2"}
    (_, _, planned), = compare.suite_configs(suite, quick=True, overrides=overrides)
    first = run_suite(suite, out, quick=True, echo=False, overrides=overrides)
    run = out / "a" / "seed0"
    assert json.loads((run / "config.json").read_text()) == planned.to_dict()
    assert planned.tokenizer == "bpe" and (run / "tokenizer.json").is_file()
    mtime = (run / "summary.json").stat().st_mtime_ns
    again = run_suite(suite, out, quick=True, echo=False, overrides=overrides)
    assert [r["val_loss"] for r in again] == [r["val_loss"] for r in first]
    assert (run / "summary.json").stat().st_mtime_ns == mtime


def test_a_finished_run_on_data_changed_since_is_trained_again(tmp_path):
    """A finished run was reused when its config.json matched, whatever data it trained on: a
    suite run again after its ``file:`` corpus was rewritten (or its shards prepared again
    into the same folder, or ``stdlib`` under another Python) reported the old data's run as
    the new one's. The reuse now also needs the run's corpus.json fingerprint to be the
    corpus's as it is now; the re-run equals a fresh suite's on the new data."""
    from models.data import load_corpus
    from models.sources import synthetic_documents

    text = tmp_path / "corpus.txt"
    text.write_bytes(b"".join(synthetic_documents(20000, seed=0)))
    suite = Suite(name="mini", baseline="pre-ln", arms=(("pre-ln", {"connection": "pre-ln"}),),
                  seeds=(0,))
    overrides = {"corpus": f"file:{text}", "steps": "4", "eval_interval": "2", "n_layer": "1",
                 "n_embd": "16", "n_head": "2", "block_size": "16", "batch_size": "4",
                 "sample_tokens": "0"}
    old = run_suite(suite, tmp_path / "a", seeds=(0,), echo=False, overrides=overrides)
    text.write_bytes(b"".join(synthetic_documents(20000, seed=1)))
    again = run_suite(suite, tmp_path / "a", seeds=(0,), echo=False, overrides=overrides)
    fresh = run_suite(suite, tmp_path / "b", seeds=(0,), echo=False, overrides=overrides)
    saved = json.loads((tmp_path / "a" / "pre-ln" / "seed0" / "corpus.json").read_text())
    assert saved["fingerprint"] == load_corpus(f"file:{text}").fingerprint
    assert again[0]["val_loss"] == fresh[0]["val_loss"] != old[0]["val_loss"]
