"""Dual iterations of steepest_direction's plain-dual update rules on random instances.

    python benchmarks/bench_dual_iterations.py [--tol 1e-3] [--cap 100] [--seeds 3]
        [--msign polar-express]

Counts, not times: for Stiefel and DGram matrices of 64x16 and 256x64, with a Gaussian and a
low-rank (decaying spectrum) gradient, the iterations Barzilai-Borwein steps (``bb``) and
Anderson-mixed eigenbasis-preconditioned steps (``anderson``) need to reach the tolerance,
in float64 with the smoothed fallback off. ``*`` marks a solve that stopped above it. The
instances are those of ``tests/optim/test_steepest.py`` (orthonormal W, DGram columns scaled by
exp(N(0, 1/4))).

    python benchmarks/bench_dual_iterations.py --aspects 1.5,2,2.25,2.5,3,4 [--columns 64] [--seeds 3]

The evidence for ``smoothing="auto"``'s threshold (``SMOOTH_BELOW_ASPECT``): for tall matrices of
``--columns`` columns and ``m = aspect x columns`` rows, Gaussian gradients, the optimizer's dual
options (``tol`` 1e-3, patience 6) with the ``--msign`` map (Polar Express by default: near the
exact polar factor, so that ``loss`` measures the dual, not the map), in float64: on the eigh path the plain
dual's iterations (cap ``--cap``; ``*`` above ``tol``) against the smoothed dual's Newton steps and
Hessian products from the start; on the sync-free products path, the tangent residual each reaches
in its fixed iterations (plain: the default count; smoothed: four times it). In parentheses the
median loss ``1 - <G, A'>/p*`` of ``bench_direction_quality.py`` (``A`` projected onto the tangent
space and scaled into the unit ball, ``p*`` the certified optimum).
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
    parser.add_argument("--aspects", default=None, help="comma-separated m/n: the smoothing threshold table")
    parser.add_argument("--columns", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.aspects is not None:
        aspects([float(a) for a in args.aspects.split(",")], args.columns, args.seeds, args.cap, args.msign)
        return
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


def aspects(ratios: list[float], n: int, seeds: int, cap: int, msign: str) -> None:
    """The smoothing-threshold table (see the module docstring)."""
    from bench_direction_quality import exact_optimum, loss

    from manifoldlib import DGram, Stiefel
    from manifoldlib.optim.options import AUTO_SMOOTHING

    kw = {"msign_method": msign, "tol": 1e-3, "patience": 6, "gap_tol": None, "return_info": True}
    print(f"n {n}, msign {msign}, tol 1e-3, cap {cap}, kappa {AUTO_SMOOTHING}, float64, {seeds} seeds (median); "
          f"eigh: iterations [Hessian products]; products (sync-free): residual")
    print(f"{'manifold':9s} {'m/n':>5s} {'eigh plain':>16s} {'eigh smoothed':>22s} "
          f"{'sync-free plain':>22s} {'sync-free smoothed':>22s}")
    for manifold in ("stiefel", "dgram"):
        for ratio in ratios:
            m = round(ratio * n)
            cells = {key: [] for key in ("ep", "es", "pp", "ps")}
            for seed in range(seeds):
                w, g = instance(m, n, manifold, seed, lowrank=False)
                optimum = exact_optimum(w, g, manifold)
                geometry = Stiefel() if manifold == "stiefel" else DGram()
                for key, opts in (("ep", {"spectral": "eigh", "smoothing": None, "max_iter": cap}),
                                  ("es", {"spectral": "eigh", "smoothing": AUTO_SMOOTHING, "max_iter": cap}),
                                  ("pp", {"spectral": "products", "smoothing": None}),
                                  ("ps", {"spectral": "products", "smoothing": AUTO_SMOOTHING})):
                    a, info = steepest_direction(w, g, manifold, **opts, **kw)
                    cells[key].append((info, loss(geometry, w, g, a, optimum)))
            med = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
            ep = " ".join(f"{i.iterations}{'' if i.converged else '*'}" for i, _ in cells["ep"])
            es = " ".join(f"{i.iterations}[{i.hessian_products}]" for i, _ in cells["es"])
            row = [f"{ep} ({med([x for _, x in cells['ep']]):.0e})", f"{es} ({med([x for _, x in cells['es']]):.0e})"]
            for key in ("pp", "ps"):
                row.append(f"{med([i.residual for i, _ in cells[key]]):.1e} ({med([x for _, x in cells[key]]):.0e})")
            print(f"{manifold:9s} {ratio:5.2f} {row[0]:>16s} {row[1]:>22s} {row[2]:>22s} {row[3]:>22s}", flush=True)


if __name__ == "__main__":
    main()
