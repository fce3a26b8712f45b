r"""Matrix sign (orthogonal polar factor) kernels.

:math:`\operatorname{msign}(X) = U \operatorname{sign}(\Sigma) V^\top` for the thin SVD
:math:`X = U \Sigma V^\top`: singular values are mapped to 1, zero singular values to 0.

Methods (all batched over leading dimensions, tall and wide inputs):

- ``"svd"``: exact reference via :func:`torch.linalg.svd`; zero singular values map to 0.
- ``"newton"``: scaled Newton iteration for the polar factor of a full-column-rank matrix,
  run to convergence; differentiable with finite gradients everywhere (used where autograd
  flows through a retraction, e.g. at a zero step where SVD backward is singular).
- ``"newton-schulz"``: the convergent quintic iteration ``(15/8, -10/8, 3/8)`` run to a
  tolerance; converges for singular values in ``(0, sqrt(7/3))`` after scaling, fastest when
  they are already near 1 (Stiefel retractions of small steps).
- ``"jordan5"``: Muon's quintic ``(3.4445, -4.7750, 2.0315)``, fixed step count (5 by
  default). Fast, *not* convergent: singular values end in roughly [0.5, 1.2]. An update
  direction, not a retraction.
- ``"polar-express"``: the Polar Express schedule (arXiv 2505.16932), fixed step count
  (8 by default); much closer to exact than ``jordan5`` for the same cost.
- ``"gram-eigh"``: :math:`X V\operatorname{diag}(\lambda^{-1/2})V^\top` from the eigendecomposition
  :math:`X^\top X = V\operatorname{diag}(\lambda)V^\top` (tall orientation): two ``m·n²``
  products and one ``n × n`` eigh, against about ten ``m·n²`` products for the convergent
  Newton–Schulz iteration. Forming the Gram matrix squares the condition number, so the error
  is about :math:`\kappa(X)^2\epsilon`: exact to rounding for well-conditioned inputs (the
  retraction of a small step, :math:`\kappa \approx 1`). The eigenvalues tell the method its
  own error: above :math:`\kappa^2\epsilon = 10^{-6}` it repeats the pass on its result (which
  is orthonormal to rounding afterwards, the answer within :math:`\kappa^2\epsilon`), above
  :math:`10^{-4}` it computes the SVD instead (float32: :math:`\kappa` above 2.9 and 29). An
  eigenvalue at or below :math:`\max(m, n)\,\epsilon\,\lambda_{\max}` (a singular value
  below about :math:`\sqrt{\max(m, n)\epsilon}\,\sigma_{\max}`, 0.02 in float32 at
  ``m = 3072``) cannot be told from zero in the Gram matrix, so such inputs — rank-deficient
  ones included — take the SVD too. The SVD runs in float64 (it resolves singular values down to
  about 1e-16 of the largest; zero singular values map to 0 there). A Gram matrix close to
  diagonal — the retraction of a small tangent step, Stiefel or DGram — skips the eigh:
  :mod:`~manifoldlib.functional.gram_rsqrt` gets the inverse square root from one to four
  ``n × n`` products (a Taylor series, or chord iterations for a graded diagonal), with an error
  bound or a computed residual at the dtype's rounding level.

Every method first scales a matrix whose largest entry lies outside :math:`2^{\pm 32}` by a
power of two (:func:`~manifoldlib.functional.scaling.into_safe_range`; exact, and msign is scale
invariant), so that no Gram matrix or norm over- or underflows; the fixed-count presets only scale
large inputs down (their ``eps`` floor still maps a tiny input to a small output, as Muon's does).
"""

from __future__ import annotations

import torch

from .gram_rsqrt import products_only_rsqrt
from .newton_schulz import CONVERGENT_QUINTIC, NEWTON_SCHULZ_PRESETS, newton_schulz
from .scaling import into_safe_range

__all__ = ["CONVERGENT_NS_CAP", "GRAM_EIGH_ONE_PASS", "GRAM_EIGH_REFINE", "MSIGN_METHODS", "POLAR_METHODS", "msign"]

#: Iteration cap of the tolerance-stopped convergent quintic in :func:`msign`.
CONVERGENT_NS_CAP = 60

#: Polar-factor methods a retraction accepts: the exact or convergent ones of :func:`msign`
#: (``"auto"``: the SVD, or the differentiable Newton iteration under autograd); the fixed-count
#: presets ``jordan5`` and ``polar-express`` are not retractions (``R_x(0) != x``).
POLAR_METHODS = ("auto", "svd", "newton", "newton-schulz", "gram-eigh")
#: Valid ``method`` names of :func:`msign`.
MSIGN_METHODS = ("svd", "newton", "newton-schulz", "jordan5", "polar-express", "gram-eigh")

