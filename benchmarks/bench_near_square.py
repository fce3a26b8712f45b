"""ManifoldMuon on near-square matrices: smoothing from the start against the plain dual first.

Below ``m/n = 2.5`` (tall orientation) ``smoothing="auto"`` solves the smoothed dual from the start
(:data:`manifoldlib.optim.dual_solvers.SMOOTH_BELOW_ASPECT`); the old rule ran the plain dual
first and smoothed only after it stalled. This script times both on the same gradients (the
generator of ``bench_manifold_muon.py``) against torch.optim.Muon in the same process and prints
seconds per step, the ratio, the dual iterations of every solve and the largest residual.

    python benchmarks/bench_near_square.py [--shapes 1024x768,768x1024] [--steps 4] [--threads 2]
        [--anchor auto|bfloat16|float32]

``--anchor`` as in ``bench_manifold_muon.py`` (float32 Newton–Schulz where bfloat16 is emulated).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_manifold_muon as bench  # the shared gradient and parameter generators
from _anchors import ANCHORS, bfloat16_line, muon_anchor

from manifoldlib.optim import ManifoldMuon, dual_solvers


def _steps(manifold: str, grads, old_rule: bool, anchor_cls=torch.optim.Muon) -> dict:
    saved = dual_solvers.SMOOTH_BELOW_ASPECT
    dual_solvers.SMOOTH_BELOW_ASPECT = 0.0 if old_rule else saved
    try:
        params = bench._params()
        opt = ManifoldMuon(params, lr=0.02, weight_decay=0.0, manifold=manifold,
                           dual={"tol": 1e-3, "max_iter": 30})
        anchor_params = bench._params()
        anchor = anchor_cls(anchor_params, lr=0.02)
        times, anchors, iterations, residuals = [], [], [], []
        for k, step_grads in enumerate(grads):
            t_anchor = bench._timed_step(anchor, anchor_params, step_grads)
            t_opt = bench._timed_step(opt, params, step_grads)
            if k == 0:
                continue
            times.append(t_opt)
            anchors.append(t_anchor)
            iterations += [opt.state[p]["dual_iterations"] for p in params]
            residuals += [opt.state[p]["dual_residual"] for p in params]
    finally:
        dual_solvers.SMOOTH_BELOW_ASPECT = saved
    return {
        "time": statistics.median(times),
        "ratio": statistics.median(times) / statistics.median(anchors),
        "iterations": iterations,
        "residual": max(residuals),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1024x768,768x1024")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--anchor", default="auto", choices=ANCHORS,
                        help="Muon anchor precision: auto (bfloat16 where native, else float32)")
    args = parser.parse_args()
    anchor_name, anchor_cls = muon_anchor(args.anchor, torch.device("cpu"))
    bench.SHAPES[:] = [tuple(int(k) for k in item.split("x")) for item in args.shapes.split(",")]
    torch.set_num_threads(args.threads)
    grads = bench._gradients(args.steps + 1)
    print(f"shapes {bench.SHAPES}, {args.steps} timed steps, {args.threads} threads, dual tol 1e-3, cap 30; "
          f"{bfloat16_line(torch.device('cpu'))}; anchor: {anchor_name}")
    for manifold in ("stiefel", "dgram"):
        for label, old_rule in (("smoothed from the start (auto)", False), ("plain dual first (old rule)", True)):
            r = _steps(manifold, grads, old_rule, anchor_cls)
            print(f"{manifold:8s} {label:32s} {r['time']:7.3f} s/step {r['ratio']:7.1f}x Muon  "
                  f"iterations {r['iterations']}  max resid {r['residual']:.1e}", flush=True)


if __name__ == "__main__":
    main()
