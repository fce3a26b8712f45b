r"""The Stiefel manifold :math:`\mathrm{St}(m, n) = \{X: X^\top X = I_n\}`, :math:`m \ge n`, Euclidean metric."""

from __future__ import annotations

import functools
from typing import Union

import torch

from ..functional.gram_rsqrt import polar_gram_factor
from ..functional.msign import GRAM_EIGH_REFINE, _msign_svd, _with_polar_derivative, msign
from ..functional.stiefel import stiefel_exp, stiefel_qr, sym
from ..retractions.base import Retraction
from .base import _random_normal, _size_tuple, check_finite_result, check_tensor, default_tolerance, max_abs
from .matrix import MatrixConstraintManifold

__all__ = ["REPAIR_MAX_DEVIATION", "STIEFEL_COLUMN_TOLERANCE", "Stiefel", "check_tall_matrix"]

#: Largest deviation from 1 of a column norm that :meth:`Stiefel.dual_factor` accepts: a sanity
#: check (one ``m·n`` pass) against points that were never projected — columns scaled by a
#: DGram-like spread — not a substitute for the constraint residual.
STIEFEL_COLUMN_TOLERANCE = 0.1
#: Largest :math:`\|X^\top X - I\|_\infty` (the largest row sum of :math:`|X^\top X - I|`, at least
#: its spectral norm) of a point that the exponential map and the Cayley retraction take. They
#: first repair the point's rounding by the cubic Newton–Schulz map normalized by the RMS
#: singular value; from a deviation :math:`\delta \le 1/4` every normalized singular value lies in
#: :math:`[0.77, 1.29] \subset (0, \sqrt 3)`, where the map converges monotonically. The entrywise
#: tolerance of a 16-bit dtype (``check_point_on_manifold``) admits matrices far beyond it
#: (bfloat16 columns at cosine 0.24 with each other: :math:`\delta = 0.24(n - 1)`), from which
#: the repair diverged; a rounded Stiefel point is inside it (of order :math:`nu/\sqrt m`, ``u`` the
#: dtype's unit roundoff: 0.125 for a bfloat16 ``1024 × 1024`` point, half the bound).
REPAIR_MAX_DEVIATION = 0.25


def check_tall_matrix(shape, name: str, manifold: str):
    """Shared shape check of the matrix manifolds: ``(..., m, n)`` with ``m >= n >= 1``."""
    if len(shape) < 2:
        return False, f"'{name}' on {manifold} needs a matrix (..., m, n) with m >= n, got shape {tuple(shape)}"
    m, n = shape[-2], shape[-1]
    if n < 1 or m < n:
        return False, (
            f"'{name}' on {manifold} needs (..., m, n) with m >= n >= 1, got m={m}, n={n}"
            " (store a wide matrix transposed)"
        )
    return True, None


def _tolerance_reason(err: float, atol: float, rtol: float) -> str:
    return f"max |X^T X - I| = {err:.3e} exceeds atol={atol}, rtol={rtol}"


