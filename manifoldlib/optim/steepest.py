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

Three ideas make the solve cheap and exact (MATH.md §4–5 give the plain dual ascent):

* **Reduced dual, one eigendecomposition per iteration.** Write :math:`W = QD` (:math:`D = I` on
  Stiefel), :math:`B = Q^\top G = D^{-1}W^\top G` and :math:`C = G^\top G - B^\top B` (zero for
  square ``W``). With :math:`M = B + 2D\Lambda` the matrix :math:`X = G + 2W\Lambda` has Gram
  matrix :math:`S = C + M^\top M`, and every spectral map of :math:`X` is :math:`XR` with
  :math:`R = V\operatorname{diag}(\psi(\lambda))V^\top` from :math:`S = V\operatorname{diag}
  (\lambda)V^\top`. For a Newton–Schulz preset :math:`\psi` is the preset's scalar polynomial
  composed ``steps`` times (the same ``R`` as the iteration, exactly), so a dual iteration is
  one ``n × n`` eigh and three ``n × n`` products, and :math:`Q^\top A = MR`. The ``m``-sized
  work is :math:`W^\top G`, :math:`G^\top G` (setup) and :math:`A = (G + 2W\Lambda)R` (end).
* **Barzilai–Borwein dual steps.** The dual objective is smooth where :math:`X` has full column
  rank; BB step sizes (alternating the long and short rule, safeguarded) adapt to its curvature.
  The step is preconditioned by :math:`2/(d_i^2 + d_j^2)` (the inverse metric of the normal
  space) so DGram columns of different norms converge together.
* **Smoothed dual for square DGram.** There the dual optimum is rank deficient and no
  :math:`\operatorname{msign}` of a dual iterate is tangent. Replacing :math:`\|X\|_*` by
  :math:`\operatorname{tr}(X^\top X + \mu^2 I)^{1/2}` makes the dual smooth; its minimizer gives
  the tangent :math:`A = X(X^\top X + \mu^2 I)^{-1/2}` (:math:`\|A\|_2 < 1`), which maximizes
  :math:`\langle G, A\rangle + \mu\sum_i\sqrt{1 - \sigma_i(A)^2}` over the tangent unit ball, so
  it loses at most :math:`n\mu` of the optimum. It is solved by Newton–CG (the Hessian from the
  same eigendecomposition, Daleckii–Krein divided differences) with a continuation in
  :math:`\mu`.

