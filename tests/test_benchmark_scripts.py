"""The Manifold Muon benchmark scripts still run (tiny sizes, CPU): they are run by hand on lent
GPU machines, where a crash costs device time. Nothing here is timed; the tests check that each
script finishes and prints its table."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"

CASES = {
    "bench_spectral_primitives.py": (
        ["--rows", "48", "--cols", "12", "--repeats", "1", "--threads", "1", "--anchor", "float32"],
        ["torch.optim.Muon, float32 NS step 48x12 (anchor)", "eigh 12^2 float32", "dgram 12x12 (products)",
         "bfloat16 products", "Gram Newton-Schulz X R (48x12, float32)",
         "relative difference to Newton-Schulz on X in float64: float32 Gram form"],
    ),
    "bench_manifold_muon.py": (
        ["--shapes", "48x12,12x12", "--layers", "2", "--steps", "1", "--warmup", "2", "--threads", "2",
         "--only", "stiefel", "--spectral", "products", "--anchor", "float32"],
        ["(12, 12)] x 2 layer(s)", "spectral products", "after 2 untimed", "sync-free auto", "ManifoldMuon stiefel",
         "max resid", "bfloat16 products", "anchor: torch.optim.Muon, float32 NS (anchor)"],
    ),
    "bench_step_counts.py": (
        ["--blocks", "2", "--width", "16", "--time-blocks", "1", "--time-steps", "1", "--warmup", "1",
         "--threads", "1", "--anchor", "float32"],
        ["12 matrices (2 blocks of width 16)", "ManifoldMuon stiefel", "ManifoldMuon hetero", "x anchor",
         "syncs", "GFLOP"],
    ),
    "bench_reference_dual.py": (
        ["--rows", "48", "--cols", "12", "--rank", "2", "--steps", "5", "--threads", "1", "--families", "all"],
        ["stiefel 48x12, rank 2", "manifoldlib steepest_direction (float32)", "manifoldlib, Polar Express",
         "reference dual, 5 steps, PE in float32", "reference dual, 5 steps, PE in bfloat16", "gap",
         "low-rank-1pct", "full-rank", "nearly-normal", "square"],
    ),
    "bench_fsdp_exchange.py": (
        ["--blocks", "1", "--width", "16", "--ranks", "2,3"],
        ["6 matrices (1 blocks of width 16)", "stiefel / dgram", "euclidean", "x minimum"],
    ),
    "check_step_syncs.py": (
        ["--device", "cpu", "--blocks", "1", "--width", "16", "--steps", "1"],
        ["6 matrices (1 blocks of width 16) on cpu", "stiefel, two learning rates, LambdaLR",
         "stiefel, one non-finite gradient", "syncs per step after the first: [0]"],
    ),
    "bench_tiny_model.py": (
        ["--layers", "1", "--width", "16", "--steps", "2", "--warmup", "1", "--load", "0", "--threads", "1"],
        ["tiny LLaMA: 1 layers, width 16", "load 0, threads       1: ManifoldMuon hetero"],
    ),
}


@pytest.mark.slow  # seven subprocesses, about 5 s each; CI runs them with -m slow
@pytest.mark.parametrize("script", list(CASES))
def test_script_runs_and_prints_its_table(script):
    args, expected = CASES[script]
    root = str(BENCHMARKS.parent)  # this checkout's manifoldlib, whatever is installed
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=300, check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for text in expected:
        assert text in done.stdout, (text, done.stdout[-2000:])


def test_float32_anchor_is_torch_muon_with_a_float32_newton_schulz():
    """The anchor used where bfloat16 is emulated: torch.optim.Muon's own step with only the
    iteration's precision changed — it equals ManifoldMuon's ``ns_dtype="float32"`` on Euclidean
    groups and differs from the bfloat16 torch.optim.Muon."""
    import torch

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from _anchors import Float32Muon, muon_anchor
    finally:
        sys.path.remove(str(BENCHMARKS))
    from manifoldlib.optim import ManifoldMuon

    start = torch.randn(40, 24, generator=torch.Generator().manual_seed(0))
    params = [torch.nn.Parameter(start.clone()) for _ in range(3)]
    opts = [Float32Muon([params[0]], lr=0.02), ManifoldMuon([{"params": [params[1]], "ns_dtype": "float32"}], lr=0.02),
            torch.optim.Muon([params[2]], lr=0.02)]
    for k in range(5):
        grad = torch.randn(40, 24, generator=torch.Generator().manual_seed(k + 1))
        for p, opt in zip(params, opts):
            p.grad = grad.clone()
            opt.step()
    assert float((params[0] - params[1]).abs().max()) <= 1e-6
    assert float((params[0] - params[2]).abs().max()) > 1e-5
    assert muon_anchor("float32", torch.device("cpu"))[1] is Float32Muon
    assert muon_anchor("bfloat16", torch.device("cpu"))[1] is torch.optim.Muon
