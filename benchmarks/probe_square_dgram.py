"""Iterations of a square DGram steepest-direction solve (the smoothed dual) under precision variants.

    python benchmarks/probe_square_dgram.py [--n 768] [--seeds 2] [--device cuda]

The smoothed Newton–CG solve of a square DGram matrix converged in 20–22 Newton steps on the
development CPU but, in float32, stopped at its cap of 30 above the tolerance on an H200 (torch
2.11, 2026-11-29): 1.2–1.5e-3 with bfloat16 or float32 search products, while the float64 solve
converged in 17–18 steps. Since then a float32 solve smoothed from the start runs in float64 on
CUDA (:attr:`manifoldlib.optim.ExecutionPolicy.smoothed_dtype`). Variants, each an explicit
:class:`~manifoldlib.optim.ExecutionPolicy`: ``float32`` (that widening switched off, bfloat16
Hessian-vector products where native), ``float32, f32 search`` (every search product in float32
too), ``library default`` (the policy resolved for the device) and ``float64`` (float64 inputs).
Prints per variant and seed: Newton steps, final residual, time, and the residual history.

``--profile`` then profiles one solve of the shipped configuration (``torch.profiler``, the
operators sorted by their own device time, CPU time on a CPU): where a solve's time goes.
``--rows M`` (``M > n``) probes a tall ``M × n`` matrix instead (plain dual, no smoothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from manifoldlib.optim import ExecutionPolicy, steepest_direction


def _instance(m: int, n: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    w = torch.linalg.qr(torch.randn(m, n, generator=g))[0] * torch.exp(0.1 * torch.randn(n, generator=g))
    signal = torch.randn(m, 16, generator=g) @ torch.randn(16, n, generator=g) / (m * n) ** 0.5
    return w.to(device), (signal + 0.3 * torch.randn(m, n, generator=g) / m**0.5).to(device)


def _profile(w: torch.Tensor, g: torch.Tensor) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if w.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        steepest_direction(w, g, "dgram", msign_method="jordan5", tol=1e-3, max_iter=30)
        if w.device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if w.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=40))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=768)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--rows", type=int, default=0, help="rows M of a tall M x n instance (default: square)")
    parser.add_argument("--profile", action="store_true", help="profile one solve of the shipped configuration")
    args = parser.parse_args()
    rows = max(args.rows, args.n)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"DGram {rows}x{args.n} on {device}, jordan5 dual msign, tol 1e-3, cap 30")
    default = ExecutionPolicy.resolve(device)
    policies = {
        "float32": dataclasses.replace(default, smoothed_dtype=None),
        "float32, f32 search": dataclasses.replace(default, smoothed_dtype=None, search_dtype=None),
        "library default": default,
        "float64": default,
    }
    for variant, policy in policies.items():
        for seed in range(args.seeds):
            w, g = _instance(rows, args.n, seed, device)
            if variant == "float64":
                w, g = w.double(), g.double()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            _, info = steepest_direction(w, g, "dgram", msign_method="jordan5", tol=1e-3, max_iter=30,
                                         execution=policy, return_info=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            history = " ".join(f"{h:.1e}" for h in info.history)
            print(f"{variant:20s} seed {seed}: {info.iterations:3d} steps, residual {info.residual:.2e}, "
                  f"{seconds:6.2f} s | {history}", flush=True)
    if args.profile:
        _profile(*_instance(rows, args.n, 0, device))

if __name__ == "__main__":
    main()
