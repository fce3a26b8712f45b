r"""Steepest directions under the spectral norm on a tangent space: :func:`steepest_direction` and the
bank solve :func:`solve_bank` that every :class:`~manifoldlib.optim.ManifoldMuon` step runs.

:func:`solve_bank` picks the solver of :mod:`~manifoldlib.optim.dual` for a bank:

* **smoothing** (:func:`resolve_smoothing`): ``"auto"`` smooths from the start where the plain
  dual cannot converge or crawls — square DGram (rank-deficient optimum) and tall matrices with
  ``m < 2.5 n`` other than square Stiefel (:data:`SMOOTH_BELOW_ASPECT`) — with
  :math:`\kappa =` :data:`AUTO_SMOOTHING`; elsewhere it runs the plain dual, and on the eigh path a
  matrix the plain dual leaves above ``tol`` continues on the smoothed dual from its best iterate;
* **the plain dual**: Anderson-mixed frozen-gain Newton steps on the eigh path
  (:func:`~manifoldlib.optim.dual.anderson_solve`), Barzilai–Borwein steps on the products path or
  when asked for (:func:`~manifoldlib.optim.dual.bb_solve`);
* **host reads**: none on a sync-free solve (the products path: a fixed iteration count, the
  smoothed dual by Barzilai–Borwein on :math:`(S + \mu^2I)` with per-matrix :math:`\mu`); an
  early-stopping solve reads the residuals once per iteration.

The reported residual is that of the returned direction, computed from the exact
:math:`W^\top A` (not the reduced problem's, which assumes :math:`W` exactly on the manifold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..functional.scaling import into_safe_range
from ..manifolds import Euclidean, MatrixConstraintManifold, get_manifold
from .dual import DualProblem, Evaluation, Spectral
from .dual_solvers import anderson_solve, bb_solve, smoothed_solve
from .execution import Execution, ieee_float32_matmul
from .options import DualOptions

__all__ = [
    "AUTO_SMOOTHING",
    "GAP_TOL",
    "SMOOTH_BELOW_ASPECT",
    "STEEPEST_DEFAULTS",
    "STEEPEST_MANIFOLDS",
    "BankSolution",
    "SteepestInfo",
    "resolve_smoothing",
    "solve_bank",
    "steepest_direction",
    "tangent_residual",
]

#: Relative smoothing :math:`\kappa` of ``smoothing="auto"``.
AUTO_SMOOTHING = 2e-2
#: ``smoothing="auto"`` smooths from the start below this aspect ratio ``m/n`` (tall orientation;
#: square Stiefel excepted): there :math:`G_\perp^\top G_\perp` has rank ``m - n`` or sits at the
#: Marchenko–Pastur edge, the optimum is close to rank deficient and the plain dual crawls.
SMOOTH_BELOW_ASPECT = 2.5
#: A sync-free solve smoothed from the start (square DGram) runs this many times the default
#: iterations: its Barzilai–Borwein steps face curvatures up to :math:`1/\mu`.
SMOOTHED_ITERATION_FACTOR = 4
#: Largest certified relative duality gap of a smoothed answer that :func:`steepest_direction`
#: reports converged (its default ``gap_tol``).
GAP_TOL = 1e-3
#: :func:`steepest_direction`'s defaults over :class:`DualOptions`' (whose ``patience`` it keeps: a
#: plain iteration that stops improving hands over to the smoothed dual, rather than running to
#: ``max_iter`` — on tall low-rank instances the exact map's iteration can climb far from tangent
#: and stay there): the exact map, a tight tolerance and a certified smoothed answer.
STEEPEST_DEFAULTS = {"msign_method": "svd", "tol": 1e-4, "max_iter": 100, "gap_tol": GAP_TOL}
#: Manifold names :func:`steepest_direction` knows.
STEEPEST_MANIFOLDS = ("stiefel", "dgram", "oblique", "euclidean")


@dataclass
class SteepestInfo:
    r"""What one :func:`steepest_direction` solve did.

    Attributes:
        iterations: dual updates taken (Newton steps for a smoothed solve).
        residual: relative tangent residual :math:`\|A - P_WA\|_F/\|A\|_F` of the returned ``A``.
        converged: ``residual <= tol`` (and, for a certified smoothed answer, ``gap <= gap_tol``).
        multiplier: the final :math:`\Lambda` ``(k, k)`` for the normalized gradient, tall orientation.
        correction: :math:`\Lambda - \Lambda_0`: pass it back as ``correction`` at a *new* point.
        history: the reduced residual after each plain dual iteration, starting with the initial one.
        gap: certified relative duality gap of a smoothed answer (``None`` without smoothing).
        stages: the solvers that ran, in order: ``"anderson"``, ``"bb"``, ``"smoothed"``.
        evaluations: dual evaluations (one eigh or Gram-form Newton–Schulz each; an SVD of the
            ``m × n`` matrix on the exact unreduced path).
        hessian_products: Hessian-vector products of the smoothed dual's conjugate gradients.
    """

    iterations: int
    residual: float
    converged: bool
    multiplier: torch.Tensor | None
    correction: torch.Tensor | None = None
    history: list[float] = field(default_factory=list)
    gap: float | None = None
    stages: tuple[str, ...] = ()
    evaluations: int = 0
    hessian_products: int = 0


@dataclass
class BankSolution:
    """The steepest directions of a bank (tall orientation, the solve's dtype).

    Attributes:
        problem: the solved :class:`~manifoldlib.optim.dual.DualProblem` (its setup, the factor
            :math:`F`, :math:`P = W^\top W` where computed).
        best: the answer's evaluation per matrix (``None`` where ``a`` holds formed answers).
        a: ``(B, m, n)`` formed directions, or ``None`` (form them with :meth:`direction`).
        residual: ``(B,)`` relative tangent residual of each answer (its exact :math:`W^\top A`).
        iterations: ``(B,)`` dual updates each matrix took.
        lam, lam0: ``(B, n, n)`` final and closed-form multipliers (``lam - lam0`` warm-starts the next step).
        gap: per matrix, the certified gap of a smoothed answer (``None`` where none ran).
        stages, evaluations, hessian_products, history: what ran (see :class:`SteepestInfo`).
        pieces: ``(W^T A, A^T A)`` ``(B, n, n)`` of a reduced answer (:meth:`DualProblem.pieces`), or ``None``.
    """

    problem: DualProblem
    best: Evaluation | None
    a: torch.Tensor | None
    residual: torch.Tensor
    iterations: torch.Tensor
    lam: torch.Tensor
    lam0: torch.Tensor
    gap: list = field(default_factory=list)
    stages: tuple[str, ...] = ()
    evaluations: int = 0
    hessian_products: int = 0
    history: list = field(default_factory=list)
    pieces: tuple[torch.Tensor, torch.Tensor] | None = None

    def direction(self) -> torch.Tensor:
        """``(B, m, n)`` the directions, formed (two ``m·n²`` products) if they were not."""
        if self.a is None:
            with ieee_float32_matmul():
                self.a = self.problem.answer(self.best)
        return self.a


def _normalized(g: torch.Tensor) -> torch.Tensor:
    r"""Each ``(m, n)`` matrix of ``g`` divided by its Frobenius norm; zero where the norm is 0 or not
    finite (a non-finite gradient gives a zero direction). The norm is accumulated in float64, so
    float32 entries of any size neither overflow nor underflow it, and a gradient times :math:`2^k`
    gives the same unit matrix bit for bit; float64 input is first brought into range by a power
    of two (:func:`~manifoldlib.functional.scaling.into_safe_range`)."""
    if g.dtype == torch.float64:
        g = into_safe_range(g)
    norm = torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True, dtype=torch.float64)
    usable = torch.isfinite(norm) & (norm > 0)
    inv = torch.where(usable, norm.reciprocal(), 0.0).to(g.dtype)
    return torch.where(usable, g * inv, 0.0)


def matrix_manifold(manifold) -> MatrixConstraintManifold | Euclidean:
    """The manifold object for a name of :data:`STEEPEST_MANIFOLDS` or an instance.

    Raises:
        ValueError: an unknown name or a manifold without a matrix constraint (e.g. a sphere).
    """
    if isinstance(manifold, (MatrixConstraintManifold, Euclidean)):
        return manifold
    if isinstance(manifold, str) and manifold in STEEPEST_MANIFOLDS:
        return get_manifold(manifold)
    raise ValueError(f"unknown manifold {manifold!r}; valid: {', '.join(STEEPEST_MANIFOLDS)} or a "
                     f"MatrixConstraintManifold instance")


def resolve_smoothing(smoothing, manifold, shape, exact: bool = False) -> tuple[float | None, float | None]:
    r"""``(kappa, fallback)``: the relative smoothing to solve with from the start (``None``: the
    plain dual) and the one a stalled plain solve continues with (``None``: keep its best iterate).
    ``shape``: the tall ``(m, n)``; ``exact``: the exact-SVD plain dual was asked for, which smooths
    from the start only where it cannot converge (square DGram)."""
    if smoothing == "auto":
        rows, cols = shape[-2], shape[-1]
        square = rows == cols
        if square and manifold.square_dual == "rank-deficient":
            return AUTO_SMOOTHING, None
        closed_form = square and manifold.square_dual == "closed-form"
        if not exact and rows < SMOOTH_BELOW_ASPECT * cols and not closed_form:
            return AUTO_SMOOTHING, None
        return None, AUTO_SMOOTHING
    if smoothing is None:
        return None, None
    return float(smoothing), None


def _projected_scale(problem: DualProblem, lam0: torch.Tensor) -> torch.Tensor:
    r"""``(B,)`` :math:`\|P_WG\|_F/\sqrt n` (the smoothing's unit), from the Gram matrix at :math:`\Lambda_0`."""
    n = lam0.size(-1)
    s0, _ = problem.gram(lam0)
    scale = torch.diagonal(s0, dim1=-2, dim2=-1).sum(-1).clamp_min(0).sqrt() / math.sqrt(n)
    return torch.where(scale > 0, scale, torch.full_like(scale, 1.0 / math.sqrt(n)))


def solve_bank(w: torch.Tensor, g: torch.Tensor, manifold: MatrixConstraintManifold, options: DualOptions,
               execution: Execution, spectral: Spectral, *, start: torch.Tensor | None = None,
               multiplier: bool = False, check_point: bool = True) -> BankSolution:
    r"""Solve the dual of a bank: tall points ``w`` and gradients ``g`` ``(B, m, n)`` in the solve's dtype.

    Each ``g`` is normalized by its Frobenius norm here (after an exact power-of-two rescaling
    into range), so the multipliers refer to the normalized problem; a zero gradient gives a zero
    direction. ``start``: ``(B, n, n)`` warm start, a correction :math:`\Lambda - \Lambda_0` (added
    to the closed-form start) or, with ``multiplier=True``, the multiplier itself. A sync-free solve
    forms :math:`G_\perp` always; an early-stopping one forms it, and computes :math:`W^\top W`, where
    a host read says they are needed (:class:`~manifoldlib.optim.dual.DualProblem`). Runs with IEEE
    float32 products.
    """
    with ieee_float32_matmul():
        g = _normalized(g)
        sync_free = execution.sync_free
        kappa, fallback = resolve_smoothing(options.smoothing, manifold, w.shape, exact=spectral.method == "svd")
        smooth_dtype = execution.work_dtype(w.dtype, smoothed=kappa is not None and not sync_free)
        if kappa is not None and spectral.method == "svd" and not sync_free:
            spectral = replace(spectral, path="eigh")
        if smooth_dtype != w.dtype:
            w, g = w.to(smooth_dtype), g.to(smooth_dtype)
            start = None if start is None else start.to(smooth_dtype)
        problem = DualProblem(w, g, manifold, spectral, execution, check_point=check_point,
                              reduced=True if kappa is not None else None,
                              explicit=True if sync_free else None, exact_gram=False if sync_free else None)
        lam0 = problem.initial_multiplier()
        lam = lam0
        closed_form = problem.square and manifold.square_dual == "closed-form" and kappa is None and problem.reduced
        if closed_form:  # Lambda_0 is optimal for every odd spectral map: no iterations, no warm start
            start = None
        if start is not None:
            given = problem.mask(0.5 * (start + start.mT)).to(lam0.dtype)
            lam = given if multiplier else lam0 + given
        tol, iterations, patience = options.tol, 0 if closed_form else options.iterations(sync_free), options.patience
        if sync_free and kappa is not None and options.max_iter is None:
            iterations *= SMOOTHED_ITERATION_FACTOR
        stages: list[str] = []
        gaps: list = [None] * w.size(0)
        history = []
        a = None
        if kappa is None or sync_free:
            if kappa is not None:  # sync-free smoothed dual: per-matrix mu, Barzilai–Borwein steps
                problem.smoothing = kappa * _projected_scale(problem, lam0)
            if options.update == "anderson" and (spectral.path != "eigh" or sync_free or not problem.reduced):
                raise ValueError(
                    f"dual update='anderson' needs the eigh path with early stopping (its steps use the eigenbasis), "
                    f"but this solve runs the {spectral.path} path{' sync-free' if sync_free else ''} with the "
                    f"{spectral.method!r} map: set spectral='eigh' (and sync_free=False), or update='auto' or 'bb'")
            anderson = (problem.reduced and spectral.path == "eigh" and options.update != "bb"
                        and not sync_free and kappa is None)
            stages.append("anderson" if anderson else "bb")
            if anderson:
                progress = anderson_solve(problem, lam, tol, iterations, patience)
            else:
                progress = bb_solve(problem, lam, tol, iterations, patience, sync_free)
            best, counts, history = progress.best, progress.iterations, progress.history
            if fallback is not None and not sync_free:
                stalled = ~(best.residual <= tol)
                if bool(stalled.any()):
                    stages.append("smoothed")
                    counts = counts.clone()
                    parts = []
                    for i in range(w.size(0)):
                        sub_best = best.select(slice(i, i + 1))
                        if not bool(stalled[i]):
                            parts.append((sub_best, None))
                            continue
                        sub = problem.select(slice(i, i + 1))
                        start_lam = sub_best.lam if bool(torch.isfinite(sub_best.lam).all()) else lam0[i:i + 1]
                        ev, more, gaps[i], part = smoothed_solve(sub, start_lam, lam0[i:i + 1], fallback, tol,
                                                                 iterations, cold=False, gap_tol=options.gap_tol)
                        counts[i] += more
                        parts.append((ev, part))
                    if problem.reduced:
                        best = Evaluation.cat([ev.materialized() for ev, _ in parts])
                    else:  # the exact unreduced path: form every answer
                        a = torch.cat([problem.select(slice(i, i + 1)).answer(ev) if part is None else part.answer(ev)
                                       for i, (ev, part) in enumerate(parts)])
                        best = None
        else:  # smoothed from the start, one matrix at a time (Newton needs the eigenbasis)
            stages.append("smoothed")
            parts = []
            counts = torch.zeros(w.size(0), dtype=torch.long, device=w.device)
            for i in range(w.size(0)):
                sub = problem.select(slice(i, i + 1))
                ev, more, gaps[i], part = smoothed_solve(sub, lam[i:i + 1], lam0[i:i + 1], kappa, tol, iterations,
                                                         cold=start is None, gap_tol=options.gap_tol)
                counts[i] = more
                parts.append(ev)
            best = Evaluation.cat(parts)
        if not sync_free and best is not None and best.eig is not None:  # a certificate where it is free
            plain = problem.relative_gaps(best)
            gaps = [float(plain[i]) if gap is None else gap for i, gap in enumerate(gaps)]
        pieces = None
        if a is None and best.a is None:  # the reduced answer: its residual from n x n pieces
            pieces = problem.pieces(best)  # the residual from W^T A and tr(A^T A)
            residual = problem.normal_residual(pieces[0], torch.diagonal(pieces[1], dim1=-2, dim2=-1).sum(-1))[1]
        else:
            a = best.a if a is None else a
            residual = problem.tangent_residual(a)
        lam_out = best.lam if best is not None else torch.cat([ev.lam for ev, _ in parts])
        return BankSolution(problem, best, a, residual, counts, lam_out, lam0, gaps, tuple(stages),
                            problem.counters["evaluations"], problem.counters["hessian_products"], history, pieces)


def steepest_direction(W: torch.Tensor, G: torch.Tensor, manifold="stiefel", *, multiplier=None, correction=None,
                       ns_coefficients=None, eps: float = 1e-7, return_info: bool = False, **options):
    r"""Steepest unit direction of ``G`` under the spectral norm in the tangent space at ``W``.

    Returns :math:`A^\star = \arg\max \langle G, A\rangle` s.t. :math:`\|A\|_2 \le 1`,
    :math:`A \in T_W\mathcal{M}`; the descent step is :math:`W - \eta A^\star`. ``"euclidean"``:
    :math:`\operatorname{msign}(G)`. ``G`` is normalized first (the dual is not scale invariant;
    the multiplier refers to the normalized problem); a wide input is solved transposed and the
    multiplier lives in the tall orientation (``min(m, n)`` square).

    Args:
        W: ``(m, n)`` point on the manifold (ignored for ``"euclidean"``).
        G: ``(m, n)`` gradient.
        manifold: ``"stiefel"``, ``"dgram"``, ``"oblique"``, ``"euclidean"`` or a
            :class:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold` instance.
        multiplier: warm start :math:`\Lambda` ``(k, k)`` from a solve at the same point.
        correction: warm start :math:`\Lambda_0 + \Delta` with :math:`\Delta` a previous solve's
            ``correction`` (the warm start after the point moved).
        ns_coefficients: a custom ``(a, b, c)`` or schedule for the Newton–Schulz map.
        eps: floor of the Newton–Schulz normalization.
        return_info: also return a :class:`SteepestInfo`.
        **options: fields of :class:`~manifoldlib.optim.DualOptions`, over :data:`STEEPEST_DEFAULTS`
            (the exact ``"svd"`` map, ``tol=1e-4``, ``max_iter=100``, ``patience=6``, a certified
            gap for smoothed answers): ``msign_method``, ``ns_steps``, ``tol``, ``max_iter``,
            ``patience``, ``smoothing``, ``update``, ``spectral``, ``gap_tol``.

    Returns:
        ``A`` with ``G``'s shape and dtype, or ``(A, info)``.

    Raises:
        ValueError: an unknown manifold or option value, mismatched shapes, non-finite ``G``, a
            point the dual cannot use, or a warm start of the wrong shape.
        TypeError: an unknown option name.
    """
    geometry = matrix_manifold(manifold)
    dual = DualOptions.coerce(options, **STEEPEST_DEFAULTS)
    if dual.msign_method == "ns":
        raise ValueError("msign_method='ns' is the optimizer's group Newton-Schulz; give a preset "
                         "('jordan5', 'polar-express', 'newton-schulz') or 'svd'")
    _check_inputs(W, G, geometry)
    if multiplier is not None and correction is not None:
        raise ValueError("give at most one of multiplier and correction")
    execution = Execution.resolve(G.device, spectral=dual.spectral, sync_free=bool(dual.sync_free),
                                  columns=min(G.shape))
    transposed = G.size(-2) < G.size(-1)
    g = (G.mT if transposed else G).to(execution.work_dtype(G.dtype))
    if geometry.flat:
        from ..functional.msign import msign
        from ..functional.newton_schulz import gram_newton_schulz

        gs = into_safe_range(g)
        if dual.msign_method == "svd":
            a = msign(gs, "svd")
        else:
            a = gs @ gram_newton_schulz(gs.mT @ gs, dual.msign_method, dual.ns_steps,
                                        coefficients=ns_coefficients, eps=eps)
        a = (a.mT if transposed else a).to(G.dtype)
        info = SteepestInfo(0, 0.0, True, multiplier, correction, [0.0])
        return (a, info) if return_info else a
    work = execution.work_dtype(G.dtype)
    if options.get("smoothing", "auto") == "auto" and dual.gap_tol is not None and work == torch.float32:
        work = torch.float64  # a certified solve may shrink the smoothing below what float32 resolves
    w = (W.mT if transposed else W).to(work)
    n = w.size(-1)
    start = multiplier if multiplier is not None else correction
    if start is not None and tuple(start.shape) != (n, n):
        label = "multiplier" if multiplier is not None else "correction"
        raise ValueError(f"{label} must have shape {(n, n)}, got {tuple(start.shape)}")
    spectral = Spectral(dual.msign_method, dual.ns_steps, None if ns_coefficients is None else tuple(ns_coefficients),
                        eps, execution.spectral)
    solution = solve_bank(w.unsqueeze(0), g.to(work).unsqueeze(0), geometry, dual, execution, spectral,
                          start=None if start is None else start.to(work).unsqueeze(0),
                          multiplier=multiplier is not None)
    a = solution.direction()[0]
    a = (a.mT if transposed else a).to(G.dtype)
    if not return_info:
        return a
    residual = float(solution.residual[0])
    gap = solution.gap[0]
    # the certificate decides for the maps meant to be exact; a Newton-Schulz preset such as jordan5
    # maps singular values near, not to, 1, and its gap measures the map, not the solve
    exact_map = dual.msign_method in ("svd", "polar-express", "newton-schulz")
    certify = options.get("smoothing", "auto") == "auto" and dual.gap_tol is not None and exact_map
    converged = residual <= dual.tol and (gap is None or not certify or gap <= dual.gap_tol)
    lam = solution.lam[0].to(work)
    history = [float(r[0]) for r in solution.history]
    info = SteepestInfo(int(solution.iterations[0]), residual, converged, lam, lam - solution.lam0[0], history,
                        gap, solution.stages, solution.evaluations, solution.hessian_products)
    return a, info


def tangent_residual(W: torch.Tensor, A: torch.Tensor, manifold="stiefel") -> float:
    r"""Relative normal component :math:`\|A - P_WA\|_F/\|A\|_F` of ``A`` at ``W`` (either orientation).

    Raises:
        ValueError: an unknown manifold or mismatched shapes.
    """
    geometry = matrix_manifold(manifold)
    if geometry.flat:
        return 0.0
    if W.shape != A.shape or W.dim() != 2:
        raise ValueError(f"W and A must be matrices of the same shape, got {tuple(W.shape)} and {tuple(A.shape)}")
    w, a = (W.mT, A.mT) if W.size(0) < W.size(1) else (W, A)
    return float(geometry.tangent_residual(w, a))


def _check_inputs(w: torch.Tensor, g: torch.Tensor, manifold) -> None:
    for label, t in (("G", g),) if manifold.flat else (("W", w), ("G", g)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{label} must be a real floating-point tensor (float16, bfloat16, float32, "
                             f"float64), got {getattr(t, 'dtype', type(t).__name__)}")
    if g.dim() != 2:
        raise ValueError(f"the gradient must be a matrix (m, n), got shape {tuple(g.shape)}")
    if not manifold.flat and w.shape != g.shape:
        raise ValueError(f"W and G must have the same shape, got {tuple(w.shape)} and {tuple(g.shape)}")
    if not bool(torch.isfinite(g.sum(dtype=torch.promote_types(g.dtype, torch.float32)))):
        raise ValueError("G has non-finite entries (NaN or inf); the dual needs a finite input")
