r"""Steepest directions under the spectral norm, restricted to a tangent space (dual solvers).

For a gradient :math:`G` at a point :math:`W` the *steepest direction* is

.. math::

    A^\star = \operatorname*{arg\,max}_{A}\ \langle G, A\rangle
    \quad\text{s.t.}\quad \|A\|_2 \le 1,\ A \in T_W\mathcal{M},

and the optimizer steps :math:`W \leftarrow R_W(-\eta A^\star)`; equivalently :math:`-A^\star`
minimizes :math:`\langle G, A\rangle` (the convention of Muon, whose Euclidean answer is
:math:`\operatorname{msign}(G)`). The normal space is :math:`\{W\Lambda\}` with :math:`\Lambda`
symmetric (Stiefel) or symmetric with zero diagonal (DGram), so the Lagrangian dual is

.. math::

    \max_A \langle G, A\rangle = \min_{\Lambda} \|G + 2W\Lambda\|_*,
    \qquad A(\Lambda) = \operatorname{msign}(G + 2W\Lambda),

and the gradient of the dual objective is the normal residual :math:`H = W^\top A + A^\top W`
(``Off`` of it for DGram). At the dual optimum :math:`H = 0`: :math:`A(\Lambda^\star)` is tangent,
has spectral norm one and is optimal.

Two ideas make the solve cheap (MATH.md §4–5 give the plain dual ascent):

* **Reduced dual.** Write :math:`W = QD` (:math:`D = I` on Stiefel), :math:`B = Q^\top g`,
  :math:`g_\perp = g - QB` and :math:`C = g_\perp^\top g_\perp`. With
  :math:`M = B + 2D\Lambda` the matrix :math:`X = g_\perp + QM` has Gram matrix
  :math:`S = C + M^\top M`, and :math:`\operatorname{msign}(X) = XR` with
  :math:`R = S^{-1/2}`. Every dual iteration then works on ``n × n`` matrices only: ``R`` comes
  from the Newton–Schulz preset run on the Gram matrix (the iteration :math:`Y \leftarrow Y
  p(Y^\top Y)` written as :math:`R \leftarrow R\,p(R^\top S R)`, identical in exact arithmetic),
  and :math:`Q^\top A = MR`. The ``m``-sized work (five ``m·n²`` products) happens once per solve.
* **Barzilai–Borwein dual steps.** The dual objective is smooth where :math:`X` has full column
  rank; BB step sizes (alternating the long and short rule, safeguarded) adapt to its curvature
  and need far fewer iterations than the decaying subgradient schedule of the reference
  implementation. The step is preconditioned by :math:`2/(d_i^2 + d_j^2)` (the inverse metric of
  the normal space) so DGram columns of different norms converge together.

``msign_method="svd"`` runs the exact, unreduced iteration (SVD of the ``m × n`` matrix
:math:`X` every step): the reference used by the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..functional.dgram import off_diagonal
from ..functional.msign import (
    JORDAN5_COEFFICIENTS,
    MSIGN_METHODS,
    POLAR_EXPRESS_COEFFICIENTS,
    msign,
)

__all__ = [
    "DEFAULT_MAX_ITER",
    "DEFAULT_TOL",
    "STEEPEST_MANIFOLDS",
    "SteepestInfo",
    "steepest_direction",
    "tangent_residual",
]

#: Manifolds :func:`steepest_direction` knows.
STEEPEST_MANIFOLDS = ("stiefel", "dgram", "euclidean")
#: Default relative tangent residual at which the dual solve stops.
DEFAULT_TOL = 1e-4
#: Default cap on dual iterations.
DEFAULT_MAX_ITER = 100

_PE_SAFETY = 1.01
_DEFAULT_NS_STEPS = {"jordan5": 5, "polar-express": 8, "newton-schulz": 30}
_CONVERGENT_QUINTIC = (15.0 / 8.0, -10.0 / 8.0, 3.0 / 8.0)


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
    """

    iterations: int
    residual: float
    converged: bool
    multiplier: torch.Tensor | None
    correction: torch.Tensor | None = None
    history: list[float] = field(default_factory=list)
    step_size: float | None = None


def _check_inputs(
    w: torch.Tensor, g: torch.Tensor, manifold: str, tol: float, max_iter: int, patience: int | None
) -> None:
    if manifold not in STEEPEST_MANIFOLDS:
        raise ValueError(f"unknown manifold {manifold!r}; valid: {', '.join(STEEPEST_MANIFOLDS)}")
    if g.dim() != 2:
        raise ValueError(f"the gradient must be a matrix (m, n), got shape {tuple(g.shape)}")
    if manifold != "euclidean" and w.shape != g.shape:
        raise ValueError(f"W and G must have the same shape, got {tuple(w.shape)} and {tuple(g.shape)}")
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be > 0, got {tol!r}")
    if not (isinstance(max_iter, int) and max_iter >= 0):
        raise ValueError(f"max_iter must be an int >= 0, got {max_iter!r}")
    if patience is not None and not (isinstance(patience, int) and patience >= 1):
        raise ValueError(f"patience must be None or an int >= 1, got {patience!r}")


