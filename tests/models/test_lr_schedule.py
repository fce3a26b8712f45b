"""The learning-rate schedule of ``models.train``: linear warm-up, then a cosine whose last update
is at ``min_lr_ratio``; runs saved before ``lr_schedule_version`` keep the formula they began with."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from models.config import ConfigError, TrainConfig, build_config
from models.run_dir import load_checkpoint, save_checkpoint
from models.train import lr_scale, main, read_metrics, run_training

#: ``(steps, warmup_steps)``: a warm-up of 0 and of 1, one update of decay (warm-up = steps - 1),
#: short and long decays.
RUNS = [(30, 5), (8, 5), (600, 30), (100, 10), (5, 0), (2, 0), (7, 1), (6, 5)]


def _multipliers(steps: int, warmup: int, **over) -> list[float]:
    """The multiplier of each of the run's updates, as the trainer reads them."""
    cfg = TrainConfig(steps=steps, warmup_steps=warmup, **over)
    return [lr_scale(t, cfg) for t in range(steps)]


def _version_1(t: int, steps: int, warmup: int, m: float) -> float:
    """The cosine of runs saved before ``lr_schedule_version``, written out by hand."""
    if t < warmup:
        return (t + 1) / warmup
    progress = min((t - warmup) / max(steps - warmup, 1), 1.0)
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("steps, warmup", RUNS)
@pytest.mark.parametrize("min_lr_ratio", [0.1, 0.0])
def test_the_last_update_of_a_cosine_run_is_at_min_lr_ratio(steps, warmup, min_lr_ratio):
    """The run's last update (``step = steps - 1``) was above ``min_lr_ratio``: 0.1036 at 30
    steps after 5 of warm-up, 0.325 at 8 after 5, 1.0 at 6 after 5; it is ``min_lr_ratio``."""
    assert _multipliers(steps, warmup, min_lr_ratio=min_lr_ratio)[-1] == min_lr_ratio


@pytest.mark.parametrize("steps, warmup", RUNS)
def test_the_peak_is_one_update_and_the_decay_never_rises(steps, warmup):
    """Warm-up ``(t + 1) / W`` reaches 1 at update ``W - 1`` (update 0 without one); the next
    update repeated 1. Exactly one update is at the peak, the decay after it never rises."""
    scales = _multipliers(steps, warmup, min_lr_ratio=0.1)
    assert scales[:warmup] == [(t + 1) / warmup for t in range(warmup)]
    peak = max(warmup, 1) - 1
    assert scales.count(1.0) == 1 and scales[peak] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(scales[peak:]))
    assert _multipliers(steps, warmup, schedule="constant")[peak:] == [1.0] * (steps - peak)


def test_an_unknown_schedule_version_is_refused_naming_it():
    from models.config import LR_SCHEDULE_VERSIONS

    assert LR_SCHEDULE_VERSIONS == (1, 2) and TrainConfig().lr_schedule_version == 2
    for bad in (0, 3):
        with pytest.raises(ConfigError, match=rf"^lr_schedule_version must be 2 \(.*\) or 1 "
                                              rf"\(.*\), got {bad}$"):
            TrainConfig(lr_schedule_version=bad)
    with pytest.raises(ConfigError, match="lr_schedule_version.* expects an integer, got '2.5'"):
        build_config(overrides={"lr_schedule_version": "2.5"})


def _tiny(**over) -> TrainConfig:
    return build_config("smoke", overrides={
        "steps": 8, "warmup_steps": 5, "n_layer": 1, "eval_interval": 4, "eval_batches": 1,
        "log_interval": 1, "sample_tokens": 0, "progress": False, "checkpoint": True, **over})


def _logged_lrs(out) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r}


def test_a_run_saved_before_the_version_resumes_with_its_own_formula(tmp_path, capsys):
    """A fresh run's last step is logged at ``lr * min_lr_ratio``. A run directory whose
    config.json and checkpoint have no ``lr_schedule_version`` (every run before the field) is
    version 1: a plain ``--resume`` continues it with that formula, bit for bit, and keeps it
    in config.json; asking for version 2 on resume is refused as a change of configuration."""
    from models.config import LEGACY_LR_SCHEDULE_VERSION

    fresh = tmp_path / "fresh"
    cfg = _tiny()
    run_training(cfg, fresh, echo=False)
    assert _logged_lrs(fresh)[8] == cfg.lr * cfg.min_lr_ratio

    old = tmp_path / "old"
    run_training(_tiny(stop_at=4), old, echo=False)
    ckpt = load_checkpoint(old, move_damaged=False)[0]
    saved = {k: v for k, v in ckpt["config"].items() if k != "lr_schedule_version"}
    save_checkpoint(old / "checkpoint.pt", {**ckpt, "config": saved}, -1)
    (old / "config.json").write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(["--resume", "--lr_schedule_version", "2", "--out", str(old)]) == 2
    assert "lr_schedule_version (1 -> 2)" in capsys.readouterr().err
    assert main(["--resume", "--out", str(old)]) == 0
    assert json.loads((old / "config.json").read_text())["lr_schedule_version"] \
        == LEGACY_LR_SCHEDULE_VERSION == 1
    assert _logged_lrs(old) == {t + 1: cfg.lr * _version_1(t, 8, 5, cfg.min_lr_ratio)
                                for t in range(8)}
