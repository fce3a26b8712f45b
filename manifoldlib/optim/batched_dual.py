r"""The reduced dual of many same-shape instances as one batched problem (products path, BB steps).

``B`` tall instances :math:`(W_b, G_b)` of one shape ``(m, n)`` and one manifold are independent
duals :math:`\min_{\Lambda_b}\|G_b + 2W_b\Lambda_b\|_*`. Stacked along a leading batch dimension
they are one :class:`~manifoldlib.optim.dual_problem._DualProblem` (the setup and the evaluation
formulas are the unbatched problem's, written once with a batch dimension), evaluated on the
products path by :meth:`~manifoldlib.optim.dual_problem._DualProblem.evaluate_products`: one
batched product where the unbatched solve runs ``B``. The eigh path's Anderson steps and the
smoothed Newton solves stay per matrix.

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

import math

import torch

from .dual_problem import _barzilai_borwein, _BestIterate, _DualProblem

__all__: list[str] = []


def _batched_bb_solve(problem: _DualProblem, lam: torch.Tensor, tol: float, max_iter: int,
                      patience: int | None):
    """Barzilai–Borwein steps on every instance of ``problem`` from ``lam`` ``(B, n, n)`` (see the
    module docstring).

    The iteration reads the ``(B,)`` residuals once (its one host synchronization) and keeps, per
    instance, the best-iterate and stall book-keeping of the unbatched solve
    (:class:`~manifoldlib.optim.dual_problem._BestIterate`); the step sizes stay on the device.
    The loop works on the active instances only: when some stop, the working problem and the
    iteration's tensors are narrowed to the rest (:meth:`~manifoldlib.optim.dual_problem._DualProblem.select`), and the
    best iterates are kept in full-size tensors, written at the rows that improved.

    Returns:
        ``(residual, lam, R, M, K, iterations)``: the best iterate of each instance (residuals and
        iterations as lists, the ``(B, n, n)`` multipliers and what rebuilds their answers).
    """
    h, residual, r, m, k = problem.evaluate_products(lam)
    batch, n = lam.shape[0], lam.size(-1)
    device = lam.device
    values = residual.tolist()
    trackers = [_BestIterate(value, None, None) for value in values]
    best = [t.clone() for t in (lam, r, m, k)]  # full size, written where an instance improved
    iterations = [0] * batch
    rows = list(range(batch))  # working row -> instance
    work = problem
    step = torch.full((batch,), 0.25 / math.sqrt(n), dtype=lam.dtype, device=device)
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
        if lam_prev is not None:  # (b,) step sizes, the unbatched solve's rule
            step = _barzilai_borwein(step, lam - lam_prev, grad - grad_prev, long=bool(taken % 2))
        lam_prev, grad_prev = lam, grad
        lam = lam - step.view(-1, 1, 1) * grad
        h, residual, r, m, k = work.evaluate_products(lam)
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
