"""The training CLI: run directory, resume exactness, non-finite loss, bad input, config layers."""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models.train as train_mod
from models.config import (
    LEGACY_MUON_NS_DTYPE,
    PRESETS,
    ConfigError,
    TrainConfig,
    build_config,
    config_keys,
    parse_overrides,
)
from models.run_dir import save_checkpoint
from models.train import lr_scale, main, read_metrics

REPO = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {"val_loss", "val_ppl", "steps", "tokens", "world_size", "wall_time_s",
                "corpus_fingerprint", "last_finite_val_loss", "last_finite_val_step",
                "lr_peak_fraction", "warmup_outlasts_run", "sel_anneal_fraction", "warnings"}
COMPARED = ("step", "train_loss", "val_loss", "lr", "tokens", "grad_norm")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "models.train", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)


def _quiet(*args: str) -> list[str]:
    """Smoke-preset arguments without the end-of-run sample (faster)."""
    return ["--preset", "smoke", "--sample_tokens", "0", *args]


def _same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in COMPARED} == {k: rb.get(k) for k in COMPARED}


# ---- one real run through the command line --------------------------------------------------


def test_smoke_run_writes_the_documented_run_directory(tmp_path):
    out = tmp_path / "run"
    proc = _cli("--preset", "smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    for name in ("config.json", "metrics.jsonl", "loss.png", "checkpoint.pt", "summary.json",
                 "sample.txt"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    steps = PRESETS["smoke"]["steps"]
    assert summary["steps"] == steps and summary["world_size"] == 1 and summary["finished"]
    assert summary["tokens"] == steps * PRESETS["smoke"]["batch_size"] * \
        PRESETS["smoke"]["block_size"]
    assert summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]), rel=1e-12)
    assert (summary["last_finite_val_loss"], summary["last_finite_val_step"]) == (
        summary["val_loss"], steps)
    assert summary["lr_peak_fraction"] == 1.0 and summary["warnings"] == []
    assert summary["warmup_outlasts_run"] is False and summary["sel_anneal_fraction"] is None
    assert "warning:" not in proc.stderr
    initial, *rows = read_metrics(out / "metrics.jsonl")
    # a fresh run evaluates its initial model first: the reference for an early spike
    assert initial["step"] == 0 and initial["tokens"] == 0 and "train_loss" not in initial
    assert abs(initial["val_loss"] - math.log(256)) < 0.1     # about uniform over bytes
    assert [r["step"] for r in rows] == list(range(5, steps + 1, 5))
    assert all(isinstance(r["train_loss"], float) and "lr" in r and "tokens" in r for r in rows)
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 30]
    assert evals[-1]["val_loss"] == summary["val_loss"]
    # it learns: below where it started and below where it was at the first evaluation
    assert summary["val_loss"] < evals[0]["val_loss"] < initial["val_loss"]
    assert "max_attention_logit" in evals[-1] and "q_spectral_norm_max" in evals[-1]
    config = TrainConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert config == build_config("smoke", overrides={"steps": str(steps), "tokenizer": "byte"})
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == steps and ckpt["finished"]
    assert {"model", "optimizer", "rng", "sampler"} <= ckpt.keys()
    assert {"torch", "numpy", "python"} <= ckpt["rng"].keys()
    sample = (out / "sample.txt").read_text()
    assert sample.startswith(TrainConfig().sample_prompt) and sample in proc.stdout
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_evaluations_leave_the_training_unchanged(tmp_path):
    # the step-0 evaluation and the later ones touch no random state (dropout on: they would)
    common = _quiet("--steps", "12", "--dropout", "0.1", "--sample_tokens", "0")
    assert main([*common, "--eval_interval", "3", "--out", str(tmp_path / "often")]) == 0
    assert main([*common, "--eval_interval", "12", "--out", str(tmp_path / "once")]) == 0
    often, once = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["model"]
                   for name in ("often", "once"))
    assert often.keys() == once.keys()
    assert all(torch.equal(often[k], once[k]) for k in often)
    steps = [[r["step"] for r in read_metrics(tmp_path / name / "metrics.jsonl")
              if "val_loss" in r] for name in ("often", "once")]
    assert steps == [[0, 3, 6, 9, 12], [0, 12]]


# ---- resume ---------------------------------------------------------------------------------


def test_resume_equals_an_uninterrupted_run(tmp_path):
    # dropout makes the torch RNG matter; the sampler state makes the data order matter
    common = _quiet("--steps", "20", "--dropout", "0.1", "--eval_interval", "5")
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--stop_at", "10", "--out", str(tmp_path / "b")]) == 0
    partial = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert partial["steps"] == 10 and not partial["finished"]
    assert main(["--resume", "--out", str(tmp_path / "b")]) == 0
    _same_rows(read_metrics(tmp_path / "a" / "metrics.jsonl"),
               read_metrics(tmp_path / "b" / "metrics.jsonl"))
    state_a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["model"]
    state_b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def _has_build_optimizer() -> bool:
    try:
        from manifoldlib.optim import build_optimizer  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_build_optimizer(), reason="manifoldlib.optim not available")
