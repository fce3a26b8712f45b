"""How far cheap answers are from the square DGram optimum, and how conditioned its smoothed dual is.

    python benchmarks/probe_square_dgram_optimum.py [--n 256] [--steps 30] [--hessian-n 64]

Why a square DGram steepest direction costs tens of eigendecompositions (``docs/guides/
benchmarks_optim.rst``). The script runs :class:`~manifoldlib.optim.ManifoldMuon` on one
``n × n`` DGram matrix with the gradients of ``bench_manifold_muon.py`` for ``--steps`` steps and
keeps the last two ``(W, update)`` pairs it solved (steady state after ~25 steps), then, in
float64, for the last one:

* **Certified bracket of the optimum** :math:`p^\\star = \\max\\{\\langle G, A\\rangle :
  \\|A\\|_2 \\le 1, A \\in T_W\\}` (``G`` normalized): any multiplier gives the upper bound
  :math:`\\|G + 2W\\Lambda\\|_*` (weak duality), any tangent ``A`` rescaled to spectral norm
  ``<= 1`` a lower bound. The library's answer (smoothing ``kappa`` = 0.02) and a ten times less
  smoothed, longer solve bracket :math:`p^\\star`; the script prints the library answer's relative
  suboptimality interval.
* **Cheap answers**: the projected gradient's polar factor, and a plain (unsmoothed) dual stopped
  after 3 and 30 iterations, each projected onto the tangent space and rescaled: their relative
  distance below :math:`p^\\star`.
* **Step to step**: the relative change of the update, of the optimal direction, and the dual
  value at the previous step's multiplier (what a warm start or a tracking method starts from).

With ``--hessian-n k`` (``k <= 96``; 0 skips) it repeats the run at ``k × k`` and forms the whole
Hessian of the smoothed dual at its optimum (``k(k-1)/2`` Hessian-vector products), printing the
condition number of the conjugate-gradient system under the normal-space metric (what
:func:`~manifoldlib.optim.dual_solvers._conjugate_gradient` uses) and under the frozen-factor
eigenbasis operator (:func:`~manifoldlib.optim.dual_solvers._preconditioned_step`).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_manifold_muon as bench  # the shared gradient and parameter generators

from manifoldlib.optim import ManifoldMuon, steepest_direction
from manifoldlib.optim.dual_problem import _DualProblem
from manifoldlib.optim.dual_solvers import AUTO_SMOOTHING

_muon_module = importlib.import_module("manifoldlib.optim.muon_step")  # where the step calls solve_dual


def _steady_state_pairs(n: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(W, update)`` pairs of the last two dual solves of a ``steps``-step run, tall orientation."""
    bench.SHAPES[:] = [(n, n)]
    grads = bench._gradients(steps)
    params = bench._params()
    pairs = []
    solve = _muon_module.solve_dual

    def recording(w, g, manifold, **kwargs):
        pairs.append((w.detach().clone(), g.detach().clone()))
        return solve(w, g, manifold, **kwargs)

    _muon_module.solve_dual = recording
    try:
        opt = ManifoldMuon(params, manifold="dgram", lr=0.02, weight_decay=0.0, workers=1)
        for step_grads in grads:
            params[0].grad = step_grads[0].clone()
            opt.step()
    finally:
        _muon_module.solve_dual = solve
    return pairs[-2:]


def _normalized(w: torch.Tensor, g: torch.Tensor):
    w, g = w.double(), g.double()
    return w, g / g.norm()