class Stiefel(MatrixConstraintManifold):
    r"""Stiefel manifold, points ``(..., m, n)`` with :math:`X^\top X = I`.

    Tangent space :math:`\{V: X^\top V + V^\top X = 0\}`, projection
    :math:`P_X(Z) = Z - X\operatorname{sym}(X^\top Z)`. Retractions: ``polar`` (default, second
    order), ``qr`` and ``cayley`` (first order), ``exp`` (the geodesic).

    Dual geometry (:class:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold`): every
    symmetric multiplier, :math:`F = I`; on square matrices :math:`\Lambda_0` is optimal.
    """

    name = "stiefel"
    default_retraction = "polar"
    projection_retractions = ("polar", "qr")
    square_dual = "closed-form"
    orthonormal_dual = True
    muon_retraction = ("polar", {"method": "gram-eigh"})

    def __init__(self, retraction: Union[str, Retraction, None] = None, **retraction_options):
        super().__init__(retraction, **retraction_options)

    def _check_shape(self, shape, name):
        return check_tall_matrix(shape, name, "Stiefel")

    @staticmethod
    def multiplier_mask(a):
        return a

    def _normal_multiplier(self, w, z):
        return sym(w.mT @ z)

    def _constraint_deviation(self, w):
        r""":math:`W^\top W - I`, ``(..., n, n)``."""
        return w.mT @ w - torch.eye(w.size(-1), dtype=w.dtype, device=w.device)

    def _point_refusal(self, x):
        r"""The value check of a point for ``exp`` and ``cayley``, from one
        :math:`D = X^\top X - I` (one ``m·n²`` product, in at least float32) and, for a point it
        takes, one host read: the entrywise check of :meth:`check_point_on_manifold` at the dtype's
        default tolerances, then, for a point that passes it,
        :math:`\|D\|_\infty \le` :data:`REPAIR_MAX_DEVIATION`."""
        tol = default_tolerance(x.dtype)
        work = torch.promote_types(x.dtype, torch.float32)
        w = x.to(work)  # (..., m, n)
        gram = w.mT @ w  # (..., n, n)
        eye = torch.eye(x.size(-1), dtype=work, device=x.device)
        deviation = gram - eye  # (..., n, n)
        # the entrywise check judges X^T X rounded to x's own dtype, as check_point_on_manifold does
        own = deviation if work == x.dtype else gram.to(x.dtype) - eye.to(x.dtype)  # (..., n, n)
        err = max_abs(own)
        within = err <= tol + tol  # (NaN fails)
        rows = max_abs(deviation.abs().sum(-1))  # the largest row sum; 0 for an empty batch
        repairable = rows <= REPAIR_MAX_DEVIATION  # (NaN fails)
        if bool(within & repairable):  # the one host read of a point taken
            return True, None
        if not bool(within):
            return False, _tolerance_reason(err.item(), tol, tol)
        return True, (f"||X^T X - I||_inf = {float(rows):.3g} (its largest row sum) exceeds "
                      f"{REPAIR_MAX_DEVIATION}, although its entries are within the default tolerances for "
                      f"{x.dtype}: from so far off, the repair of x's rounding that these maps take first "
                      f"does not converge")

    def dual_factor(self, w, check=True):
        if not check:
            return None
        # (..., n) column norms; summed squares are a single pass where torch's norm over the
        # strided dim takes several (an entry past sqrt(max) overflows to inf: fails, as it should)
        norms = (w * w).sum(dim=-2).sqrt()
        deviation = (norms - 1).abs()
        if not bool((deviation <= STIEFEL_COLUMN_TOLERANCE).all()):  # (NaN fails too)
            flat = int(torch.nan_to_num(deviation, nan=float("inf")).argmax())  # over the batch too
            j = flat % norms.size(-1)
            raise ValueError(
                f"W is not a Stiefel point: column {j} (tall orientation) has norm "
                f"{float(norms.flatten()[flat]):.4g}, expected 1 (within {STIEFEL_COLUMN_TOLERANCE}); "
                f"project W first (e.g. Stiefel().projx)"
            )
        return None

    def gram_retraction_factor(self, gram, rsqrt):
        return polar_gram_factor(gram, rsqrt)

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        err = max_abs(self._constraint_deviation(x))
        ok = bool(err <= atol + rtol)
        return ok, None if ok else _tolerance_reason(err.item(), atol, rtol)

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        r"""Every entry :math:`(i, j)`, the diagonal included:
        :math:`|x_i^\top u_j + u_i^\top x_j| \le \mathrm{atol} + \mathrm{rtol}\,(\|u_i\| + \|u_j\|)`.

        Each entry is judged against the norms of the two columns it involves (DGram's check at
        unit column norms), so a small column's normal part counts in full whatever the other
        columns' sizes: one bound ``rtol max|U|`` for the whole matrix let a fully normal column
        of norm 1e-2 pass next to columns of norm 1e4. The rounding of a computed
        :math:`x_i^\top u_j`, of order :math:`m\,\epsilon\,\|u_j\|`, is inside the bound. Products
        in at least float32; each column norm of ``u`` is taken after dividing the column by its
        largest entry, so it neither over- nor underflows."""
        work = torch.promote_types(torch.promote_types(x.dtype, u.dtype), torch.float32)
        w, v = x.to(work), u.to(work)
        s = w.mT @ v  # (..., n, n): x_i^T u_j
        err = (s + s.mT).abs()
        largest = torch.linalg.vector_norm(v, ord=float("inf"), dim=-2, keepdim=True)  # (..., 1, n)
        largest = torch.where(largest > 0, largest, torch.ones_like(largest))
        un = (v / largest).norm(dim=-2) * largest.squeeze(-2)  # (..., n) column norms of u
        bound = atol + rtol * (un.unsqueeze(-1) + un.unsqueeze(-2))
        if bool((err <= bound).all()):  # (NaN fails)
            return True, None
        excess = torch.nan_to_num(err - bound, nan=float("inf"))
        flat = int(excess.flatten().argmax())
        n = x.size(-1)
        i, j = (flat // n) % n, flat % n
        return False, (
            f"|x_i^T u_j + u_i^T x_j| = {float(err.reshape(-1)[flat]):.3e} (columns {i}, {j}) exceeds "
            f"atol + rtol (||u_i|| + ||u_j||) = {float(bound.reshape(-1)[flat]):.3e} (atol={atol}, rtol={rtol})"
        )

    def projx(self, x):
        r"""Nearest Stiefel point: :math:`UV^\top` from the thin SVD :math:`X = U\Sigma V^\top`.

        For full column rank this is the polar factor :math:`\operatorname{msign}(X)`. For a
        rank-deficient ``X`` the nearest point is not unique and :math:`\operatorname{msign}`
        (which maps zero singular values to 0) is *not* on the manifold; :math:`UV^\top` still
        is — the SVD's orthonormal completion of the range fills the missing directions.
        Computed in float64 and returned in ``x``'s dtype.

        Differentiable with finite gradients at full column rank, repeated singular values
        included (every Stiefel point and its multiples, where the SVD's backward divides by
        zero): when a gradient is needed at well-conditioned column rank the polar factor comes
        from the scaled Newton iteration (:func:`~manifoldlib.functional.msign`, ``"newton"``),
        the same point to rounding; at :math:`\kappa(X)^2\epsilon` above
        :data:`~manifoldlib.functional.msign.GRAM_EIGH_REFINE` from the SVD, differentiated by the
        polar factor's own derivative (once: a second derivative raises), as
        :func:`~manifoldlib.functional.msign` does (autograd through the SVD gave NaN where two
        singular values repeat). At a Stiefel point the derivative is the tangent projection.
        """
        self._validate(x, "x")
        check_tensor(x, "x", "stiefel.projx", finite=True)
        # float64 (a projection is rare: an initialization, a repair); cast back at the end
        work = x.to(torch.float64)
        if torch.is_grad_enabled() and x.requires_grad:
            s = torch.linalg.svdvals(work.detach())  # (..., n)
            kappa_sq_eps = (s.amax(-1) / s.amin(-1)).square() * torch.finfo(torch.float64).eps
            if bool((kappa_sq_eps <= GRAM_EIGH_REFINE).all()):  # Newton's Gram solves are accurate
                return msign(work, "newton").to(x.dtype)
            # U V^T of the same SVD, with the polar factor's own derivative: autograd through the SVD
            # divides by sigma_i^2 - sigma_j^2, NaN where two singular values repeat
            return _with_polar_derivative(work, functools.partial(_msign_svd, complete=True)).to(x.dtype)
        return _msign_svd(work, complete=True).to(x.dtype)  # U V^T of the SVD

    def expmap(self, x, u):
        r"""The geodesic from ``x`` along :math:`P_X u` (a normal part of ``u`` is dropped).

        Computed in float64 (the projection too) from ``x`` re-orthonormalized to float64
        rounding, and re-orthonormalized before the cast back
        (:func:`~manifoldlib.functional.stiefel_exp`): the result passes
        :meth:`check_point_on_manifold` in every dtype, where computing the projection in the
        input dtype left long float32 steps off the manifold (``test_long_steps_stay_on_the_manifold``).
        A step longer than
        :data:`~manifoldlib.functional.stiefel.STIEFEL_EXP_MAX_STEP` (:math:`\|P_X u\|_F > 2^{43}`),
        whose end float64 does not determine, raises ``ValueError``, and so does an ``x`` off the
        manifold beyond the dtype's default tolerances (a value check, as
        :meth:`~manifoldlib.Sphere.expmap`'s): the re-orthonormalization repairs rounding, and from
        a matrix farther off the geodesic started elsewhere (for :math:`u = 0` the map of
        :math:`3X` is :math:`X`).
        """
        dtype = self._validate_args(f"{self.name}.expmap", x=x, u=u)
        self._require_point(x, f"{self.name}.expmap", "the exponential map (the geodesic from x)")
        y = stiefel_exp(x.to(dtype), u.to(dtype))
        return check_finite_result(y, f"{self.name}.expmap", x=x, u=u)

    def random(self, *size, generator: torch.Generator | None = None, dtype=None, device=None) -> torch.Tensor:
        """Haar-distributed points (sign-fixed QR of a Gaussian matrix): ``random(m, n)``."""
        shape = _size_tuple(size)
        self._validate(torch.empty(shape, device="meta"), "size")
        z, dtype = _random_normal(shape, generator, dtype, device)
        return stiefel_qr(torch.zeros_like(z), z).to(dtype)

