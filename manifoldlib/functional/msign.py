r"""Matrix sign (orthogonal polar factor) kernels.

:math:`\operatorname{msign}(X) = U \operatorname{sign}(\Sigma) V^\top` for the thin SVD
:math:`X = U \Sigma V^\top`: singular values are mapped to 1, zero singular values to 0.

Methods (all batched over leading dimensions, tall and wide inputs):

- ``"svd"``: exact reference via :func:`torch.linalg.svd`; zero singular values map to 0.
- ``"newton"``: scaled Newton iteration for the polar factor of a full-column-rank matrix,
  run to convergence; differentiated through its QR steps (``"auto"``'s choice where autograd
  flows through a retraction). Its QR resolves each column relative to its own norm, so the rank
  is judged with the columns scaled to unit norm (:math:`RD^{-1}`, ``D`` the column norms): a
  singular value at most :math:`\max(m, n)\,\epsilon` of the largest there (a rank-2 product,
  whose rounding leaves no zero on ``R``'s diagonal) raises ``ValueError`` naming the numerical
  rank; graded full-rank matrices (column norms over many orders, DGram's) are resolved.
- ``"newton-schulz"``: the convergent quintic iteration ``(15/8, -10/8, 3/8)`` run to a
  tolerance; converges for singular values in ``(0, sqrt(7/3))`` after scaling, fastest when
  they are already near 1 (Stiefel retractions of small steps). Where it has not converged
  within its cap (singular values too small to reach 1 in time), or where it may have carried a
  singular value at most :math:`\max(m, n)\,\epsilon` of the largest to 1 (a step multiplies
  one by at most 15/8, so the steps until all exceed 1/2 bound the smallest from below; a float32
  rank-deficient input's rounding-level ones reach 1 along directions the rounding chose), the
  float64 SVD's factor.
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
  retraction of a small step, :math:`\kappa \approx 1`). Where the condition number comes from
  the columns' norms alone (a graded input with well-conditioned column cosines: DGram's
  alternating retraction), Newton steps on the inverse square root, judged in column-scaled
  variables, bring the answer to rounding for ``n × n`` work (``_refine_rsqrt``). Otherwise the
  eigenvalues tell the method its own error: above :math:`\kappa^2\epsilon = 10^{-6}` it repeats the pass on its result (which
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

Under autograd ``"svd"``, ``"newton-schulz"`` and ``"gram-eigh"`` compute the factor without a
graph and attach the polar factor's own derivative (:class:`_PolarDerivative`: a Sylvester
equation with :math:`\sigma_i + \sigma_j` denominators, finite at repeated singular values, e.g.
every retraction's zero step, where autograd through an SVD or eigh gives NaN or wrong values).

Every method first scales a matrix whose largest entry lies outside :math:`2^{\pm 32}` by a
power of two (:func:`~manifoldlib.functional.scaling.into_safe_range`; exact, and msign is scale
invariant), so that no Gram matrix or norm over- or underflows; the fixed-count presets only scale
large inputs down (their ``eps`` floor still maps a tiny input to a small output, as Muon's does).
"""

from __future__ import annotations

import functools
import math

import torch

from .._numbers import is_integer, is_real, require_positive
from .gram_rsqrt import CHORD_TOL_EPS, products_only_rsqrt
from .newton_schulz import CONVERGENT_QUINTIC, NEWTON_SCHULZ_PRESETS, newton_schulz
from .scaling import into_safe_range, out_of_range_scale

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


def _msign_svd(x: torch.Tensor, complete: bool = False) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    if complete:  # every singular value to 1, zero ones too: U V^T, the SVD's completion of the range
        return u @ vh  # (the same bits as msign's (U diag(1)) V^T where no singular value is zero)
    # zero (numerically zero) singular values map to 0
    tol = s.amax(dim=-1, keepdim=True) * max(x.shape[-2:]) * torch.finfo(x.dtype).eps
    sign = (s > tol).to(x.dtype)
    return (u * sign.unsqueeze(-2)) @ vh


