r"""The square Stiefel polar step :math:`\operatorname{msign}(W - \eta A)` from a solved reduced dual.

:class:`~manifoldlib.optim.ManifoldMuon` retracts the steepest direction with the polar
retraction. For a square Stiefel matrix the dual is closed form and everything lives in the
eigenbasis :math:`V` of :math:`S = M^\top M = V\operatorname{diag}(\lambda)V^\top` that the
solve computed (:math:`M = B + 2\Lambda`, :math:`B = W^\top G`): the direction is
:math:`A = WK`, :math:`K = MR`, :math:`R = V\operatorname{diag}(\psi)V^\top` (``G`` lies in the
span of ``W`` up to the rounding drift of the point), so

.. math::

    Y = W - \eta A = WP, \qquad PV = V - \eta\,(MV)\operatorname{diag}(\psi),

and the Gram matrix of :math:`YV` is :math:`T = (PV)^\top (W^\top W)(PV)` — formed exactly, drift
included, so the result is orthonormal whatever the step and the drift. :math:`T` is diagonal up
to the dual's residual and the drift (:math:`V^\top K^\top KV = \operatorname{diag}(\lambda\psi^2)`),
so its inverse square root is taken to first order around its diagonal :math:`t`
(Daleckii–Krein, exact divided differences of :math:`x^{-1/2}`):

.. math::

    T^{-1/2} \approx \operatorname{diag}(t^{-1/2}) + F\circ\operatorname{Off}(T), \qquad
    F_{ij} = -\frac{1}{\sqrt{t_i t_j}(\sqrt{t_i} + \sqrt{t_j})},

error at most :math:`\tfrac34\|\operatorname{Off}(T)\|_F^2`; above :data:`FIRST_ORDER_LIMIT` the
eigh of :math:`T` is used instead. The new point is :math:`W\,(PV)\,T^{-1/2}V^\top`: six ``n × n``
products and no eigh, against six products and an eigh for forming :math:`A` and retracting it.

(A tall matrix has :math:`G_\perp \neq 0`; its exact Gram matrix in the eigenbasis costs about
as much as the eigh it would save, so tall matrices keep the general path.)
"""

from __future__ import annotations

import torch

from .spectral_factors import _rsqrt_divided_differences
from .steepest import DualSolution

__all__ = ["FIRST_ORDER_LIMIT", "fusable", "stiefel_polar_step"]

#: Largest Frobenius norm of Off(T) for which the first-order inverse square root is used
#: (its error is at most 3/4 of the square: 7.5e-7).
FIRST_ORDER_LIMIT = 1e-3


def _inverse_sqrt_near_diagonal(t: torch.Tensor) -> torch.Tensor:
    """``(n, n)`` :math:`T^{-1/2}` of a symmetric positive definite, nearly diagonal ``t``."""
    off = t - torch.diag_embed(torch.diagonal(t))
    if float(off.norm()) > FIRST_ORDER_LIMIT:
        tau, u = torch.linalg.eigh(t)
        return (u * tau.clamp_min(torch.finfo(t.dtype).tiny).rsqrt()) @ u.mT
    root = torch.diagonal(t).clamp_min(torch.finfo(t.dtype).tiny).sqrt()  # (n,)
    return torch.diag_embed(root.reciprocal()) + _rsqrt_divided_differences(root) * off


def stiefel_polar_step(solution: DualSolution, eta: float) -> torch.Tensor:
    r"""``msign(W - eta A)`` for the direction ``A`` of a reduced square Stiefel ``solution``.

    Args:
        solution: a :func:`~manifoldlib.optim.steepest.solve_dual` result on ``"stiefel"`` for a
            square ``W`` with a reduced dual (a Newton–Schulz ``msign_method``).
        eta: the step length (the adjusted learning rate).

    Returns:
        ``(n, n)`` new point, in the solve's work dtype.

    Raises:
        ValueError: the solution is not a reduced square Stiefel solve.
    """
    if not fusable(solution):
        problem = solution.problem
        got = ("no dual (Euclidean or a zero gradient)" if problem is None else
               f"manifold {problem.manifold!r}, shape {tuple(problem.w.shape)}, reduced={problem.reduced}")
        raise ValueError("stiefel_polar_step needs a reduced dual solution of a square Stiefel matrix "
                         f"(solve_dual on 'stiefel' with a Newton-Schulz msign_method); got {got}")
    problem, state = solution.problem, solution.state
    w, vec = problem.w, state.vec  # (n, n), (n, n)
    pv = vec - eta * (state.mv * state.gain)  # (n, n) = P V
    t = pv.mT @ ((w.mT @ w) @ pv)  # (n, n), Gram matrix of Y V, drift included
    t = 0.5 * (t + t.mT)
    return w @ ((pv @ _inverse_sqrt_near_diagonal(t)) @ vec.mT)


def fusable(solution: DualSolution) -> bool:
    """Whether :func:`stiefel_polar_step` applies: a reduced dual of a square Stiefel matrix."""
    problem = solution.problem
    return (
        problem is not None
        and problem.manifold == "stiefel"
        and problem.reduced
        and problem.square
        and solution.state is not None
        and solution.state.vec is not None
    )
