r"""Solvers of the steepest-direction dual (:mod:`~manifoldlib.optim.dual`), on banks of matrices.

:func:`bb_solve`: Barzilai–Borwein steps on the metric-preconditioned gradient
(:math:`2/(d_i^2 + d_j^2)`, so DGram columns of different norms converge together), alternating
the long and short rules, with per-matrix step sizes, convergence masks, stall counts and best
iterates, all on the device; it runs a fixed number of iterations (``sync_free``) or stops once
every matrix has converged. :func:`anderson_solve` (eigh path): frozen-gain Newton steps in the
eigenbasis the evaluation computed, with Anderson mixing. :func:`smoothed_solve` (one matrix,
eigh path): Newton–CG on the smoothed dual :math:`\operatorname{tr}(X^\top X + \mu^2 I)^{1/2}`,
whose optimum is tangent with :math:`\|A\|_2 < 1` and loses at most :math:`n\mu` of the
objective — for square DGram, whose plain dual optimum is rank deficient, and for plain solves
that stall.

:func:`solve_bank` runs them on a bank, the solve of every :class:`~manifoldlib.optim.ManifoldMuon`
step and of :func:`~manifoldlib.optim.steepest_direction`:

* **smoothing** (:func:`~manifoldlib.optim.options.resolve_smoothing`): ``"auto"`` smooths from
  the start where the plain dual cannot converge or crawls — square DGram (rank-deficient
  optimum) and tall matrices with ``m < 2.5 n`` other than square Stiefel
  (:data:`~manifoldlib.optim.options.SMOOTH_BELOW_ASPECT`) — with :math:`\kappa =`
  :data:`~manifoldlib.optim.options.AUTO_SMOOTHING`; elsewhere it runs the plain dual, and on the
  eigh path a matrix the plain dual leaves above ``tol`` continues on the smoothed dual from its
  best iterate;
* **the plain dual**: :func:`anderson_solve` on the eigh path, :func:`bb_solve` on the products
  path or when asked for;
* **host reads**: none on a sync-free solve (the products path: a fixed iteration count, the
  smoothed dual by Barzilai–Borwein on :math:`(S + \mu^2I)` with per-matrix :math:`\mu`); an
  early-stopping solve reads the residuals once per iteration.

The reported residual is that of the returned direction, computed from the exact
:math:`W^\top A` (not the reduced problem's, which assumes :math:`W` exactly on the manifold).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields, replace

import torch

from ..functional.newton_schulz import _gram_newton_schulz
from ..functional.scaling import into_safe_range
from ..manifolds import MatrixConstraintManifold
from .dual import _DIMS, DualProblem, Evaluation, Spectral, with_smoothing
from .execution import Execution, ieee_float32_matmul
from .options import DualOptions, resolve_smoothing

__all__ = [
    "BankSolution",
    "Progress",
    "anderson_solve",
    "bb_solve",
    "smoothed_solve",
    "solve_bank",
    "stiefel_solve",
]

#: A sync-free solve smoothed from the start (square DGram) runs this many times the default
#: iterations: its Barzilai–Borwein steps face curvatures up to :math:`1/\mu`.
SMOOTHED_ITERATION_FACTOR = 4
#: Past steps Anderson mixing combines.
ANDERSON_MEMORY = 2
#: Over-relaxation of the frozen-gain Newton step until a matrix's residual first grows.
PRECONDITIONED_RELAXATION = 1.2
#: CG iterations per Newton step of the smoothed dual.
NEWTON_CG_ITER = 40
#: Backtracking steps of the smoothed dual's line search.
LINE_SEARCH_STEPS = 20
#: Rounding noise of the smoothed dual value, in units of ``eps · |value|``: below it the Armijo
#: test cannot see a predicted decrease, and a trial is accepted when it lowers the residual.
VALUE_NOISE_ULPS = 16
#: Continuation start of a cold smoothed solve (relative :math:`\kappa`).
SMOOTHING_START = 1e-1
#: Smallest relative smoothing the gap-driven continuation goes down to.
SMOOTHING_FLOOR = 2e-5


# -- Barzilai–Borwein on a bank ----------------------------------------------------------------

@dataclass
class Progress:
    """Per-matrix book-keeping of a bank's solve, all on the device.

    Attributes:
        best: the best evaluation of each matrix so far (a NaN one is always replaced).
        iterations: ``(B,)`` dual updates each matrix took.
        active: ``(B,)`` matrices still iterating (above ``tol``, finite, not stalled).
        mark, stall: ``(B,)`` the residual of the last 10% cut and the iterations since.
        history: the ``(B,)`` residuals of every evaluation, in order (device tensors).
    """

    best: Evaluation
    iterations: torch.Tensor
    active: torch.Tensor
    mark: torch.Tensor
    stall: torch.Tensor
    history: list

    sync_free: bool = True
    #: ``best``'s tensors are this object's own (copied), so rows may be written into them in place
    #: (:meth:`record_rows`); until then they are an evaluation's, shared with the solver loop.
    owned: bool = False

    @classmethod
    def start(cls, ev: Evaluation, tol: float, sync_free: bool = True) -> Progress:
        r = ev.residual
        return cls(ev, torch.zeros_like(r, dtype=torch.long), (r > tol) & torch.isfinite(r), r.clone(),
                   torch.zeros_like(r, dtype=torch.long), [r], sync_free)

    def record_rows(self, ev: Evaluation, rows: torch.Tensor, tol: float, patience: int | None) -> None:
        """Take ``ev``, the evaluation of the matrices ``rows`` (an index tensor) that stepped: best
        iterate, stall count, activity. Early-stopping loops only (a host read per call)."""
        r = ev.residual
        self.history.append(r)
        self.iterations[rows] += 1
        best_r = self.best.residual[rows]
        improved = (r < best_r) | torch.isnan(best_r)
        every = bool(improved.all())
        if every and rows.numel() == self.iterations.numel():  # every matrix stepped and improved
            self.best, self.owned = ev, False  # taken as it is: nothing copied
        elif every or bool(improved.any()):
            if not self.owned:  # copy once before writing rows in place
                self.best = Evaluation(**{f.name: None if getattr(self.best, f.name) is None
                                          else getattr(self.best, f.name).clone() for f in fields(self.best)})
                self.owned = True
            take = rows if every else rows[improved]
            sub = ev if every else ev.select(improved)
            for f in fields(self.best):
                mine, theirs = getattr(self.best, f.name), getattr(sub, f.name)
                if mine is not None and theirs is not None:
                    mine[take] = theirs
        progress = r < 0.9 * self.mark[rows]
        self.mark[rows] = torch.where(progress, r, self.mark[rows])
        self.stall[rows] = torch.where(progress, 0, self.stall[rows] + 1)
        still = (r > tol) & torch.isfinite(r)
        if patience is not None:
            still = still & (self.stall[rows] < patience)
        self.active[rows] = still

    def record(self, ev: Evaluation, stepped: torch.Tensor, tol: float, patience: int | None) -> None:
        """Take ``ev`` for the matrices that ``stepped``: best iterate, stall count, activity."""
        r = ev.residual
        self.history.append(r)
        self.iterations = self.iterations + stepped.long()
        improved = stepped & ((r < self.best.residual) | torch.isnan(self.best.residual))
        self.best = ev.where(improved, self.best)
        progress = r < 0.9 * self.mark
        self.mark = torch.where(stepped & progress, r, self.mark)
        self.stall = torch.where(stepped, torch.where(progress, 0, self.stall + 1), self.stall)
        still = (r > tol) & torch.isfinite(r)
        if patience is not None:
            still = still & (self.stall < patience)
        self.active = stepped & still | (~stepped & self.active)


def _barzilai_borwein(step, s_vec, y_vec, long: bool):
    """Next BB step size per matrix ``(B,)``: long :math:`\\langle s,s\\rangle/\\langle s,y\\rangle` or
    short :math:`\\langle s,y\\rangle/\\langle y,y\\rangle`, kept only where :math:`\\langle s,y\\rangle > 0`."""
    sy = (s_vec * y_vec).sum(_DIMS)
    if long:
        proposed = (s_vec * s_vec).sum(_DIMS) / sy
    else:
        proposed = sy / (y_vec * y_vec).sum(_DIMS).clamp_min(torch.finfo(sy.dtype).tiny)
    return torch.where(sy > 0, proposed, step)


def bb_solve(problem: DualProblem, lam: torch.Tensor, tol: float, iterations: int, patience: int | None,
             sync_free: bool) -> Progress:
    r"""Barzilai–Borwein steps on every matrix of ``problem`` from ``lam`` ``(B, n, n)``.

    The first step is :math:`\|X\|_F/(4\sqrt n)` at the start (about a quarter of a typical
    singular value), then the long and short rules alternate. A matrix stops moving once it
    is inactive (:class:`Progress`). ``sync_free``: exactly ``iterations`` iterations, every matrix
    evaluated each time under device-side masks, and no host read; otherwise the loop reads which
    matrices are still active, works on those alone (:meth:`DualProblem.select`) and stops when
    none is.
    """
    ev = problem.evaluate(lam)
    progress = Progress.start(ev, tol, sync_free)
    # ~ a quarter of a typical singular value of X: the curvature of the nuclear norm is ~ 1/sigma
    # (for a gradient nearly normal to the tangent space X is small, and so is the first step)
    step = 0.25 * problem.x_norm(lam) / math.sqrt(lam.size(-1))
    lam_prev = grad_prev = None
    # the bank rows still worked on (an early-stopping loop narrows them; a sync-free one masks)
    work, rows = problem, None if sync_free else torch.arange(lam.size(0), device=lam.device)
    for taken in range(iterations):
        if sync_free:
            active = progress.active
        else:
            keep = progress.active[rows]
            if not bool(keep.any()):
                break
            if not bool(keep.all()):  # narrow the work to the active matrices
                index = keep.nonzero().flatten()
                rows = rows[index]
                work, ev, lam, step = work.select(index), ev.select(index), lam[index], step[index]
                if lam_prev is not None:
                    lam_prev, grad_prev = lam_prev[index], grad_prev[index]
            active = None
        grad = ev.h / work.metric  # preconditioned dual gradient
        if lam_prev is not None:
            proposed = _barzilai_borwein(step, lam - lam_prev, grad - grad_prev, long=bool(taken % 2))
            step = proposed if active is None else torch.where(active, proposed, step)
        lam_prev, grad_prev = lam, grad
        moved = lam - step.view(-1, 1, 1) * grad
        lam = moved if active is None else torch.where(active.view(-1, 1, 1), moved, lam)
        ev = work.evaluate(lam)
        if active is None:
            progress.record_rows(ev, rows, tol, patience)
        else:
            progress.record(ev, active, tol, patience)
    return progress


# -- Anderson-mixed frozen-gain Newton steps (eigh path) -----------------------------------

def _preconditioned_step(problem: DualProblem, ev: Evaluation, relaxation: torch.Tensor) -> torch.Tensor:
    r"""Approximate Newton step :math:`-\mathcal{H}^{-1}H` from the eigenbasis in hand.

    With the gain frozen, a change :math:`\Delta` of the multiplier changes :math:`H` by
    :math:`\mathcal{P}(2D^2\Delta R + 2R\Delta D^2)`; with :math:`D^2` replaced by the metric
    that operator is diagonal in the basis :math:`V`, with entries :math:`2(\psi_i + \psi_j)`.
    Freezing :math:`R` drops the curvature of the spectral map, so the step is short (on
    Stiefel the preconditioned Jacobian has its spectrum in :math:`(0, 1]`) and is over-relaxed
    by ``relaxation`` ``(B,)``.
    """
    low = ev.vec.to(problem.execution.search_dtype_for(ev.vec))
    rotated = ev.rotated.to(low.dtype) if ev.rotated is not None else \
        low.mT @ (ev.h / problem.metric).to(low.dtype) @ low  # in the eigenbasis of S
    scale = 2.0 * (ev.gain.unsqueeze(-1) + ev.gain.unsqueeze(-2))
    step = (low @ (rotated / scale.clamp_min(torch.finfo(scale.dtype).tiny)).to(low.dtype) @ low.mT).to(ev.vec.dtype)
    step = problem.mask(step + step.mT)  # symmetric part, times two
    return step * (-0.5 * relaxation).view(-1, 1, 1)


def anderson_solve(problem: DualProblem, lam: torch.Tensor, tol: float, iterations: int,
                   patience: int | None, memory: int = ANDERSON_MEMORY) -> Progress:
    r"""Frozen-gain Newton steps (:func:`_preconditioned_step`) with Anderson mixing, per matrix.

    The fixed-point map :math:`\Lambda + \delta(\Lambda)` converges linearly; Anderson mixing of
    the last ``memory`` steps (type II: :math:`\Lambda_{k+1} = \Lambda_k + \delta_k - (\Delta\Lambda
    + \Delta\delta)\gamma`, :math:`\gamma = \arg\min\|\delta_k - \Delta\delta\,\gamma\|`) about halves
    the iterations of Barzilai–Borwein steps. Steps are over-relaxed by
    :data:`PRECONDITIONED_RELAXATION` until a matrix's residual first grows; then its memory
    restarts and its relaxation drops to 1. Eigh path only (the eigenbasis); it reads which
    matrices are still active every iteration, works on those alone and stops when none is.
    """
    ev = problem.evaluate(lam, rotated=True)
    progress = Progress.start(ev, tol, sync_free=False)
    relaxation = torch.full((lam.size(0),), PRECONDITIONED_RELAXATION, dtype=lam.dtype, device=lam.device)
    points: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    valid: list[torch.Tensor] = []  # per history entry, per matrix: not cleared by a restart
    previous = ev.residual
    work, rows = problem, torch.arange(lam.size(0), device=lam.device)  # the bank rows still worked on
    for _ in range(iterations):
        keep = progress.active[rows]
        if not bool(keep.any()):
            break
        if not bool(keep.all()):  # narrow the work to the active matrices
            index = keep.nonzero().flatten()
            rows = rows[index]
            work, ev, lam = work.select(index), ev.select(index), lam[index]
            relaxation, previous = relaxation[index], previous[index]
            points, steps, valid = [p[index] for p in points], [d[index] for d in steps], [v[index] for v in valid]
        delta = _preconditioned_step(work, ev, relaxation)
        points, steps = (points + [lam])[-(memory + 1):], (steps + [delta])[-(memory + 1):]
        valid = (valid + [torch.ones_like(previous, dtype=torch.bool)])[-(memory + 1):]
        lam = lam + delta
        if len(steps) > 1:
            lam = lam - _anderson_correction(points, steps, valid, delta)
        ev = work.evaluate(lam, rotated=True)
        progress.record_rows(ev, rows, tol, patience)
        grew = ~(ev.residual < previous)
        relaxation = torch.where(grew, torch.ones_like(relaxation), relaxation)
        valid = [v & ~grew for v in valid]  # the mixing overshot: restart from plain steps
        previous = ev.residual
    return progress


def _anderson_correction(points, steps, valid, delta) -> torch.Tensor:
    r"""``(B, n, n)`` :math:`(\Delta\Lambda + \Delta\delta)\gamma` from the consecutive differences of
    the history; pairs that a restart invalidated get :math:`\gamma = 0`."""
    d_steps = torch.diff(torch.stack(steps, dim=1).flatten(2), dim=1)  # (B, k, n*n)
    d_points = torch.diff(torch.stack(points, dim=1).flatten(2), dim=1)  # (B, k, n*n)
    ok = [u & v for u, v in itertools.pairwise(valid)]
    k = d_steps.size(1)
    keep = torch.stack(ok, dim=1).to(d_steps.dtype)  # (B, k)
    gram = (d_steps @ d_steps.mT) * (keep.unsqueeze(-1) * keep.unsqueeze(-2))  # (B, k, k), dropped pairs 0
    rhs = (d_steps @ delta.flatten(1).unsqueeze(-1)).squeeze(-1) * keep  # (B, k)
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    ridge = 1e-10 * torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(gram.dtype).tiny)
    gamma, info = torch.linalg.solve_ex(gram + ridge.view(-1, 1, 1) * eye + (1 - keep).unsqueeze(-1) * eye, rhs)
    gamma = torch.where((info == 0).unsqueeze(-1) & torch.isfinite(gamma), gamma * keep, 0.0)  # (B, k)
    return (gamma.unsqueeze(1) @ d_points.add_(d_steps)).view_as(delta)  # sum_i gamma_i (dLambda_i + ddelta_i)


# -- the smoothed dual: Newton–CG, one matrix ----------------------------------------------

def _conjugate_gradient(problem: DualProblem, ev: Evaluation, rhs: torch.Tensor, max_iter: int, rtol: float):
    """Preconditioned CG on ``Hess · p = rhs`` (preconditioner: the normal-space metric)."""
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    z = r / problem.metric
    p = z.clone()
    rz = float((r * z).sum())
    stop = rtol * float(rhs.norm())
    cache: dict = {}
    for _ in range(max_iter):
        hp = problem.hessian_vector(ev, p, cache)
        php = float((p * hp).sum())
        if not php > 0:  # flat or numerically indefinite: keep what we have
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


def _newton(problem: DualProblem, lam: torch.Tensor, tol: float, max_iter: int):
    r"""Newton–CG with backtracking on the smoothed dual of one matrix (a bank of one).

    Armijo on the smoothed value where it resolves the predicted decrease; below the value's
    rounding noise (:data:`VALUE_NOISE_ULPS`) a trial is accepted when it lowers the residual.
    Runs to ``tol`` or ``max_iter`` (or a NaN): no ``patience`` — its damped first steps often cut
    the residual by less than 10 % for a while before the quadratic phase, and a solve cut short
    there leaves a direction far from tangent.
    Returns ``(best evaluation, iterations)``.
    """
    ev = problem.evaluate(lam)
    best, iterations = ev, 0
    residual = float(ev.residual)
    while not residual <= tol and iterations < max_iter:
        if math.isnan(residual):
            break
        h = ev.h
        direction = _conjugate_gradient(problem, ev, -h, NEWTON_CG_ITER, min(0.5, float(h.norm()) ** 0.5))
        slope = float((h * direction).sum())
        if not slope < 0:
            direction, slope = -h / problem.metric, -float((h * h / problem.metric).sum())
        noise = VALUE_NOISE_ULPS * torch.finfo(lam.dtype).eps * abs(float(ev.value))
        t = 1.0
        for _ in range(LINE_SEARCH_STEPS):
            trial = problem.evaluate(lam + t * direction)
            decrease = t * slope
            if -decrease > noise:
                accepted = float(trial.value) <= float(ev.value) + 1e-4 * decrease
            else:
                accepted = float(trial.residual) < residual
            if accepted:
                break
            t *= 0.5
        ev, lam = trial, trial.lam
        residual = float(ev.residual)
        iterations += 1
        if residual < float(best.residual) or math.isnan(float(best.residual)):
            best = ev
    return best, iterations


def smoothed_solve(problem: DualProblem, lam: torch.Tensor, lam0: torch.Tensor, kappa: float, tol: float,
                   max_iter: int, cold: bool, gap_tol: float | None = None):
    r"""Newton–CG on the smoothed dual of one matrix with :math:`\mu = \kappa\|P_WG\|_F/\sqrt n`.

    A cold start runs a continuation (:data:`SMOOTHING_START` to ``10 tol``, then ``kappa`` to
    ``tol``); a warm start goes straight to ``kappa`` when it beats the closed-form start. With
    ``gap_tol`` the smoothing shrinks tenfold a stage (down to :data:`SMOOTHING_FLOOR`) until the
    certified relative gap is at most ``gap_tol``. The iteration budget is shared.

    Returns:
        ``(best evaluation, iterations, gap, problem)``: ``problem`` the reduced copy that ran
        (its :meth:`~DualProblem.answer` forms the direction).
    """
    n = lam.size(-1)
    problem = with_smoothing(problem, None)
    s0, _ = problem.gram(lam0)
    scale = float(torch.diagonal(s0, dim1=-2, dim2=-1).sum().clamp_min(0).sqrt()) / math.sqrt(n)
    scale = scale if scale > 0 else 1.0 / math.sqrt(n)
    if not cold:
        problem.smoothing = kappa * scale
        cold = not float(problem.evaluate(lam).residual) < float(problem.evaluate(lam0).residual)
        lam = lam0 if cold else lam
    stages = [SMOOTHING_START, kappa] if (cold and kappa < SMOOTHING_START) else [kappa]
    iterations, ev = 0, None
    for i, stage in enumerate(stages):
        problem.smoothing = stage * scale
        stage_tol = tol if i == len(stages) - 1 else 10.0 * tol
        ev, done = _newton(problem, lam, stage_tol, max_iter - iterations)
        lam, iterations = ev.lam, iterations + done
    gap = problem.relative_gap(ev)
    while gap_tol is not None and not gap <= gap_tol and float(ev.residual) <= tol and iterations < max_iter:
        stage = stage / 10.0
        if stage < SMOOTHING_FLOOR:
            break
        before = problem.smoothing
        problem.smoothing = stage * scale
        more, done = _newton(problem, ev.lam, tol, max_iter - iterations)
        iterations += done
        if not float(more.residual) <= tol:
            problem.smoothing = before
            break  # the smaller smoothing did not get to tol: keep the last answer that did
        ev, gap = more, problem.relative_gap(more)
    return ev, iterations, gap, problem


# -- the bank solve ------------------------------------------------------------------------


@dataclass
class BankSolution:
    r"""The steepest directions of a bank (tall orientation, the solve's dtype).

    Attributes:
        problem: the solved :class:`~manifoldlib.optim.dual.DualProblem` (its setup, the factor
            :math:`F`, :math:`P = W^\top W` where computed); ``None`` from :func:`stiefel_solve`.
        best: the answer's evaluation per matrix (``None`` where ``a`` holds formed answers: from
            :func:`stiefel_solve` always).
        a: ``(B, m, n)`` formed directions, or ``None`` (form them with :meth:`direction`).
        residual: ``(B,)`` relative tangent residual of each answer (its exact :math:`W^\top A`).
        iterations: ``(B,)`` dual updates each matrix took.
        lam, lam0: ``(B, n, n)`` final and closed-form multipliers.
        tangent: ``(B,)`` :math:`\|P_WG\|_F` of each normalized gradient (as computed: 0 for a zero
            gradient).
        correction: ``(B, n, n)`` :math:`(\Lambda - \Lambda_0)/\|P_WG\|_F` (:math:`\|P_WG\|_F` taken as 1
            where it is 0 or not finite): the next solve's warm start (``start``), in units of the
            tangent part, so that a gradient's normal part (which shifts :math:`\Lambda` and
            :math:`\Lambda_0` alike) does not change it.
        gap: per matrix, the certified gap of a smoothed answer (``None`` where none ran; an eigh
            answer's is :meth:`DualProblem.relative_gaps` of ``best``, computed where it is read).
        stages, evaluations, hessian_products, history: what ran (see :class:`SteepestInfo`).
        pieces: ``(W^T A, A^T A)`` ``(B, n, n)`` of a reduced answer (:meth:`DualProblem.pieces`), or ``None``.
    """

    problem: DualProblem
    best: Evaluation | None
    a: torch.Tensor | None
    residual: torch.Tensor
    iterations: torch.Tensor
    lam: torch.Tensor
    lam0: torch.Tensor
    tangent: torch.Tensor
    correction: torch.Tensor
    gap: list = field(default_factory=list)
    stages: tuple[str, ...] = ()
    evaluations: int = 0
    hessian_products: int = 0
    history: list = field(default_factory=list)
    pieces: tuple[torch.Tensor, torch.Tensor] | None = None

    def direction(self) -> torch.Tensor:
        """``(B, m, n)`` the directions, formed (two ``m·n²`` products) if they were not."""
        if self.a is None:
            with ieee_float32_matmul():
                self.a = self.problem.answer(self.best)
        return self.a


def _normalized(g: torch.Tensor) -> torch.Tensor:
    r""":math:`G/\|G\|_F` for each matrix of ``g`` ``(B, m, n)``; zero where the norm is 0 or not finite (a
    non-finite gradient gives a zero direction). The norm is that of :math:`2^{-e}G`, :math:`2^e` the
    power of two of the largest entry (float64 out of range: :func:`~manifoldlib.functional.scaling.into_safe_range`):
    no square over- or underflows it, and :math:`2^kG` gives the unit matrix of :math:`G` bit for bit."""
    if g.dtype == torch.float64:
        g = into_safe_range(g)
    else:  # a fresh tensor, then scaled in place; scales kept normal (a subnormal or huge top)
        top = torch.maximum(g.amax(dim=(-2, -1), keepdim=True), -g.amin(dim=(-2, -1), keepdim=True))
        g = g * torch.ldexp(torch.ones_like(top), -torch.frexp(top)[1].clamp(-125, 126))  # (B, 1, 1)
    norm = torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True, dtype=torch.promote_types(g.dtype, torch.float32))
    usable = torch.isfinite(norm) & (norm > 0)
    inv = torch.where(usable, norm.reciprocal(), 0.0).to(g.dtype)
    return torch.where(usable, g * inv, 0.0) if g.dtype == torch.float64 else g.mul_(inv).masked_fill_(~usable, 0.0)


def stiefel_solve(w: torch.Tensor, g: torch.Tensor, spectral: Spectral, start: torch.Tensor | None, tol: float,
                  patience: int | None, iterations: int) -> BankSolution:
    r"""The sync-free products-path solve of a Stiefel bank, written out: ``(B, m, n)`` tall points and
    gradients in the solve's dtype, ``start`` a warm-start correction (as :func:`solve_bank`'s),
    ``tol``, ``patience`` and ``iterations`` (run in full) as :func:`bb_solve`'s.

    On Stiefel :math:`W = Q` (:math:`F = I`) and the multiplier mask and normal-space metric are the
    identity: with :math:`B = W^\top G`, :math:`G_\perp = G - WB`, :math:`C = G_\perp^\top G_\perp`
    the reduced dual (:class:`~manifoldlib.optim.dual.DualProblem`) is :math:`M = B + 2\Lambda`,
    :math:`S = C + M^\top M`, :math:`R = \mathrm{ns}(S)`, :math:`K = MR`, gradient :math:`H = K + K^\top`,
    answer :math:`A = G_\perp R + WK`. It starts from :math:`\Lambda_0 = -(B + B^\top)/4` (then
    :math:`G + 2W\Lambda_0 = P_WG`) plus the warm start and takes :func:`bb_solve`'s steps, masks, stall
    counts and best iterates: the same iterates bit for bit (:class:`~manifoldlib.optim.ManifoldMuon`
    takes it for sync-free Stiefel banks unless ``DualOptions(update="bb")`` asks for that general
    solver). A square bank takes :math:`\Lambda_0`, optimal for every odd spectral map, and no
    iterations. Nothing is read back to the host.
    """
    g = _normalized(g)
    n, square = w.size(-1), w.size(-2) == w.size(-1)
    b = w.mT @ g  # (B, n, n)
    gperp = None if square else g - w @ b  # (B, m, n)
    c = torch.zeros_like(b) if square else gperp.mT @ gperp
    trace_c = torch.diagonal(c, dim1=-2, dim2=-1).sum(-1)  # (B,)
    tiny = torch.finfo(w.dtype).tiny
    lam0 = -(b + b.mT) / 4.0

    def x_norm(lam):  # (B,) ||G + 2 W Lambda||_F, as computed
        m = torch.add(b, lam, alpha=2.0)
        return ((m * m).sum(_DIMS) + trace_c).clamp_min(0).sqrt()

    def evaluate(lam):  # (residual, H, K, R, S R) at lam
        m = torch.add(b, lam, alpha=2.0)
        s = m.mT @ m if square else torch.baddbmm(c, m.mT, m)
        finite = torch.isfinite(s.sum(_DIMS))
        r = _gram_newton_schulz(s, *spectral.schedule, spectral.eps)
        sr, k = s @ r, m @ r
        h = k + k.mT
        residual = (h / 2.0).norm(dim=_DIMS) / (sr * r).sum(_DIMS).clamp_min(tiny).sqrt()
        return torch.where(finite, residual, torch.full_like(residual, float("nan"))), h, k, r, sr

    tangent = x_norm(lam0)  # (B,) ||P_W G||
    unit = torch.where(torch.isfinite(tangent) & (tangent > 0), tangent, 1.0).view(-1, 1, 1)
    lam = lam0
    if start is not None and not square:
        lam = lam0 + (0.5 * (start + start.mT)).to(lam0.dtype) * unit
    iterations = 0 if square else iterations
    residual, h, k, r, sr = evaluate(lam)
    best = (lam, k, r, sr)
    best_residual, history = residual, [residual]
    active = (residual > tol) & torch.isfinite(residual)
    mark, stall = residual.clone(), torch.zeros_like(residual, dtype=torch.long)
    counts = torch.zeros_like(stall)
    size = tangent if lam is lam0 else x_norm(lam)  # the first step: a quarter of a typical singular value of X
    size = 0.25 * torch.where(torch.isfinite(size) & (size > 0), size, 1.0) / math.sqrt(n)
    lam_prev = grad_prev = None
    for taken in range(iterations):
        if lam_prev is not None:
            size = torch.where(active, _barzilai_borwein(size, lam - lam_prev, h - grad_prev, long=bool(taken % 2)),
                               size)
        lam_prev, grad_prev = lam, h
        lam = torch.where(active.view(-1, 1, 1), lam - size.view(-1, 1, 1) * h, lam)
        residual, h, k, r, sr = evaluate(lam)
        history.append(residual)
        counts = counts + active.long()
        improved = active & ((residual < best_residual) | torch.isnan(best_residual))
        best = tuple(torch.where(improved.view(-1, 1, 1), new, old) for new, old in zip((lam, k, r, sr), best))
        best_residual = torch.where(improved, residual, best_residual)
        progress = residual < 0.9 * mark
        mark = torch.where(active & progress, residual, mark)
        stall = torch.where(active, torch.where(progress, 0, stall + 1), stall)
        still = (residual > tol) & torch.isfinite(residual)
        if patience is not None:
            still = still & (stall < patience)
        active = active & still
    lam, k, r, sr = best
    ata = r.mT @ sr
    ata = 0.5 * (ata + ata.mT)  # A^T A = R S R
    answer_residual = ((k + k.mT) / 2.0).norm(dim=_DIMS) / torch.diagonal(ata, dim1=-2, dim2=-1).sum(-1) \
        .clamp_min(tiny).sqrt()  # of A = G_perp R + W K: W^T A = K
    a = w @ k if square else torch.baddbmm(w @ k, gperp, r)
    return BankSolution(None, None, a, answer_residual, counts, lam, lam0, tangent, (lam - lam0) / unit,
                        [None] * w.size(0), ("bb",), iterations + 1, 0, history, (k, ata))


def solve_bank(w: torch.Tensor, g: torch.Tensor, manifold: MatrixConstraintManifold, options: DualOptions,
               execution: Execution, spectral: Spectral, *, start: torch.Tensor | None = None,
               multiplier: bool = False, check_point: bool = True) -> BankSolution:
    r"""Solve the dual of a bank: tall points ``w`` and gradients ``g`` ``(B, m, n)`` in the solve's dtype.

    Each ``g`` is normalized by its Frobenius norm here (after an exact power-of-two rescaling
    into range), so the multipliers refer to the normalized problem; a zero gradient gives a zero
    direction. ``start``: ``(B, n, n)`` warm start, a correction :math:`\Lambda - \Lambda_0` in units of
    the normalized gradient's tangent part (:attr:`BankSolution.correction`: multiplied by this
    gradient's and added to the closed-form start) or, with ``multiplier=True``, the multiplier itself. A sync-free solve
    forms :math:`G_\perp` always; an early-stopping one forms it, and computes :math:`W^\top W`, where
    a host read says they are needed (:class:`~manifoldlib.optim.dual.DualProblem`). Runs with IEEE
    float32 products.
    """
    with ieee_float32_matmul():
        g = _normalized(g)
        sync_free = execution.sync_free
        kappa, fallback = resolve_smoothing(options.smoothing, manifold, w.shape, exact=spectral.method == "svd")
        smooth_dtype = execution.work_dtype(w.dtype, smoothed=kappa is not None and not sync_free)
        if kappa is not None and spectral.method == "svd" and not sync_free:
            spectral = replace(spectral, path="eigh")
        if smooth_dtype != w.dtype:
            w, g = w.to(smooth_dtype), g.to(smooth_dtype)
            start = None if start is None else start.to(smooth_dtype)
        problem = DualProblem(w, g, manifold, spectral, execution, check_point=check_point,
                              reduced=True if kappa is not None else None,
                              explicit=True if sync_free else None, exact_gram=False if sync_free else None)
        lam0 = problem.initial_multiplier()
        lam = lam0
        closed_form = problem.square and manifold.square_dual == "closed-form" and kappa is None and problem.reduced
        if closed_form:  # Lambda_0 is optimal for every odd spectral map: no iterations, no warm start
            start = None
        # a correction is kept in units of the unit gradient's tangent part ||P_W G||: the multipliers
        # of G and G + W S (S in the normal space) differ by Lambda_0's shift alone, so Lambda - Lambda_0
        # of the normalized problem scales with ||P_W G|| / ||G||; in these units it carries over to a
        # step whose gradient has another normal part
        tangent = problem.x_norm(lam0, raw=True)  # (B,)
        unit = torch.where(torch.isfinite(tangent) & (tangent > 0), tangent, 1.0).view(-1, 1, 1)
        if start is not None:
            given = problem.mask(0.5 * (start + start.mT)).to(lam0.dtype)
            lam = given if multiplier else lam0 + given * unit
        tol, iterations, patience = options.tol, 0 if closed_form else options.iterations(sync_free), options.patience
        if sync_free and kappa is not None and options.max_iter is None:
            iterations *= SMOOTHED_ITERATION_FACTOR
        stages: list[str] = []
        gaps: list = [None] * w.size(0)
        history = []
        a = None
        if kappa is None or sync_free:
            if kappa is not None:  # sync-free smoothed dual: per-matrix mu, Barzilai–Borwein steps
                # mu in units of ||P_W G|| / sqrt(n) (1 / sqrt(n) for a zero or diverged G)
                scale = tangent / math.sqrt(lam0.size(-1))
                problem.smoothing = kappa * torch.where(scale > 0, scale, 1.0 / math.sqrt(lam0.size(-1)))
            if options.update == "anderson" and (spectral.path != "eigh" or sync_free or not problem.reduced):
                raise ValueError(
                    f"dual update='anderson' needs the eigh path with early stopping (its steps use the eigenbasis), "
                    f"but this solve runs the {spectral.path} path{' sync-free' if sync_free else ''} with the "
                    f"{spectral.method!r} map: set spectral='eigh' (and sync_free=False), or update='auto' or 'bb'")
            anderson = (problem.reduced and spectral.path == "eigh" and options.update != "bb"
                        and not sync_free and kappa is None)
            stages.append("anderson" if anderson else "bb")
            if anderson:
                progress = anderson_solve(problem, lam, tol, iterations, patience)
            else:
                progress = bb_solve(problem, lam, tol, iterations, patience, sync_free)
            best, counts, history = progress.best, progress.iterations, progress.history
            if fallback is not None and not sync_free:
                stalled = ~(best.residual <= tol)
                if bool(stalled.any()):
                    stages.append("smoothed")
                    counts = counts.clone()
                    parts = []
                    for i in range(w.size(0)):
                        sub_best = best.select(slice(i, i + 1))
                        if not bool(stalled[i]):
                            parts.append((sub_best, None))
                            continue
                        sub = problem.select(slice(i, i + 1))
                        start_lam = sub_best.lam if bool(torch.isfinite(sub_best.lam).all()) else lam0[i:i + 1]
                        ev, more, gaps[i], part = smoothed_solve(sub, start_lam, lam0[i:i + 1], fallback, tol,
                                                                 iterations, cold=False, gap_tol=options.gap_tol)
                        counts[i] += more
                        parts.append((ev, part))
                    if problem.reduced:
                        best = Evaluation.cat([ev.materialized() for ev, _ in parts])
                    else:  # the exact unreduced path: form every answer
                        a = torch.cat([problem.select(slice(i, i + 1)).answer(ev) if part is None else part.answer(ev)
                                       for i, (ev, part) in enumerate(parts)])
                        best = None
        else:  # smoothed from the start, one matrix at a time (Newton needs the eigenbasis)
            stages.append("smoothed")
            parts = []
            counts = torch.zeros(w.size(0), dtype=torch.long, device=w.device)
            for i in range(w.size(0)):
                sub = problem.select(slice(i, i + 1))
                ev, more, gaps[i], part = smoothed_solve(sub, lam[i:i + 1], lam0[i:i + 1], kappa, tol, iterations,
                                                         cold=start is None, gap_tol=options.gap_tol)
                counts[i] = more
                parts.append(ev)
            best = Evaluation.cat(parts)
        pieces = None
        if a is None and best.a is None:  # the reduced answer: its residual from n x n pieces
            pieces = problem.pieces(best)  # the residual from W^T A and tr(A^T A)
            residual = problem.normal_residual(pieces[0], torch.diagonal(pieces[1], dim1=-2, dim2=-1).sum(-1))[1]
        else:
            a = best.a if a is None else a
            residual = problem.tangent_residual(a)
        lam_out = best.lam if best is not None else torch.cat([ev.lam for ev, _ in parts])
        return BankSolution(problem, best, a, residual, counts, lam_out, lam0, tangent,
                            (lam_out - lam0) / unit.to(lam_out.dtype), gaps, tuple(stages),
                            problem.counters["evaluations"], problem.counters["hessian_products"], history, pieces)
