"""What one Manifold Muon step is made of, timed against a torch.optim.Muon step in one process.

    python benchmarks/bench_spectral_primitives.py [--rows 3072] [--cols 768] [--repeats 20]
        [--device cuda] [--threads 0] [--anchor auto|bfloat16|float32]

The dual solves of :mod:`manifoldlib.optim.dual` are built from ``n × n`` eigendecompositions
and matrix products (n = ``--cols``) plus a few ``m × n`` products. Their relative prices decide
the design: on a CPU an eigh of 768² costs about a third of a Muon step on 3072x768, on a GPU
the eigh is a sequential, latency-bound algorithm while products run on the matrix units. This
script prints, for the device it is given, the median time of each primitive and its ratio to
one ``torch.optim.Muon`` step on an ``m × n`` parameter (the anchor, timed round robin with the
rest), the Newton–Schulz iteration of Muon on the tall matrix against the same map in Gram form
(:func:`~manifoldlib.functional.newton_schulz.gram_newton_schulz`: two ``m·n²`` products instead of
two a step) with their distance to the float64 iteration, then the time, ratio and dual iterations
of ``steepest_direction`` on Stiefel and DGram
instances of the benchmark's shapes (tall and square), at the optimizer's settings
(``jordan5`` dual msign, tol 1e-3, cap 30), for each ``--spectral`` path (one eigh per dual
evaluation, or Gram-form Newton–Schulz products). ``resid`` is the solver's own relative tangent
residual, ``f64 resid`` the same quantity recomputed in float64 from the returned direction (it
shows what reduced-precision products, e.g. ``--tf32``, do to the solver's judgement).
``--anchor`` as in ``bench_manifold_muon.py``: where bfloat16 products are emulated the Muon
step's Newton–Schulz runs in float32 (``_anchors.py``), and the table says so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _anchors import ANCHORS, bfloat16_line, muon_anchor
from _timing import round_robin_ms, sync

from manifoldlib.functional.newton_schulz import (
    MUON_COEFFICIENTS,
    gram_newton_schulz,
    newton_schulz,
    newton_schulz_gain,
)
from manifoldlib.optim import steepest_direction, tangent_residual


def _gram_factor_eigh(s: torch.Tensor) -> torch.Tensor:
    """Muon's five-step map from one eigendecomposition of ``s``: ``V diag(psi(lambda)) V^T``."""
    lam, vec = torch.linalg.eigh(s)
    return (vec * newton_schulz_gain(lam.clamp_min(0), "jordan5").unsqueeze(-2)) @ vec.mT


def _muon_step(m: int, n: int, device: torch.device, anchor=torch.optim.Muon):
    param = torch.nn.Parameter(torch.randn(m, n, device=device) / m**0.5)
    opt = anchor([param], lr=0.02, weight_decay=0.0)
    grad = torch.randn(m, n, device=device) / m**0.5

    def step():
        param.grad = grad
        opt.step()

    return step


def _eigh(s: torch.Tensor, library: str | None = None):
    def run():
        if library is not None:
            torch.backends.cuda.preferred_linalg_library(library)
        try:
            return torch.linalg.eigh(s)
        finally:
            if library is not None:
                torch.backends.cuda.preferred_linalg_library("default")

    return run