def _ns_schedule(method: str, coefficients) -> tuple[tuple[float, float, float], ...]:
    if coefficients is not None:
        return (tuple(coefficients),) if isinstance(coefficients[0], (int, float)) else tuple(coefficients)
    if method == "jordan5":
        return (JORDAN5_COEFFICIENTS,)
    if method == "polar-express":
        return POLAR_EXPRESS_COEFFICIENTS
    return (_CONVERGENT_QUINTIC,)


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
        s: ``(n, n)`` symmetric positive semi-definite.
        method: ``"jordan5"``, ``"polar-express"`` or ``"newton-schulz"`` (convergent quintic).
        steps: iteration count (defaults: 5, 8, 30).
        coefficients: a custom ``(a, b, c)`` or schedule of triples (overrides the preset's).
        eps: added to the normalizing norm.

    Returns:
        ``(n, n)`` factor ``R``.
    """
    n_steps = _DEFAULT_NS_STEPS.get(method, 5) if steps is None else steps
    schedule = _ns_schedule(method, coefficients)
    scale = _PE_SAFETY if (method == "polar-express" and coefficients is None) else 1.0
    fro = torch.diagonal(s).sum().clamp_min(0).sqrt()  # ||X||_F
    eye = torch.eye(s.size(-1), dtype=s.dtype, device=s.device)
    r = eye / (scale * fro + eps)
    for k in range(n_steps):
        a, b, c = schedule[min(k, len(schedule) - 1)]
        t = r.mT @ s @ r  # (n, n), Gram matrix of the current iterate
        r = r @ (a * eye + b * t + c * (t @ t))
    return r


def tangent_residual(w: torch.Tensor, a: torch.Tensor, manifold: str) -> torch.Tensor:
    r"""Relative normal component :math:`\|A - P_W A\|_F / \|A\|_F` of ``a`` at ``w`` (tall, ``(m, n)``).

    Stiefel: :math:`\|W\operatorname{sym}(W^\top A)\|_F`; DGram: :math:`\|WS\|_F` with
    :math:`S_{ij} = (W^\top A + A^\top W)_{ij}/(d_i^2 + d_j^2)`, :math:`S_{ii} = 0`; Euclidean: 0.
    """
    if manifold == "euclidean":
        return torch.zeros((), dtype=a.dtype, device=a.device)
    wa = w.mT @ a  # (n, n)
    h = wa + wa.mT
    if manifold == "stiefel":
        normal = 0.5 * (w @ h)
    else:
        d2 = (w * w).sum(-2)
        normal = w @ (off_diagonal(h) / (d2.unsqueeze(-1) + d2.unsqueeze(-2)))
    return normal.norm() / a.norm().clamp_min(torch.finfo(a.dtype).tiny)


class _DualProblem:
    """The reduced dual of one tall instance: everything but the last product is ``n × n``."""

    def __init__(self, w, g, manifold, method, steps, coefficients, eps):
        self.manifold = manifold
        self.method = method
        self.steps, self.coefficients, self.eps = steps, coefficients, eps
        n = w.size(-1)
        if manifold == "dgram":
            self.d = w.norm(dim=-2)  # (n,) column norms
            self.q = w / self.d
        else:
            self.d = torch.ones(n, dtype=w.dtype, device=w.device)
            self.q = w
        self.w, self.g = w, g
        d2 = self.d * self.d
        self.metric = 0.5 * (d2.unsqueeze(-1) + d2.unsqueeze(-2))  # (n, n), (d_i^2 + d_j^2)/2
        self.mask = off_diagonal if manifold == "dgram" else (lambda x: x)
        if method != "svd":
            self.b = self.q.mT @ g  # (n, n)
            g_perp = g - self.q @ self.b  # (m, n)
            self.c = g_perp.mT @ g_perp  # (n, n)
            self.g_perp = g_perp

    def initial_multiplier(self) -> torch.Tensor:
        # G + 2 W Lambda_0 = P_T(G): Lambda_0 = -(W^T G + G^T W) / (2 (d_i^2 + d_j^2))
        wg = self.w.mT @ self.g
        return -self.mask(wg + wg.mT) / (4.0 * self.metric)

    def evaluate(self, lam: torch.Tensor):
        """``(H, residual, state)`` at the multiplier ``lam``; ``state`` rebuilds ``A``."""
        if self.method == "svd":
            x = self.g + 2.0 * (self.w @ lam)  # (m, n)
            a = msign(x, "svd")
            k = self.q.mT @ a  # (n, n) = Q^T A
            a_sq = (a * a).sum()
            state = a
        else:
            m = self.b + 2.0 * (self.d.unsqueeze(-1) * lam)  # (n, n) = B + 2 D Lambda
            s = self.c + m.mT @ m  # (n, n) Gram matrix of X
            r = gram_msign_factor(s, self.method, self.steps, coefficients=self.coefficients, eps=self.eps)
            k = m @ r  # Q^T A
            a_sq = torch.diagonal(r.mT @ s @ r).sum()  # ||A||_F^2
            state = (m, r)
        dk = self.d.unsqueeze(-1) * k  # D Q^T A = W^T A
        h = self.mask(dk + dk.mT)  # dual gradient
        # normal part of A is W S with S = H / (d_i^2 + d_j^2); ||W S||_F = ||D S||_F
        normal = self.d.unsqueeze(-1) * (h / (2.0 * self.metric))
        residual = float(normal.norm() / a_sq.clamp_min(torch.finfo(a_sq.dtype).tiny).sqrt())
        return h, residual, state

    def direction(self, state) -> torch.Tensor:
        if self.method == "svd":
            return state
        m, r = state
        return (self.g_perp + self.q @ m) @ r  # X R = msign(X), (m, n)


def _dual_solve(
    problem: _DualProblem,
    lam: torch.Tensor,
    tol: float,
    max_iter: int,
    history: list[float],
    step: float | None,
    patience: int | None,
):
    h, residual, state = problem.evaluate(lam)
    history.append(residual)
    n = lam.size(-1)
    if step is None:
        # ~ sigma / 4 (the nuclear norm's curvature is ~ 1/sigma), sigma ~ ||X||_F / sqrt(n) <= 1/sqrt(n)
        step = 0.25 / math.sqrt(n)
    lam_prev = grad_prev = None
    best = (residual, lam, state)
    iterations = since_progress = 0
    progress_mark = residual
    while not residual <= tol and iterations < max_iter:  # a NaN residual keeps iterating
        if patience is not None and since_progress >= patience:
            break  # stalled (e.g. a rank-deficient dual optimum): keep the best iterate
        grad = h / problem.metric  # preconditioned dual gradient
        if lam_prev is not None:
            s_vec = lam - lam_prev
            y_vec = grad - grad_prev
            sy = float((s_vec * y_vec).sum())
            if sy > 0:
                # alternate the long (BB1) and short (BB2) Barzilai-Borwein steps
                if iterations % 2:
                    step = float((s_vec * s_vec).sum()) / sy
                else:
                    step = sy / max(float((y_vec * y_vec).sum()), 1e-300)
        lam_prev, grad_prev = lam, grad
        lam = lam - step * grad
        iterations += 1
        h, residual, state = problem.evaluate(lam)
        history.append(residual)
        if residual < best[0] or best[0] != best[0]:
            best = (residual, lam, state)
        if residual < 0.9 * progress_mark:
            progress_mark, since_progress = residual, 0
        else:
            since_progress += 1
    residual, lam, state = best
    return lam, state, residual, iterations, step


def steepest_direction(
    W: torch.Tensor,
    G: torch.Tensor,
    manifold: str = "stiefel",
    *,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
    msign_method: str = "svd",
    ns_steps: int | None = None,
    ns_coefficients=None,
    eps: float = 1e-7,
    multiplier: torch.Tensor | None = None,
    correction: torch.Tensor | None = None,
    step_size: float | None = None,
    patience: int | None = None,
    return_info: bool = False,
):
    r"""Steepest unit direction of ``G`` under the spectral norm in the tangent space at ``W``.

    Returns :math:`A^\star = \arg\max \langle G, A\rangle` s.t. :math:`\|A\|_2 \le 1`,
    :math:`A \in T_W\mathcal{M}`; the descent step is :math:`W - \eta A^\star`
    (so :math:`-A^\star` is the minimizer of :math:`\langle G, A\rangle`).

    * ``"euclidean"``: :math:`\operatorname{msign}(G)` (no constraint, no dual).
    * ``"stiefel"`` (:math:`W^\top W = I`): dual over symmetric :math:`\Lambda`,
      :math:`A = \operatorname{msign}(G + 2W\Lambda)`, :math:`H = W^\top A + A^\top W`,
      :math:`\Lambda_0 = -\tfrac14(W^\top G + G^\top W)`.
    * ``"dgram"`` (:math:`\operatorname{Off}(W^\top W) = 0`): :math:`\Lambda` symmetric with zero
      diagonal, :math:`H = \operatorname{Off}(W^\top A + A^\top W)`,
      :math:`\Lambda_{0,ij} = -(W^\top G + G^\top W)_{ij}/(2(d_i^2 + d_j^2))`, steps scaled by
      :math:`2/(d_i^2+d_j^2)`.

    ``G`` is normalized by its Frobenius norm first (the dual is not scale invariant); the
    multiplier refers to the normalized problem. A wide ``(m < n)`` input is solved transposed and
    the answer transposed back; the multiplier lives in the tall orientation (``min(m, n)`` square).

    Args:
        W: ``(m, n)`` point on the manifold (ignored for ``"euclidean"``).
        G: ``(m, n)`` gradient (or momentum).
        manifold: ``"stiefel"``, ``"dgram"`` or ``"euclidean"``.
        tol: stop once the relative tangent residual :math:`\|A - P_W A\|_F/\|A\|_F \le` ``tol``.
        max_iter: cap on dual iterations; the best iterate seen is returned.
        msign_method: ``"svd"`` (exact, full-size; for tests), or a Newton–Schulz preset
            ``"jordan5"``, ``"polar-express"``, ``"newton-schulz"`` run on the ``n × n`` Gram matrix.
        ns_steps: Newton–Schulz step count (preset default when ``None``).
        ns_coefficients: custom ``(a, b, c)`` (or a schedule) for the Newton–Schulz iteration.
        eps: added to the normalizing norm of Newton–Schulz.
        multiplier: warm start :math:`\Lambda` ``(k, k)``, ``k = min(m, n)``, from a previous solve
            at the same point.
        correction: warm start :math:`\Lambda_0 + \Delta` with :math:`\Delta` the ``correction``
            of a previous solve: the right warm start after the point moved (the optimizer's), since
            :math:`\Lambda_0` already carries the closed-form part (exact for square Stiefel).
        step_size: first dual step (default :math:`1/(4\sqrt{n})`, about a quarter of a typical
            singular value of the normalized problem); later steps follow Barzilai–Borwein.
        patience: stop early once this many iterations in a row failed to cut the best residual
            by 10% (``None``: run to ``tol`` or ``max_iter``). Guards the cost where the dual
            optimum is rank deficient and the residual stalls (square DGram).
        return_info: also return a :class:`SteepestInfo`.

    Returns:
        ``A`` with ``G``'s shape and dtype, or ``(A, info)`` when ``return_info``.

    Raises:
        ValueError: unknown manifold or method, mismatched shapes, bad ``tol``/``max_iter``, or a
            multiplier of the wrong shape.
    """
    _check_inputs(W, G, manifold, tol, max_iter, patience)
    if msign_method not in MSIGN_METHODS or msign_method == "newton":
        valid = [m for m in MSIGN_METHODS if m != "newton"]
        raise ValueError(f"unknown msign_method {msign_method!r}; valid: {', '.join(valid)}")
    out_dtype = G.dtype
    work_dtype = torch.float32 if G.dtype in (torch.float16, torch.bfloat16) else G.dtype
    transposed = G.size(-2) < G.size(-1)
    g = (G.mT if transposed else G).to(work_dtype)
    norm = g.norm()
    if manifold == "euclidean" or not bool(norm > 0):
        if msign_method == "svd":
            a = msign(g, "svd")
        else:
            r = gram_msign_factor(g.mT @ g, msign_method, ns_steps, coefficients=ns_coefficients, eps=eps)
            a = g @ r
        a = a.mT if transposed else a
        info = SteepestInfo(0, 0.0, True, multiplier, correction, [0.0], step_size)
        return (a.to(out_dtype), info) if return_info else a.to(out_dtype)
    w = (W.mT if transposed else W).to(work_dtype)
    g = g / norm
    n = g.size(-1)
    problem = _DualProblem(w, g, manifold, msign_method, ns_steps, ns_coefficients, eps)
    if multiplier is not None and correction is not None:
        raise ValueError("give at most one of multiplier and correction")
    lam0 = problem.initial_multiplier()
    lam = lam0
    for label, start in (("multiplier", multiplier), ("correction", correction)):
        if start is None:
            continue
        if tuple(start.shape) != (n, n):
            raise ValueError(f"{label} must have shape {(n, n)}, got {tuple(start.shape)}")
        start = problem.mask(0.5 * (start + start.mT)).to(work_dtype)
        lam = start if label == "multiplier" else lam0 + start
    history: list[float] = []
    lam, state, residual, iterations, last_step = _dual_solve(
        problem, lam, float(tol), max_iter, history, step_size, patience
    )
    a = problem.direction(state)
    a = a.mT if transposed else a
    a = a.to(out_dtype)
    if not return_info:
        return a
    return a, SteepestInfo(iterations, residual, residual <= tol, lam, lam - lam0, history, last_step)