_DEFAULT_STEPS = {
    "jordan5": NEWTON_SCHULZ_PRESETS["jordan5"].steps,
    "polar-express": NEWTON_SCHULZ_PRESETS["polar-express"].steps,
    "newton-schulz": CONVERGENT_NS_CAP,
    "newton": 40,
}


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # linalg kernels do not support half types; iterate in float32 and cast back.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _default_tol(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) * 8.0


def _check_matrix(x: torch.Tensor) -> None:
    if x.dim() < 2:
        raise ValueError(
            f"msign expects a matrix or a batch of matrices (..., m, n), got shape {tuple(x.shape)}"
        )


def _msign_svd(x: torch.Tensor) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    # zero (numerically zero) singular values map to 0
    tol = s.amax(dim=-1, keepdim=True) * max(x.shape[-2:]) * torch.finfo(x.dtype).eps
    sign = (s > tol).to(x.dtype)
    return (u * sign.unsqueeze(-2)) @ vh


#: Largest :math:`\kappa^2\epsilon` for which one Gram-form pass is kept as it is.
GRAM_EIGH_ONE_PASS = 1e-6
#: Largest :math:`\kappa^2\epsilon` for which ``"gram-eigh"`` refines with a second pass; beyond
#: it the Gram matrix cannot carry the answer and the SVD is used.
GRAM_EIGH_REFINE = 1e-4


def _gram_eigh_pass(y: torch.Tensor) -> tuple[torch.Tensor, float]:
    r"""One Gram-form pass on a tall ``(..., m, n)`` input: the result and :math:`\kappa^2\epsilon`
    (largest over the batch; infinite when an eigenvalue is at or under the resolution floor
    :math:`\max(m, n)\,\epsilon\,\lambda_{\max}`, where the Gram matrix cannot tell a small
    singular value from zero). A Gram matrix close to diagonal (the retraction of a small step)
    takes :mod:`~manifoldlib.functional.gram_rsqrt`'s product-only kernels instead of the eigh;
    their error bound or residual stands in for :math:`\kappa^2\epsilon`."""
    if y.numel() == 0:
        return y.clone(), 0.0
    gram = y.mT @ y  # (..., n, n); eigh reads its lower triangle
    gram_sym = 0.5 * (gram + gram.mT)
    found = products_only_rsqrt(gram_sym)  # no eigh near diagonal
    if found is not None:
        return y @ found[0], found[1]
    lam, vec = torch.linalg.eigh(gram)  # (..., n), (..., n, n)
    eps = torch.finfo(y.dtype).eps
    top = lam.amax(dim=-1, keepdim=True)
    floor = top * max(y.shape[-2:]) * eps
    if not bool((lam > floor).all()):
        return y, float("inf")
    ratio = float((top / lam.amin(dim=-1, keepdim=True)).detach().amax())
    return y @ ((vec * lam.rsqrt().unsqueeze(-2)) @ vec.mT), ratio * eps  # (..., m, n)


def _msign_gram_eigh(x: torch.Tensor) -> torch.Tensor:
    # X (X^T X)^{-1/2} on the tall orientation, from one n x n eigendecomposition; a second pass
    # on the result when kappa^2 eps says the first lost orthogonality, the SVD when even that
    # would leave an error above GRAM_EIGH_REFINE
    transposed = x.size(-2) < x.size(-1)
    y = x.mT if transposed else x  # (..., m, n), m >= n
    out, error = _gram_eigh_pass(y)
    if error > GRAM_EIGH_REFINE:
        # the rare ill-conditioned case: an SVD in float64, which resolves singular values down to
        # 1e-16 of the largest (float32's own SVD stops at about 1e-7 and would zero the rest)
        out = _msign_svd(y.to(torch.float64)).to(y.dtype)
    elif error > GRAM_EIGH_ONE_PASS:
        out = _gram_eigh_pass(out)[0]
    return out.mT if transposed else out


