"""The library's exact steepest-direction solver against the public reference's dual loop.

    python benchmarks/bench_reference_dual.py [--rows 3072] [--cols 768] [--rank 16] [--noise 0.1]
        [--seed 0] [--threads 1] [--steps 100] [--alpha 0.01] [--dtypes float32,bfloat16]
        [--families low-rank]

The public manifold-Muon implementations solve the dual of the steepest-direction problem on
Stiefel one matrix at a time by plain subgradient ascent: start from
:math:`\\Lambda_0 = -\\tfrac14(W^\\top G + G^\\top W)`, then ``--steps`` times
:math:`A = \\operatorname{msign}(G + 2W\\Lambda)`, :math:`H = W^\\top A + A^\\top W`,
:math:`\\Lambda \\leftarrow \\Lambda - \\alpha(1 - k/K)H`, with Polar Express (eight steps) for
msign, iterated in ``--dtypes``. It is written here from that description (not their code), and
timed beside :func:`~manifoldlib.optim.steepest_direction` (float32) with its defaults (the exact
map) and with Polar Express on the eigh and the products path, on Stiefel instances of each of
``--families`` (comma-separated), each gradient scaled to unit Frobenius norm
(``--alpha`` is a step in those units: the reference's step is not scale free):

* ``low-rank``: :func:`manifoldlib.testing.hard_instance`, rank ``--rank`` plus ``--noise``;
* ``low-rank-1pct``: the same with noise 0.01 (where Polar Express inside a dual falls short);
* ``full-rank``: rank ``--cols`` plus ``--noise`` (a generic gradient);
* ``nearly-normal``: :func:`manifoldlib.testing.nearly_normal_instance`, tangent part 1e-2 of the
  normal one;
* ``square``: ``--cols`` × ``--cols``, rank ``--rank`` plus ``--noise``.

Printed for each: seconds (one run, ``--threads`` intra-op threads) and the *gap*
:math:`1 - \\langle G, A'\\rangle/p^*` of its answer :math:`A'` (projected onto the tangent
space and scaled into the spectral unit ball), :math:`p^*` from a float64 solve at tolerance
1e-7 with a certified duality gap of 1e-6 (``bench_direction_quality.exact_optimum``); and the
tangent residual of the raw answer.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_direction_quality import exact_optimum
from bench_direction_quality import loss as gap  # the same loss as the direction-quality table

from manifoldlib import Stiefel
from manifoldlib.functional.newton_schulz import NEWTON_SCHULZ_PRESETS, newton_schulz
from manifoldlib.optim import steepest_direction
from manifoldlib.testing import hard_instance, nearly_normal_instance

FAMILIES = ("low-rank", "low-rank-1pct", "full-rank", "nearly-normal", "square")


def polar_express(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Polar Express msign of ``x``, iterated in ``dtype``, returned in float32."""
    preset = NEWTON_SCHULZ_PRESETS["polar-express"]
    return newton_schulz(x, preset.schedule, preset.steps, normalize_scale=preset.scale, dtype=dtype).float()


def reference_dual(w: torch.Tensor, g: torch.Tensor, steps: int, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """The reference's subgradient dual ascent on a tall Stiefel ``w``; the ``(m, n)`` answer."""
    lam = -0.25 * (w.mT @ g + g.mT @ w)
    a = polar_express(g + 2.0 * w @ lam, dtype)
    for k in range(steps):
        h = w.mT @ a + a.mT @ w
        lam = lam - alpha * (1.0 - k / steps) * h
        a = polar_express(g + 2.0 * w @ lam, dtype)
    return a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3072)
    parser.add_argument("--cols", type=int, default=768)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--families", default="low-rank",
                        help=f"comma-separated, of {', '.join(FAMILIES)} (or 'all')")
    args = parser.parse_args()
    families = FAMILIES if args.families == "all" else tuple(f for f in args.families.split(",") if f)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; accepted: {', '.join(FAMILIES)} or 'all'")
    torch.set_num_threads(args.threads)
    print(f"stiefel {args.rows}x{args.cols}, rank {args.rank}, noise {args.noise}, seed {args.seed}, "
          f"{args.threads} thread(s)")
    print(f"{'family':14s} {'solver':44s} {'seconds':>8s} {'gap':>9s} {'tangent resid':>14s}")
    for family in families:
        run_family(family, args)


def instance(family: str, args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, G)`` in float64 of one family (see the module docstring), ``G`` of unit norm."""
    m, n, rank, noise = args.rows, args.cols, args.rank, args.noise
    if family == "nearly-normal":
        w, g = nearly_normal_instance("stiefel", m, n, 1e-2, args.seed)
    else:
        if family == "low-rank-1pct":
            noise = 0.01
        elif family == "full-rank":
            rank = n
        elif family == "square":
            m = n
        w, g = hard_instance("stiefel", m, n, rank, noise, args.seed)
    return w, g / g.norm()


def run_family(family: str, args) -> None:
    manifold = Stiefel()  # the reference's dual is Stiefel's
    w64, g64 = instance(family, args)
    optimum = exact_optimum(w64, g64, "stiefel")
    w, g = w64.float(), g64.float()
    rows = [("manifoldlib steepest_direction (float32)", lambda: steepest_direction(w, g, "stiefel")),
            ("manifoldlib, Polar Express, eigh path", lambda: steepest_direction(
                w, g, "stiefel", msign_method="polar-express", spectral="eigh")),
            ("manifoldlib, Polar Express, products path", lambda: steepest_direction(
                w, g, "stiefel", msign_method="polar-express", spectral="products"))]
    for name in [d for d in args.dtypes.split(",") if d]:
        dtype = getattr(torch, name)
        rows.append((f"reference dual, {args.steps} steps, PE in {name}",
                     lambda dtype=dtype: reference_dual(w, g, args.steps, args.alpha, dtype)))
    for label, solve in rows:
        start = time.perf_counter()
        a = solve()
        seconds = time.perf_counter() - start
        raw = a.double()
        resid = float((raw - manifold.proju(w64, raw)).norm() / raw.norm())
        print(f"{family:14s} {label:44s} {seconds:8.2f} {gap(manifold, w64, g64, a.double(), optimum):9.2e} "
              f"{resid:14.2e}", flush=True)

if __name__ == "__main__":
    main()
