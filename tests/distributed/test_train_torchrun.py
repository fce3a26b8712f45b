"""``python -m torch.distributed.run ... -m models.train``: the documented command, end to end.

Slow (three torchrun launches of two interpreters each); ``.ci/run`` runs it with ``-m slow``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.config import PRESETS
from models.train import read_metrics

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
COMPARED = ("step", "train_loss", "val_loss", "lr", "tokens", "grad_norm")


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    done = subprocess.run([*TORCHRUN, "-m", "models.train", *args], cwd=REPO, env=env, check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_torchrun_trains_writes_one_run_directory_and_resumes(tmp_path: Path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    done = _torchrun("--preset", "smoke", "--out", str(full))
    for name in ("config.json", "metrics.jsonl", "loss.png", "checkpoint.pt", "summary.json",
                 "sample.txt"):
        assert (full / name).is_file(), name
    assert not list(full.glob("*.tmp"))
    summary = json.loads((full / "summary.json").read_text())
    smoke = PRESETS["smoke"]
    assert summary["world_size"] == 2 and summary["finished"]
    assert summary["tokens"] == smoke["steps"] * smoke["batch_size"] * smoke["block_size"]
    assert summary["val_loss"] < math.log(256) - 1.0
    # only rank 0 logs: one start line and one line per evaluation, not two
    assert done.stdout.count("on 2 processes (cpu)") == 1
    assert done.stdout.count(f"step {smoke['steps']}/{smoke['steps']}:") == 1
    rows = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, *range(5, smoke["steps"] + 1, 5)]  # no duplicates
    assert done.stdout.count(f"step 0/{smoke['steps']}:") == 1

    _torchrun("--preset", "smoke", "--sample_tokens", "0", "--stop_at", "20", "--out", str(part))
    assert json.loads((part / "summary.json").read_text())["steps"] == 20
    resumed = _torchrun("--resume", "--out", str(part))
    assert "resuming" in resumed.stdout and "at step 20 on 2 processes" in resumed.stdout
    again = read_metrics(part / "metrics.jsonl")
    assert [{k: r.get(k) for k in COMPARED} for r in again] == \
        [{k: r.get(k) for k in COMPARED} for r in rows]
    state_full = torch.load(full / "checkpoint.pt", weights_only=False)
    state_part = torch.load(part / "checkpoint.pt", weights_only=False)
    assert state_part["world_size"] == 2 and state_part["step"] == smoke["steps"]
    assert all(torch.equal(state_full["model"][k], state_part["model"][k])
               for k in state_full["model"])
