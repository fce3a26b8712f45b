r"""Inverse square roots of Gram matrices close to diagonal, without an eigendecomposition.

A Gram-form polar factor is :math:`\operatorname{msign}(Y) = Y\,T^{-1/2}` with :math:`T = Y^\top Y`
(:mod:`manifoldlib.functional.msign`, method ``"gram-eigh"``). The retraction of a small step
:math:`Y = W + V` of a Stiefel or DGram point has a Gram matrix that is diagonal up to terms of
order :math:`\|V\|^2` (the first-order terms vanish for a tangent :math:`V`). There the inverse
square root is a few ``n × n`` products away from the diagonal, and an eigh (several times the
cost of a product, and float32 eigenvectors are orthonormal only to about :math:`\sqrt{n}\epsilon`)
is not needed. Two kernels, both returning ``None`` when ``T`` is too far from diagonal:

* :func:`near_scalar_rsqrt`: :math:`T = s(I + E)`, the Taylor series of :math:`(1 + x)^{-1/2}`
  with an *a priori* truncation bound (the Stiefel case: the diagonal is nearly constant);
* :func:`near_diagonal_rsqrt`: :math:`T = D(I + E)D` with a graded diagonal ``D`` (the DGram
  case: columns of different norms), by chord iterations checked *a posteriori* on
  :math:`I - YTY`.

Both measure the distance from diagonal by :math:`\rho = \|E\|_1 \ge \|E\|_2` (``E`` symmetric).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "CHORD_FIXED_STEPS",
    "alternating_gram_factor",
    "chord_rsqrt",
    "near_diagonal_rsqrt",
    "near_scalar_rsqrt",
    "normalize_gram_factor",
    "polar_gram_factor",
    "products_only_rsqrt",
]

#: Taylor coefficients :math:`\binom{-1/2}{k}` of :math:`(1 + x)^{-1/2}`, :math:`k = 0, 1, \dots`
RSQRT_TAYLOR = (1.0, -0.5, 0.375, -0.3125, 0.2734375, -0.24609375)
#: Largest :math:`\rho` the chord iterations start from (they gain about a factor :math:`\rho` each).
CHORD_START_LIMIT = 0.1
#: Residual evaluations (two ``n × n`` products each) before :func:`near_diagonal_rsqrt` gives up.
CHORD_MAX_CHECKS = 3
#: :func:`near_diagonal_rsqrt` accepts :math:`\|I - YTY\|_1 \le` this many ``eps`` of the dtype
#: (its rounding floor is about 2 eps in float32 and float64).
CHORD_TOL_EPS = 16.0


def near_scalar_rsqrt(t: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    r"""``(T^{-1/2}, error bound)`` of a symmetric ``(..., n, n)`` ``t`` close to a multiple of the identity.

    With :math:`s = \operatorname{tr}(T)/n` and :math:`E = T/s - I`,
    :math:`T^{-1/2} = s^{-1/2}\sum_k c_k E^k`, :math:`c_k = \binom{-1/2}{k}`. The :math:`|c_k|`
    decrease, so truncating after ``K`` terms errs by at most :math:`|c_K|\rho^K/(1 - \rho)`
    (spectral norm, relative). The fewest terms whose bound is under the dtype's :math:`\epsilon`
    are used, in Horner form (``K - 2`` products): the polar retraction of a step of length
    :math:`\eta` along a unit tangent has :math:`\rho = O(\eta^2)` (2.7e-3 at :math:`\eta = 0.02`,
    768 columns) and needs one product. ``None`` when six terms are not enough.

    Returns:
        ``(y, bound)``: ``(..., n, n)`` inverse square root and the largest truncation bound
        (at least :math:`\epsilon\,(1 + \rho)/(1 - \rho)`, the rounding of a well-conditioned pass).
    """
    n = t.size(-1)
    eps = float(torch.finfo(t.dtype).eps)
    scale = torch.diagonal(t, dim1=-2, dim2=-1).sum(-1).div(n)[..., None, None]  # (..., 1, 1)
    if not bool((scale > 0).all()):
        return None
    eye = torch.eye(n, dtype=t.dtype, device=t.device)
    e = t / scale - eye  # (..., n, n)
    rho = float(e.detach().abs().sum(-2).amax())
    if not rho < 0.5:  # (also catches NaN)
        return None
    for terms in range(2, len(RSQRT_TAYLOR)):
        bound = abs(RSQRT_TAYLOR[terms]) * rho**terms / (1.0 - rho)
        if bound <= eps:
            break
    else:
        return None
    acc = RSQRT_TAYLOR[terms - 1] * e + RSQRT_TAYLOR[terms - 2] * eye
    for k in range(terms - 3, -1, -1):
        acc = e @ acc + RSQRT_TAYLOR[k] * eye
    return acc * scale.rsqrt(), max(bound, eps * (1.0 + rho) / (1.0 - rho))


def near_diagonal_rsqrt(t: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    r"""``(T^{-1/2}, residual)`` of a symmetric ``(..., n, n)`` ``t`` close to a positive diagonal.

    With :math:`D = \operatorname{diag}(T)^{1/2}` and :math:`E = D^{-1}TD^{-1} - I` (zero diagonal),
    :math:`\rho = \|E\|_1 <` :data:`CHORD_START_LIMIT`: the chord method on :math:`YTY = I` with the
    linearization frozen at :math:`T \approx D^2`,

    .. math::

        Y_1 = D^{-1} - E \oslash (d_i + d_j), \qquad
        Y_{k+1} = Y_k + (I - Y_kTY_k) \oslash (d_i + d_j),

    each step gaining about a factor :math:`\rho`. Every :math:`Y_k` is symmetric, and
    :math:`YTY = I` has the single symmetric positive definite solution :math:`T^{-1/2}`, so the
    residual :math:`\|I - YTY\|_1` — computed in the scaled form :math:`U^\top(I + E)U`,
    :math:`U = DY \approx I` — is the orthonormality defect of the polar factor :math:`YT^{1/2}`
    and the stopping test: at most :data:`CHORD_TOL_EPS` ``eps``, else ``None`` after
    :data:`CHORD_MAX_CHECKS` residuals. The grading never enters the arithmetic: a column whose
    norm is 1e-6 of another's is resolved like any other (the Gram matrix's eigenvalues would
    span 1e-24 and an eigh in float32 would zero it).

    Returns:
        ``(y, residual)``: ``(..., n, n)`` inverse square root and the largest :math:`\|I - YTY\|_1`.
    """
    n = t.size(-1)
    eps = float(torch.finfo(t.dtype).eps)
    diag = torch.diagonal(t, dim1=-2, dim2=-1)  # (..., n)
    if not bool((diag > 0).all()):
        return None
    d = diag.sqrt()
    eye = torch.eye(n, dtype=t.dtype, device=t.device)
    e = t / (d.unsqueeze(-1) * d.unsqueeze(-2)) - eye  # (..., n, n), zero diagonal up to rounding
    rho = float(e.detach().abs().sum(-2).amax())
    if not rho < CHORD_START_LIMIT:  # (also catches NaN)
        return None
    # in the scaled variable U = D Y (D^{-1} U D^{-1} = Y, symmetric): U_1 = I - E d_i/(d_i + d_j)
    weight = d.unsqueeze(-1) / (d.unsqueeze(-1) + d.unsqueeze(-2))  # (..., n, n): d_i / (d_i + d_j)
    u = eye - e * weight
    scaled = eye + e  # D^{-1} T D^{-1}
    for _ in range(CHORD_MAX_CHECKS):
        # Y T Y = D^{-1} U^T (D^{-1} T D^{-1})... in the scaled form: I - Y T Y = I - U^T (I + E) U,
        # with U = D Y row-scaled (U^T = Y D)
        r = eye - u.mT @ (scaled @ u)  # (..., n, n)
        r = 0.5 * (r + r.mT)
        residual = float(r.detach().abs().sum(-2).amax())
        if math.isnan(residual):
            return None
        if residual <= CHORD_TOL_EPS * eps:
            y = u / d.unsqueeze(-1)  # Y = D^{-1} U
            return 0.5 * (y + y.mT), residual
        u = u + r * weight  # D (Y + R / (d_i + d_j))
    return None


#: Chord steps of :func:`chord_rsqrt` (each gains about a factor :math:`\rho`).
CHORD_FIXED_STEPS = 3


def chord_rsqrt(t: torch.Tensor, steps: int = CHORD_FIXED_STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(T^{-1/2}, residual)`` by a fixed number of chord steps, with nothing read back to the host.

    :func:`near_diagonal_rsqrt`'s iteration (scaled by :math:`D = \operatorname{diag}(T)^{1/2}`, so a
    graded diagonal costs nothing) run exactly ``steps`` times: for the sync-free retraction of a
    Manifold Muon step, whose Gram matrix is diagonal up to :math:`O(\eta^2)`. Nothing checks
    that ``t`` is close enough to diagonal; the residual :math:`\|I - YTY\|_1` (two more
    products) says how far the result is from :math:`T^{-1/2}`, so the caller can keep what it
    had where it is not small (it is large or NaN where ``t`` is far from diagonal).

    Returns:
        ``(y, residual)``: ``(..., n, n)`` and ``(...)``.
    """
    n = t.size(-1)
    eye = torch.eye(n, dtype=t.dtype, device=t.device)
    d = torch.diagonal(t, dim1=-2, dim2=-1).clamp_min(torch.finfo(t.dtype).tiny).sqrt()  # (..., n)
    scaled = t / (d.unsqueeze(-1) * d.unsqueeze(-2))  # I + E
    weight = d.unsqueeze(-1) / (d.unsqueeze(-1) + d.unsqueeze(-2))
    u = eye - (scaled - eye) * weight
    for _ in range(steps + 1):
        r = eye - u.mT @ (scaled @ u)
        r = 0.5 * (r + r.mT)
        if _ < steps:
            u = u + r * weight
    # the residual of the last update is the last r's successor: one more evaluation would cost two
    # products; r here is that of the final u (the loop evaluates once more than it updates)
    y = u / d.unsqueeze(-1)
    return 0.5 * (y + y.mT), r.abs().sum(-2).amax(-1)