def _msign_newton(x: torch.Tensor, tol: float, max_steps: int) -> torch.Tensor:
    # Scaled Newton iteration X <- (zeta X + X^{-T}/zeta)/2 on the tall orientation, with
    # X^{-T} = X (X^T X)^{-1} = Q R^{-T} from X = QR (through X^T X it would square the condition
    # number: a polar factor wrong by about kappa^2 eps, yet orthonormal);
    # the Frobenius scaling makes it converge in ~10 steps for any condition number. A QR and a
    # triangular inverse: gradients stay finite where SVD's do not (equal singular values).
    transposed = x.size(-2) < x.size(-1)
    y = x.mT if transposed else x
    eye = torch.eye(y.size(-1), dtype=y.dtype, device=y.device)
    previous = float("inf")
    for _ in range(max_steps):
        q, r = torch.linalg.qr(y)  # (..., m, n), (..., n, n)
        r_inv = torch.linalg.solve_triangular(r, eye.expand_as(r), upper=True)
        y_inv_t = q @ r_inv.mT  # (..., m, n)
        zeta = (
            torch.linalg.matrix_norm(y_inv_t, keepdim=True)
            / torch.linalg.matrix_norm(y, keepdim=True)
        ).sqrt()
        y_next = 0.5 * (zeta * y + y_inv_t / zeta)
        # the stopping test is not part of the function: detach it (no autograd warning/graph)
        delta = float(
            (torch.linalg.matrix_norm(y_next - y) / torch.linalg.matrix_norm(y_next)).detach().max()
        )
        y = y_next
        if delta != delta:  # a non-finite input (NaN out, as the SVD gives), or a zero on R's diagonal
            if not bool(torch.isfinite(x).all()):
                break
            raise ValueError(f"msign(method='newton') needs matrices of full rank {y.size(-1)}; got a "
                             f"rank-deficient {tuple(x.shape)} input (use method='svd', which maps zero "
                             f"singular values to 0)")
        # quadratic convergence: stop at tolerance, or once rounding stops the progress
        if delta <= tol or (delta < 1e-3 and delta > 0.5 * previous):
            break
        previous = delta
    return y.mT if transposed else y


def _msign_convergent_ns(x: torch.Tensor, tol: float, max_steps: int) -> torch.Tensor:
    transposed = x.size(-2) > x.size(-1)
    y = x.mT if transposed else x
    # scale so every singular value lies in (0, 1]; the spectral norm is bounded by Frobenius
    # but for near-orthogonal inputs that bound is loose by sqrt(n): use a cheap power bound.
    gram = y @ y.mT
    bound = torch.linalg.matrix_norm(gram, ord=1, keepdim=True).sqrt()  # >= ||y||_2
    y = y / bound.clamp_min(torch.finfo(y.dtype).tiny)
    a, b, c = CONVERGENT_QUINTIC
    eye = torch.eye(y.size(-2), dtype=y.dtype, device=y.device)
    scaled_tol = tol * y.size(-2) ** 0.5
    previous = float("inf")
    for _ in range(max_steps):
        gram = y @ y.mT
        err = float(torch.linalg.matrix_norm(gram.detach() - eye).max())
        if err <= scaled_tol or (err < 1e-3 * y.size(-2) ** 0.5 and err > 0.5 * previous):
            break  # converged, or rounding stopped the progress (cubic convergence near 1)
        previous = err
        y = a * y + (b * gram + c * (gram @ gram)) @ y
    return y.mT if transposed else y


def msign(
    x: torch.Tensor,
    method: str = "svd",
    *,
    steps: int | None = None,
    tol: float | None = None,
    eps: float = 1e-7,
) -> torch.Tensor:
    r"""Orthogonal polar factor :math:`\operatorname{msign}(X) = U\operatorname{sign}(\Sigma)V^\top`.

    Args:
        x: ``(..., m, n)``, tall or wide.
        method: one of :data:`MSIGN_METHODS` (see the module docstring).
        steps: iteration count for ``jordan5``/``polar-express``; the iteration cap for the
            convergent methods.
        tol: convergence tolerance of the convergent methods (default ``8 * eps(dtype)``).
        eps: added to the normalizing norm of the fixed-count methods.

    Returns:
        ``(..., m, n)`` tensor with ``x``'s dtype and device.

    Raises:
        ValueError: unknown method, a non-matrix input, or a negative step count.
    """
    _check_matrix(x)
    if method not in MSIGN_METHODS:
        raise ValueError(f"unknown msign method {method!r}; valid methods: {', '.join(MSIGN_METHODS)}")
    n_steps = _DEFAULT_STEPS.get(method) if steps is None else steps
    if n_steps is not None and n_steps < 0:
        raise ValueError(f"steps must be >= 0, got {n_steps}")
    if x.numel() == 0:  # an empty matrix or batch is its own polar factor
        return x.clone()
    if method in ("jordan5", "polar-express"):
        preset = NEWTON_SCHULZ_PRESETS[method]
        return newton_schulz(x, preset.schedule, n_steps, eps=eps, normalize_scale=preset.scale).to(x.dtype)
    work = into_safe_range(x.to(_compute_dtype(x.dtype)))
    tolerance = _default_tol(work.dtype) if tol is None else tol
    if method == "svd":
        out = _msign_svd(work)
    elif method == "gram-eigh":
        out = _msign_gram_eigh(work)
    elif method == "newton":
        out = _msign_newton(work, tolerance, n_steps)
    else:
        out = _msign_convergent_ns(work, tolerance, n_steps)
    return out.to(x.dtype)
