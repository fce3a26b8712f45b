r"""Spectral factors :math:`R` with :math:`\operatorname{msign}(X) \approx XR`, from the Gram matrix of :math:`X`.

The dual solves of :mod:`manifoldlib.optim.steepest` never touch the ``m × n`` matrix
:math:`X = G + 2W\Lambda` inside their iterations: every spectral map of :math:`X` is
:math:`XR` with :math:`R` a function of :math:`S = X^\top X`. Two ways to get it:
:func:`gram_msign_factor` runs a Newton–Schulz preset in Gram form (matrix products only);
:func:`gram_msign_factor_eigh` applies the preset's scalar map to the eigenvalues of :math:`S`
(one eigh), which is what the solvers use.
"""

from __future__ import annotations

import torch

from ..functional.msign import NEWTON_SCHULZ_PRESETS

__all__ = ["gram_msign_factor", "gram_msign_factor_eigh"]


def _ns_plan(method: str, steps: int | None, coefficients):
    """``(steps, schedule, first-scaling safety factor)`` of a Newton–Schulz preset
    (:data:`~manifoldlib.functional.msign.NEWTON_SCHULZ_PRESETS`); custom ``coefficients``
    (one triple or a schedule) replace the preset's schedule and its safety factor."""
    if method not in NEWTON_SCHULZ_PRESETS:
        raise ValueError(f"unknown Newton-Schulz preset {method!r}; valid: {', '.join(NEWTON_SCHULZ_PRESETS)}")
    preset = NEWTON_SCHULZ_PRESETS[method]
    n_steps = preset.steps if steps is None else steps
    if coefficients is None:
        return n_steps, preset.schedule, preset.scale
    schedule = (tuple(coefficients),) if isinstance(coefficients[0], (int, float)) else tuple(coefficients)
    return n_steps, schedule, 1.0


def gram_msign_factor(
    s: torch.Tensor,
    method: str,
    steps: int | None = None,
    *,
    coefficients=None,
    eps: float = 1e-7,
) -> torch.Tensor:
    r"""``R`` with :math:`\operatorname{msign}(X) \approx XR` from the Gram matrix :math:`S = X^\top X`.

    Runs the Newton–Schulz preset ``method`` in Gram form: with :math:`R_0 = I/(c\|X\|_F + \epsilon)`
    (:math:`c = 1.01` for Polar Express, else 1) and :math:`T_k = R_k^\top S R_k`,
    :math:`R_{k+1} = R_k(aI + bT_k + cT_k^2)`. This equals the preset applied to ``X`` in exact
    arithmetic, at ``O(n³)`` per step instead of ``O(mn²)``.

    Args:
        s: ``(..., n, n)`` symmetric positive semi-definite (a leading batch: one factor per
            matrix, each normalized by its own :math:`\|X\|_F`).
        method: ``"jordan5"``, ``"polar-express"`` or ``"newton-schulz"`` (convergent quintic).
        steps: iteration count (defaults: 5, 8, 30).
        coefficients: a custom ``(a, b, c)`` or schedule of triples (overrides the preset's).
        eps: added to the normalizing norm.

    Returns:
        ``(..., n, n)`` factor ``R``.
    """
    n_steps, schedule, scale = _ns_plan(method, steps, coefficients)
    fro = torch.diagonal(s, dim1=-2, dim2=-1).sum(-1).clamp_min(0).sqrt()  # (...,) ||X||_F
    eye = torch.eye(s.size(-1), dtype=s.dtype, device=s.device)
    r = eye / (scale * fro + eps)[..., None, None]
    for k in range(n_steps):
        a, b, c = schedule[min(k, len(schedule) - 1)]
        t = r.mT @ s @ r  # (..., n, n), Gram matrix of the current iterate
        poly = t * b
        poly.diagonal(dim1=-2, dim2=-1).add_(a)  # a I + b T, no broadcast of I over a batch
        r = r @ (poly + c * (t @ t))
    return r