``msign_method="svd"`` without smoothing runs the exact, unreduced iteration (SVD of the
``m × n`` matrix :math:`X` every step): the reference used by the tests.
"""

from __future__ import annotations

import itertools
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
    "AUTO_SMOOTHING",
    "DEFAULT_MAX_ITER",
    "DEFAULT_TOL",
    "DUAL_UPDATES",
    "STEEPEST_MANIFOLDS",
    "DualSolution",
    "SteepestInfo",
    "gram_msign_factor",
    "gram_msign_factor_eigh",
    "solve_dual",
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
_LINE_SEARCH_STEPS = 20
#: CG iterations per Newton step of the smoothed dual.
NEWTON_CG_ITER = 40
#: Relative smoothing :math:`\kappa` that ``smoothing="auto"`` uses for square DGram matrices.
AUTO_SMOOTHING = 2e-2
#: Past steps Anderson mixing combines in the plain reduced dual.
ANDERSON_MEMORY = 2
#: Plain-dual update rules of :func:`steepest_direction`.
DUAL_UPDATES = ("auto", "anderson", "bb")
#: Continuation start of a cold smoothed solve (relative :math:`\kappa`).
SMOOTHING_START = 1e-1


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


def _ns_plan(method: str, steps: int | None, coefficients):
    """``(steps, schedule, first-scaling safety factor)`` of a Newton–Schulz preset."""
    n_steps = _DEFAULT_NS_STEPS.get(method, 5) if steps is None else steps
    scale = _PE_SAFETY if (method == "polar-express" and coefficients is None) else 1.0
    return n_steps, _ns_schedule(method, coefficients), scale


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
    n_steps, schedule, scale = _ns_plan(method, steps, coefficients)
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


@dataclass
class _State:
    """One evaluation of the dual: the multiplier and what rebuilds ``A`` (and its Hessian)."""

    lam: torch.Tensor
    factor: torch.Tensor | None  # R (n, n) on the reduced path (built on demand), A (m, n) on the SVD path
    m: torch.Tensor | None = None
    eig: torch.Tensor | None = None
    vec: torch.Tensor | None = None
    gain: torch.Tensor | None = None
    value: float | None = None  # smoothed dual objective sum sqrt(lambda + mu^2)
    mv: torch.Tensor | None = None
    rotated: torch.Tensor | None = None  # V^T (H / metric) V, when the evaluation formed it

    def spectral_factor(self) -> torch.Tensor:
        """:math:`R = V\operatorname{diag}(\psi)V^\top` ``(n, n)`` (reduced path), built once."""
        if self.factor is None:
            self.factor = (self.vec * self.gain) @ self.vec.mT
        return self.factor


class _DualProblem:
    r"""The reduced dual of one tall instance: every iteration is ``n × n`` work only.

    Setup: :math:`W^\top G` and :math:`G^\top G` (two ``m·n²`` products); the answer
    :math:`A = (G + 2W\Lambda)R` costs two more. The Gram matrix of :math:`X = G + 2W\Lambda` is
    :math:`S = C + M^\top M` with :math:`M = B + 2D\Lambda`, :math:`B = Q^\top G` and
    :math:`C = G^\top G - B^\top B` (zero for square ``W``).
    """

    def __init__(self, w, g, manifold, method, steps, coefficients, eps, smoothing=None):
        self.manifold = manifold
        self.method = method
        self.steps, self.coefficients, self.eps = steps, coefficients, eps
        self.smoothing = smoothing  # absolute mu of the smoothed nuclear norm, or None
        n = w.size(-1)
        if manifold == "dgram":
            self.d = w.norm(dim=-2)  # (n,) column norms
            if not bool((self.d > 0).all()):
                zero = (self.d == 0).nonzero().flatten().tolist()
                raise ValueError(
                    f"W is not a DGram point: columns {zero} (tall orientation) are zero; DGram "
                    f"points have nonzero orthogonal columns (project W first)"
                )
        else:
            self.d = torch.ones(n, dtype=w.dtype, device=w.device)
        self.w, self.g = w, g
        self.unit = manifold == "stiefel"  # D = I, metric 1, no mask: skip the scalings
        self.square = w.size(-2) == n
        d2 = self.d * self.d
        self.metric = 0.5 * (d2.unsqueeze(-1) + d2.unsqueeze(-2))  # (n, n), (d_i^2 + d_j^2)/2
        self.two_d = 2.0 * self.d.unsqueeze(-1)  # (n, 1)
        self.normal_scale = self.d.unsqueeze(-1) / (2.0 * self.metric)  # (n, n): H -> D S
        self.mask = off_diagonal if manifold == "dgram" else (lambda x: x)
        self.wg = w.mT @ g  # (n, n) = W^T G = D B
        self.reduced = method != "svd" or smoothing is not None
        if self.reduced:
            self.b = self.wg / self.d.unsqueeze(-1)  # (n, n) = Q^T G
            if w.size(-2) == n:
                self.c = torch.zeros_like(self.b)  # square: G lies in span(Q)
            else:
                gram = g.mT @ g  # (n, n)
                self.c = gram - self.b.mT @ self.b  # G_perp^T G_perp
                self.c = 0.5 * (self.c + self.c.mT)

    def initial_multiplier(self) -> torch.Tensor:
        # G + 2 W Lambda_0 = P_T(G): Lambda_0 = -(W^T G + G^T W) / (2 (d_i^2 + d_j^2))
        return -self.mask(self.wg + self.wg.mT) / (4.0 * self.metric)

    def gram(self, lam: torch.Tensor) -> torch.Tensor:
        r"""``(n, n)`` Gram matrix :math:`S` of :math:`X = G + 2W\Lambda` (reduced path only)."""
        m = self.b + 2.0 * (self.d.unsqueeze(-1) * lam)
        return self.c + m.mT @ m

    def evaluate(self, lam: torch.Tensor, *, rotated: bool = False):
        """``(H, residual, state)`` at the multiplier ``lam``; ``state`` rebuilds ``A``.

        ``rotated=True`` (reduced Stiefel path only) skips ``H`` (returned as ``None``) and leaves
        :math:`V^\top H V = N\Psi + \Psi N^\top`, :math:`N = V^\top M V`, in ``state.rotated``:
        what the eigenbasis-preconditioned step needs, two ``n × n`` products cheaper.
        """
        if not self.reduced:
            x = self.g + 2.0 * (self.w @ lam)  # (m, n)
            a = msign(x, "svd")
            k = (self.w.mT @ a) / self.d.unsqueeze(-1)  # (n, n) = Q^T A
            a_sq = (a * a).sum()
            state = _State(lam, a)
        else:
            m = torch.add(self.b, lam, alpha=2.0) if self.unit else torch.addcmul(self.b, self.two_d, lam)  # B + 2 D Lambda
            s = m.mT @ m if self.square else torch.addmm(self.c, m.mT, m)  # (n, n) Gram matrix of X
            if not bool(torch.isfinite(s.sum())):
                nan = torch.full_like(lam, float("nan"))
                return nan, float("nan"), _State(lam, nan, value=float("nan"))
            eig, vec, gain = _spectral_gain(s, self.method, self.steps, self.coefficients, self.eps, self.smoothing)
            a_sq = (eig * gain * gain).sum()  # ||A||_F^2
            value = float((eig + self.smoothing**2).sqrt().sum()) if self.smoothing is not None else None
            state = _State(lam, None, m, eig, vec, gain, value)
            state.mv = m @ vec  # (n, n) = M V
            if rotated and self.unit and self.manifold == "stiefel":
                nt = vec.mT @ state.mv  # (n, n) = V^T M V
                state.rotated = nt * gain + (nt * gain).mT  # V^T H V (metric 1 on Stiefel)
                tiny = torch.finfo(a_sq.dtype).tiny
                residual = float(0.5 * state.rotated.norm() / a_sq.clamp_min(tiny).sqrt())
                return None, residual, state
            k = (state.mv * gain) @ vec.mT  # (n, n) = M R = Q^T A
        dk = k if self.unit else self.d.unsqueeze(-1) * k  # D Q^T A = W^T A
        h = dk + dk.mT  # dual gradient (fresh tensor: its diagonal is masked in place)
        if self.manifold == "dgram":
            h.diagonal().zero_()
        # normal part of A is W S with S = H / (d_i^2 + d_j^2); ||W S||_F = ||D S||_F
        normal_norm = 0.5 * h.norm() if self.unit else (h * self.normal_scale).norm()
        residual = float(normal_norm / a_sq.clamp_min(torch.finfo(a_sq.dtype).tiny).sqrt())
        return h, residual, state

    def direction(self, state: _State) -> torch.Tensor:
        if not self.reduced:
            return state.factor  # the (m, n) direction itself
        x = torch.addmm(self.g, self.w, state.lam, alpha=2.0)  # (m, n) = G + 2 W Lambda
        return x @ state.spectral_factor()  # msign(X) = X R, (m, n)

    def hessian_vector(self, state: _State, delta: torch.Tensor) -> torch.Tensor:
        r"""Second derivative of the smoothed dual along the symmetric ``delta`` (reduced path).

        :math:`E = 2D\Delta`, :math:`dS = E^\top M + M^\top E`,
        :math:`dR = V[(V^\top dS V)\circ\Phi]V^\top` with :math:`\Phi_{ij}` the divided difference of
        :math:`\psi(\lambda) = (\lambda + \mu^2)^{-1/2}`, :math:`-1/(a_i a_j (a_i + a_j))`,
        :math:`a = \psi^{-1}`; then :math:`dK = ER + M\,dR` and the answer is
        :math:`\mathcal{N}(D\,dK + dK^\top D)`. Four ``n × n`` products.
        """
        vec, gain = state.vec, state.gain
        root = gain.reciprocal()  # a_i = sqrt(lambda_i + mu^2)
        phi = -1.0 / (root.unsqueeze(-1) * root.unsqueeze(-2) * (root.unsqueeze(-1) + root.unsqueeze(-2)))
        if state.mv is None:
            state.mv = state.m @ vec  # (n, n) = M V
        ev = (2.0 * (self.d.unsqueeze(-1) * delta)) @ vec  # (n, n) = E V
        t = ev.mT @ state.mv  # (n, n)
        dr = (t + t.mT) * phi  # V^T dR V
        dk = (ev * gain + state.mv @ dr) @ vec.mT  # (n, n) = dK
        ddk = self.d.unsqueeze(-1) * dk
        return self.mask(ddk + ddk.mT)


class _BestIterate:
    """Book-keeping shared by the dual iterations: the best iterate so far (a NaN one is always
    replaced) and the stall count behind ``patience`` (iterations in a row without a 10% cut of
    the best-so-far residual mark)."""

    def __init__(self, residual: float, lam: torch.Tensor, state: _State) -> None:
        self.best = (residual, lam, state)
        self.mark = residual
        self.since_progress = 0

    def record(self, residual: float, lam: torch.Tensor, state: _State) -> None:
        if residual < self.best[0] or self.best[0] != self.best[0]:
            self.best = (residual, lam, state)
        if residual < 0.9 * self.mark:
            self.mark, self.since_progress = residual, 0
        else:
            self.since_progress += 1

    def stalled(self, patience: int | None) -> bool:
        return patience is not None and self.since_progress >= patience


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
    tracker = _BestIterate(residual, lam, state)
    iterations = 0
    while not residual <= tol and iterations < max_iter:  # a NaN residual keeps iterating
        if tracker.stalled(patience):
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
        tracker.record(residual, lam, state)
    residual, lam, state = tracker.best
    return lam, state, residual, iterations, step


def _preconditioned_step(problem: _DualProblem, h: torch.Tensor, state: _State) -> torch.Tensor:
    r"""Approximate Newton step :math:`-\mathcal{H}^{-1}H` of the reduced dual, from the eigenbasis in hand.

    With the spectral factor :math:`R = V\operatorname{diag}(\psi)V^\top` frozen, a change
    :math:`\Delta` of the multiplier changes the dual gradient :math:`H = \mathcal{N}(DK + K^\top D)`,
    :math:`K = (B + 2D\Lambda)R`, by :math:`\mathcal{N}(2D^2\Delta R + 2R\Delta D^2)`; with
    :math:`D^2` replaced by the normal-space metric :math:`(d_i^2 + d_j^2)/2` that operator is diagonal
    in the basis :math:`V`, with entries :math:`2(\psi_i + \psi_j)` after dividing by the metric.
    The step inverts it: :math:`\Delta = V\big[(V^\top (H \oslash \text{metric}) V) \oslash
    2(\psi_i + \psi_j)\big]V^\top`, four ``n × n`` products. Freezing :math:`R` drops the (negative)
    curvature of the spectral map, so the step is conservative; Anderson mixing in
    :func:`_anderson_solve` recovers the rest.
    """
    vec, gain = state.vec, state.gain
    rotated = state.rotated
    if rotated is None:
        rotated = vec.mT @ (h / problem.metric) @ vec  # (n, n), in the eigenbasis of S
    scale = 2.0 * (gain.unsqueeze(-1) + gain.unsqueeze(-2))
    step = vec @ (rotated / scale.clamp_min(torch.finfo(scale.dtype).tiny)) @ vec.mT
    step = step + step.mT  # (fresh) symmetric part, times two
    if problem.manifold == "dgram":
        step.diagonal().zero_()
    return step.mul_(-0.5)


def _anderson_solve(
    problem: _DualProblem,
    lam: torch.Tensor,
    tol: float,
    max_iter: int,
    history: list[float],
    patience: int | None,
    memory: int = ANDERSON_MEMORY,
):
    r"""The plain reduced dual by eigenbasis-preconditioned steps with Anderson mixing.

    The fixed-point map :math:`T(\Lambda) = \Lambda + \delta(\Lambda)` (:math:`\delta` from
    :func:`_preconditioned_step`) converges linearly (about 0.4 per iteration on GPT-sized
    matrices); Anderson mixing of the last ``memory`` steps (type II: minimize the norm of the
    combined step over affine combinations, :math:`\Lambda_{k+1} = \Lambda_k + \delta_k -
    (\Delta\Lambda + \Delta\delta)\gamma`) halves the iteration count against
    Barzilai–Borwein steps. The memory restarts whenever the residual grows.
    """
    h, residual, state = problem.evaluate(lam, rotated=True)
    history.append(residual)
    tracker = _BestIterate(residual, lam, state)
    points: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    iterations = 0
    previous = residual
    while not residual <= tol and iterations < max_iter:
        if tracker.stalled(patience) or math.isnan(residual):
            break
        delta = _preconditioned_step(problem, h, state)
        points.append(lam)
        steps.append(delta)
        points, steps = points[-(memory + 1):], steps[-(memory + 1):]
        new = lam + delta
        if len(steps) > 1:
            d_steps = torch.stack([(b - a).flatten() for a, b in itertools.pairwise(steps)], -1)  # (n², k)
            d_points = torch.stack([(b - a).flatten() for a, b in itertools.pairwise(points)], -1)
            gram = d_steps.mT @ d_steps  # (k, k)
            ridge = 1e-10 * torch.diagonal(gram).sum() * torch.eye(gram.size(-1), dtype=gram.dtype, device=gram.device)
            gamma = torch.linalg.solve(gram + ridge, d_steps.mT @ delta.flatten())  # (k,)
            new = new - ((d_points + d_steps) @ gamma).reshape(delta.shape)
        lam = new
        iterations += 1
        h, residual, state = problem.evaluate(lam, rotated=True)
        history.append(residual)
        tracker.record(residual, lam, state)
        if not residual < previous:
            points, steps = [], []  # the mixing overshot: restart from plain preconditioned steps
        previous = residual
    residual, lam, state = tracker.best
    return lam, state, residual, iterations


def _conjugate_gradient(problem: _DualProblem, state: _State, rhs: torch.Tensor, max_iter: int, rtol: float):
    """Preconditioned CG on ``Hess · p = rhs`` (preconditioner: the normal-space metric)."""
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    z = r / problem.metric
    p = z.clone()
    rz = float((r * z).sum())
    stop = rtol * float(rhs.norm())
    for _ in range(max_iter):
        hp = problem.hessian_vector(state, p)
        php = float((p * hp).sum())
        if not php > 0:  # flat or numerically indefinite direction: keep what we have
            break
        alpha = rz / php
        x = x + alpha * p
        r = r - alpha * hp
        if float(r.norm()) <= stop:
            break
        z = r / problem.metric
        rz_new = float((r * z).sum())
        p = z + (rz_new / rz) * p
        rz = rz_new
    return x if bool(x.abs().sum() > 0) else z


def _newton_solve(
    problem: _DualProblem,
    lam: torch.Tensor,
    tol: float,
    max_iter: int,
    history: list[float],
    patience: int | None,
    cg_iter: int = NEWTON_CG_ITER,
):
    r"""Newton–CG on the smoothed dual :math:`\sum_i (\lambda_i(S) + \mu^2)^{1/2}` with backtracking.

    The smoothed dual is smooth and convex, so inexact Newton steps (CG on the Hessian from one
    eigendecomposition) with an Armijo line search on the dual value converge fast where BB
    crawls (its curvature spans :math:`1/\mu` to :math:`1/\sigma_{\max}`).
    """
    h, residual, state = problem.evaluate(lam)
    history.append(residual)
    tracker = _BestIterate(residual, lam, state)
    iterations = 0
    while not residual <= tol and iterations < max_iter:
        if tracker.stalled(patience) or math.isnan(residual):
            break
        hnorm = float(h.norm())
        direction = _conjugate_gradient(problem, state, -h, cg_iter, min(0.5, hnorm**0.5))
        slope = float((h * direction).sum())
        if not slope < 0:
            direction, slope = -h / problem.metric, -float((h * h / problem.metric).sum())
        t = 1.0
        for _ in range(_LINE_SEARCH_STEPS):
            trial = lam + t * direction
            h_t, res_t, state_t = problem.evaluate(trial)
            if state_t.value is not None and state_t.value <= state.value + 1e-4 * t * slope:
                break
            t *= 0.5
        lam, h, residual, state = trial, h_t, res_t, state_t
        iterations += 1
        history.append(residual)
        tracker.record(residual, lam, state)
    residual, lam, state = tracker.best
    return lam, state, residual, iterations, None


def _resolve_smoothing(smoothing, manifold: str, shape) -> tuple[float | None, float | None]:
    """``(kappa, fallback)``: the relative smoothing :math:`\\kappa` to solve with from the start
    (``None``: the plain dual), and the one to continue with when the plain dual stalls (``None``:
    keep the plain dual's best iterate)."""
    if smoothing == "auto":
        square = shape[-2] == shape[-1]
        return (AUTO_SMOOTHING, None) if (manifold == "dgram" and square) else (None, AUTO_SMOOTHING)
    if smoothing is None:
        return None, None
    if isinstance(smoothing, (int, float)) and not isinstance(smoothing, bool) and smoothing > 0:
        return float(smoothing), None
    raise ValueError(f"smoothing must be 'auto', None or a float > 0, got {smoothing!r}")


def _smoothed_solve(problem, lam, lam0, kappa, tol, max_iter, history, patience, cold):
    r"""Newton–CG on the smoothed dual with :math:`\mu = \kappa\|P_W G\|_F/\sqrt{n}`.

    A cold start runs a continuation (first :data:`SMOOTHING_START` to ``10 tol``, then ``kappa``
    to ``tol``); a warm start (a previous step's correction, or a stalled plain dual's best
    iterate) goes straight to ``kappa`` when its residual beats the closed-form start's. The
    iteration budget is shared.
    """
    n = lam.size(-1)
    scale = float(torch.diagonal(problem.gram(lam0)).sum().clamp_min(0).sqrt()) / math.sqrt(n)
    scale = scale if scale > 0 else 1.0 / math.sqrt(n)
    if not cold:
        # a warm start from another gradient can be worse than the closed-form start: keep the
        # better of the two (at the final smoothing), and run the continuation from Lambda_0
        problem.smoothing = kappa * scale
        cold = not problem.evaluate(lam)[1] < problem.evaluate(lam0)[1]
        lam = lam0 if cold else lam
    stages = [SMOOTHING_START, kappa] if (cold and kappa < SMOOTHING_START) else [kappa]
    iterations, state, residual = 0, None, float("nan")
    for k, stage in enumerate(stages):
        problem.smoothing = stage * scale
        stage_tol = tol if k == len(stages) - 1 else 10.0 * tol  # a continuation stage needs less
        lam, state, residual, done, _ = _newton_solve(
            problem, lam, stage_tol, max_iter - iterations, history, patience
        )
        iterations += done
    return lam, state, residual, iterations


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
    smoothing: float | str | None = "auto",
    dual_update: str = "auto",
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
        max_iter: cap on dual iterations (Newton steps for a smoothed solve); the best iterate seen
            is returned.
        msign_method: ``"svd"`` (exact, full-size; for tests), or a Newton–Schulz preset
            ``"jordan5"``, ``"polar-express"``, ``"newton-schulz"``, applied exactly to the
            eigenvalues of the ``n × n`` Gram matrix (one eigh per dual iteration).
        ns_steps: Newton–Schulz step count (preset default when ``None``).
        ns_coefficients: custom ``(a, b, c)`` (or a schedule) for the Newton–Schulz iteration.
        eps: added to the normalizing norm of Newton–Schulz.
        multiplier: warm start :math:`\Lambda` ``(k, k)``, ``k = min(m, n)``, from a previous solve
            at the same point.
        correction: warm start :math:`\Lambda_0 + \Delta` with :math:`\Delta` the ``correction``
            of a previous solve: the right warm start after the point moved (the optimizer's), since
            :math:`\Lambda_0` already carries the closed-form part (exact for square Stiefel).
        step_size: first dual step of ``dual_update="bb"`` (default :math:`1/(4\sqrt{n})`, about a
            quarter of a typical singular value of the normalized problem); later steps follow
            Barzilai–Borwein. Unused by the other updates.
        patience: stop early once this many iterations in a row failed to cut the best residual
            by 10% (``None``: run to ``tol`` or ``max_iter``). Guards the cost where the dual
            optimum is rank deficient and the residual stalls (square DGram).
        smoothing: replace the nuclear norm of the dual by
            :math:`\\operatorname{tr}(X^\\top X + \\mu^2 I)^{1/2}` with
            :math:`\\mu = \\kappa\\|P_W G\\|_F/\\sqrt{n}` (``kappa`` = this float) and solve it by
            Newton–CG. Its optimum is exactly tangent with :math:`\\|A\\|_2 < 1` and loses at
            most :math:`n\\mu` of the objective. ``"auto"`` (default) uses
            :data:`AUTO_SMOOTHING` from the start for square DGram matrices, whose plain dual has
            a rank-deficient optimum that no :math:`\\operatorname{msign}` reaches; elsewhere it
            runs the plain dual (BB steps, the ``msign_method`` map) and, only if that stops
            above ``tol`` (a stall or the cap: tall DGram and Stiefel instances can have
            rank-deficient optima too), continues with the smoothed dual from the best iterate
            for up to ``max_iter`` more Newton steps. ``None`` never smooths (the plain dual's
            best iterate is returned, above ``tol`` if it stalled). With
            smoothing, ``msign_method`` only selects the exact SVD-free eigen path.
        dual_update: how the plain (unsmoothed) dual moves. ``"anderson"``: approximate Newton
            steps preconditioned in the eigenbasis the iteration already computes, with Anderson
            mixing (about half the iterations of BB; needs a Newton–Schulz ``msign_method``);
            ``"bb"``: Barzilai–Borwein gradient steps (``step_size`` is their first step);
            ``"auto"`` (default): ``"anderson"`` on the eigen path, ``"bb"`` for ``"svd"``.
        return_info: also return a :class:`SteepestInfo`.

    Returns:
        ``A`` with ``G``'s shape and dtype, or ``(A, info)`` when ``return_info``.

    Raises:
        ValueError: unknown manifold or method, mismatched shapes, bad ``tol``/``max_iter``, or a
            multiplier of the wrong shape.
    """
    solution = solve_dual(
        W,
        G,
        manifold,
        tol=tol,
        max_iter=max_iter,
        msign_method=msign_method,
        ns_steps=ns_steps,
        ns_coefficients=ns_coefficients,
        eps=eps,
        multiplier=multiplier,
        correction=correction,
        step_size=step_size,
        patience=patience,
        smoothing=smoothing,
        dual_update=dual_update,
    )
    a = solution.direction().to(G.dtype)
    return (a, solution.info) if return_info else a


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
        """The steepest direction in the input's orientation (work dtype: float32 for 16-bit input)."""
        a = self.answer if self.problem is None else self.problem.direction(self.state)
        return a.mT if self.transposed else a


def solve_dual(
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
    smoothing: float | str | None = "auto",
    dual_update: str = "auto",
) -> DualSolution:
    """:func:`steepest_direction` without forming the answer: the solved reduced dual.

    Same arguments and checks. What consumes the direction can use the reduced quantities
    instead of the ``m × n`` matrix (the Stiefel polar step of :class:`ManifoldMuon` does).
    """
    _check_inputs(W, G, manifold, tol, max_iter, patience)
    if msign_method not in MSIGN_METHODS or msign_method in ("newton", "gram-eigh"):
        valid = [m for m in MSIGN_METHODS if m not in ("newton", "gram-eigh")]
        raise ValueError(f"unknown msign_method {msign_method!r}; valid: {', '.join(valid)}")
    if dual_update not in DUAL_UPDATES:
        raise ValueError(f"unknown dual_update {dual_update!r}; valid: {', '.join(DUAL_UPDATES)}")
    if dual_update == "anderson" and msign_method == "svd":
        raise ValueError(
            "dual_update='anderson' needs a Newton-Schulz msign_method (its steps use the eigenbasis "
            "of the n x n Gram matrix); msign_method='svd' runs the unreduced iteration: use 'bb' or 'auto'"
        )
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
        info = SteepestInfo(0, 0.0, True, multiplier, correction, [0.0], step_size)
        return DualSolution(info, transposed, answer=a)
    w = (W.mT if transposed else W).to(work_dtype)
    g = g / norm
    n = g.size(-1)
    kappa, fallback = _resolve_smoothing(smoothing, manifold, w.shape)
    problem = _DualProblem(w, g, manifold, msign_method, ns_steps, ns_coefficients, eps, smoothing=kappa)
    if multiplier is not None and correction is not None:
        raise ValueError("give at most one of multiplier and correction")
    lam0 = problem.initial_multiplier()
    lam = lam0
    start = multiplier if multiplier is not None else correction
    for label, given in (("multiplier", multiplier), ("correction", correction)):
        if given is None:
            continue
        if tuple(given.shape) != (n, n):
            raise ValueError(f"{label} must have shape {(n, n)}, got {tuple(given.shape)}")
        given = problem.mask(0.5 * (given + given.mT)).to(work_dtype)
        lam = given if label == "multiplier" else lam0 + given
    history: list[float] = []
    if kappa is None and problem.reduced and dual_update != "bb":
        lam, state, residual, iterations = _anderson_solve(problem, lam, float(tol), max_iter, history, patience)
        last_step = step_size
    elif kappa is None:
        lam, state, residual, iterations, last_step = _dual_solve(
            problem, lam, float(tol), max_iter, history, step_size, patience
        )
    if kappa is None:
        if fallback is not None and problem.reduced and not residual <= tol:
            # the plain dual stalled: its optimum is (near) rank deficient, no msign of a dual
            # iterate is tangent; the smoothed dual, started from the best iterate, has a unique
            # smooth optimum and gets there in a few Newton steps
            lam, state, residual, more = _smoothed_solve(
                problem, lam, lam0, fallback, float(tol), max_iter, history, patience, cold=False
            )
            iterations += more
    else:
        lam, state, residual, iterations = _smoothed_solve(
            problem, lam, lam0, kappa, float(tol), max_iter, history, patience, cold=start is None
        )
        last_step = step_size
    info = SteepestInfo(iterations, residual, residual <= tol, lam, lam - lam0, history, last_step)
    return DualSolution(info, transposed, problem, state)
