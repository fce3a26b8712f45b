r"""Solvers of the reduced dual (:mod:`manifoldlib.optim.dual_problem`).

* :func:`_anderson_solve`: eigenbasis-preconditioned steps with Anderson mixing (the default
  plain-dual update);
* :func:`_dual_solve`: Barzilai–Borwein steps on the metric-preconditioned gradient (also the
  exact SVD path's);
* :func:`_smoothed_solve` / :func:`_newton_solve`: Newton–CG on the smoothed dual, for square
  DGram and for plain solves that stall at a rank-deficient optimum.

All keep the best iterate (:class:`_BestIterate`) and stop on ``tol``, ``max_iter`` or
``patience``. :func:`~manifoldlib.optim.steepest.solve_dual` picks among them.
"""

from __future__ import annotations

import itertools
import math

import torch

from .dual_manifolds import dual_manifold
from .dual_problem import _barzilai_borwein, _BestIterate, _DualProblem, _State

__all__ = [
    "ANDERSON_MEMORY",
    "AUTO_SMOOTHING",
    "GAP_TOL",
    "NEWTON_CG_ITER",
    "PRECONDITIONED_RELAXATION",
    "SMOOTHING_FLOOR",
    "SMOOTHING_START",
    "SMOOTH_BELOW_ASPECT",
    "VALUE_NOISE_ULPS",
]

_LINE_SEARCH_STEPS = 20
#: Rounding noise of the smoothed dual value, in units of ``eps · |value|``: below it the Armijo
#: test cannot see a predicted decrease. Measured: float32 values of 12.4 (a 512² DGram solve)
#: scattered by 1–6e-6 (1–6 ulps) between trial points whose predicted change was 1e-9.
VALUE_NOISE_ULPS = 16
#: CG iterations per Newton step of the smoothed dual.
NEWTON_CG_ITER = 40
#: Relative smoothing :math:`\kappa` that ``smoothing="auto"`` uses for square DGram matrices.
AUTO_SMOOTHING = 2e-2
#: Past steps Anderson mixing combines in the plain reduced dual.
ANDERSON_MEMORY = 2
#: Over-relaxation :math:`\omega` of the eigenbasis-preconditioned step (see
#: :func:`_preconditioned_step`); a solve drops to :math:`\omega = 1` once its residual grows.
PRECONDITIONED_RELAXATION = 1.2
#: Continuation start of a cold smoothed solve (relative :math:`\kappa`).
SMOOTHING_START = 1e-1
#: ``smoothing="auto"`` smooths from the start below this aspect ratio ``m/n`` (tall orientation;
#: square Stiefel excepted). There :math:`C = G_\perp^\top G_\perp` has rank ``m - n`` or sits at the
#: Marchenko–Pastur edge, the dual optimum is close to rank deficient and the plain dual crawls:
#: 20–40 iterations at ``m/n`` in [1.02, 2] against 4 at ``m/n = 4`` (256 columns, noisy
#: gradients); smoothing from the start took 2–7x less time there, broke even at 2.25 and lost
#: at 2.67 and above.
SMOOTH_BELOW_ASPECT = 2.5
#: Largest certified relative duality gap (:meth:`_DualProblem.relative_gap`) at which a solve
#: with ``smoothing="auto"`` counts as converged. Smoothing by :math:`\kappa` loses about
#: :math:`\kappa^{1.5}`–:math:`\kappa^2` of the objective: measured on 128×32 rank-4-plus-noise
#: instances, relative gaps of 8–9e-3 at :math:`\kappa = 2\cdot10^{-2}` and 1e-4 at
#: :math:`2\cdot10^{-3}`; so an auto solve shrinks :math:`\kappa` tenfold until the gap is below this.
GAP_TOL = 1e-3
#: Smallest relative smoothing the gap-driven continuation goes down to.
SMOOTHING_FLOOR = 2e-5


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
    step = torch.tensor(step, dtype=lam.dtype, device=lam.device)
    lam_prev = grad_prev = None
    tracker = _BestIterate(residual, lam, state)
    iterations = 0
    while not residual <= tol and iterations < max_iter:
        if tracker.stalled(patience) or math.isnan(residual):
            break  # stalled (e.g. a rank-deficient dual optimum) or diverged: keep the best iterate
        grad = h / problem.metric  # preconditioned dual gradient
        if lam_prev is not None:  # alternate the long (BB1) and short (BB2) steps
            step = _barzilai_borwein(step, lam - lam_prev, grad - grad_prev, long=bool(iterations % 2))
        lam_prev, grad_prev = lam, grad
        lam = lam - step * grad
        iterations += 1
        h, residual, state = problem.evaluate(lam)
        history.append(residual)
        tracker.record(residual, lam, state)
    residual, lam, state = tracker.best
    return lam, state, residual, iterations, float(step)