def products_only_rsqrt(t: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    r"""``(T^{-1/2}, error)`` by the first kernel that resolves the symmetric ``t``:
    :func:`near_scalar_rsqrt`, then :func:`near_diagonal_rsqrt`; ``None`` when neither does.

    The one order every Gram-form polar factor of a small step uses (``msign(..., "gram-eigh")``
    and :mod:`~manifoldlib.optim.fused_retraction`), so both take the same kernel on the same
    Gram matrix.
    """
    for kernel in (near_scalar_rsqrt, near_diagonal_rsqrt):
        found = kernel(t)
        if found is not None:
            return found
    return None


# -- Gram-form retraction factors -----------------------------------------------------------
# The retraction of Y is Y Φ with Φ an n x n function of T = Y^T Y; a manifold names its own
# (manifoldlib.manifolds.*.gram_retraction_factor), and the fused Manifold Muon step forms Y^T Y
# without Y. ``rsqrt`` maps a symmetric T to T^{-1/2} or None (then the factor is None too).


def polar_gram_factor(gram: torch.Tensor, rsqrt) -> torch.Tensor | None:
    r"""Polar retraction (Stiefel): :math:`\Phi = T^{-1/2}`."""
    return rsqrt(gram)


def alternating_gram_factor(gram: torch.Tensor, rsqrt) -> torch.Tensor | None:
    r"""Alternating retraction (DGram): with :math:`c_j = \|y_j\|` and :math:`F = (cTc)^{-1/2}`,
    :math:`d'_j = (FcT)_{jj}` and :math:`\Phi = cFd'`."""
    c = torch.diagonal(gram, dim1=-2, dim2=-1).clamp_min(0).sqrt()  # (..., n) column norms of Y
    f = rsqrt(c.unsqueeze(-1) * gram * c.unsqueeze(-2))  # (cY^T Y c)^{-1/2}
    if f is None:
        return None
    d = ((f * c.unsqueeze(-2)) * gram).sum(-1).clamp_min(torch.finfo(gram.dtype).tiny)  # diag(F c Y^T Y)
    return (c.unsqueeze(-1) * f) * d.unsqueeze(-2)


def normalize_gram_factor(gram: torch.Tensor, rsqrt=None) -> torch.Tensor:
    r"""Column normalization (Oblique): :math:`\Phi = \operatorname{diag}(T_{jj}^{-1/2})`."""
    return torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1).rsqrt())