def _polynomial_gain(lam: torch.Tensor, method: str, steps: int | None, coefficients, eps: float) -> torch.Tensor:
    r"""Gain :math:`\psi(\lambda) = \phi(\sigma)/\sigma` of a Newton–Schulz preset, :math:`\lambda = \sigma^2`.

    The preset maps a singular value by :math:`y_0 = \sigma/(c\|X\|_F + \epsilon)`,
    :math:`y_{k+1} = y_k(a + b y_k^2 + c y_k^4)`; the gain is the product of the factors times the
    first scaling, so no division by :math:`\sigma` happens (finite at :math:`\sigma = 0`).
    """
    n_steps, schedule, scale = _ns_plan(method, steps, coefficients)
    s0 = 1.0 / (scale * float(lam.sum().clamp_min(0).sqrt()) + eps)
    gain = torch.full_like(lam, s0)
    t = lam * (s0 * s0)  # y_k^2
    for k in range(n_steps):
        a, b, c = schedule[min(k, len(schedule) - 1)]
        factor = a + t * (b + c * t)
        gain = gain * factor
        t = t * factor * factor
    return gain


def gram_msign_factor_eigh(
    s: torch.Tensor,
    method: str,
    steps: int | None = None,
    *,
    coefficients=None,
    eps: float = 1e-7,
    smoothing: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``R`` with :math:`\operatorname{msign}(X) \approx XR` from one eigendecomposition of :math:`S = X^\top X`.

    With :math:`S = V\operatorname{diag}(\lambda)V^\top` every spectral map of ``X`` is
    :math:`XR` with :math:`R = V\operatorname{diag}(\psi(\lambda))V^\top`:

    * a Newton–Schulz preset: :math:`\psi` is its scalar polynomial composed ``steps`` times, so
      ``R`` equals :func:`gram_msign_factor`'s in exact arithmetic, at one ``n × n`` eigh and one
      product instead of four products per Newton–Schulz step;
    * ``smoothing`` :math:`= \mu > 0`: :math:`\psi = (\lambda + \mu^2)^{-1/2}`, the gradient
      :math:`X(X^\top X + \mu^2 I)^{-1/2}` of the smoothed nuclear norm
      :math:`\operatorname{tr}(X^\top X + \mu^2 I)^{1/2}` (singular values
      :math:`\sigma/\sqrt{\sigma^2 + \mu^2} < 1`).

    Args:
        s: ``(n, n)`` symmetric positive semi-definite.
        method: ``"jordan5"``, ``"polar-express"`` or ``"newton-schulz"`` (ignored with ``smoothing``).
        steps: Newton–Schulz iteration count (defaults: 5, 8, 30).
        coefficients: a custom ``(a, b, c)`` or schedule of triples.
        eps: added to the normalizing norm.
        smoothing: :math:`\mu` (absolute), or ``None`` for the preset.

    Returns:
        ``(R, norm_sq)``: the ``(n, n)`` factor and :math:`\|XR\|_F^2 = \sum_i \lambda_i\psi_i^2`.
    """
    lam, vec, gain = _spectral_gain(s, method, steps, coefficients, eps, smoothing)
    r = (vec * gain) @ vec.mT  # (n, n)
    return r, (lam * gain * gain).sum()


def _spectral_gain(s, method, steps, coefficients, eps, smoothing):
    r"""Eigenvalues (clamped at 0), eigenvectors and the gain :math:`\psi(\lambda)` of ``s``."""
    lam, vec = torch.linalg.eigh(s)  # (n,), (n, n); reads the lower triangle only
    lam = lam.clamp_min(0)
    if smoothing is not None:
        gain = (lam + smoothing * smoothing).rsqrt()
    else:
        gain = _polynomial_gain(lam, method, steps, coefficients, eps)
    return lam, vec, gain


def _rsqrt_divided_differences(root: torch.Tensor) -> torch.Tensor:
    r"""``(n, n)`` divided differences of :math:`f(x) = x^{-1/2}` at :math:`x_i = r_i^2`, given ``root`` :math:`= r`.

    :math:`f[x_i, x_j] = -1/(r_ir_j(r_i + r_j))` exactly (no cancellation; the diagonal is
    :math:`f'(x_i)`): the Daleckii–Krein kernel of the inverse square root.
    """
    ri, rj = root.unsqueeze(-1), root.unsqueeze(-2)
    return -1.0 / (ri * rj * (ri + rj))
