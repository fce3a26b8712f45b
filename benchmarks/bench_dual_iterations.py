"""Dual iterations of steepest_direction's plain-dual update rules on random instances.

    python benchmarks/bench_dual_iterations.py [--tol 1e-3] [--cap 100] [--seeds 3]
        [--msign polar-express]

Counts, not times: for Stiefel and DGram matrices of 64x16 and 256x64, with a Gaussian and a
low-rank (decaying spectrum) gradient, the iterations Barzilai-Borwein steps (``bb``) and
Anderson-mixed eigenbasis-preconditioned steps (``anderson``) need to reach the tolerance,
in float64 with the smoothed fallback off. ``*`` marks a solve that stopped above it. The
instances are those of ``tests/optim/test_steepest.py`` (orthonormal W, DGram columns scaled by
exp(N(0, 1/4))).
"""

from __future__ import annotations

import argparse

import torch

from manifoldlib.optim import steepest_direction


def instance(m: int, n: int, manifold: str, seed: int, lowrank: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))[0]
    if manifold == "dgram":
        w = w * torch.exp(0.5 * torch.randn(n, generator=g, dtype=torch.float64))
    if lowrank:
        u = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))[0]
        v = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
        grad = (u * torch.exp(-torch.arange(n, dtype=torch.float64) / (n / 4))) @ v.T
    else:
        grad = torch.randn(m, n, generator=g, dtype=torch.float64)
    return w, grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tol", type=float, default=1e-3)
    parser.add_argument("--cap", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--msign", default="polar-express")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"tol {args.tol}, cap {args.cap}, msign {args.msign}, float64, {args.seeds} seeds")
    print(f"{'manifold':9s} {'shape':8s} {'gradient':9s} {'bb':>16s} {'anderson':>16s}")
    for manifold in ("stiefel", "dgram"):
        for m, n in ((64, 16), (256, 64)):
            for lowrank in (False, True):
                row = []
                for update in ("bb", "anderson"):
                    counts = []
                    for seed in range(args.seeds):
                        w, g = instance(m, n, manifold, seed, lowrank)
                        _, info = steepest_direction(
                            w, g, manifold, tol=args.tol, max_iter=args.cap, msign_method=args.msign,
                            dual_update=update, smoothing=None, return_info=True,
                        )
                        counts.append(f"{info.iterations}{'' if info.converged else '*'}")
                    row.append(" ".join(counts))
                kind = "low rank" if lowrank else "Gaussian"
                print(f"{manifold:9s} {f'{m}x{n}':8s} {kind:9s} {row[0]:>16s} {row[1]:>16s}", flush=True)


if __name__ == "__main__":
    main()
