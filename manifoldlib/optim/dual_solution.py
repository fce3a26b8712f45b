"""What a dual solve returns: :class:`SteepestInfo` (what it did) and :class:`DualSolution` (the solved reduced dual)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dual_problem import _DualProblem, _State
from .matmul_precision import ieee_float32_matmul

__all__ = ["DualSolution", "SteepestInfo"]


@dataclass
class SteepestInfo:
    r"""What one dual solve did.

    Attributes:
        iterations: dual updates taken (0 when the initial multiplier already met ``tol``).
        residual: relative tangent residual :math:`\|A - P_W A\|_F / \|A\|_F` of the returned ``A``.
        converged: ``residual <= tol``.
        multiplier: the final :math:`\Lambda` ``(n, n)`` for the *normalized* gradient
            :math:`G/\|G\|_F`, in the tall orientation; pass it back as ``multiplier`` to warm-start.
        correction: :math:`\Lambda - \Lambda_0` (what the dual iterations added to the closed-form
            start); pass it back as ``correction`` to warm-start at a *new* point.
        history: residual after each dual iteration (starting with the initial one).
        step_size: the last Barzilai–Borwein dual step; pass it back as ``step_size`` to start
            the next solve with the curvature this one learned.
        gap: certified relative duality gap :math:`(\|G + 2W\Lambda\|_* - \langle G, A\rangle)
            / \|G + 2W\Lambda\|_*` of a smoothed answer (``None`` when no smoothing ran). With
            ``smoothing="auto"`` a solve counts as converged only if this is at most
            :data:`~manifoldlib.optim.dual_solvers.GAP_TOL`.
        stages: the solvers that ran, in order: ``"anderson"`` (eigenbasis-preconditioned steps),
            ``"bb"`` (Barzilai–Borwein steps; also the exact SVD path), ``"smoothed"`` (Newton–CG
            on the smoothed dual, from the start or after a stalled plain stage); ``()`` when no
            dual ran (Euclidean, zero gradient).
        evaluations: dual evaluations (one ``n × n`` eigendecomposition or Gram-form
            Newton–Schulz each; an SVD of the ``m × n`` matrix on the exact path).
        hessian_products: Hessian-vector products of the smoothed dual's conjugate gradients
            (four ``n × n`` products each).
        relaxations: the over-relaxation :math:`\omega` of each eigenbasis-preconditioned step of
            the ``"anderson"`` stage, in order: :data:`~manifoldlib.optim.dual_solvers.PRECONDITIONED_RELAXATION`
            until the residual first grows, 1 after it; ``()`` when that stage did not run.
    """

    iterations: int
    residual: float
    converged: bool
    multiplier: torch.Tensor | None
    correction: torch.Tensor | None = None
    history: list[float] = field(default_factory=list)
    step_size: float | None = None
    gap: float | None = None
    stages: tuple[str, ...] = ()
    evaluations: int = 0
    hessian_products: int = 0
    relaxations: tuple[float, ...] = ()


@dataclass
class DualSolution:
    """A finished dual solve, before the ``m × n`` answer is formed (see :func:`solve_dual`).

    Attributes:
        info: what the solve did.
        transposed: the problem was solved in the tall orientation of a wide input.
        problem: the reduced dual (``None`` when no dual ran: Euclidean, or a zero gradient).
        state: its final evaluation (``None`` likewise).
        answer: the direction itself when no dual ran (tall orientation, work dtype).
    """

    info: SteepestInfo
    transposed: bool
    problem: _DualProblem | None = None
    state: _State | None = None
    answer: torch.Tensor | None = None

    def direction(self) -> torch.Tensor:
        """The steepest direction in the input's orientation, in the solve's work dtype
        (:meth:`~manifoldlib.optim.execution.ExecutionPolicy.work_dtype`: float32 for 16-bit
        input, float64 for a smoothed float32 solve on CUDA); runs with IEEE float32 products."""
        with ieee_float32_matmul():  # the m x n product X R: TF32 would blur the tangency
            a = self.answer if self.problem is None else self.problem.direction(self.state)
        return a.mT if self.transposed else a
