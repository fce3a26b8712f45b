"""The Manifold Muon benchmark scripts still run (tiny sizes, CPU): they are run by hand on lent
GPU machines, where a crash costs device time. Nothing here is timed; the tests check that each
script finishes and prints its table."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"

CASES = {
    "bench_spectral_primitives.py": (
        ["--rows", "48", "--cols", "12", "--repeats", "1", "--threads", "1"],
        ["torch.optim.Muon step 48x12 (anchor)", "eigh 12^2 float32", "dgram 12x12 (products)"],
    ),
    "bench_manifold_muon.py": (
        ["--shapes", "48x12,12x12", "--steps", "1", "--warmup", "2", "--threads", "2", "--workers", "2",
         "--only", "stiefel", "--spectral", "products"],
        ["spectral products", "after 2 untimed", "workers 2", "ManifoldMuon stiefel", "max resid"],
    ),
    "bench_concurrent_solves.py": (
        ["--steps", "1", "--threads", "2", "--scale", "4", "--size", "32", "--sets", "gpt,imbalanced"],
        ["eigh 32^2 float32", "set gpt: 4 stiefel matrices", "auto decides 2 worker(s)",
         "set imbalanced", "auto decides 1 worker(s)", "side by side (2)"],
    ),
    "probe_square_dgram.py": (
        ["--n", "12", "--seeds", "1", "--threads", "1"],
        ["DGram 12x12 on cpu", "float32, f32 search", "default, bf16 search", "float64"],
    ),
}


@pytest.mark.parametrize("script", list(CASES))
def test_script_runs_and_prints_its_table(script):
    args, expected = CASES[script]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for text in expected:
        assert text in done.stdout, (text, done.stdout[-2000:])