class _PolarDerivative(torch.autograd.Function):
    r"""``q = msign(x)`` (computed without autograd) with the polar factor's own derivative.

    Autograd through :func:`torch.linalg.svd` or :func:`torch.linalg.eigh` divides by
    :math:`\sigma_i^2 - \sigma_j^2`: NaN where singular values repeat (every polar retraction at a
    zero step, where they all equal 1) and wrong where rounding barely separates them; through a
    tolerance-stopped iteration it is the derivative of the steps that ran (none at an orthonormal
    input). The polar factor needs no such division. On the tall orientation, with
    :math:`H = Q^\top X = W\operatorname{diag}(\mu)W^\top` (:math:`\mu` the singular values),
    differentiating :math:`X = QH` with :math:`Q^\top dQ = \Omega` skew gives the Sylvester
    equation :math:`\Omega H + H\Omega = Q^\top dX - dX^\top Q`, so that

    .. math::

        dQ = Q\,W\Big[\frac{W^\top(Q^\top dX - dX^\top Q)W}{\mu_i + \mu_j}\Big]W^\top
             + (I - QQ^\top)\,dX\,H^{+},\qquad
        \bar X = Q\,W\Big[\frac{W^\top(Q^\top\bar Q - \bar Q^\top Q)W}{\mu_i + \mu_j}\Big]W^\top
             + (I - QQ^\top)\,\bar Q\,H^{+},

    finite wherever :math:`X` has full rank, repeated singular values included. A singular value
    :func:`msign` maps to 0 (at most :math:`\max(m, n)\,\epsilon\,\mu_{\max}`) is left out of
    :math:`H^{+}` and of the pairs where both are 0: there the map jumps, and this is its
    derivative along steps that keep the rank. Once differentiable (a second derivative raises
    instead of being silently wrong); one ``n × n`` eigh in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, q)
        return q.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, q = ctx.saved_tensors
        wide = x.size(-2) < x.size(-1)
        if wide:  # msign(X^T) = msign(X)^T
            x, q, grad = x.mT, q.mT, grad.mT
        h = q.mT @ x  # (..., n, n)
        mu, vec = torch.linalg.eigh(0.5 * (h + h.mT))
        mu = mu.clamp_min(0.0)
        keep = mu > mu.amax(-1, keepdim=True) * max(x.shape[-2:]) * torch.finfo(x.dtype).eps
        pair = keep.unsqueeze(-1) | keep.unsqueeze(-2)
        sums = torch.where(pair, mu.unsqueeze(-1) + mu.unsqueeze(-2), 1.0)  # (..., n, n)
        inverse_sum = torch.where(pair, 1.0 / sums, 0.0)
        inverse = torch.where(keep, 1.0 / torch.where(keep, mu, 1.0), 0.0)  # (..., n)
        skew = q.mT @ grad
        skew = vec.mT @ (skew - skew.mT) @ vec
        pinv = (vec * inverse.unsqueeze(-2)) @ vec.mT
        out = q @ (vec @ (skew * inverse_sum) @ vec.mT) + (grad - q @ (q.mT @ grad)) @ pinv
        return (out.mT if wide else out), None


def _with_polar_derivative(x: torch.Tensor, polar) -> torch.Tensor:
    """``polar(x)``, differentiated by :class:`_PolarDerivative` where autograd needs it."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return polar(x)
    with torch.no_grad():
        q = polar(x)
    return _PolarDerivative.apply(x, q)


#: Largest :math:`\kappa^2\epsilon` for which one Gram-form pass is kept as it is.
GRAM_EIGH_ONE_PASS = 1e-6
#: Largest :math:`\kappa^2\epsilon` for which ``"gram-eigh"`` refines with a second pass; beyond
#: it the Gram matrix cannot carry the answer and the fallback runs: a float64 SVD for
#: :func:`msign`, the QR-based Newton iteration for callers that need every column resolved (DGram's).
GRAM_EIGH_REFINE = 1e-4


#: :math:`\kappa^2\epsilon`, in units of the dtype's ``eps``, up to which one Gram-form pass is at
#: rounding level and is kept without a residual check.
GRAM_EIGH_ROUNDING_EPS = 16.0
#: Newton steps of the scaled refinement (:func:`_refine_rsqrt`) at most.
GRAM_EIGH_REFINE_STEPS = 3


