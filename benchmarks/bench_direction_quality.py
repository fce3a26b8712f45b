"""How far below the exact steepest direction the optimizer's direction lies, beside Muon's own loss.

    python benchmarks/bench_direction_quality.py [--seeds 3] [--dtype float64] [--sequence 0]

Counts, not times. For Stiefel and DGram instances of ``manifoldlib.testing.hard_instance``
(low rank plus noise; tall and square) the exact optimum :math:`p^* = \\max\\langle G, A\\rangle` over
the tangent unit ball comes from :func:`~manifoldlib.optim.steepest_direction` with the exact map, a
tight tolerance and, where the solve smooths the dual, a certified duality gap of at most 1e-6
(:func:`exact_optimum`: the default ``gap_tol`` of 1e-3 would leave :math:`p^*` up to 0.1 % low;
where the smoothing floor stops short of 1e-6, square DGram, the gap reached is printed). Each
candidate direction is projected onto the tangent space and scaled into the unit ball (divided by
its spectral norm when that exceeds 1), and its loss is
:math:`1 - \\langle G, A\\rangle/p^*`. Candidates: the optimizer's direction on the eigh path (Muon's
quintic inside the dual, solved to ``tol``) and on the products path (the same map, the fixed three
Barzilai-Borwein iterations of a sync-free step, cold), and Polar Express on the products path.
Beside them, Muon's own loss on the same gradient in Euclidean space (its five-step direction against
the nuclear norm), which is what "loses no more than Muon" compares with. Printed: the median and
the largest loss over the seeds.

``--sequence K`` then follows a training step more closely for the products path: at a fixed
point, ``K`` gradients :math:`G_t = G + 0.3\\,\\|G\\|_F/\\sqrt{mn}\\,N_t` (seed 0 of each case), each
solved from the previous solve's warm start (its ``correction``, as the optimizer carries it);
printed, the median loss over steps 4 to ``K`` beside Muon's over the same gradients.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from manifoldlib import DGram, Stiefel
from manifoldlib.functional import MUON_COEFFICIENTS, newton_schulz
from manifoldlib.optim import steepest_direction
from manifoldlib.testing import hard_instance

CASES = [(256, 64, 4, 0.01), (256, 64, 4, 0.1), (512, 128, 16, 0.1), (128, 128, 4, 0.1)]
CANDIDATES = {
    # the optimizer's dual options (DualOptions' defaults: tol 1e-3, patience 6, no certificate)
    "eigh, Muon's map": {"msign_method": "jordan5", "spectral": "eigh", "tol": 1e-3, "max_iter": None,
                         "patience": 6, "gap_tol": None},
    "products, 3 it.": {"msign_method": "jordan5", "spectral": "products", "max_iter": 3, "sync_free": True},
    "products, PE, 3 it.": {"msign_method": "polar-express", "spectral": "products", "max_iter": 3,
                            "sync_free": True},
}


#: Certified relative duality gap of the reference optimum (where the solve smooths the dual).
OPTIMUM_GAP = 1e-6


def exact_optimum(w, g, name) -> float:
    """:math:`p^* = \\max\\langle G, A\\rangle` over the tangent unit ball, in float64: the exact
    map solved to a tangent residual of 1e-7 and, where the dual is smoothed, to a certified gap of
    :data:`OPTIMUM_GAP`; where the smoothing floor stops the solve short of it (square DGram), the
    gap it did certify is printed to stderr: the losses are then exact to that much."""
    w, g = w.double(), g.double()
    exact, info = steepest_direction(w, g, name, tol=1e-7, gap_tol=OPTIMUM_GAP, max_iter=1000, return_info=True)
    if not info.residual <= 1e-7:
        raise RuntimeError(f"the reference solve did not converge (residual {info.residual:.1e})")
    if info.gap is not None and info.gap > OPTIMUM_GAP:
        print(f"note: p* of a {name} {tuple(w.shape)} instance is certified to a relative gap of {info.gap:.1e}",
              file=sys.stderr)
    return float((g * exact).sum())


def loss(manifold, w, g, a, optimum) -> float:
    """``1 - <G, A'>/p*`` for ``A`` projected onto the tangent space and scaled into the unit ball."""
    a = manifold.proju(w, a)
    scale = max(float(torch.linalg.matrix_norm(a, ord=2)), 1.0)
    return 1.0 - float((g * a).sum()) / scale / optimum