def _instance(m: int, n: int, manifold: str, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.linalg.qr(torch.randn(m, n, generator=g))[0]
    if manifold == "dgram":
        w = w * torch.exp(0.1 * torch.randn(n, generator=g))
    u = torch.randn(m, 16, generator=g) / m**0.5
    v = torch.randn(16, n, generator=g) / n**0.5
    grad = u @ v + 0.3 * torch.randn(m, n, generator=g) / m**0.5
    return w.to(device), grad.to(device)


def _solve_times(shapes, device: torch.device, repeats: int, anchor_ms: dict, paths: list[str]) -> list[str]:
    header = f"{'steepest_direction':34s} {'ms':>9s} {'x Muon':>7s} {'iters':>6s} {'resid':>8s} {'f64 resid':>9s}"
    rows = [header]
    for m, n in shapes:
        for manifold in ("stiefel", "dgram"):
            w, grad = _instance(m, n, manifold, device, seed=m + n)
            for path in paths:
                kw = {"msign_method": "jordan5", "tol": 1e-3, "max_iter": 30, "return_info": True, "spectral": path}
                steepest_direction(w, grad, manifold, **kw)  # warm-up
                times, iters, resid = [], [], []
                for _ in range(max(3, repeats // 4)):
                    sync(device)
                    start = time.perf_counter()
                    a, info = steepest_direction(w, grad, manifold, **kw)
                    sync(device)
                    times.append(time.perf_counter() - start)
                    iters.append(info.iterations)
                    resid.append(info.residual)
                exact = float(tangent_residual(w.double(), a.double(), manifold))
                ms = 1e3 * statistics.median(times)
                anchor = anchor_ms[(max(m, n), min(m, n))]
                rows.append(
                    f"{f'{manifold} {m}x{n} ({path})':34s} {ms:7.2f}ms {ms / anchor:7.1f} "
                    f"{statistics.mean(iters):6.1f} {max(resid):8.1e} {exact:9.1e}"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=3072)
    parser.add_argument("--cols", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    parser.add_argument("--spectral", default="eigh,products", help="comma-separated dual spectral paths")
    parser.add_argument("--tf32", action="store_true", help="float32 products in TF32 (matmul precision 'high')")
    parser.add_argument("--anchor", default="auto", choices=ANCHORS,
                        help="Muon anchor precision: auto (bfloat16 where native, else float32)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this machine")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    m, n = args.rows, args.cols
    torch.manual_seed(0)
    x = torch.randn(m, n, device=device) / m**0.5
    s = x.mT @ x  # (n, n) Gram matrix
    sq = torch.randn(n, n, device=device)
    sq16 = sq.bfloat16()
    anchor_label, anchor = muon_anchor(args.anchor, device)
    muon = anchor_label.removesuffix(" (anchor)")
    fns = {
        f"{muon} step {m}x{n} (anchor)": _muon_step(m, n, device, anchor),
        f"{muon} step {n}x{n}": _muon_step(n, n, device, anchor),
        f"mm {n}^3 float32": lambda: sq @ sq,
        f"mm {n}^3 bfloat16": lambda: sq16 @ sq16,
        f"Gram X^T X ({m}x{n}) float32": lambda: x.mT @ x,
        f"eigh {n}^2 float32": _eigh(s),
        f"eigh {n}^2 float64": _eigh(s.double()),
        f"gram_newton_schulz jordan5 ({n}^2, 17 mm)": lambda: gram_newton_schulz(s, "jordan5"),
        "eigh + newton_schulz_gain jordan5": lambda: _gram_factor_eigh(s),
        f"Newton-Schulz on X ({m}x{n}, float32)": lambda: newton_schulz(x, MUON_COEFFICIENTS, 5),
        f"Gram Newton-Schulz X R ({m}x{n}, float32)": lambda: x @ gram_newton_schulz(x.mT @ x, "jordan5"),
    }
    if device.type == "cuda":
        for library in ("magma", "cusolver"):
            try:
                _eigh(s, library)()
            except RuntimeError as err:  # e.g. a build without MAGMA
                print(f"eigh with {library}: unavailable ({str(err).splitlines()[0]})")
                continue
            fns[f"eigh {n}^2 float32 ({library})"] = _eigh(s, library)
    results = round_robin_ms(fns, args.repeats, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"device {name}, torch {torch.__version__}, {args.repeats} rounds, "
          f"float32 matmul precision {torch.get_float32_matmul_precision()!r}; {bfloat16_line(device)}")
    print(f"{'primitive':50s} {'median':>10s} {'x Muon':>7s}")
    for label, (ms, ratio) in results.items():
        print(f"{label:50s} {ms:8.3f}ms {ratio:7.3f}")
    on_matrix = newton_schulz(x.double(), MUON_COEFFICIENTS, 5)
    for label, value in (("float32", x @ gram_newton_schulz(x.mT @ x, "jordan5")),
                         ("bfloat16", newton_schulz(x, MUON_COEFFICIENTS, 5, dtype=torch.bfloat16))):
        error = float((value.double() - on_matrix).norm() / on_matrix.norm())
        print(f"relative difference to Newton-Schulz on X in float64: {label} "
              f"{'Gram form' if label == 'float32' else 'on X (Muon)'} {error:.1e}")
    anchors = round_robin_ms(
        {f"{m}x{n}": _muon_step(m, n, device, anchor), f"{n}x{n}": _muon_step(n, n, device, anchor)},
        args.repeats,
        device,
    )
    anchor_ms = {(m, n): anchors[f"{m}x{n}"][0], (n, n): anchors[f"{n}x{n}"][0]}
    print()
    for row in _solve_times([(m, n), (n, n)], device, args.repeats, anchor_ms, args.spectral.split(",")):
        print(row)


if __name__ == "__main__":
    main()