def test_resume_is_exact_with_manifold_muon(tmp_path):
    common = _quiet("--steps", "12", "--eval_interval", "4", "--log_interval", "2",
                    "--optimizer", "manifold-muon", "--policy", "unconstrained", "--lr", "0.02")
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--stop_at", "8", "--out", str(tmp_path / "b")]) == 0
    assert main(["--resume", "--out", str(tmp_path / "b")]) == 0
    _same_rows(read_metrics(tmp_path / "a" / "metrics.jsonl"),
               read_metrics(tmp_path / "b" / "metrics.jsonl"))


@pytest.mark.skipif(not _has_build_optimizer(), reason="manifoldlib.optim not available")
def test_muon_ns_dtype_reaches_the_euclidean_groups(tmp_path):
    from models.train import build_model, build_train_optimizer

    cfg = build_config("smoke", overrides={"optimizer": "manifold-muon", "policy": "unconstrained",
                                           "muon_ns_dtype": "float32"})
    model = build_model(cfg, vocab_size=256)
    opt, _ = build_train_optimizer(model, cfg)
    groups = [g for g in opt.param_groups if g.get("manifold") == "euclidean"]
    assert groups and {g["ns_dtype"] for g in groups} == {"float32"}
    assert TrainConfig().muon_ns_dtype == "auto"


@pytest.mark.skipif(not _has_build_optimizer(), reason="manifoldlib.optim not available")
def test_a_run_saved_before_muon_ns_dtype_resumes_in_bfloat16(tmp_path):
    """Runs made before the field existed used bfloat16 Newton–Schulz: resuming one keeps it (an
    exact resume), and asking for another dtype is refused as a configuration change."""
    common = _quiet("--steps", "12", "--eval_interval", "4", "--log_interval", "2",
                    "--optimizer", "manifold-muon", "--policy", "unconstrained", "--lr", "0.02",
                    "--muon_ns_dtype", "bfloat16")
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--stop_at", "8", "--out", str(tmp_path / "b")]) == 0
    path = tmp_path / "b" / "config.json"  # make run b look like an old run directory
    saved = json.loads(path.read_text())
    del saved["muon_ns_dtype"]
    path.write_text(json.dumps(saved))
    ckpt_path = tmp_path / "b" / "checkpoint.pt"
    ckpt = torch.load(ckpt_path, weights_only=False)
    del ckpt["config"]["muon_ns_dtype"]
    save_checkpoint(ckpt_path, ckpt, previous_step=-1)  # re-sealed with its new checksum
    assert main(["--resume", "--muon_ns_dtype", "float32", "--out", str(tmp_path / "b")]) == 2
    assert main(["--resume", "--out", str(tmp_path / "b")]) == 0
    resumed = json.loads((tmp_path / "b" / "config.json").read_text())["muon_ns_dtype"]
    assert resumed == LEGACY_MUON_NS_DTYPE == "bfloat16"
    _same_rows(read_metrics(tmp_path / "a" / "metrics.jsonl"),
               read_metrics(tmp_path / "b" / "metrics.jsonl"))


def test_resume_extends_a_finished_run_with_more_steps(tmp_path):
    common = _quiet("--schedule", "constant", "--eval_interval", "5")
    assert main([*common, "--steps", "20", "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--steps", "10", "--out", str(tmp_path / "b")]) == 0
    assert main(["--resume", "--steps", "20", "--out", str(tmp_path / "b")]) == 0
    _same_rows(read_metrics(tmp_path / "a" / "metrics.jsonl"),
               read_metrics(tmp_path / "b" / "metrics.jsonl"))


def _interrupt_at_call(monkeypatch, n: int):
    """Make the ``n``-th ``train_step`` from now raise ``KeyboardInterrupt``; the real one."""
    real, calls = train_mod.train_step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "train_step", interrupted)
    return real