def _refine_rsqrt(gram: torch.Tensor, lam: torch.Tensor, vec: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    r"""``(S, residual, bound)``: :math:`S \approx T^{-1/2}` from the eigendecomposition
    :math:`T = V\operatorname{diag}(\lambda)V^\top` of a symmetric positive definite ``(..., n, n)``
    ``gram``, refined by Newton steps judged in the column-scaled variables.

    With :math:`D = \operatorname{diag}(T)^{1/2}`, :math:`C = D^{-1}TD^{-1}` and :math:`U = DS`, the
    polar factor :math:`XS` has the Gram matrix :math:`SX^\top XS = U^\top CU`, so
    :math:`R = I - U^\top CU` is its orthogonality defect, computed from bounded quantities whatever
    the grading of :math:`T`. The eigh resolves an eigenvalue only to :math:`\epsilon\lambda_{\max}`:
    a Gram matrix graded by column norms (DGram's alternating retraction takes the polar factor of
    :math:`Y\operatorname{diag}(c)`, whose column norms square the spread) loses orthogonality in
    its small columns although :math:`C` is well conditioned. Each step solves the linearized
    :math:`(S + \Delta)T(S + \Delta) = I`, :math:`\Delta T^{1/2} + T^{1/2}\Delta = R`, in the
    eigenbasis: :math:`\Delta = V[(V^\top RV)_{ij}/(\mu_i + \mu_j)]V^\top`, :math:`\mu = \lambda^{1/2}`
    (four ``n × n`` products, and two for each residual); it contracts by about
    :math:`\kappa^2\epsilon`, the eigenbasis' own error. Steps stop at the tolerance
    (:data:`~manifoldlib.functional.gram_rsqrt.CHORD_TOL_EPS` ``eps`` times :math:`\sqrt n`), after
    :data:`GRAM_EIGH_REFINE_STEPS`, or where a step gains less than a factor 4; the best ``S`` is
    returned with its residual (largest :math:`\|R\|_1` over the batch) and the largest
    :math:`\|U\|_1\|U\|_\infty \ge \|U\|_2^2 = 1/\lambda_{\min}(C)` (at :math:`U^\top CU = I`),
    which bounds how far the rounding of ``gram`` itself moves the result."""
    n = gram.size(-1)
    tol = CHORD_TOL_EPS * float(torch.finfo(gram.dtype).eps) * max(1.0, n**0.5)
    eye = torch.eye(n, dtype=gram.dtype, device=gram.device)
    d = torch.diagonal(gram, dim1=-2, dim2=-1).sqrt()  # (..., n), positive: T is positive definite
    scaled = gram / (d.unsqueeze(-1) * d.unsqueeze(-2))  # C, unit diagonal
    mu = lam.sqrt()
    denominator = mu.unsqueeze(-1) + mu.unsqueeze(-2)  # (..., n, n)
    s = (vec * lam.rsqrt().unsqueeze(-2)) @ vec.mT
    best, best_residual, best_u = s, float("inf"), None
    for step in range(GRAM_EIGH_REFINE_STEPS + 1):
        u = d.unsqueeze(-1) * s  # U = D S
        r = eye - u.mT @ (scaled @ u)
        r = 0.5 * (r + r.mT)
        residual = float(r.detach().abs().sum(-2).amax())
        if not residual < 0.25 * best_residual:  # stalled (or NaN): keep the best
            break
        best, best_residual, best_u = s, residual, u
        if residual <= tol or step == GRAM_EIGH_REFINE_STEPS:
            break
        s = s + vec @ (((vec.mT @ r) @ vec) / denominator) @ vec.mT
        s = 0.5 * (s + s.mT)
    if best_u is None:
        return best, float("inf"), float("inf")
    a = best_u.detach().abs()
    bound = float((a.sum(-2).amax(-1) * a.sum(-1).amax(-1)).amax())
    return best, best_residual, bound


def _gram_eigh_pass(y: torch.Tensor, refine: bool = False) -> tuple[torch.Tensor, float]:
    r"""One Gram-form pass on a tall ``(..., m, n)`` input: the result and :math:`\kappa^2\epsilon`
    (largest over the batch; infinite when an eigenvalue is at or under the resolution floor
    :math:`\max(m, n)\,\epsilon\,\lambda_{\max}`, where the Gram matrix cannot tell a small
    singular value from zero). A Gram matrix close to diagonal (the retraction of a small step)
    takes :mod:`~manifoldlib.functional.gram_rsqrt`'s product-only kernels instead of the eigh;
    their error bound or residual stands in for :math:`\kappa^2\epsilon`.

    ``refine``: where :math:`\kappa^2\epsilon` exceeds :data:`GRAM_EIGH_ROUNDING_EPS` ``eps`` (or the
    floor is hit), the inverse square root is refined in the column-scaled variables
    (:func:`_refine_rsqrt`; ``n × n`` work only: from the same eigh, or, for a float32 input whose
    :math:`\kappa^2\epsilon` exceeds :data:`GRAM_EIGH_REFINE`, from a float64 eigh of its Gram
    matrix, which holds each entry to float32's rounding). Where that brings the orthogonality defect to its
    tolerance and the column cosines are well conditioned (the bound on :math:`1/\lambda_{\min}(C)`
    at most the tolerance in units of ``eps``, so that the Gram matrix's own rounding, amplified by
    it, stays under the tolerance too: the condition number came from the column norms' spread),
    the refined result is returned with error 0; else the refinement is discarded."""
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
    resolved = bool((lam > floor).all())
    ratio = float((top / lam.amin(dim=-1, keepdim=True)).detach().amax()) if resolved else float("inf")
    tol = CHORD_TOL_EPS * max(1.0, y.size(-1) ** 0.5)  # the refinement's tolerance, in units of eps
    # lambda_min(T) >= lambda_min(C) min_j T_jj: where even the eigh's lambda_min plus its error is
    # below min_j T_jj / tol, the cosines are ill conditioned and the refinement cannot be accepted
    graded = bool((lam.amin(-1) + floor.squeeze(-1) >= torch.diagonal(gram_sym, dim1=-2, dim2=-1).amin(-1) / tol).all())
    if refine and ratio > GRAM_EIGH_ROUNDING_EPS and graded:
        work, lam_w, vec_w = gram_sym, lam, vec
        if y.dtype == torch.float32 and ratio * eps > GRAM_EIGH_REFINE:
            # float32's eigenbasis too far off to contract from: the n x n work in float64
            work = gram_sym.to(torch.float64)
            lam_w, vec_w = torch.linalg.eigh(work)
        if bool((lam_w > 0).all()):
            s, residual, bound = _refine_rsqrt(work, lam_w, vec_w)
            if residual <= tol * float(torch.finfo(work.dtype).eps) and bound <= tol:
                return y @ s.to(y.dtype), 0.0
    if not resolved:
        return y, float("inf")
    return y @ ((vec * lam.rsqrt().unsqueeze(-2)) @ vec.mT), ratio * eps  # (..., m, n)


def _msign_gram_eigh(x: torch.Tensor, fallback: str = "svd") -> torch.Tensor:
    # fallback: "svd" (msign's), "complete" (the float64 SVD's U V^T, an orthonormal factor for a
    # rank-deficient input too: a retraction's) or "newton"
    # X (X^T X)^{-1/2} on the tall orientation, from one n x n eigendecomposition, refined in the
    # column-scaled variables where kappa^2 eps is above rounding; a second pass on the result when
    # the error still says the first lost orthogonality, the fallback (the SVD, or the Newton
    # iteration for callers that need every column resolved) when even that would leave an error
    # above GRAM_EIGH_REFINE
    transposed = x.size(-2) < x.size(-1)
    y = x.mT if transposed else x  # (..., m, n), m >= n
    out, error = _gram_eigh_pass(y, refine=True)
    if error > GRAM_EIGH_REFINE:
        if fallback == "newton":  # resolves every column relative to its own norm; refuses rank deficiency
            out = _msign_newton(y, _default_tol(y.dtype), _DEFAULT_STEPS["newton"])
        else:
            # the rare ill-conditioned case: an SVD in float64, which resolves singular values down to
            # 1e-16 of the largest (float32's own SVD stops at about 1e-7 and would zero the rest)
            out = _msign_svd(y.to(torch.float64), complete=fallback == "complete").to(y.dtype)
    elif error > GRAM_EIGH_ONE_PASS:
        out = _gram_eigh_pass(out)[0]
    return out.mT if transposed else out


def _gram_eigh_polar(x: torch.Tensor, fallback: str = "svd") -> torch.Tensor:
    """``msign(x, "gram-eigh")`` with the ill-conditioned fallback named: ``"svd"`` (msign's) or
    ``"newton"`` (:func:`msign`'s QR-based Newton iteration: every column resolved relative to its
    own norm, a ``ValueError`` for rank-deficient input)."""
    _check_matrix(x)
    if x.numel() == 0:
        return x.clone()
    work = into_safe_range(x.to(_compute_dtype(x.dtype)))
    return _with_polar_derivative(work, lambda y: _msign_gram_eigh(y, fallback)).to(x.dtype)


def _require_full_rank(x: torch.Tensor, r: torch.Tensor, norms: torch.Tensor) -> None:
    r"""Raise ``ValueError`` naming the numerical rank where the column-scaled :math:`RD^{-1}` of a
    finite ``x`` (``r`` the QR factor of its tall orientation, ``norms`` the column norms) has a
    singular value at most ``max(m, n)`` eps (of ``r``'s dtype) of its largest (msign's rank
    threshold): the Newton iteration cannot tell its polar factor from a rank-deficient matrix's.
    Scaling the columns keeps graded full-rank matrices (column norms over many orders, DGram's)
    resolved; the threshold grows with ``m`` as the QR's rounding does."""
    if not bool(torch.isfinite(x).all()):
        return  # NaN out, as the SVD gives
    n, size = r.size(-1), max(x.shape[-2:])
    sv = torch.linalg.svdvals((r / torch.where(norms > 0, norms, 1.0)).to(torch.float64))  # (..., n)
    rank = int((sv > sv.amax(-1, keepdim=True) * size * torch.finfo(r.dtype).eps).sum(-1).amin())
    if rank < n:
        raise ValueError(
            f"msign(method='newton') needs matrices of full rank {n}; got a rank-deficient {tuple(x.shape)} "
            f"input (numerical rank {rank}: with its columns scaled to unit norm, a singular value at most "
            f"{size} eps of the largest; use method='svd', which maps zero singular values to 0)")


def _msign_newton(x: torch.Tensor, tol: float, max_steps: int) -> torch.Tensor:
    # Scaled Newton iteration X <- (zeta X + X^{-T}/zeta)/2 on the tall orientation, with
    # X^{-T} = X (X^T X)^{-1} = Q R^{-T} from X = QR (through X^T X it would square the condition
    # number: a polar factor wrong by about kappa^2 eps, yet orthonormal);
    # the Frobenius scaling makes it converge in ~10 steps for any condition number. A QR and a
    # triangular inverse: gradients stay finite where SVD's do not (equal singular values).
    transposed = x.size(-2) < x.size(-1)
    y = x.mT if transposed else x
    n = y.size(-1)
    eye = torch.eye(n, dtype=y.dtype, device=y.device)
    previous = float("inf")
    for step in range(max_steps):
        q, r = torch.linalg.qr(y)  # (..., m, n), (..., n, n)
        r_inv = torch.linalg.solve_triangular(r, eye.expand_as(r), upper=True)
        if step == 0:
            # the rank, on the column-scaled R D^{-1} (D: the column norms, R's as y's): a product of
            # rank 2 rounds to an R with no zero on its diagonal, and the iteration maps its
            # rounding-level singular values to 1 (no error). 1 / sigma_min(R D^{-1}) = ||D R^{-1}||_2
            # is at most ||D R^{-1}||_F and sigma_max at most sqrt(n) (unit columns): under that bound
            # the rank is full, without a decomposition
            norms = r.detach().norm(dim=-2, keepdim=True)  # (..., 1, n)
            bound = float((r_inv.detach() * norms.mT).square().sum((-2, -1)).amax().sqrt())
            if not bound * n**0.5 * max(y.shape[-2:]) * torch.finfo(y.dtype).eps < 1.0:  # (NaN, inf too)
                _require_full_rank(x, r.detach(), norms)
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
        if delta != delta:  # a non-finite input (NaN out, as the SVD gives), or an overflow
            if not bool(torch.isfinite(x).all()):
                break
            # the rank is full (checked above), but the squares in ||Y^{-T}||_F overflowed: column
            # norms over more orders than the dtype's range holds squared (float32 columns of norms
            # 1e-10 and 1e10, DGram's alternating retraction of column norms 1e-5 .. 1e5): the same
            # ratio from the matrices at powers of two (exact)
            scale_inv, scale = out_of_range_scale(y_inv_t, 0), out_of_range_scale(y, 0)
            zeta = (
                torch.linalg.matrix_norm(y_inv_t * scale_inv, keepdim=True) * scale
                / (torch.linalg.matrix_norm(y * scale, keepdim=True) * scale_inv)
            ).sqrt()
            y_next = 0.5 * (zeta * y + y_inv_t / zeta)
            delta = float((torch.linalg.matrix_norm(y_next - y) / torch.linalg.matrix_norm(y_next)).detach().max())
            if delta != delta:
                raise ValueError(
                    f"msign(method='newton') cannot iterate on a {tuple(x.shape)} {x.dtype} input whose column "
                    f"norms span more orders than its dtype holds (its inverse overflows); use float64 or "
                    f"method='svd'")
        y = y_next
        # quadratic convergence: stop at tolerance, or once rounding stops the progress
        if delta <= tol or (delta < 1e-3 and delta > 0.5 * previous):
            break
        previous = delta
    else:  # not converged within max_steps (a cap below the ~10 steps it takes): the float64 SVD's
        # factor, as the convergent Newton-Schulz iteration gives, not the last iterate
        return _with_polar_derivative(x, lambda z: _msign_svd(z.to(torch.float64)).to(z.dtype))
    return y.mT if transposed else y


def _msign_convergent_ns(x: torch.Tensor, tol: float, max_steps: int, complete: bool = False) -> torch.Tensor:
    # where the iteration has not converged after max_steps (one singular value below about
    # 1.875^-max_steps of the largest does not reach 1; a rank-deficient float64 input's rounding-
    # level ones ended anywhere in (0, 1), neither msign's 0 nor 1), or where it may have carried a
    # singular value at most max(m, n) eps of the largest to 1 (a float32 input's rounding-level
    # ones reach 1 within the cap, along directions the rounding chose: orthonormal, and 0.6 to 0.9
    # off the float64 SVD's factor), that factor instead: msign's, or with complete U V^T, an
    # orthonormal factor (a retraction's); a non-finite input still gives NaN
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
    previous = err = float("inf")
    passed_half = None  # the first step at which every singular value exceeds 1/2
    for step in range(max_steps):
        gram = y @ y.mT
        err = float(torch.linalg.matrix_norm(gram.detach() - eye).max())
        if passed_half is None and err < 0.75:  # err >= 1 - sigma_min^2
            passed_half = step
        if err <= scaled_tol or (err < 1e-3 * y.size(-2) ** 0.5 and err > 0.5 * previous):
            break  # converged, or rounding stopped the progress (cubic convergence near 1)
        previous = err
        y = a * y + (b * gram + c * (gram @ gram)) @ y
    else:
        passed_half = None
    # each step multiplies a singular value in [0, 1] by at most a = 15/8, so the smallest was at
    # least (1/2) (8/15)^passed_half of the largest: above msign's rank threshold, it was resolved
    if not math.isnan(err) and (passed_half is None or 0.5 * (1.0 / a) ** passed_half <= max(x.shape[-2:])
                                * torch.finfo(y.dtype).eps):
        return _msign_svd(x.to(torch.float64), complete=complete).to(x.dtype)
    return y.mT if transposed else y


def _orthonormal_polar(x: torch.Tensor, method: str) -> torch.Tensor:
    r"""``msign(x, method)`` for a polar retraction: where ``x`` ``(..., m, n)`` has a zero singular
    value, an orthonormal factor all the same.

    :func:`msign` maps a zero singular value to 0 (``"svd"``, the float64 SVD that ``"gram-eigh"``
    falls back to, the convergent Newton–Schulz iteration, which also leaves one below about
    :math:`1.875^{-60}` of the largest short of 1): its factor of a rank-deficient ``x`` is no
    Stiefel point. Those three methods here take :math:`UV^\top` of the SVD instead, a nearest
    orthonormal factor (:meth:`~manifoldlib.Stiefel.projx`'s), the same bits as :func:`msign`'s
    where no singular value is zero; ``"newton"`` raises ``ValueError`` for a rank-deficient
    ``x``."""
    if method not in ("svd", "gram-eigh", "newton-schulz") or x.numel() == 0:
        return msign(x, method)
    work = into_safe_range(x.to(_compute_dtype(x.dtype)))
    if method == "svd":
        polar = functools.partial(_msign_svd, complete=True)
    elif method == "gram-eigh":
        polar = functools.partial(_msign_gram_eigh, fallback="complete")
    else:
        tol, cap = _default_tol(work.dtype), _DEFAULT_STEPS["newton-schulz"]
        polar = functools.partial(_msign_convergent_ns, tol=tol, max_steps=cap, complete=True)
    return _with_polar_derivative(work, polar).to(x.dtype)


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
            convergent methods (``newton`` or ``newton-schulz`` not converged by then, or
            ``newton-schulz`` not shown to have resolved every singular value, returns the float64
            SVD's factor, not its last iterate).
        tol: convergence tolerance of the convergent methods (default ``8 * eps(dtype)``).
        eps: added to the normalizing norm of the fixed-count methods.

    Returns:
        ``(..., m, n)`` tensor with ``x``'s dtype and device.

    Raises:
        ValueError: unknown method, a non-matrix input, a ``steps`` that is not ``None`` or an int
            ``>= 0`` (``True`` ran one step), a ``tol`` that is not ``None`` or a finite number
            ``>= 0`` (``True`` stopped the Newton iteration at 1.0, an infinite one after its first
            step), an ``eps`` that is not a finite number ``> 0`` (NaN gave NaN matrices), or, with
            ``"newton"``, a numerically rank-deficient ``x`` (see the module docstring; its
            iteration mapped the rounding-level singular values to 1), naming the rank.
    """
    _check_matrix(x)
    if method not in MSIGN_METHODS:
        raise ValueError(f"unknown msign method {method!r}; valid methods: {', '.join(MSIGN_METHODS)}")
    if steps is not None and not (is_integer(steps) and steps >= 0):
        raise ValueError(f"steps must be None or an int >= 0, got {steps!r}")
    if tol is not None and not (is_real(tol) and math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol must be None or a finite number >= 0, got {tol!r}")
    require_positive("eps", eps)
    n_steps = _DEFAULT_STEPS.get(method) if steps is None else int(steps)
    if x.numel() == 0:  # an empty matrix or batch is its own polar factor
        return x.clone()
    if method in ("jordan5", "polar-express"):
        preset = NEWTON_SCHULZ_PRESETS[method]
        return newton_schulz(x, preset.schedule, n_steps, eps=eps, normalize_scale=preset.scale).to(x.dtype)
    work = into_safe_range(x.to(_compute_dtype(x.dtype)))
    tolerance = _default_tol(work.dtype) if tol is None else tol
    if method == "svd":
        out = _with_polar_derivative(work, _msign_svd)
    elif method == "gram-eigh":
        out = _with_polar_derivative(work, _msign_gram_eigh)
    elif method == "newton":  # differentiated through its QR steps (finite and right everywhere)
        out = _msign_newton(work, tolerance, n_steps)
    else:
        out = _with_polar_derivative(work, lambda y: _msign_convergent_ns(y, tolerance, n_steps))
    return out.to(x.dtype)
