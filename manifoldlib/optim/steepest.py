r"""Steepest directions under the spectral norm on a tangent space, one matrix at a time:
:func:`steepest_direction` (the exact solver by default, with a certificate) and
:func:`tangent_residual`.

:func:`steepest_direction` solves the one-matrix bank of :func:`~manifoldlib.optim.dual_solvers.solve_bank`,
the solve every :class:`~manifoldlib.optim.ManifoldMuon` step runs, over its own defaults
(:data:`STEEPEST_DEFAULTS`: the exact ``"svd"`` map, a tight tolerance and a certified smoothed
answer). The reported residual is that of the returned direction, computed from the exact
:math:`W^\top A` (not the reduced problem's, which assumes :math:`W` exactly on the manifold).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..functional.scaling import into_safe_range
from ..manifolds import Euclidean, MatrixConstraintManifold, get_manifold
from .dual import NORMAL_GRADIENT_ULPS, Spectral
from .dual_solvers import solve_bank
from .execution import Execution, ieee_float32_matmul
from .options import DualOptions

__all__ = [
    "GAP_TOL",
    "STEEPEST_DEFAULTS",
    "STEEPEST_MANIFOLDS",
    "SteepestInfo",
    "matrix_manifold",
    "steepest_direction",
    "tangent_residual",
]

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
        correction: :math:`\Lambda - \Lambda_0` divided by :math:`\|P_WG\|_F` (of the normalized
            gradient): pass it back as ``correction`` at a *new* point.
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


def steepest_direction(W: torch.Tensor, G: torch.Tensor, manifold="stiefel", *, multiplier=None, correction=None,
                       ns_coefficients=None, eps: float = 1e-7, return_info: bool = False, **options):
    r"""Steepest unit direction of ``G`` under the spectral norm in the tangent space at ``W``.

    Returns :math:`A^\star = \arg\max \langle G, A\rangle` s.t. :math:`\|A\|_2 \le 1`,
    :math:`A \in T_W\mathcal{M}`; the descent step is :math:`W - \eta A^\star`. ``"euclidean"``:
    :math:`\operatorname{msign}(G)`. ``G`` is normalized first (the dual is not scale invariant;
    the multiplier refers to the normalized problem); a wide input is solved transposed and the
    multiplier lives in the tall orientation (``min(m, n)`` square). A ``G`` with no tangent part
    at ``W`` above the rounding of the inputs (a normal gradient such as :math:`G = WS` on Stiefel)
    gives ``A = 0`` like ``G = 0`` (every tangent ``A`` has :math:`\langle G, A\rangle = 0`), with
    ``converged=True``, no gap and the exact multiplier.

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
    with ieee_float32_matmul():  # a TF32 product's error (~1e-3) would hide the rounding it looks for
        normal = _normal_multiplier_if_normal(geometry, w, g.to(work), (W.dtype, G.dtype))
    if normal is not None:  # no tangent part above the inputs' rounding: every tangent A has <G, A> = 0
        a = torch.zeros_like(G)
        info = SteepestInfo(0, 0.0, True, normal, torch.zeros_like(normal), [0.0])
        return (a, info) if return_info else a
    spectral = Spectral(dual.msign_method, dual.ns_steps, None if ns_coefficients is None else tuple(ns_coefficients),
                        eps, execution.spectral)
    solution = solve_bank(w.unsqueeze(0), g.to(work).unsqueeze(0), geometry, dual, execution, spectral,
                          start=None if start is None else start.to(work).unsqueeze(0),
                          multiplier=multiplier is not None)
    tall = solution.direction()[0]
    a = (tall.mT if transposed else tall).to(G.dtype)
    if not return_info:
        return a
    residual = float(solution.residual[0])
    if a.dtype != tall.dtype:  # the returned A is rounded: its residual, not the solve's (bfloat16: ~5e-4)
        residual = max(residual, float(geometry.tangent_residual(w, (a.mT if transposed else a).to(work))))
    gap = solution.gap[0]
    best = solution.best
    if gap is None and best is not None and best.eig is not None and solution.problem.reduced:
        gap = solution.problem.relative_gap(best)  # an unsmoothed eigh answer's certificate
    # the certificate decides for the maps meant to be exact; a Newton-Schulz preset such as jordan5
    # maps singular values near, not to, 1, and its gap measures the map, not the solve
    exact_map = dual.msign_method in ("svd", "polar-express", "newton-schulz")
    certify = options.get("smoothing", "auto") == "auto" and dual.gap_tol is not None and exact_map
    converged = residual <= dual.tol and (gap is None or not certify or gap <= dual.gap_tol)
    lam = solution.lam[0].to(work)
    history = [float(r[0]) for r in solution.history]
    info = SteepestInfo(int(solution.iterations[0]), residual, converged, lam, solution.correction[0].to(work), history,
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


def _normal_multiplier_if_normal(geometry, w: torch.Tensor, g: torch.Tensor, dtypes) -> torch.Tensor | None:
    r"""The optimal multiplier :math:`\Lambda_0` (the closed-form start, for ``g`` normalized) when ``g``'s
    tangent part at ``w`` is below the rounding of the inputs, ``None`` otherwise (and for ``g = 0``,
    which the solve handles). Then ``g`` is normal: the steepest direction is ``A = 0``, and a solve would
    chase rounding noise (its relative duality gap divides by :math:`\langle G, A\rangle \approx 0`).
    The threshold is :data:`~manifoldlib.optim.dual.NORMAL_GRADIENT_ULPS` times
    :math:`(2\epsilon_{\text{in}} + \sqrt n\,\epsilon_{\text{work}})\|G\|_F`, :math:`\epsilon_{\text{in}}` the
    machine epsilon (``torch.finfo(dtype).eps``) of the less precise of ``W`` and ``G``,
    :math:`\epsilon_{\text{work}}` the solve's (the optimizer's step uses the same)."""
    g = into_safe_range(g)
    size = g.norm()
    if not bool(size > 0):
        return None
    g = g / size
    multiplier = geometry.normal_multiplier(w, g)
    tangent = (g - w @ multiplier).norm()
    u_in = max(torch.finfo(d).eps for d in dtypes)
    floor = NORMAL_GRADIENT_ULPS * (2 * u_in + g.size(-1) ** 0.5 * torch.finfo(g.dtype).eps)
    if not bool(tangent <= floor):
        return None
    return -0.5 * multiplier


def _check_inputs(w: torch.Tensor, g: torch.Tensor, manifold) -> None:
    for label, t in (("G", g),) if manifold.flat else (("W", w), ("G", g)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{label} must be a real floating-point tensor (float16, bfloat16, float32, "
                             f"float64), got {getattr(t, 'dtype', type(t).__name__)}")
    if g.dim() != 2:
        raise ValueError(f"the gradient must be a matrix (m, n), got shape {tuple(g.shape)}")
    if not manifold.flat and w.shape != g.shape:
        raise ValueError(f"W and G must have the same shape, got {tuple(w.shape)} and {tuple(g.shape)}")
    if not bool(torch.isfinite(g).all()):  # (not a sum: that overflows for finite entries)
        raise ValueError("G has non-finite entries (NaN or inf); the dual needs a finite input")
