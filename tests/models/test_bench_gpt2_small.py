"""benchmarks/bench_gpt2_small.py runs in its tiny CPU mode and prints its table (a GPU run
costs device time: a crash there should be caught here). Nothing is timed."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a subprocess training two tiny arms: about 5 s
def test_bench_gpt2_small_quick_prints_both_arms():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpt2_small.py"),
                           "--quick", "--peak_flops", "1e12"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpt2-small (--quick: tiny), 5 steps on cpu")
    for arm in ("spheret+hetero", "pre-ln+adamw"):
        row = next(line for line in lines if line.startswith(arm))
        assert "%" in row and "n/a" not in row, row  # MFU (given peak) and optimizer share
    assert "spheret+hetero tokens/s / pre-ln+adamw: " in lines[-1]