def _tangent_part(w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``P_W(a)``: ``a - W S``, ``S_ij = (W^T a + a^T W)_ij / (d_i^2 + d_j^2)``, ``S_ii = 0``."""
    d2 = (w * w).sum(0)
    h = w.T @ a
    h = h + h.T
    h.fill_diagonal_(0)
    return a - w @ (h / (d2[:, None] + d2[None, :]))


def _lower_bound(w: torch.Tensor, g: torch.Tensor, a: torch.Tensor) -> float:
    """``<G, A'>`` of the tangent part ``A'`` of ``a``, rescaled to spectral norm at most one."""
    tangent = _tangent_part(w, a)
    return float((g * tangent).sum()) / max(1.0, float(torch.linalg.matrix_norm(tangent, 2)))


def _upper_bound(w: torch.Tensor, g: torch.Tensor, lam: torch.Tensor) -> float:
    return float(torch.linalg.svdvals(g + 2.0 * w @ lam).sum())


def _solve(w, g, **kwargs):
    return steepest_direction(w, g, "dgram", msign_method="jordan5", return_info=True, **kwargs)


def _closed_form_multiplier(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    r""":math:`\Lambda_0`, with :math:`G + 2W\Lambda_0 = P_W(G)`."""
    wg = w.T @ g
    d2 = (w * w).sum(0)
    lam = -(wg + wg.T) / (2.0 * (d2[:, None] + d2[None, :]))
    lam.fill_diagonal_(0)
    return lam


def _report_optimum(pairs) -> None:
    (w0, g0), (w1, g1) = (_normalized(*pair) for pair in pairs)
    start = time.perf_counter()
    a1, info1 = _solve(w1, g1, tol=1e-3, max_iter=30, patience=6)  # as ManifoldMuon solves it
    tight, tight_info = _solve(w1, g1, tol=1e-7, max_iter=200, smoothing=AUTO_SMOOTHING / 10)
    library = _lower_bound(w1, g1, a1)
    lower = max(library, _lower_bound(w1, g1, tight))
    upper = min(_upper_bound(w1, g1, info1.multiplier), _upper_bound(w1, g1, tight_info.multiplier))
    print(f"p* in [{lower:.6f}, {upper:.6f}] (relative width {(upper - lower) / upper:.1e}; "
          f"{time.perf_counter() - start:.0f} s)")
    print(f"library answer (kappa {AUTO_SMOOTHING}, {info1.iterations} Newton steps, residual "
          f"{info1.residual:.1e}): {library:.6f}, relative suboptimality in "
          f"[{(lower - library) / lower:.1e}, {(upper - library) / upper:.1e}]")
    u, _, vh = torch.linalg.svd(g1 + 2.0 * w1 @ _closed_form_multiplier(w1, g1))
    candidates = {"polar factor of the projected gradient": u @ vh}
    for iterations in (3, 30):
        a, _ = _solve(w1, g1, tol=1e-9, max_iter=iterations, smoothing=None)
        candidates[f"plain dual, {iterations} iterations"] = a
    for name, a in candidates.items():
        value = _lower_bound(w1, g1, a)
        print(f"  {name:42s} {value:.6f}  ({(upper - value) / upper:.1%} below the upper bound)")
    a0, info0 = _solve(w0, g0, tol=1e-3, max_iter=30, patience=6)
    warm = _upper_bound(w1, g1, _closed_form_multiplier(w1, g1) + info0.correction)
    print(f"step to step: |dG|/|G| {float((g1 - g0).norm() / g1.norm()):.3f}, |dA|/|A| of the answers "
          f"{float((a1 - a0).norm() / a1.norm()):.3f}; dual value at the warm start (Lambda_0 plus the "
          f"previous correction) {warm:.6f}, {(warm - upper) / upper:.1%} above the optimum")


def _spectral_hessian_inverse(problem: _DualProblem, lam: torch.Tensor):
    r"""The inverse of the Hessian of :math:`F(M) = \sum_i (\sigma_i(M)^2 + \mu^2)^{1/2}` at
    :math:`M = B + 2D\Lambda` (square), applied in its SVD frame (Lewis–Sendov): on the symmetric
    and skew parts of :math:`U^\top E V` it scales by the divided differences
    :math:`(f'(\sigma_i) \mp f'(\sigma_j))/(\sigma_i \mp \sigma_j)`."""
    m = problem._m(lam)
    mu = problem.smoothing
    eig, v = torch.linalg.eigh(m.T @ m)
    sigma = eig.clamp_min(0).sqrt()
    u = m @ v / sigma
    slope = sigma / (sigma**2 + mu**2).sqrt()  # f'
    curvature = mu**2 / (sigma**2 + mu**2) ** 1.5  # f''
    gap = sigma[:, None] - sigma[None, :]
    close = gap.abs() <= 1e-12 * sigma.max()
    sym_scale = torch.where(close, curvature[:, None].expand_as(gap),
                            (slope[:, None] - slope[None, :]) / torch.where(close, torch.ones_like(gap), gap))
    skew_scale = (slope[:, None] + slope[None, :]) / (sigma[:, None] + sigma[None, :])

    def apply(y):
        rotated = u.T @ y @ v
        sym, skew = 0.5 * (rotated + rotated.T), 0.5 * (rotated - rotated.T)
        return u @ (sym / sym_scale + skew / skew_scale) @ v.T

    return apply


def _report_hessian(pairs) -> None:
    w, g = _normalized(*pairs[-1])
    n = w.size(1)
    _, info = _solve(w, g, tol=1e-9, max_iter=200, smoothing=AUTO_SMOOTHING)
    problem = _DualProblem(w, g, "dgram", "jordan5", None, None, 1e-7)
    start = problem.initial_multiplier()
    scale = float(torch.diagonal(problem.gram(start)).sum().clamp_min(0).sqrt()) / math.sqrt(n)
    problem.smoothing = AUTO_SMOOTHING * scale  # the mu of steepest's smoothed solve
    _, residual, state = problem.evaluate(info.multiplier)
    rows, cols = torch.triu_indices(n, n, 1)

    def unpack(v):
        x = torch.zeros(n, n, dtype=v.dtype)
        x[rows, cols] = v
        return x + x.T

    def matrix(op, symmetric=True):
        """The operator ``op`` on symmetric zero-diagonal matrices, in the upper-triangle coordinates."""
        columns = []
        for k in range(rows.numel()):
            e = torch.zeros(rows.numel(), dtype=w.dtype)
            e[k] = 1.0
            columns.append(op(unpack(e))[rows, cols])
        out = torch.stack(columns, 1)
        return 0.5 * (out + out.T) if symmetric else out

    hessian = matrix(lambda x: problem.hessian_vector(state, x))
    metric = problem.metric
    vec, gain = state.vec, state.gain

    def frozen_inverse(r):
        x = vec @ ((vec.T @ (r / metric) @ vec) / (2.0 * (gain[:, None] + gain[None, :]))) @ vec.T
        x = 0.5 * (x + x.T)
        x.fill_diagonal_(0)
        return x

    spectral_inverse = _spectral_hessian_inverse(problem, info.multiplier)

    def lewis_sendov(r):
        # P'^T H_M^{-1} P' with P' = 2D(. / 4 metric), the pseudo-inverse of Lambda -> 2 D Lambda
        x = problem.d[:, None] * spectral_inverse(2.0 * problem.d[:, None] * (r / (4.0 * metric)))
        x = x + x.T
        x.fill_diagonal_(0)
        return x / (4.0 * metric)

    print(f"smoothed dual Hessian at its optimum, {n}x{n} (residual {residual:.1e}, mu {problem.smoothing:.2e}):")
    for name, inverse in (
        ("normal-space metric", lambda r: r / metric),
        ("frozen-factor eigenbasis", frozen_inverse),
        ("spectral Hessian inverse", lewis_sendov),
    ):
        eig = torch.linalg.eigvals(matrix(inverse, symmetric=False) @ hessian)  # of P^-1 H
        real = eig.real.sort().values
        q = torch.quantile(real, torch.tensor([0.01, 0.5, 0.99], dtype=real.dtype)).tolist()
        print(f"  preconditioner {name:26s} condition {float(real.max() / real.min()):.2e} "
              f"(eigenvalue quantiles 1/50/99%: {q[0]:.2e} {q[1]:.2e} {q[2]:.2e}; "
              f"largest imaginary part {float(eig.imag.abs().max()):.1e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps before the probe (>= 2)")
    parser.add_argument("--hessian-n", type=int, default=64, help="size of the Hessian probe (0: skip)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit(f"--steps must be >= 2, got {args.steps}")
    if not 0 <= args.hessian_n <= 96:
        raise SystemExit(f"--hessian-n must be in [0, 96], got {args.hessian_n}")
    torch.set_num_threads(args.threads)
    print(f"square DGram {args.n}x{args.n}, the last solves of a {args.steps}-step ManifoldMuon run "
          f"(bench_manifold_muon gradients), float64 probe")
    _report_optimum(_steady_state_pairs(args.n, args.steps))
    if args.hessian_n:
        _report_hessian(_steady_state_pairs(args.hessian_n, args.steps))


if __name__ == "__main__":
    main()