def muon_loss(g) -> float:
    """Muon's own loss: its five-step direction against the nuclear norm (Euclidean optimum)."""
    direction = newton_schulz(g, MUON_COEFFICIENTS, 5).double()
    nuclear = float(torch.linalg.matrix_norm(g.double(), ord="nuc"))
    spectral = max(float(torch.linalg.matrix_norm(direction, ord=2)), 1.0)
    return 1.0 - float((g.double() * direction).sum()) / spectral / nuclear


def warm_sequence(steps: int, dtype: torch.dtype) -> None:
    """The ``--sequence`` table (module docstring)."""
    options = CANDIDATES["products, 3 it."]
    print(f"\nwarm-started products path, {steps} correlated gradients per case (median over steps 4..{steps})")
    print(f"{'manifold, m x n, rank, noise':34s} {'Muon (Euclidean)':>17s} {'cold':>8s} {'warm':>8s}")
    for name, manifold in (("stiefel", Stiefel()), ("dgram", DGram())):
        for m, n, rank, noise in CASES:
            w, g0 = hard_instance(name, m, n, rank, noise, 0, dtype=torch.float64)
            gen = torch.Generator().manual_seed(1)
            correction, muon, cold, warm = None, [], [], []
            for _ in range(steps):
                g = g0 + 0.3 * g0.norm() / (m * n) ** 0.5 * torch.randn(m, n, generator=gen, dtype=torch.float64)
                optimum = exact_optimum(w, g, name)
                a, info = steepest_direction(w.to(dtype), g.to(dtype), name, correction=correction,
                                             return_info=True, **options)
                correction = info.correction
                muon.append(muon_loss(g))
                warm.append(loss(manifold, w, g, a.double(), optimum))
                cold.append(loss(manifold, w, g, steepest_direction(w.to(dtype), g.to(dtype), name, **options).double(),
                                 optimum))
            print(f"{f'{name} {m}x{n}, {rank}, {noise}':34s} {statistics.median(muon[3:]):17.3f} "
                  f"{statistics.median(cold[3:]):8.3f} {statistics.median(warm[3:]):8.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--sequence", type=int, default=0, help="also the warm-started sequence table (>= 4 steps)")
    args = parser.parse_args()
    if args.sequence and args.sequence < 4:
        parser.error(f"--sequence must be 0 or at least 4, got {args.sequence}")
    dtype = getattr(torch, args.dtype)
    print(f"{'manifold, m x n, rank, noise':34s} {'Muon (Euclidean)':>17s} "
          + " ".join(f"{name:>20s}" for name in CANDIDATES))
    for name, manifold in (("stiefel", Stiefel()), ("dgram", DGram())):
        for m, n, rank, noise in CASES:
            rows = {key: [] for key in ("muon", *CANDIDATES)}
            for seed in range(args.seeds):
                w, g = hard_instance(name, m, n, rank, noise, seed, dtype=dtype)
                optimum = exact_optimum(w, g, name)
                rows["muon"].append(muon_loss(g))
                for key, options in CANDIDATES.items():
                    a = steepest_direction(w, g, name, **options)
                    rows[key].append(loss(manifold, w.double(), g.double(), a.double(), optimum))
            cells = [f"{statistics.median(v):7.3f} ({max(v):5.3f})" for v in rows.values()]
            print(f"{f'{name} {m}x{n}, {rank}, {noise}':34s} {cells[0]:>17s} " + " ".join(f"{c:>20s}" for c in cells[1:]),
                  flush=True)
    if args.sequence:
        warm_sequence(args.sequence, dtype)


if __name__ == "__main__":
    main()