def _preconditioned_step(
    problem: _DualProblem, h: torch.Tensor, state: _State, relaxation: float = 1.0
) -> torch.Tensor:
    r"""Approximate Newton step :math:`-\mathcal{H}^{-1}H` of the reduced dual, from the eigenbasis in hand.

    With the spectral factor :math:`R = V\operatorname{diag}(\psi)V^\top` frozen, a change
    :math:`\Delta` of the multiplier changes the dual gradient :math:`H = \mathcal{N}(DK + K^\top D)`,
    :math:`K = (B + 2D\Lambda)R`, by :math:`\mathcal{N}(2D^2\Delta R + 2R\Delta D^2)`; with
    :math:`D^2` replaced by the normal-space metric :math:`(d_i^2 + d_j^2)/2` that operator is diagonal
    in the basis :math:`V`, with entries :math:`2(\psi_i + \psi_j)` after dividing by the metric.
    The step inverts it: :math:`\Delta = V\big[(V^\top (H \oslash \text{metric}) V) \oslash
    2(\psi_i + \psi_j)\big]V^\top`, four ``n × n`` products (two when the evaluation left
    :math:`V^\top HV`), in bfloat16 for a float32 solve where that is native
    (the execution policy's :attr:`~manifoldlib.optim.execution.ExecutionPolicy.search_dtype`:
    5–7% of a 3072×768 solve, the same iterations). Freezing :math:`R` drops the curvature of
    the spectral map, :math:`\langle\Delta, \mathcal{N}(\Delta)\rangle \le 0` where the gain
    :math:`\psi` decreases (its divided differences :math:`\Phi \le 0`; exactly so for the polar
    map, mostly so for a Newton–Schulz preset), so the step is too short: where the frozen
    operator is the exact one (Stiefel, :math:`D = I`) the preconditioned Jacobian has its
    spectrum in :math:`(0, 1]`, and a step over-relaxed by ``relaxation`` :math:`\omega > 1`
    converges faster (:data:`PRECONDITIONED_RELAXATION`; on DGram, where the metric stands in
    for :math:`D^2` and the diagonal is masked after the solve, the bound holds only roughly and
    :func:`_anderson_solve` falls back to :math:`\omega = 1` once the residual grows). Anderson
    mixing recovers the rest.
    """
    vec, gain = state.vec, state.gain
    low = vec.to(problem.policy.search_dtype_for(vec))
    rotated = state.rotated
    if rotated is None:
        rotated = low.mT @ (h / problem.metric).to(low.dtype) @ low  # (n, n), in the eigenbasis of S
    scale = 2.0 * (gain.unsqueeze(-1) + gain.unsqueeze(-2))
    inner = (rotated / scale.clamp_min(torch.finfo(scale.dtype).tiny)).to(low.dtype)
    step = (low @ inner @ low.mT).to(vec.dtype)
    step = problem.mask(step + step.mT)  # symmetric part, times two, on the multipliers
    return step.mul_(-0.5 * relaxation)


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
    Barzilai–Borwein steps. The steps are over-relaxed by :data:`PRECONDITIONED_RELAXATION`
    until the residual first grows; then the memory restarts (as at every growth) and the rest of
    the solve takes plain steps. Measured (``benchmarks/bench_dual_iterations.py``, six seeds,
    float64): on DGram, over-relaxation without that fallback sent a low-rank 64×16 instance to
    the cap of 100 iterations with either msign (with it: 24 and 17); on the 3072×768 GPT
    benchmark instances the residual after three steps fell by about a quarter, and the
    steady-state solves (after 25 steps) took three Anderson steps instead of four (Stiefel)
    and four instead of five (DGram).
    """
    h, residual, state = problem.evaluate(lam, rotated=True)
    history.append(residual)
    tracker = _BestIterate(residual, lam, state)
    points: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    iterations = 0
    previous = residual
    relaxation = PRECONDITIONED_RELAXATION
    while not residual <= tol and iterations < max_iter:
        if tracker.stalled(patience) or math.isnan(residual):
            break
        problem.relaxations.append(relaxation)
        delta = _preconditioned_step(problem, h, state, relaxation)
        points.append(lam)
        steps.append(delta)
        points, steps = points[-(memory + 1):], steps[-(memory + 1):]
        new = lam + delta
        if len(steps) > 1:
            new = new - _anderson_correction(points, steps, delta)
        lam = new
        iterations += 1
        h, residual, state = problem.evaluate(lam, rotated=True)
        history.append(residual)
        tracker.record(residual, lam, state)
        if not residual < previous:
            points, steps = [], []  # the mixing overshot: restart from plain preconditioned steps
            relaxation = 1.0
        previous = residual
    residual, lam, state = tracker.best
    return lam, state, residual, iterations


def _anderson_correction(points: list[torch.Tensor], steps: list[torch.Tensor], delta: torch.Tensor) -> torch.Tensor:
    r"""``(n, n)`` :math:`(\Delta\Lambda + \Delta\delta)\gamma`, :math:`\gamma = \arg\min\|\delta - \Delta\delta\,\gamma\|`.

    From the ``k <= memory`` consecutive differences of the points and steps; the ``k × k``
    normal equations (ridge 1e-10 of their trace) from inner products of the ``n × n``
    differences themselves, without stacking them into ``n² × k`` copies.
    """
    d_steps = [b - a for a, b in itertools.pairwise(steps)]
    d_points = [b - a for a, b in itertools.pairwise(points)]
    k = len(d_steps)
    gram = delta.new_empty(k, k)
    rhs = delta.new_empty(k)
    for i in range(k):
        rhs[i] = torch.vdot(d_steps[i].flatten(), delta.flatten())
        for j in range(i, k):
            gram[i, j] = gram[j, i] = torch.vdot(d_steps[i].flatten(), d_steps[j].flatten())
    ridge = 1e-10 * torch.diagonal(gram).sum() * torch.eye(k, dtype=gram.dtype, device=gram.device)
    gamma = torch.linalg.solve(gram + ridge, rhs).tolist()  # (k,)
    out = torch.zeros_like(delta)
    for i in range(k):
        out.add_(d_points[i], alpha=gamma[i]).add_(d_steps[i], alpha=gamma[i])
    return out


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

    Near the optimum the predicted decrease :math:`t|\langle H, \Delta\rangle|` falls below the
    rounding noise of the value (:data:`VALUE_NOISE_ULPS`); there a trial is accepted when it
    lowers the residual (the dual gradient) instead. With the Armijo test alone, float32 solves
    with bfloat16 search products backtracked 20 times on noise in 5 of 12 square DGram solves
    (256² and 512², six seeds each) — 20 wasted eigendecompositions each, once rejecting a trial
    already at the tolerance; the noise-aware test took 22% fewer evaluations over those
    solves (408 against 526), all converged.
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
        noise = VALUE_NOISE_ULPS * torch.finfo(lam.dtype).eps * abs(state.value)
        t = 1.0
        for _ in range(_LINE_SEARCH_STEPS):
            trial = lam + t * direction
            h_t, res_t, state_t = problem.evaluate(trial)
            if state_t.value is not None and _accept(state, state_t, residual, res_t, t * slope, noise):
                break
            t *= 0.5
        lam, h, residual, state = trial, h_t, res_t, state_t
        iterations += 1
        history.append(residual)
        tracker.record(residual, lam, state)
    residual, lam, state = tracker.best
    return lam, state, residual, iterations, None


def _accept(state: _State, trial: _State, residual: float, trial_residual: float, decrease: float, noise: float) -> bool:
    """Line-search test: Armijo on the smoothed value where it can resolve the predicted
    ``decrease`` (negative), else a lower residual."""
    if -decrease > noise:
        return trial.value <= state.value + 1e-4 * decrease
    return trial_residual < residual


def _resolve_smoothing(smoothing, manifold, shape, exact: bool = False) -> tuple[float | None, float | None]:
    """``(kappa, fallback)``: the relative smoothing :math:`\\kappa` to solve with from the start
    (``None``: the plain dual), and the one to continue with when the plain dual stalls (``None``:
    keep the plain dual's best iterate). ``exact``: the exact-SVD plain dual was asked for, which
    smooths from the start only where it cannot converge (square DGram). ``manifold``: the
    manifold object, whose ``square_dual`` says what the plain dual does on square matrices."""
    if smoothing == "auto":
        manifold = dual_manifold(manifold)
        rows, cols = shape[-2], shape[-1]  # tall orientation, rows >= cols
        square = rows == cols
        if square and manifold.square_dual == "rank-deficient":
            return AUTO_SMOOTHING, None
        closed_form = square and manifold.square_dual == "closed-form"  # the plain dual is exact
        if not exact and rows < SMOOTH_BELOW_ASPECT * cols and not closed_form:
            return AUTO_SMOOTHING, None
        return None, AUTO_SMOOTHING
    if smoothing is None:
        return None, None
    if isinstance(smoothing, (int, float)) and not isinstance(smoothing, bool) and smoothing > 0:
        return float(smoothing), None
    raise ValueError(f"smoothing must be 'auto', None or a float > 0, got {smoothing!r}")


def _smoothed_solve(problem, lam, lam0, kappa, tol, max_iter, history, patience, cold, gap_tol=None):
    r"""Newton–CG on the smoothed dual with :math:`\mu = \kappa\|P_W G\|_F/\sqrt{n}`.

    A cold start runs a continuation (first :data:`SMOOTHING_START` to ``10 tol``, then ``kappa``
    to ``tol``); a warm start (a previous step's correction, or a stalled plain dual's best
    iterate) goes straight to ``kappa`` when its residual beats the closed-form start's. With a
    ``gap_tol``, the continuation goes on, :math:`\kappa` shrunk tenfold a stage (down to
    :data:`SMOOTHING_FLOOR`), until the certified relative gap is at most ``gap_tol``. The
    iteration budget is shared.

    Returns:
        ``(lam, state, residual, iterations, gap)``, ``gap`` the relative duality gap of the answer.
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
    gap = problem.relative_gap(state)
    kept = problem.smoothing  # the smoothing of the answer kept
    while gap_tol is not None and not gap <= gap_tol and residual <= tol and iterations < max_iter:
        stage = stage / 10.0
        if stage < SMOOTHING_FLOOR:
            break
        problem.smoothing = stage * scale
        more = _newton_solve(problem, lam, tol, max_iter - iterations, history, patience)
        iterations += more[3]
        if not more[2] <= tol:
            break  # the smaller smoothing did not get to tol: keep the last answer that did
        lam, state, residual, _, _ = more
        gap, kept = problem.relative_gap(state), problem.smoothing
    problem.smoothing = kept
    return lam, state, residual, iterations, gap
