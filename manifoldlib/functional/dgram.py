r"""DGram kernels: :math:`\{W \in \mathbb{R}^{m\times n}: \operatorname{Off}(W^\top W) = 0,\ \operatorname{rank} W = n\}`.

Write :math:`W = QD`, :math:`Q` Stiefel, :math:`D = \operatorname{diag}(d)`, :math:`d_j = \|w_j\| > 0`.
Tangent space :math:`\{V: w_i^\top v_j + v_i^\top w_j = 0,\ i \ne j\}`; normal space
:math:`\{WS: S \text{ symmetric, zero diagonal}\}`. See :doc:`/theory/dgram`.
"""

from __future__ import annotations

import math

import torch

from .._numbers import is_integer
from .msign import _gram_eigh_polar, _orthonormal_polar, msign
from .normal_space import _normal_component, normal_multiplier, off_diagonal
from .scaling import SAFE_EXPONENT, out_of_range_scale
from .stiefel import _check_tall_pair, _linalg_dtype

__all__ = [
    "off_diagonal",
    "dgram_normal_multiplier",
    "dgram_project_tangent",
    "dgram_alternating",
    "dgram_colnorm_polar",
    "dgram_metric_projection",
]


def dgram_normal_multiplier(w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    r""":math:`S_{ij} = (w_i^\top z_j + z_i^\top w_j)/(d_i^2 + d_j^2)` for :math:`i \ne j`, :math:`S_{ii} = 0`.

    ``WS`` is the normal component of ``Z`` at ``W``: ``(..., n, n)``.

    Scale-safe (:func:`~manifoldlib.functional.normal_space.normal_multiplier` brings ``W``'s
    largest entry into :math:`[0.5, 1)` by a power of two), so :math:`d_i^2` neither overflows
    (float32 columns of norm 1e20 gave NaN) nor underflows into the subnormals (columns of norms
    1e-21 .. 1e-15 left the projection off tangent by 2e-5 relative).
    """
    return normal_multiplier(w, z, off_diagonal)


def dgram_project_tangent(w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    r"""Orthogonal projection :math:`P_W(Z) = Z - WS` (assumes :math:`W^\top W` diagonal).

    :math:`WS` is formed column-scaled, never :math:`S` at its own scale (of order
    :math:`|z|/|w|`), so a ``Z`` far larger than ``W`` and columns far smaller than the largest
    are projected wherever :math:`WS` is representable. In the promoted dtype of ``w`` and ``z``."""
    dtype = torch.promote_types(w.dtype, z.dtype)
    w, z = w.to(dtype), z.to(dtype)
    return z - _normal_component(w, z, off_diagonal)


def _polar(y: torch.Tensor, method: str) -> torch.Tensor:
    if method == "auto":
        method = "newton" if (torch.is_grad_enabled() and y.requires_grad) else "svd"
    return _orthonormal_polar(y, method)


def dgram_alternating(w: torch.Tensor, v: torch.Tensor, method: str = "auto") -> torch.Tensor:
    r"""Alternating retraction (second order): one step of alternating metric projection.

    With :math:`Y = W + V`, :math:`c_j = \|y_j\|`: :math:`Q' = \operatorname{msign}(Y\operatorname{diag}(c))`,
    :math:`d'_j = q_j'^\top y_j`, :math:`R = Q'\operatorname{diag}(d')`; a column with
    :math:`d'_j \le 0` (a zero column of :math:`Y`, where no DGram point exists) is NaN, with
    every method (:meth:`~manifoldlib.DGram.retr` refuses it by name).
    :math:`Y\operatorname{diag}(c)` has column norms :math:`c_j^2`: ``method="auto"`` takes the
    scaled Newton polar factor, whose QR resolves each column relative to its own norm (an SVD
    maps the small ones to 0 once the spread passes its rank threshold, and the point's column
    collapses with no error). ``method="gram-eigh"`` refines its eigh in the column-scaled
    variables (the grading costs it no accuracy) and, where the Gram matrix cannot resolve the
    columns at all, takes the Newton polar factor too, not the SVD.
    """
    _check_tall_pair(w, v, "dgram_alternating")
    out_dtype = torch.promote_types(w.dtype, v.dtype)
    # float32 for the 16-bit dtypes: Y diag(c) squares Y's scale, and float16 entries of 100
    # (column norms ~300) overflowed it to inf
    work = _linalg_dtype(torch.empty((), dtype=out_dtype))
    y = w.to(work) + v.to(work)
    # R(sW, sV) = sR(W, V): work at the power of two that brings Y's largest entry into [1/2, 1),
    # where Y diag(c) (Y's scale squared) neither overflows nor underflows (float64 entries of
    # 1e-300 gave the zero matrix, of 1e300 a failed SVD)
    scale = out_of_range_scale(y, SAFE_EXPONENT)  # (..., 1, 1)
    y = y * scale
    c = y.norm(dim=-2, keepdim=True)  # (..., 1, n)
    if method == "gram-eigh":
        q = _gram_eigh_polar(y * c, fallback="newton")
    else:
        q = _orthonormal_polar(y * c, "newton" if method == "auto" else method)
    d = (q * y).sum(-2, keepdim=True)  # (..., 1, n): > 0 for every column Q' resolves
    # d_j <= 0 (a zero column of Y, a step u_j = -x_j) has no DGram point: NaN there, which
    # DGram.retr refuses by name; clamping it to a tiny norm returned a collapsed column, no error
    d = torch.where(d > 0, d, torch.nan)
    return (q * (d / scale)).to(out_dtype)


def dgram_colnorm_polar(w: torch.Tensor, v: torch.Tensor, method: str = "auto") -> torch.Tensor:
    r"""Column-normalized polar retraction (first order): :math:`\operatorname{msign}(Y D_Y^{-1}) D_Y`.

    Where :math:`Y` is rank deficient (dependent nonzero columns), the polar factor is the SVD's
    :math:`UV^\top`, orthonormal (msign's zero singular values to 0 put two columns of the result
    on one line, off the manifold without an error)."""
    _check_tall_pair(w, v, "dgram_colnorm_polar")
    y = w + v
    # scale-equivariant too: the column norms of Y at the power of two that brings its largest
    # entry into [1/2, 1) neither over- nor underflow (float32 entries of 1e-30 gave 0 / 0)
    scale = out_of_range_scale(y, SAFE_EXPONENT)  # (..., 1, 1)
    y = y * scale
    c = y.norm(dim=-2, keepdim=True)  # (..., 1, n)
    return _polar(y / c, method) * (c / scale)


def check_full_column_rank(x: torch.Tensor, who: str) -> None:
    """Raise ``ValueError`` naming the rank when a tall ``(..., m, n)`` matrix is numerically rank
    deficient: a zero column, or, with every column scaled to unit norm, a smallest singular value
    at most ``max(m, n)·eps`` of the largest, ``eps`` of float64, the precision the projection
    runs in (:func:`~manifoldlib.functional.dgram.dgram_metric_projection`).

    The scaling matters: DGram's columns are free in norm, and float32 columns of norms 1e-3 and
    1e3 are independent though the unscaled matrix's singular values span 1e6. So does the
    precision: the matrix as stored is what is projected, and a float32 Gaussian initialization
    of a square ``n × n`` map has a condition number above ``1/(n·eps₃₂)`` with a probability of
    about ``2n²·eps₃₂`` (one in seven at ``n = 768``), so float32's ``eps`` would refuse valid
    weights that float64 projects accurately."""
    work = x.detach().to(torch.float64)
    work = work * out_of_range_scale(work, SAFE_EXPONENT)  # rank is scale-free; the norms are not
    norms = work.norm(dim=-2, keepdim=True)  # (..., 1, n)
    sv = torch.linalg.svdvals(work / torch.where(norms > 0, norms, 1.0))  # (..., n)
    floor = sv.amax(dim=-1, keepdim=True) * max(x.shape[-2:]) * torch.finfo(work.dtype).eps
    rank = (sv > floor).sum(-1)  # (...,)
    n = x.shape[-1]
    if bool((rank < n).any()):
        zero_cols = (work.norm(dim=-2) == 0).nonzero()[:, -1].unique().tolist()
        detail = f"; zero columns: {zero_cols}" if zero_cols else ""
        raise ValueError(
            f"{who} needs a matrix of full column rank {n} (nonzero, linearly independent "
            f"columns), got rank {int(rank.min())}{detail}: no nearest dgram point exists"
        )


#: Relative stationarity :math:`\|d - c\|/\|d\|` (:func:`dgram_metric_projection`) at which the
#: nearest point is taken as found (the Frobenius distance's accuracy: large columns weigh most).
PROJECTION_TOL = 1e-12
#: Where the search stops improving (column norms spread over many orders put the polar factor's
#: small columns, and so :math:`c`, at float64's rounding floor), the stationarity it must have
#: reached for its best point to be returned.
PROJECTION_FLOOR = 1e-8
#: Largest relative stationarity :math:`|d_j - c_j|/d_j` of any one column of a returned point:
#: above it the column's norm is not determined (column norms spread over many orders, the small
#: ones drowned in the polar factor's rounding): the search is repeated with the Newton polar
#: factor, and raises where that does not determine it either.
PROJECTION_COLUMN_TOL = 1e-4
#: Evaluations without a 10 % better stationarity after which the search counts as stalled.
PROJECTION_PATIENCE = 20
#: Evaluations (one polar factor each) the nearest-point search may take.
PROJECTION_MAX_EVALUATIONS = 500
#: Past values the non-monotone line search of the nearest-point search compares against.
_LINE_SEARCH_MEMORY = 10


def dgram_metric_projection(y: torch.Tensor, iterations: int | None = None, method: str = "svd") -> torch.Tensor:
    r"""Nearest DGram point to ``y``: :math:`\min_{Q, d}\|Y - Q\operatorname{diag}(d)\|_F`.

    For fixed :math:`d` the best :math:`Q` is :math:`\operatorname{msign}(Y\operatorname{diag}(d))`,
    which leaves (up to :math:`\|Y\|_F^2`)

    .. math::

        \varphi(d) = \|d\|^2 - 2\|Y\operatorname{diag}(d)\|_*,\qquad
        \nabla\varphi = 2(d - c),\quad c_j = q_j^\top y_j.

    The alternating minimization :math:`d \leftarrow c` is gradient descent on :math:`\varphi` with
    step :math:`1/2`: every iterate lies exactly on DGram, but it converges slowly where columns
    are nearly dependent or their norms spread, and a fixed number of rounds can leave column
    norms far from the nearest point's. ``iterations=None`` (default) minimizes :math:`\varphi`
    to stationarity :data:`PROJECTION_TOL` instead, by Barzilai–Borwein steps with a non-monotone
    line search (its first step is one alternating round); an ``int`` runs that many alternating
    rounds (one round is the alternating retraction).

    Args:
        y: ``(..., m, n)`` with :math:`m \ge n` and full column rank (checked: a rank-deficient
            ``y`` has no nearest point).
        iterations: ``None`` or the number of alternating rounds (>= 1).
        method: the polar factor's method (:func:`~manifoldlib.functional.msign`); with the
            default ``"svd"``, a search that leaves a column undetermined or stalls is repeated
            with ``"newton"``, whose QR resolves every column relative to its own norm.

    Raises:
        ValueError: ``iterations`` not ``None`` or an int ``>= 1``, a ``y`` that is not of full
            column rank (:func:`check_full_column_rank`: with ``iterations`` a zero column came
            back zero, two parallel ones a point off DGram) or with non-finite entries, or a column whose norm the search does not determine
            (:data:`PROJECTION_COLUMN_TOL`; column norms spread over too many orders), naming
            the columns.
        RuntimeError: the search stalled above :data:`PROJECTION_FLOOR`, naming the stationarity.
    """
    if iterations is not None and not (is_integer(iterations) and iterations >= 1):  # (True ran one round)
        raise ValueError(f"iterations must be an int >= 1 (or None: to convergence), got {iterations!r}")
    if not bool(torch.isfinite(y).all()):
        raise ValueError("dgram_metric_projection needs finite entries, got nan or inf: no nearest DGram point exists")
    check_full_column_rank(y, "dgram_metric_projection")
    return _dgram_metric_projection(y, iterations, method)


def _dgram_metric_projection(y: torch.Tensor, iterations: int | None = None, method: str = "svd") -> torch.Tensor:
    """:func:`dgram_metric_projection` of a checked ``y``."""
    # Y diag(d) is graded like the squared spread of the column norms; a float32 SVD resolves its
    # singular values only down to ~1e-7 of the largest and would zero the smaller columns, so the
    # search runs in float64 (the projection is not on a hot path)
    out_dtype = y.dtype
    y = y.to(torch.float64) if y.dtype in (torch.float16, torch.bfloat16, torch.float32) else y
    # DGram is a cone, so the nearest point of uY is u times that of Y: search at the power of two
    # u that brings each matrix's largest entry into [1/2, 1) (exact), where Y diag(d) and |d|^2,
    # which square Y's scale, neither overflow nor underflow (float64 entries of 1e300 failed in
    # the SVD, entries of 1e-300 returned the zero matrix, no error), and divide it back out
    scale = out_of_range_scale(y, SAFE_EXPONENT)  # (..., 1, 1)
    y = y * scale
    if iterations is None:
        flat = y.reshape((-1,) + y.shape[-2:])
        found = [_nearest_resolved(matrix, method) for matrix in flat.unbind(0)]
        return (torch.stack(found).reshape(y.shape) / scale).to(out_dtype) if found else y.to(out_dtype)
    d = y.norm(dim=-2, keepdim=True)  # (..., 1, n)
    tiny = torch.finfo(y.dtype).tiny
    for _ in range(iterations):
        q = msign(y * d, method)
        d = (q * y).sum(-2, keepdim=True).clamp_min(tiny)
    return (q * d / scale).to(out_dtype)


def _nearest_resolved(y: torch.Tensor, method: str) -> torch.Tensor:
    r""":func:`_nearest` with ``method``; where that is the SVD and it leaves a column undetermined
    or the search stalls, again with the QR-based Newton polar factor. :math:`Y\operatorname{diag}(d)`
    has column norms :math:`d_j\|y_j\|`, graded like the squared spread of the point's column
    norms; an SVD resolves a column only to about :math:`\epsilon\,\sigma_{\max}` absolutely, the
    Newton iteration's QR column by column (:func:`~manifoldlib.functional.msign`), at a few times
    the SVD's cost."""
    try:
        return _nearest(y, method)
    except (ValueError, RuntimeError):
        if method != "svd":
            raise
    return _nearest(y, "newton")


def _nearest(y: torch.Tensor, method: str) -> torch.Tensor:
    r"""The nearest DGram point of one ``(m, n)`` matrix: Barzilai–Borwein on :math:`\varphi(d)`
    (:func:`dgram_metric_projection`), Grippo's non-monotone Armijo test over the last
    :data:`_LINE_SEARCH_MEMORY` values."""
    tiny = torch.finfo(y.dtype).tiny

    def evaluate(d):  # (phi, gradient, Q)
        q = msign(y * d, method)
        c = (q * y).sum(-2, keepdim=True)  # (1, n)
        return float((d * d).sum() - 2.0 * (d * c).sum()), 2.0 * (d - c), q

    d = y.norm(dim=-2, keepdim=True)  # (1, n)
    value, grad, q = evaluate(d)
    values, step, evaluations = [value], 0.5, 1
    best, best_point, since = math.inf, None, 0
    while True:
        stationarity = float(grad.norm() / (2.0 * d.norm()).clamp_min(tiny))
        if stationarity <= PROJECTION_TOL:
            return _checked(q * d, grad, d)
        if stationarity < 0.9 * best:
            best, best_point, since = stationarity, (q * d, grad, d), 0
        if since >= PROJECTION_PATIENCE or evaluations >= PROJECTION_MAX_EVALUATIONS:
            if best <= PROJECTION_FLOOR:
                return _checked(*best_point)
            raise RuntimeError(
                f"dgram_metric_projection: the nearest DGram point of a {tuple(y.shape)} matrix was not found "
                f"within {evaluations} evaluations (relative stationarity {best:.3e}, needed {PROJECTION_TOL:g}, "
                f"or {PROJECTION_FLOOR:g} where it stops improving); its columns may be dependent to working "
                f"precision")
        reference = max(values[-_LINE_SEARCH_MEMORY:])
        t = step
        while True:
            trial = (d - t * grad).clamp_min(tiny)
            trial_value, trial_grad, trial_q = evaluate(trial)
            evaluations += 1
            since += 1
            decrease = float((grad * (d - trial)).sum())
            if (trial_value <= reference - 1e-4 * decrease or evaluations >= PROJECTION_MAX_EVALUATIONS
                    or since >= PROJECTION_PATIENCE):
                break
            t *= 0.5
        s_vec, y_vec = trial - d, trial_grad - grad
        sy = float((s_vec * y_vec).sum())
        step = min(max(float((s_vec * s_vec).sum()) / sy, 1e-6), 1e6) if sy > 0 else 0.5
        d, value, grad, q = trial, trial_value, trial_grad, trial_q
        values.append(value)


def _checked(point: torch.Tensor, grad: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``point``, unless a column's norm is not a fixed point to :data:`PROJECTION_COLUMN_TOL`."""
    column = grad.abs().squeeze(-2) / (2.0 * d.squeeze(-2))  # (n,) |d_j - c_j| / d_j
    bad = (column > PROJECTION_COLUMN_TOL).nonzero().flatten().tolist()
    if bad:
        norms = d.squeeze(-2)
        raise ValueError(
            f"dgram_metric_projection: the search does not determine the nearest DGram point's columns {bad[:8]}"
            f"{' ...' if len(bad) > 8 else ''} of a {tuple(point.shape)} matrix (relative stationarity up to "
            f"{float(column.max()):.3e}, accepted {PROJECTION_COLUMN_TOL:g}): their norms are drowned by the "
            f"other columns' rounding (column norms of the point from {float(norms.min()):.3e} to "
            f"{float(norms.max()):.3e}); rescale the columns of the input into a narrower range")
    return point
