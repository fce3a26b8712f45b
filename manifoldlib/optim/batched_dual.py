r"""The reduced dual of many same-shape instances as one batched problem (products path, BB steps).

``B`` tall instances :math:`(W_b, G_b)` of one shape ``(m, n)`` and one manifold are independent
duals :math:`\min_{\Lambda_b}\|G_b + 2W_b\Lambda_b\|_*`; stacked along a leading batch dimension,
every ``n × n`` quantity of :class:`~manifoldlib.optim.dual_problem._DualProblem` carries it:
:math:`B_b = Q_b^\top G_b`, :math:`C_b = G_b^\top G_b - B_b^\top B_b`, the factor :math:`F_b`
(:meth:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold.dual_factor` of the stack), the
metric :math:`(d_i^2 + d_j^2)/2` and, at a multiplier, :math:`M_b = B_b + 2F_b\Lambda_b`,
:math:`S_b = C_b + M_b^\top M_b`, the Gram-form Newton–Schulz factor :math:`R_b`
(:func:`~manifoldlib.optim.spectral_factors.gram_msign_factor`, each normalized by its own
:math:`\|X_b\|_F`), :math:`K_b = M_bR_b`, the dual gradient :math:`H_b = \mathcal{P}(F_b^\top K_b +
K_b^\top F_b)` and the relative tangent residual :math:`r_b` — one batched product where the
unbatched solve runs ``B``. That is the products path only (``spectral="products"``): the eigh
path's Anderson steps and the smoothed Newton solves stay per matrix.

:func:`_batched_bb_solve` is :func:`~manifoldlib.optim.dual_solvers._dual_solve`, instance for
instance: the first step :math:`1/(4\sqrt n)`, then Barzilai–Borwein steps on the
metric-preconditioned gradient, alternating the long rule :math:`\langle s, s\rangle/\langle s,
y\rangle` (odd iterations) and the short rule :math:`\langle s, y\rangle/\langle y, y\rangle`, kept
only where :math:`\langle s, y\rangle > 0` — with every step size, stall count and best iterate a
``(B,)`` tensor. An instance is *active* while its residual is above ``tol``, finite, and it has
not gone ``patience`` iterations without a 10% cut of its best-so-far mark; an inactive instance
leaves the working batch (its multiplier, residual and best iterate no longer change, and it
costs nothing more), so it takes exactly the iterations, and returns exactly the iterate, of its
own unbatched solve (to rounding). All active instances have taken the same number of steps, so
the alternation of the two rules agrees. The loop stops when no instance is active or at
``max_iter``; its one host synchronization per iteration reads the ``(B,)`` residuals.
"""

from __future__ import annotations

import copy
import math

import torch

from ..functional.normal_space import normal_metric
from .dual_problem import _BestIterate
from .spectral_factors import gram_msign_factor

__all__: list[str] = []

_DIMS = (-2, -1)


class _BatchedDualProblem:
    r"""The reduced duals of a stack of tall instances ``w``, ``g`` ``(B, m, n)`` (``g`` normalized
    per instance), evaluated on the products path.

    Setup: :math:`W^\top G` and :math:`G^\top G`, two batched ``m·n²`` products; the factor
    :math:`F` of every instance from the manifold (raises its ``ValueError`` for a point the dual
    cannot use). :attr:`pieces` hands one instance's setup to a
    :class:`~manifoldlib.optim.dual_problem._DualProblem` (its answer and retraction).
    """

    def __init__(self, w: torch.Tensor, g: torch.Tensor, manifold, method: str, steps, coefficients, eps: float):
        self.manifold, self.method, self.steps, self.coefficients, self.eps = manifold, method, steps, coefficients, eps
        batch, rows, n = w.shape
        self.f = manifold.dual_factor(w)  # None (F = I), (B, n) diagonal or (B, n, n) triangular
        self.unit = self.f is None
        self.full = self.f is not None and self.f.dim() == 3
        if self.unit:
            self.d = torch.ones(batch, n, dtype=w.dtype, device=w.device)
        else:
            self.d = self.f.norm(dim=-2) if self.full else self.f  # (B, n) column norms of W
        self.square = rows == n
        self.metric = normal_metric(self.d * self.d)  # (B, n, n)
        self.two_d = 2.0 * self.d.unsqueeze(-1)  # (B, n, 1)
        self.normal_scale = self.d.unsqueeze(-1) / (2.0 * self.metric)  # (B, n, n)
        self.mask = manifold.multiplier_mask
        self.wg = w.mT @ g  # (B, n, n) = W^T G
        if self.full:
            self.b = torch.linalg.solve_triangular(self.f.mT, self.wg, upper=False)  # Q^T G
        else:
            self.b = self.wg / self.d.unsqueeze(-1)
        if self.square:
            self.c = torch.zeros_like(self.b)
        else:
            c = g.mT @ g - self.b.mT @ self.b  # (B, n, n) G_perp^T G_perp
            self.c = 0.5 * (c + c.mT)

    def select(self, rows: torch.Tensor) -> _BatchedDualProblem:
        """The problem of the instances ``rows`` (a 1-D index tensor) only, for evaluation."""
        part = copy.copy(self)
        for name in ("f", "d", "metric", "two_d", "normal_scale", "b", "c"):
            value = getattr(self, name)
            setattr(part, name, None if value is None else value[rows])
        part.wg = None  # (the setup's; pieces() reads the full problem)
        return part

    def pieces(self, index: int) -> tuple:
        """``(F, W^T G, B, C)`` of one instance (views), what ``_DualProblem(pieces=...)`` takes."""
        f = None if self.unit else self.f[index]
        return f, self.wg[index], self.b[index], self.c[index]

    def initial_multiplier(self) -> torch.Tensor:
        r"""``(B, n, n)`` :math:`\Lambda_0 = -\mathcal{P}(W^\top G + G^\top W)/(4\cdot\text{metric})`."""
        return -self.mask(self.wg + self.wg.mT) / (4.0 * self.metric)

    def _m(self, lam: torch.Tensor) -> torch.Tensor:
        """``(B, n, n)`` :math:`M = B + 2F\\Lambda`."""
        if self.full:
            return torch.baddbmm(self.b, self.f, lam, alpha=2.0)
        return torch.add(self.b, lam, alpha=2.0) if self.unit else torch.addcmul(self.b, self.two_d, lam)

    def evaluate(self, lam: torch.Tensor):
        r"""``(H, residual, R, M, K)`` at the multipliers ``lam`` ``(B, n, n)``; ``residual`` ``(B,)``
        is NaN for an instance whose Gram matrix is not finite (a diverged step)."""
        m = self._m(lam)
        s = m.mT @ m if self.square else torch.baddbmm(self.c, m.mT, m)  # (B, n, n) Gram matrix of X
        r = gram_msign_factor(s, self.method, self.steps, coefficients=self.coefficients, eps=self.eps)
        a_sq = ((s @ r) * r).sum(_DIMS)  # (B,) ||X R||_F^2
        k = m @ r  # (B, n, n) = Q^T A
        if self.unit:
            dk = k
        else:
            dk = self.f.mT @ k if self.full else self.d.unsqueeze(-1) * k  # W^T A
        h = self.mask(dk + dk.mT)
        if self.full:
            normal = (self.f @ (h / (2.0 * self.metric))).norm(dim=_DIMS)
        else:
            normal = 0.5 * h.norm(dim=_DIMS) if self.unit else (h * self.normal_scale).norm(dim=_DIMS)
        residual = normal / a_sq.clamp_min(torch.finfo(a_sq.dtype).tiny).sqrt()
        finite = torch.isfinite(s.sum(_DIMS))
        residual = torch.where(finite, residual, torch.full_like(residual, float("nan")))
        return h, residual, r, m, k