def test_an_interrupted_resume_leaves_no_summary_of_the_run_before(tmp_path, monkeypatch):
    """A finished 4-step run resumed with ``--steps 10`` and interrupted at step 7 (checkpoint
    at 6) kept the 4-step run's summary.json (finished, steps 4, its val loss) beside a
    config.json of steps 10: read as the end of the 10-step run, and models.compare reused it
    as one. The resume now removes it; the end of the resumed run writes its own."""
    from models.compare.runner import _reusable

    out = tmp_path / "r"
    common = _quiet("--eval_interval", "2", "--warmup_steps", "2", "--progress", "false")
    assert main([*common, "--steps", "4", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["finished"]
    real = _interrupt_at_call(monkeypatch, 3)  # of a resume from step 4: at step 7
    assert main(["--resume", "--steps", "10", "--out", str(out)]) == 130
    saved = json.loads((out / "config.json").read_text())
    assert saved["steps"] == 10
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 6
    assert not (out / "summary.json").exists()
    assert _reusable(out, TrainConfig.from_dict(saved), {}) is None  # trained again, not reused
    monkeypatch.setattr(train_mod, "train_step", real)
    assert main(["--resume", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == 10


def test_an_interrupted_resume_leaves_no_end_files_of_the_run_before(tmp_path, monkeypatch):
    """d0a9640 removed the old summary.json on resume, but the finished 4-step run's sample.txt
    and loss.png stayed beside the config.json of steps 10 when the resume was interrupted at
    step 7; and a directory left with the old summary too (by code before d0a9640) was still
    reused by models.compare, whose check did not compare the summary's steps (4) with the
    config's (10). The resume now removes all three; the reuse check needs the summary's steps
    to be the config's. The end of the resumed run writes each again."""
    from models.compare.runner import _reusable

    out = tmp_path / "r"
    common = ["--preset", "smoke", "--sample_tokens", "8", "--eval_interval", "2",
              "--warmup_steps", "2", "--progress", "false"]
    assert main([*common, "--steps", "4", "--out", str(out)]) == 0
    ended = {name: (out / name).read_bytes() for name in ("summary.json", "loss.png", "sample.txt")}
    real = _interrupt_at_call(monkeypatch, 3)  # of a resume from step 4: at step 7
    assert main(["--resume", "--steps", "10", "--out", str(out)]) == 130
    assert not [name for name in ended if (out / name).exists()]
    saved = TrainConfig.from_dict(json.loads((out / "config.json").read_text()))
    (out / "summary.json").write_bytes(ended["summary.json"])  # as code before d0a9640 left it
    assert _reusable(out, saved, {}) is None                    # steps 4 of 10: trained again
    (out / "summary.json").unlink()
    monkeypatch.setattr(train_mod, "train_step", real)
    assert main(["--resume", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 10
    assert (out / "loss.png").read_bytes() != ended["loss.png"] and (out / "sample.txt").is_file()
    assert _reusable(out, saved, {})["steps"] == 10


def test_a_resumed_runs_tensorboard_log_holds_each_step_once(tmp_path, monkeypatch):
    """A run killed at step 4 had logged step 3 to TensorBoard after its checkpoint at step 2;
    the resume drops that row from metrics.jsonl and logs step 3 again, but its writer kept the
    killed run's events: TensorBoard showed step 3 twice. The resume's writer now purges the
    steps after the checkpoint (``purge_step``: TensorBoard hides the events of earlier files
    at and after it), which the fake writer below applies."""
    import types

    writers = []

    class Writer:  # records what reaches TensorBoard
        def __init__(self, log_dir, purge_step=None):
            self.purge_step, self.events = purge_step, []
            writers.append(self)

        def add_scalar(self, key, value, step):
            self.events.append((key, step, value))

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=Writer))
    out = tmp_path / "run"
    real = _interrupt_at_call(monkeypatch, 4)
    args = _quiet("--steps", "6", "--eval_interval", "2", "--log_interval", "1", "--log",
                  "tensorboard", "--progress", "false", "--out", str(out))
    assert main(args) == 130
    monkeypatch.setattr(train_mod, "train_step", real)
    assert main(["--resume", "--out", str(out)]) == 0
    shown = []
    for writer in writers:  # each file hides the earlier files' events from its purge_step on
        if writer.purge_step is not None:
            shown = [e for e in shown if e[1] < writer.purge_step]
        shown += writer.events
    losses = [(step, value) for key, step, value in shown if key == "train_loss"]
    rows = read_metrics(out / "metrics.jsonl")
    assert losses == [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6]


def test_a_resume_that_changes_settings_names_them_and_what_dropout_makes_of_it(tmp_path, capsys):
    # with dropout, grad_accum_steps 2 draws other masks than 1 (step 1's loss differs in the
    # third digit), so such a resume leaves the uninterrupted run; it used to pass unsaid
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "8", "--eval_interval", "4", "--dropout", "0.1",
                         "--stop_at", "4"), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["--resume", "--steps", "6", "--grad_accum_steps", "2", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "resuming with changed settings: grad_accum_steps 1 -> 2, steps 8 -> 6 (with " \
           "dropout 0.1" in said and "dropout masks from here on differ" in said
    assert main(["--resume", "--steps", "8", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "resuming with changed settings: steps 6 -> 8\n" in said  # saved: the resumed config


def test_a_resume_refuses_a_preset_that_does_not_describe_the_run(tmp_path, capsys):
    """``--resume`` continues the saved configuration and dropped ``--preset`` unsaid: a smoke
    run (2 layers of 32, synthetic:60000) resumed with ``--preset default`` (4 layers of 128 on
    stdlib, ManifoldMuon) trained on as smoke, exit 0, and an unknown preset passed too. Such a
    preset is now refused, naming the settings it would change; the run's own preset (the same
    command again with --resume) still resumes, and the run is left as it was."""
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "4", "--eval_interval", "2"), "--out", str(out)]) == 0
    assert main([*_quiet("--steps", "6", "--eval_interval", "2"), "--resume", "--out", str(out)]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["--resume", "--preset", "default", "--steps", "8", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --preset 'default' does not describe the run in {out}: ")
    named = [part.split()[0] for part in err.split(": ", 2)[2].split("; ")[0].split(", ")]
    assert "n_layer 2 (the run) != 4 (the preset)" in err and "steps" not in named  # resumable
    assert {"corpus", "n_embd", "optimizer", "lr"} <= set(named)
    assert err.rstrip().endswith("--resume continues the run's saved configuration: drop --preset, "
                                 "or start a fresh run in another --out")
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "default"\n')
    assert main(["--resume", "--config", str(toml), "--out", str(out)]) == 2
    assert f"error: preset 'default' (config file {toml}) does not describe the run in {out}: " \
        in capsys.readouterr().err
    assert main(["--resume", "--preset", "smok", "--out", str(out)]) == 2
    assert "unknown preset 'smok'" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resuming_a_finished_run_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "10"), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["--resume", "--out", str(out)]) == 0
    assert "already finished" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_run_directory_rules(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "10"), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*_quiet("--steps", "10"), "--out", str(out)]) == 2
    assert "not empty; pass --resume" in capsys.readouterr().err
    assert main(["--resume", "--steps", "20", "--n_embd", "64", "--out", str(out)]) == 2
    assert "n_embd (32 -> 64)" in capsys.readouterr().err
    assert main(["--resume", "--out", str(tmp_path / "nothing")]) == 2
    assert "has no checkpoint.pt" in capsys.readouterr().err


# ---- non-finite loss ------------------------------------------------------------------------


def _nan_loss(monkeypatch, training: bool, from_step: int) -> None:
    """``build_model`` replaced: from the ``from_step``-th training forward on, the loss of every
    forward in training (``training``) or evaluation mode is NaN."""
    build = train_mod.build_model

    def poisoned(cfg, vocab_size):
        model = build(cfg, vocab_size)
        forward, calls = model.forward, {"train": 0}

        def forward_with_nan(idx, targets=None):
            logits, loss = forward(idx, targets)
            calls["train"] += model.training
            if model.training == training and calls["train"] >= from_step and loss is not None:
                loss = loss * float("nan")
            return logits, loss

        model.forward = forward_with_nan
        return model

    monkeypatch.setattr(train_mod, "build_model", poisoned)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    _nan_loss(monkeypatch, training=True, from_step=13)
    out = tmp_path / "run"
    assert main([*_quiet("--eval_interval", "5"), "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "non-finite training loss (nan) at step 13" in err and "step 10" in err
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 10
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"] and summary["steps"] == 12 and not summary["finished"]
    last = read_metrics(out / "metrics.jsonl")[-1]
    assert last["step"] == 13 and last["train_loss"] is None and last["diverged"] is True
    assert last["tokens"] == 12 * 8 * 32
    # no loss of a diverged run is its final one: val_loss was the step-10 evaluation's, beside
    # diverged: true, where a run whose validation loss went NaN had null
    at_10 = next(r["val_loss"] for r in read_metrics(out / "metrics.jsonl") if r["step"] == 10
                 and "val_loss" in r)
    assert summary["val_loss"] is None and summary["val_ppl"] is None
    assert (summary["last_finite_val_loss"], summary["last_finite_val_step"]) == (at_10, 10)
    assert f"val_loss is null (no final loss), the last finite one {at_10:.4f} at step 10" in err


def test_a_diverged_validation_loss_keeps_the_last_finite_one_apart(tmp_path, monkeypatch, capsys):
    """The validation loss goes NaN at the step-10 evaluation: ``val_loss`` null (as before) and
    the step-5 evaluation under ``last_finite_val_loss`` / ``last_finite_val_step``."""
    _nan_loss(monkeypatch, training=False, from_step=10)
    out = tmp_path / "run"
    assert main([*_quiet("--eval_interval", "5", "--steps", "20"), "--out", str(out)]) == 3
    assert "non-finite validation loss (nan) at step 10" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    at_5 = next(r["val_loss"] for r in read_metrics(out / "metrics.jsonl") if r["step"] == 5
                and "val_loss" in r)
    assert summary["diverged"] and summary["val_loss"] is None
    assert (summary["last_finite_val_loss"], summary["last_finite_val_step"]) == (at_5, 5)


def test_a_warmup_longer_than_the_run_is_said_and_recorded(tmp_path):
    """The smoke preset warms up over 5 steps; ``--steps 4`` peaked the learning rate at 4/5 of
    ``lr`` (0.008, not 0.01) and its cosine schedule and min_lr_ratio did nothing, unsaid. The
    run now warns at the start, naming the numbers, and summary.json records the line and
    ``lr_peak_fraction`` 0.8 (it trains as before: not refused)."""
    import re
    import warnings

    from models.cli import _short_warnings

    out = tmp_path / "run"
    line = ("warmup_steps 5 >= steps 4: the learning rate warms up for the whole run and peaks "
            "at its last step at 4/5 = 0.8 of each configured rate (lr 0.01 -> 0.008); schedule "
            "'cosine' and min_lr_ratio 0.1 never act; give warmup_steps below steps to train at "
            "the configured rates")
    with pytest.warns(RuntimeWarning, match=f"^{re.escape(line)}$"):
        assert main([*_quiet("--steps", "4", "--log_interval", "1"), "--out", str(out)]) == 0
    with _short_warnings():  # how the command line prints it: one line, as its errors
        shown = warnings.formatwarning(line, RuntimeWarning, train_mod.__file__, 151)
    assert shown == f"warning: {line}\n"
    assert "warning:" not in warnings.formatwarning(line, RuntimeWarning, train_mod.__file__, 1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["warnings"] == [line] and summary["lr_peak_fraction"] == pytest.approx(0.8)
    lrs = [r["lr"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r]
    assert max(lrs) == pytest.approx(0.008) and len(lrs) == 4


@pytest.mark.parametrize("steps, warmup, schedule", [
    (10, 20, "cosine"), (20, 20, "constant"), (21, 20, "cosine"), (5, 0, "cosine"),
    (1, 1, "constant"), (100, 10, "constant")])
def test_lr_peak_fraction_is_the_schedules_largest_multiplier(steps, warmup, schedule):
    from models.build import lr_peak_fraction, warmup_outlasts_run

    cfg = TrainConfig(steps=steps, warmup_steps=warmup, schedule=schedule)
    peak = max(lr_scale(s, cfg) for s in range(steps))
    assert lr_peak_fraction(cfg) == pytest.approx(peak, rel=1e-15)
    note = warmup_outlasts_run(cfg)
    assert (note is None) == (warmup < steps)
    if note is not None:
        assert note.startswith(f"warmup_steps {warmup} >= steps {steps}: ")
        assert f"schedule '{schedule}'" in note and ("min_lr_ratio" in note) == (schedule == "cosine")


@pytest.mark.parametrize("steps, anneal, sel", [
    (60, 100, "mismatched"), (100, 100, "congruent"), (101, 100, "mismatched"), (1, 1, "no-linear"),
    (300, 100, "mismatched"), (10, 0, "mismatched"), (10, 100, "none")])
def test_sel_anneal_fraction_is_where_the_last_update_reads_the_ramp(steps, anneal, sel):
    """The anneal completes (fraction 1, the multipliers at 1) exactly where ``sel_anneal_steps
    < steps``; otherwise the trainer's line names the fraction and where the rates end."""
    from manifoldlib.charts import SELLRMultiplier
    from models.build import sel_anneal_fraction, sel_anneal_outlasts_run

    cfg = TrainConfig(steps=steps, sel=sel, sel_anneal_steps=anneal)
    done, note = sel_anneal_fraction(cfg), sel_anneal_outlasts_run(cfg)
    if sel == "none" or anneal == 0:
        assert done is None and note is None
        return
    e_w, m = (SELLRMultiplier(role, anneal)(steps - 1) for role in ("e_w", "m"))
    assert (done == 1.0) == (e_w == m == 1.0) == (anneal < steps) == (note is None)
    assert done == pytest.approx((steps - 1) / anneal if anneal >= steps else 1.0, rel=1e-15)
    if note is not None:
        assert note.startswith(f"sel_anneal_steps {anneal} >= steps {steps}: ")
        assert f"{steps - 1}/{anneal} = {done:.3g}" in note and f"ends at {e_w:.4g}" in note


def test_a_huge_learning_rate_diverges_with_status_3(tmp_path, capsys):
    assert main([*_quiet("--lr", "1e30", "--grad_clip", "0"), "--out", str(tmp_path / "r")]) == 3
    assert "training diverged: non-finite" in capsys.readouterr().err


# ---- bad input ------------------------------------------------------------------------------


def test_missing_corpus_is_one_line_without_traceback(tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    assert main(["--preset", "smoke", "--corpus", f"file:{missing}", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [f"error: corpus path {missing} does not exist"]


@pytest.mark.parametrize("args, needle", [
    (["--lr", "fast"], "--lr expects a number, got 'fast'"),
    (["--n_layer", "2.5"], "--n_layer expects an integer"),
    (["--bias", "maybe"], "--bias expects a boolean"),
    (["--colour", "red"], "unknown option --colour: neither a flag nor a config key"),
    (["--connection", "resnet"], "unknown connection 'resnet'; valid connections: "),
    (["--n_head", "3"], "n_embd (32) must be divisible by n_head (3)"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--lr"], "--lr needs a value"),
    (["stray"], "unexpected argument 'stray'"),
    (["--batch_size", "4000"], "smaller than one batch"),
    (["--muon_distributed", "zero3"], "muon_distributed must be one of sharded, replicated"),
    (["--muon_ns_dtype", "fp8"], "muon_ns_dtype must be one of auto, bfloat16, float32; got 'fp8'"),
    # the smoke preset trains with adamw, which does not use the policy: still never ignored
    (["--policy", "hetro"], ("policy must be one of all-dgram, all-stiefel, hetero, hetero-inv, "
                             "unconstrained; got 'hetro'")),
    # values past what torch can take: refused by name, not a crash inside torch
    (["--threads", str(10**20)], "threads must be at most 4096, got 1000"),
    (["--n_embd", str(10**20)], "n_embd must be at most 2**31 - 1"),
    (["--vocab_size", "100"], "vocab_size 100 is smaller than the vocabulary of corpus"),
    (["--fsdp", "--dtype", "float16"], "dtype 'float16' with fsdp is not supported"),
    (["--fsdp", "--device", "mps"], "fsdp runs on cpu (gloo) or cuda (nccl), not on mps"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, args, needle):
    argv = ["--preset", "smoke", *args] if "--preset" not in args else args
    assert main([*argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


@pytest.mark.slow  # a fresh interpreter under an address-space cap (~5 s)
def test_a_model_too_large_for_memory_is_one_line(tmp_path):
    # the address space capped at 4 GiB (the trainer itself needs under 1): the 16 GiB token
    # embedding cannot be allocated, and the CPU allocator's error becomes one line
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    r = subprocess.run([sys.executable, "-m", "models.train", *_quiet(), "--n_embd",
                        str(1 << 24), "--n_head", "1", "--out", str(tmp_path / "r")], cwd=REPO,
                       capture_output=True, text=True, timeout=300, preexec_fn=cap,
                       check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: out of memory on cpu building the model: "
                               "DefaultCPUAllocator: can't allocate memory"), r.stderr
    assert "lower batch_size" in r.stderr and "checkpoint" not in r.stderr
    assert r.stderr.count("\n") == 1


def test_padded_vocabulary_trains_and_samples_only_tokens(tmp_path):
    # --vocab_size pads the model's vocabulary past the corpus's (256 bytes); the end-of-run
    # sample decodes, so no padded id was drawn
    out = tmp_path / "r"
    assert main(["--preset", "smoke", "--steps", "4", "--vocab_size", "320",
                 "--out", str(out)]) == 0
    state = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    assert state["wte.weight"].shape[0] == 320
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 320


def test_incomplete_torchrun_environment_exits_2_before_training(tmp_path, capsys,
                                                                  monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*_quiet(), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: incomplete torchrun environment: WORLD_SIZE set but "
                          "LOCAL_RANK, RANK missing")
    assert not (tmp_path / "r").exists()


def test_tiny_text_file_corpus_is_rejected(tmp_path, capsys):
    path = tmp_path / "tiny.txt"
    path.write_text("print('hi')\n" * 5)
    assert main(["--preset", "smoke", "--corpus", f"file:{path}", "--out",
                 str(tmp_path / "r")]) == 2
    assert "smaller than one batch" in capsys.readouterr().err
    assert not (tmp_path / "r" / "checkpoint.pt").exists()


# ---- configuration layers -------------------------------------------------------------------


FLAGS = "--preset, --config, --out, --steps, --corpus, --resume and --help"


@pytest.mark.parametrize("args, line", [
    (["--presset", "smoke"], ("unknown option --presset: neither a flag nor a config key; did you "
                              "mean the flag --preset?")),
    # a misspelt switch is named before its missing value is
    (["--resum"], ("unknown option --resum: neither a flag nor a config key; did you mean the "
                   "flag --resume?")),
    (["--lrr", "1e-3"], ("unknown option --lrr: neither a flag nor a config key; did you mean the "
                         "config key --lr?")),
    (["--block-lrr", "1e-3"], ("unknown option --block-lrr: neither a flag nor a config key; did "
                               "you mean the config key --block_lr?")),
    (["--zzzq", "1"], (f"unknown option --zzzq: neither a flag nor a config key; the flags are "
                       f"{FLAGS}, which lists the config keys (any of them is an option --key "
                       f"value)")),
    (["--preset", "smok"], ("unknown preset 'smok'; did you mean 'smoke'? available: smoke, "
                            "default, gpt2-small")),
])
def test_a_misspelt_option_is_one_line_naming_the_closest_flag_or_key(tmp_path, capsys, args,
                                                                      line):
    assert main([*args, "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == f"error: {line}\n"
    assert not (tmp_path / "r").exists()


def test_config_keys_are_the_flat_keys_of_a_config():
    assert list(config_keys()) == sorted(TrainConfig().to_dict())
    assert "n_layer" in config_keys() and "shard_dtype" in config_keys()
    assert "model" not in config_keys() and "preset" not in config_keys()


def test_the_compare_cli_names_a_misspelt_key_too(capsys):
    from models.compare import main as compare

    assert compare(["--suite", "sel", "--quick", "--jbos", "1"]) == 2
    assert capsys.readouterr().err == ("error: unknown option --jbos: neither a flag nor a "
                                       "config key; did you mean the flag --jobs?\n")


@pytest.mark.parametrize("text, line", [
    ('presett = "smoke"\n', ("unknown config key 'presett' in config file {toml}; did you mean "
                             "'preset'?")),
    ("lrr = 0.1\n", "unknown config key 'lrr' in config file {toml}; did you mean 'lr'?"),
    ('lr = "fast"\n', "'lr' in config file {toml} expects a number, got 'fast'"),
])
def test_a_config_files_bad_key_or_value_is_named_as_a_key_of_that_file(tmp_path, capsys, text,
                                                                        line):
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    assert main(["--config", str(toml), "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == f"error: {line.format(toml=toml)}\n"


def test_toml_preset_and_overrides_stack_in_order(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "smoke"\nlr = 0.005\nbias = true\nconnection = "pre-ln"\n')
    cfg = build_config(toml_path=toml, overrides={"lr": "2e-3", "n_layer": "3"})
    assert cfg.n_embd == PRESETS["smoke"]["n_embd"]           # from the preset
    assert cfg.bias is True and cfg.connection == "pre-ln"    # from the file
    assert cfg.lr == 2e-3 and cfg.n_layer == 3                # the command line wins
    toml.write_text("lr = [1, 2]\n")
    with pytest.raises(ConfigError, match="must be a plain value"):
        build_config(toml_path=toml)
    toml.write_text("lr = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config(toml_path=toml)


def test_every_field_can_be_overridden_with_its_type():
    changed = {bool: lambda v: str(not v).lower(), int: lambda v: str(v + 1),
               float: lambda v: repr(v * 0.5 if v else 0.25)}
    for name, value in TrainConfig().to_dict().items():
        if type(value) not in changed:
            continue
        text = changed[type(value)](value)
        try:
            cfg = build_config(overrides={name: text})
        except ConfigError:   # a legal type but an illegal value for this field, e.g. stop_at
            continue
        assert getattr(cfg, name) != value and type(getattr(cfg, name)) is type(value)


def test_parse_overrides_forms():
    assert parse_overrides(["--lr", "1e-3", "--bias=true", "--p", "-1"]) == {
        "lr": "1e-3", "bias": "true", "p": "-1"}
    # a boolean key alone is a switch; a value still wins
    assert parse_overrides(["--fsdp", "--steps", "3", "--compile"]) == {
        "fsdp": "true", "steps": "3", "compile": "true"}
    assert build_config(overrides=parse_overrides(["--fsdp", "off"])).fsdp is False
    with pytest.raises(ConfigError, match=r"p must be a number in \(0, inf\], got -1.0"):
        build_config(overrides={"p": "-1"})


def test_every_model_field_can_be_set_from_the_command_line():
    """Every GPTConfig field but the corpus-given vocab_size is a flat config key that reaches
    the nested model (routed by GPTConfig's field names, so new fields need no trainer code)."""
    import dataclasses

    from models.config import MODEL_KEYS
    from models.gpt import GPTConfig

    names = [f.name for f in dataclasses.fields(GPTConfig) if f.name != "vocab_size"]
    assert list(MODEL_KEYS) == names
    assert set(names) <= TrainConfig().to_dict().keys()
    assert not {f.name for f in dataclasses.fields(TrainConfig)} & set(names)  # not repeated
    cfg = build_config("smoke", overrides=parse_overrides(["--alpha_init", "2.5", "--damping", "linear"]))
    assert cfg.model.alpha_init == 2.5 and cfg.alpha_init == 2.5
    model = train_mod.build_model(cfg, vocab_size=256)
    assert model.config.alpha_init == 2.5 and model.config.damping == "linear"
    assert model.config.vocab_size == 256


def test_config_round_trips_through_its_flat_dict():
    cfg = build_config("smoke", overrides={"n_layer": "3", "dtype": "bfloat16", "lr": "2e-3"})
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(n_layer=5).model.n_layer == 5 and cfg.replace(lr=1.0).lr == 1.0
    with pytest.raises(ConfigError, match="unknown config key 'colour'; valid keys: adamw_lr, "):
        TrainConfig.from_dict({**cfg.to_dict(), "colour": "red"})
    with pytest.raises(ConfigError, match=r"^unknown config key 'n_layers'; did you mean "
                                          r"'n_layer'\?$"):
        TrainConfig.from_dict({**cfg.to_dict(), "n_layers": 3})
    with pytest.raises(AttributeError, match="colour"):
        cfg.colour  # noqa: B018


@pytest.mark.parametrize("key", ["alpha_init", "dyt_alpha_init", "dyt_alpha_attn", "dropout"])
def test_a_boolean_model_number_in_a_saved_config_is_refused(key):
    """A hand-edited config.json with "alpha_init": true built a model with alpha_init 1.0 (and
    "dropout": false one with dropout 0.0): the training fields refuse a bool for a number, the
    model's did not."""
    with pytest.raises(ConfigError, match=rf"{key} must be .*got (True|False)"):
        TrainConfig.from_dict({**TrainConfig().to_dict(), key: key != "dropout"})


def _groups_by_lr(opt) -> dict[float, set[int]]:
    out: dict[float, set[int]] = {}
    for g in opt.param_groups:
        out.setdefault(g["lr"], set()).update(id(p) for p in g["params"])
    return out


@pytest.mark.parametrize("sel", ["none", "mismatched"])
def test_block_lr_steps_the_block_matrices_apart_and_nothing_else(sel):
    """block_lr: the attention and MLP matrices (SEL's raw coordinates where charted) at their own
    lr, every other parameter where it was, each once; 0 leaves the groups as they were."""
    from models.train import build_model, build_train_optimizer

    base = {"sel": sel, "lr": 3e-3, "sel_scale_lr": 5e-3}
    cfg = build_config("smoke", overrides={**base, "block_lr": 1e-3})
    model = build_model(cfg, vocab_size=256)
    opt, mults = build_train_optimizer(model, cfg)
    assert len(mults) == len(opt.param_groups)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len([p for p in model.parameters() if p.requires_grad])
    names = {id(p): n for n, p in model.named_parameters()}
    block = {n for n, p in model.named_parameters()
             if (".attn." in n or ".mlp." in n)
             and n.endswith((".weight", ".parametrizations.weight.original"))}
    assert block and {names[i] for i in _groups_by_lr(opt)[1e-3]} == block
    if sel != "none":  # the charts' raw coordinates, their scales still at sel_scale_lr
        assert all("parametrizations.weight.original" in n for n in block)
        assert _groups_by_lr(opt)[5e-3]
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert {id(p) for n, p in model.named_parameters() if n in block} <= decayed
    # without block_lr: the groups of before, no block group
    plain, _ = build_train_optimizer(build_model(build_config("smoke", overrides=base), 256),
                                     build_config("smoke", overrides=base))
    assert len(plain.param_groups) == len(opt.param_groups) - 1
    assert 1e-3 not in _groups_by_lr(plain)


def test_sel_kappa_sets_every_charts_curvature():
    """sel_kappa is the chart's kappa: beta = kappa / (sigma_0 m_0) scales with it exactly;
    under the congruent init (an exact right inverse) the initial effective weights do not move
    with it; a non-positive value is refused."""
    from models.train import build_model

    def charts(kappa, variant):
        torch.manual_seed(0)
        model = build_model(build_config("smoke", overrides={"sel": variant,
                                                             "sel_kappa": kappa}), 256)
        return model, {n: m.parametrizations.weight[0] for n, m in model.named_modules()
                       if hasattr(m, "parametrizations")}

    for variant in ("mismatched", "congruent"):
        (one, at_one), (half, at_half) = charts(1.0, variant), charts(0.5, variant)
        assert at_one and at_one.keys() == at_half.keys()
        for name, chart in at_one.items():
            assert float(at_half[name].beta) == pytest.approx(0.5 * float(chart.beta), rel=1e-6)
        for (n, p), (_, q) in zip(one.named_parameters(), half.named_parameters(), strict=True):
            if "parametrizations" not in n:
                assert torch.equal(p, q), n
    for name in at_one:  # congruent
        torch.testing.assert_close(one.get_submodule(name).weight,
                                   half.get_submodule(name).weight, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="sel_kappa must be > 0, got 0.0"):
        build_config("smoke", overrides={"sel_kappa": 0.0})


def test_block_lr_is_refused_with_manifold_muon():
    from models.train import build_model, build_train_optimizer

    cfg = build_config("smoke", overrides={"optimizer": "manifold-muon", "block_lr": 1e-3})
    with pytest.raises(ConfigError, match=r"block_lr=0.001 applies to optimizer='adamw'"):
        build_train_optimizer(build_model(cfg, vocab_size=256), cfg)
    with pytest.raises(ConfigError, match="block_lr must be >= 0, got -0.1"):
        build_config("smoke", overrides={"block_lr": -0.1})


@pytest.mark.skipif(not _has_build_optimizer(), reason="manifoldlib.optim not available")
@pytest.mark.parametrize("policy", ["unconstrained", "hetero"])
def test_muon_weight_decay_reaches_the_unconstrained_matrices_only(policy):
    """The seed's recipe: unconstrained Muon decays by 0.1, the manifold path not at all (DGram's
    column norms are its uncontrolled scale). Before muon_weight_decay the trainer passed no decay
    to ManifoldMuon at all, while weight_decay (0.1) reached the AdamW groups only."""
    from models.train import build_model, build_train_optimizer

    cfg = build_config("smoke", overrides={"optimizer": "manifold-muon", "policy": policy,
                                           "weight_decay": 0.05})
    assert cfg.muon_weight_decay == 0.1
    opt, _ = build_train_optimizer(build_model(cfg, vocab_size=256), cfg)
    decay = {g.get("manifold", "adamw"): g["weight_decay"] for g in opt.param_groups
             if g.get("manifold") != "stiefel" and (g.get("manifold") or g["weight_decay"])}
    want = {"unconstrained": {"euclidean": 0.1, "adamw": 0.05},
            "hetero": {"dgram": 0.0, "adamw": 0.05}}[policy]
    assert decay == want
    cfg0 = cfg.replace(muon_weight_decay=0.0)
    opt0, _ = build_train_optimizer(build_model(cfg0, vocab_size=256), cfg0)
    assert all(g["weight_decay"] == 0.0 for g in opt0.param_groups if g.get("manifold") == "euclidean")
    with pytest.raises(ConfigError, match="muon_weight_decay must be >= 0, got -1"):
        build_config("smoke", overrides={"muon_weight_decay": -1.0})
