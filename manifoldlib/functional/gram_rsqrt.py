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

from .scaling import SAFE_EXPONENT, out_of_range_scale

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
    :math:`T^{-1/2} = s^{-1/2}\sum_k c_k E^k`, :math:`c_k = \binom{-1/2}{k}`. The fewest ``K``
    terms whose truncation error (below) is under the dtype's :math:`\epsilon` are evaluated by
    Horner's rule with the identity kept apart, :math:`P_j = c_jI + R_j`,
    :math:`R_{K-2} = c_{K-1}E`, :math:`R_j = c_{j+1}E + E\,R_{j+1}` (``K - 2`` products, each of
    :math:`E` with an :math:`R` of norm :math:`O(\rho)`), :math:`Y = s^{-1/2}(c_0I + R_0)`. The
    polar retraction of a step of length :math:`\eta` along a unit tangent has
    :math:`\rho = O(\eta^2)` and, at training's step lengths, needs one product
    (``test_a_float32_step_at_768_columns_keeps_the_one_pass_fast_path`` checks steps of
    :math:`\eta = 0.02` and 0.05 on 768 columns).
    ``None`` when five terms (``K = 5``, the most the six coefficients of :data:`RSQRT_TAYLOR` bound)
    are not enough: :math:`|c_5|\rho^5/(1 - \rho) > \epsilon`, i.e. :math:`\rho` above about
    0.054 in float32 and 1e-3 in float64.

    The bound is on :math:`\|Y - T^{-1/2}\|_2 / \|T^{-1/2}\|_2` for the ``t`` given (its own
    rounding is the caller's): a worst case in IEEE arithmetic with unit roundoff
    :math:`u = \epsilon/2` (float32 products in IEEE float32, not TF32; the sums apart from the
    products, as in eager mode: a compiler that fuses them into a product's accumulator voids the
    product term below), to first order in :math:`u`, barring underflow. Write
    :math:`\rho = \|E\|_1 \ge \|\,|E|\,\|_2` for the computed, symmetric :math:`E` (its computed
    norm raised by :math:`1/(1 - \gamma_n)`), :math:`\gamma_n = nu/(1 - nu)`,
    :math:`g = \sum_k |c_k|\rho^k = (1 - \rho)^{-1/2}` and
    :math:`r_j = \sum_{i \ge 1}|c_{j+i}|\rho^i \ge \|\,|R_j|\,\|_2` (so
    :math:`r_j = |c_{j+1}|\rho + \rho\,r_{j+1}`, :math:`|c_j| + r_j \le g`: the :math:`|c_k|`
    decrease). In units of :math:`s^{-1/2}`:

    * truncation: :math:`\|\sum_{k \ge K} c_kE^k\|_2 \le |c_K|\rho^K/(1 - \rho)`;
    * input: the computed :math:`E = \mathrm{fl}(T/s) - I` (the subtraction is exact, Sterbenz)
      differs from :math:`T/s - I` by :math:`|F| \le u(I + |E|)`, :math:`\|F\|_2 \le u(1 + \rho)`,
      which moves :math:`(I + E)^{-1/2}` by at most
      :math:`\sum_k k|c_k|\rho^{k-1}\|F\| = \tfrac12(1 - \rho)^{-3/2}\|F\|`;
    * Horner: :math:`R_{K-2}` errs by :math:`u\,r_{K-2}` (a rounding per entry). Step ``j``
      multiplies the error so far by :math:`E` (norm :math:`\le \rho`) and adds
      :math:`u|c_{j+1}|\rho` (the scaled :math:`E`), :math:`\gamma_n\rho\,r_{j+1}` (the product:
      the worst case of an ``n``-term dot product in any summation order, blocked and FMA
      included, :math:`\gamma_n\|\,|E||R_{j+1}|\,\|_2`) and :math:`u\,r_j` (the sum). The last
      :math:`c_0I` rounds the diagonal only: a diagonal error of norm :math:`\le ug`. Random inputs
      round about :math:`\sqrt n` times less in the products; the bound does not assume it. The
      product's share is :math:`O(\gamma_n\rho^2)` because the identity never enters a product
      (Horner on :math:`P_j` itself puts :math:`c\,I` into every dot product and costs
      :math:`\gamma_n\rho\,g`: at 768 columns in float32, :math:`\gamma_n \approx 4.6\cdot10^{-5}`,
      that bound would pass the 1e-6 under which its readers keep one pass
      (:data:`~manifoldlib.functional.msign.GRAM_EIGH_ONE_PASS`) near :math:`\rho = 0.015`);
    * scaling by :math:`\mathrm{fl}(1/\mathrm{fl}(\sqrt s))` (each correctly rounded: :math:`2u`)
      and the product: :math:`3ug`.

    The sum is made relative by a factor :math:`\sqrt{1 + \rho} \ge 1/(\|T^{-1/2}\|_2 s^{1/2})`.
    As :math:`\rho \to 0` it is :math:`4.5u = 2.25\epsilon`. The earlier
    :math:`\epsilon(1 + \rho)/(1 - \rho)` left out the rounding of :math:`E`, of the scaling and of
    the Horner steps, a few :math:`u` each, and computed errors exceeded it.
    ``test_near_scalar_error_is_within_its_bound`` (``tests/functional/test_gram_rsqrt.py``)
    checks computed errors against this bound with a 60-digit oracle, in float32 and float64, for
    ``n`` from 2 to 256 and :math:`\rho` from 1e-8 to 0.45, and that the bound stays below
    :math:`3.5\epsilon + n\epsilon\rho^2`.

    Returns:
        ``(y, bound)``: ``(..., n, n)`` inverse square root and the largest bound over the batch.
    """
    n = t.size(-1)
    eps = float(torch.finfo(t.dtype).eps)
    scale = torch.diagonal(t, dim1=-2, dim2=-1).sum(-1).div(n)[..., None, None]  # (..., 1, 1)
    if not bool((scale > 0).all()):
        return None
    eye = torch.eye(n, dtype=t.dtype, device=t.device)
    e = t / scale - eye  # (..., n, n)
    rho = float(e.detach().abs().sum(-2).amax()) / (1.0 - _gamma(n, eps))
    if not rho < 0.5:  # (also catches NaN)
        return None
    for terms in range(2, len(RSQRT_TAYLOR)):
        if abs(RSQRT_TAYLOR[terms]) * rho**terms / (1.0 - rho) <= eps:
            break
    else:
        return None
    r = RSQRT_TAYLOR[terms - 1] * e  # (..., n, n): P_{K-2} - c_{K-2} I
    for k in range(terms - 3, -1, -1):
        r = RSQRT_TAYLOR[k + 1] * e + e @ r  # P_k - c_k I = E P_{k+1}
    y = (r + RSQRT_TAYLOR[0] * eye) * scale.sqrt().reciprocal()
    return y, _near_scalar_bound(rho, n, terms, eps)


def _gamma(n: int, eps: float) -> float:
    r""":math:`\gamma_n = nu/(1 - nu)`, :math:`u = \epsilon/2`: the relative rounding of an
    ``n``-term dot product in the worst case (infinite where :math:`nu \ge 1/2`)."""
    nu = n * eps / 2
    return nu / (1.0 - nu) if nu < 0.5 else math.inf


def _near_scalar_bound(rho: float, n: int, terms: int, eps: float) -> float:
    r""":func:`near_scalar_rsqrt`'s relative error bound for :math:`\rho = \|E\|_1`, ``n`` columns,
    ``terms`` Taylor terms and the dtype's ``eps`` (its docstring derives each term)."""
    u, gamma = eps / 2, _gamma(n, eps)
    g = (1.0 - rho) ** -0.5
    r = abs(RSQRT_TAYLOR[terms - 1]) * rho  # r_{K-2}
    horner = u * r
    for j in range(terms - 3, -1, -1):
        r_next, r = r, abs(RSQRT_TAYLOR[j + 1]) * rho + rho * r
        horner = rho * horner + u * abs(RSQRT_TAYLOR[j + 1]) * rho + gamma * rho * r_next + u * r
    truncation = abs(RSQRT_TAYLOR[terms]) * rho**terms / (1.0 - rho)
    inputs = 0.5 * u * (1.0 + rho) * (1.0 - rho) ** -1.5
    return (1.0 + rho) ** 0.5 * (truncation + inputs + horner + u * g + 3.0 * u * g)


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
    span 1e-12, below the :math:`\epsilon\lambda_{\max}` to which a float32 eigh resolves them;
    ``test_near_diagonal_chord_resolves_graded_gram_matrices`` checks such a grading).

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
    and the fused retraction of :mod:`~manifoldlib.optim.core`), so both take the same kernel on the same
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
    :math:`d'_j = (FcT)_{jj}` and :math:`\Phi = cFd'`.

    :math:`\Phi` is invariant under :math:`T \mapsto sT` (:math:`R(\sqrt s\,Y) = \sqrt s\,R(Y)`)
    while :math:`cTc` scales like :math:`T^2`: a ``gram`` whose largest entry lies outside
    :math:`[2^{-32}, 2^{32}]` is first multiplied by the power of two that brings it into
    :math:`[1/2, 1)` (exact). Without it :math:`cTc`, of the fourth power of the point's scale,
    overflowed (a non-finite :math:`\Phi`) or underflowed (:math:`\Phi = 0`, residual 1) once
    that power left the dtype's range, and :func:`products_only_rsqrt` resolved neither
    (``test_alternating_gram_factor_is_scale_free_over_the_whole_range`` checks points scaled by
    :math:`2^{\pm 30}` and :math:`2^{\pm 60}` in float32, :math:`2^{\pm 200}` and
    :math:`2^{\pm 500}` in float64).
    """
    gram = gram * out_of_range_scale(gram, SAFE_EXPONENT)  # Phi is scale-free; cTc is T's scale squared
    c = torch.diagonal(gram, dim1=-2, dim2=-1).clamp_min(0).sqrt()  # (..., n) column norms of Y
    f = rsqrt(c.unsqueeze(-1) * gram * c.unsqueeze(-2))  # (cY^T Y c)^{-1/2}
    if f is None:
        return None
    d = ((f * c.unsqueeze(-2)) * gram).sum(-1).clamp_min(torch.finfo(gram.dtype).tiny)  # diag(F c Y^T Y)
    return (c.unsqueeze(-1) * f) * d.unsqueeze(-2)


def normalize_gram_factor(gram: torch.Tensor, rsqrt=None) -> torch.Tensor:
    r"""Column normalization (Oblique): :math:`\Phi = \operatorname{diag}(T_{jj}^{-1/2})`."""
    return torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1).rsqrt())