def _batched_bb_solve(problem: _BatchedDualProblem, lam: torch.Tensor, tol: float, max_iter: int,
                      patience: int | None):
    """Barzilai–Borwein steps on every instance of ``problem`` from ``lam`` ``(B, n, n)`` (see the
    module docstring).

    The iteration reads the ``(B,)`` residuals once (its one host synchronization) and keeps, per
    instance, the best-iterate and stall book-keeping of the unbatched solve
    (:class:`~manifoldlib.optim.dual_problem._BestIterate`); the step sizes stay on the device.
    The loop works on the active instances only: when some stop, the working problem and the
    iteration's tensors are narrowed to the rest (:meth:`_BatchedDualProblem.select`), and the
    best iterates are kept in full-size tensors, written at the rows that improved.

    Returns:
        ``(residual, lam, R, M, K, iterations)``: the best iterate of each instance (residuals and
        iterations as lists, the ``(B, n, n)`` multipliers and what rebuilds their answers).
    """
    h, residual, r, m, k = problem.evaluate(lam)
    batch, n = lam.shape[0], lam.size(-1)
    device = lam.device
    values = residual.tolist()
    trackers = [_BestIterate(value, None, None) for value in values]
    best = [t.clone() for t in (lam, r, m, k)]  # full size, written where an instance improved
    iterations = [0] * batch
    rows = list(range(batch))  # working row -> instance
    work = problem
    step = torch.full((batch,), 0.25 / math.sqrt(n), dtype=lam.dtype, device=device)
    tiny = torch.finfo(lam.dtype).tiny
    lam_prev = grad_prev = None
    for taken in range(max_iter):  # every working instance has taken `taken` steps
        active = [j for j, b in enumerate(rows)
                  if not values[j] <= tol and not math.isnan(values[j]) and not trackers[b].stalled(patience)]
        if not active:
            break
        if len(active) < len(rows):  # narrow the work to the active instances
            keep = torch.tensor(active, device=device)
            work, rows = work.select(keep), [rows[j] for j in active]
            lam, h, step = lam[keep], h[keep], step[keep]
            if lam_prev is not None:
                lam_prev, grad_prev = lam_prev[keep], grad_prev[keep]
        grad = h / work.metric  # preconditioned dual gradient
        if lam_prev is not None:
            s_vec, y_vec = lam - lam_prev, grad - grad_prev
            sy = (s_vec * y_vec).sum(_DIMS)  # (b,)
            if taken % 2:
                proposed = (s_vec * s_vec).sum(_DIMS) / sy
            else:
                proposed = sy / (y_vec * y_vec).sum(_DIMS).clamp_min(tiny)
            step = torch.where(sy > 0, proposed, step)
        lam_prev, grad_prev = lam, grad
        lam = lam - step.view(-1, 1, 1) * grad
        h, residual, r, m, k = work.evaluate(lam)
        values = residual.tolist()  # the iteration's one host synchronization
        improved = []
        for j, b in enumerate(rows):
            iterations[b] += 1
            before = trackers[b].best
            trackers[b].record(values[j], None, None)
            if trackers[b].best is not before:
                improved.append(j)
        if len(improved) == batch:  # every instance still working, and each improved
            for kept, new in zip(best, (lam, r, m, k)):
                kept.copy_(new)
        elif improved:
            at = torch.tensor(improved, device=device)
            into = torch.tensor([rows[j] for j in improved], device=device)
            for kept, new in zip(best, (lam, r, m, k)):
                kept.index_copy_(0, into, new.index_select(0, at))
    return [t.best[0] for t in trackers], *best, iterations
