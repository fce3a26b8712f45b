r"""Steepest directions under the spectral norm, restricted to a tangent space (dual solvers).

For a gradient :math:`G` at a point :math:`W` the *steepest direction* is

.. math::

    A^\star = \operatorname*{arg\,max}_{A}\ \langle G, A\rangle
    \quad\text{s.t.}\quad \|A\|_2 \le 1,\ A \in T_W\mathcal{M},

and the optimizer steps :math:`W \leftarrow R_W(-\eta A^\star)`; equivalently :math:`-A^\star`
minimizes :math:`\langle G, A\rangle` (the convention of Muon, whose Euclidean answer is
:math:`\operatorname{msign}(G)`). The normal space is :math:`\{W\Lambda\}` with :math:`\Lambda`
symmetric (Stiefel), symmetric with zero diagonal (DGram) or diagonal (Oblique): the
manifold's :meth:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold.multiplier_mask`, so the Lagrangian dual is

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

* **Products instead of eigendecompositions on a GPU** (``spectral="products"``, the default on
  CUDA): the same :math:`R` from the Newton–Schulz preset in Gram form, about twenty ``n × n``
  products, with BB dual steps; on an H200 a 768² eigh costs about six such evaluations.
  Solves run with IEEE float32 products whatever the process's TF32 setting, and a float32 solve
  smoothed from the start runs in float64 on CUDA (cuSOLVER's float32 eigh stalls it).

``msign_method="svd"`` without smoothing runs the exact, unreduced iteration (SVD of the
``m × n`` matrix :math:`X` every step): the reference used by the tests.
"""

from __future__ import annotations

import torch

from ..functional.msign import MSIGN_METHODS, msign
from .dual_manifolds import STEEPEST_MANIFOLDS, dual_manifold
from .dual_problem import _DualProblem, _scaled_with_norm, tangent_residual
from .dual_solution import DualSolution, SteepestInfo
from .dual_solvers import (
    AUTO_SMOOTHING,
    GAP_TOL,
    _anderson_solve,
    _dual_solve,
    _resolve_smoothing,
    _smoothed_solve,
)
from .execution import SPECTRAL_PATHS, ExecutionPolicy
from .matmul_precision import ieee_float32_matmul
from .spectral_factors import gram_msign_factor, gram_msign_factor_eigh

__all__ = [
    "AUTO_SMOOTHING",
    "DEFAULT_MAX_ITER",
    "DEFAULT_TOL",
    "DUAL_UPDATES",
    "SPECTRAL_PATHS",
    "STEEPEST_MANIFOLDS",
    "DualSolution",
    "ExecutionPolicy",
    "SteepestInfo",
    "gram_msign_factor",
    "gram_msign_factor_eigh",
    "solve_dual",
    "steepest_direction",
    "tangent_residual",
]

#: Default relative tangent residual at which the dual solve stops.
DEFAULT_TOL = 1e-4
#: Default cap on dual iterations.
DEFAULT_MAX_ITER = 100
#: Plain-dual update rules of :func:`steepest_direction`.
DUAL_UPDATES = ("auto", "anderson", "bb")


def _check_inputs(w: torch.Tensor, g: torch.Tensor, manifold, tol: float, max_iter: int, patience: int | None) -> None:
    for label, t in (("G", g),) if manifold.flat else (("W", w), ("G", g)):  # W is unused when flat
        if not t.is_floating_point():
            raise ValueError(f"{label} must be a real floating-point tensor (float16, bfloat16, float32, "
                             f"float64), got dtype {t.dtype}")
    if g.dim() != 2:
        raise ValueError(f"the gradient must be a matrix (m, n), got shape {tuple(g.shape)}")
    if not manifold.flat and w.shape != g.shape:
        raise ValueError(f"W and G must have the same shape, got {tuple(w.shape)} and {tuple(g.shape)}")
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be > 0, got {tol!r}")
    if not (isinstance(max_iter, int) and max_iter >= 0):
        raise ValueError(f"max_iter must be an int >= 0, got {max_iter!r}")
    if patience is not None and not (isinstance(patience, int) and patience >= 1):
        raise ValueError(f"patience must be None or an int >= 1, got {patience!r}")
    for label, t in (("G", g),):  # a non-finite W fails the point checks
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t.sum())):
            raise ValueError(f"{label} has non-finite entries (NaN or inf); the dual needs a finite input")


def steepest_direction(
    W: torch.Tensor,
    G: torch.Tensor,
    manifold="stiefel",
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
    spectral: str = "auto",
    gap_tol: float | None = GAP_TOL,
    execution: ExecutionPolicy | None = None,
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
    * ``"oblique"`` (:math:`\operatorname{Diag}(W^\top W) = I`): :math:`\Lambda` diagonal,
      :math:`H = \operatorname{Diag}(W^\top A + A^\top W)`.
    * a :class:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold` instance: the same dual
      with that manifold's mask, factor and metric (the three above are such instances).

    ``G`` is normalized by its Frobenius norm first (the dual is not scale invariant); the
    multiplier refers to the normalized problem. A wide ``(m < n)`` input is solved transposed and
    the answer transposed back; the multiplier lives in the tall orientation (``min(m, n)`` square).

    Args:
        W: ``(m, n)`` point on the manifold (ignored for ``"euclidean"``).
        G: ``(m, n)`` gradient (or momentum).
        manifold: ``"stiefel"``, ``"dgram"``, ``"oblique"``, ``"euclidean"`` or a manifold object
            (:func:`~manifoldlib.optim.dual_manifolds.dual_manifold`).
        tol: stop once the relative tangent residual :math:`\|A - P_W A\|_F/\|A\|_F \le` ``tol``.
        max_iter: cap on dual iterations (Newton steps for a smoothed solve); the best iterate seen
            is returned.
        msign_method: ``"svd"`` (exact, full-size; for tests), or a Newton–Schulz preset
            ``"jordan5"``, ``"polar-express"``, ``"newton-schulz"``, applied exactly to the
            eigenvalues of the ``n × n`` Gram matrix (one eigh per dual iteration) or run in
            Gram form (matrix products only), as ``spectral`` says.
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
            a rank-deficient optimum that no :math:`\\operatorname{msign}` reaches, and for tall
            matrices with ``m < 2.5 n`` except square Stiefel, on either spectral path
            (:data:`~manifoldlib.optim.dual_solvers.SMOOTH_BELOW_ASPECT`: there the optimum is
            nearly rank deficient and the plain dual crawls; the threshold was measured on the
            eigen path, and such matrices are never batched); elsewhere it
            runs the plain dual (the ``msign_method`` map) and, only if that stops
            above ``tol`` (a stall or the cap: tall DGram and Stiefel instances can have
            rank-deficient optima too), continues with the smoothed dual from the best iterate
            for up to ``max_iter`` more Newton steps. ``None`` never smooths (the plain dual's
            best iterate is returned, above ``tol`` if it stalled). With
            smoothing, ``msign_method`` only selects the exact SVD-free eigen path.
        dual_update: how the plain (unsmoothed) dual moves. ``"anderson"``: approximate Newton
            steps preconditioned in the eigenbasis the iteration already computes, with Anderson
            mixing (about half the iterations of BB; needs a Newton–Schulz ``msign_method``);
            ``"bb"``: Barzilai–Borwein gradient steps (``step_size`` is their first step);
            ``"auto"`` (default): ``"anderson"`` on the eigen path with ``spectral`` resolved to
            ``"eigh"``, ``"bb"`` otherwise (``"svd"``, or the products path).
        spectral: how a plain reduced evaluation gets its spectral factor :math:`R`: ``"eigh"``
            (one ``n × n`` eigendecomposition; its eigenbasis also serves the Anderson step),
            ``"products"`` (the Newton–Schulz preset in Gram form, about twenty ``n × n``
            products and no factorization: what a GPU runs fast; dual updates by BB), or
            ``"auto"`` (default): products on a CUDA device, the eigh elsewhere
            (:meth:`~manifoldlib.optim.execution.ExecutionPolicy.resolve`). Smoothed solves always
            take the eigh (their Newton steps need the eigenbasis).
        gap_tol: with ``smoothing="auto"``, the largest certified relative duality gap
            (:attr:`SteepestInfo.gap`) of a smoothed answer: the smoothing is shrunk tenfold a stage
            (down to :data:`~manifoldlib.optim.dual_solvers.SMOOTHING_FLOOR`) until the gap is
            below it, and a solve above it is not reported converged. ``None``: keep the first
            smoothing that meets ``tol`` (what :class:`ManifoldMuon` does: a training step does not
            need the last 1% of the objective). Unused with an explicit ``smoothing`` float.
        execution: the device-dependent choices (:class:`~manifoldlib.optim.execution.ExecutionPolicy`:
            spectral path, work and search dtypes); ``None`` resolves them for ``G``'s device and
            ``spectral``. Given, it decides the spectral path, and ``spectral`` must be ``"auto"``
            or agree with it.
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
        spectral=spectral,
        gap_tol=gap_tol,
        execution=execution,
    )
    a = solution.direction().to(G.dtype)
    return (a, solution.info) if return_info else a


@ieee_float32_matmul()
def solve_dual(
    W: torch.Tensor,
    G: torch.Tensor,
    manifold="stiefel",
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
    spectral: str = "auto",
    gap_tol: float | None = GAP_TOL,
    execution: ExecutionPolicy | None = None,
) -> DualSolution:
    """:func:`steepest_direction` without forming the answer: the solved reduced dual.

    Same arguments and checks. What consumes the direction can use the reduced quantities
    instead of the ``m × n`` matrix (the Stiefel polar step of :class:`ManifoldMuon` does).
    Runs with IEEE float32 products whatever the process's TF32 setting
    (:func:`~manifoldlib.optim.matmul_precision.ieee_float32_matmul`).
    """
    manifold = dual_manifold(manifold)  # raises on an unknown name
    _check_inputs(W, G, manifold, tol, max_iter, patience)
    if gap_tol is not None and not (isinstance(gap_tol, (int, float)) and gap_tol > 0):
        raise ValueError(f"gap_tol must be None or a number > 0, got {gap_tol!r}")
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
    if execution is None:
        execution = ExecutionPolicy.resolve(G.device, spectral=spectral)
    elif spectral not in ("auto", execution.spectral):
        raise ValueError(
            f"spectral={spectral!r} disagrees with the execution policy's {execution.spectral!r}: "
            f"give the spectral path in one place"
        )
    path = execution.spectral
    if dual_update == "anderson" and path == "products":
        raise ValueError(
            f"dual_update='anderson' needs the eigenbasis of the n x n Gram matrix, but spectral={spectral!r} "
            f"resolved to 'products' on {G.device.type} (no eigendecomposition): use spectral='eigh', or "
            f"dual_update='bb' / 'auto'"
        )
    work_dtype = execution.work_dtype(G.dtype, smoothed=False)  # float32 for 16-bit input
    transposed = G.size(-2) < G.size(-1)
    g, norm = _scaled_with_norm((G.mT if transposed else G).to(work_dtype), manifold.flat)
    if manifold.flat or not bool(norm > 0):
        if msign_method == "svd":
            a = msign(g, "svd")
        else:
            r = gram_msign_factor(g.mT @ g, msign_method, ns_steps, coefficients=ns_coefficients, eps=eps)
            a = g @ r
        info = SteepestInfo(0, 0.0, True, multiplier, correction, [0.0], step_size)
        return DualSolution(info, transposed, answer=a)
    g = g / norm
    n = g.size(-1)
    kappa, fallback = _resolve_smoothing(smoothing, manifold, g.shape, exact=msign_method == "svd")
    work_dtype = execution.work_dtype(work_dtype, smoothed=kappa is not None)
    if smoothing == "auto" and gap_tol is not None and work_dtype == torch.float32:
        # a certified solve may drive the smoothing down to where a float32 eigh cannot follow
        # (24x24 DGram: stuck at a residual of 4e-3 at kappa = 2e-3): run it in float64
        work_dtype = torch.float64
    w, g = (W.mT if transposed else W).to(work_dtype), g.to(work_dtype)
    problem = _DualProblem(
        w, g, manifold, msign_method, ns_steps, ns_coefficients, eps, smoothing=kappa, policy=execution
    )
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
    certify = smoothing == "auto" and gap_tol is not None
    gap = None
    stages: list[str] = []
    if kappa is None and problem.reduced and path == "eigh" and dual_update != "bb":
        stages.append("anderson")
        lam, state, residual, iterations = _anderson_solve(problem, lam, float(tol), max_iter, history, patience)
        last_step = step_size
    elif kappa is None:
        stages.append("bb")
        lam, state, residual, iterations, last_step = _dual_solve(
            problem, lam, float(tol), max_iter, history, step_size, patience
        )
    if kappa is None:
        if fallback is not None and not residual <= tol:
            # the plain dual stalled (or diverged): its optimum is (near) rank deficient, no msign
            # of a dual iterate is tangent; the smoothed dual, started from the best iterate (the
            # closed-form start if that is not finite), has a unique smooth optimum and gets
            # there in a few Newton steps
            problem.enable_reduced()
            lam = lam if bool(torch.isfinite(lam).all()) else lam0
            stages.append("smoothed")
            lam, state, residual, more, gap = _smoothed_solve(
                problem, lam, lam0, fallback, float(tol), max_iter, history, patience, cold=False,
                gap_tol=gap_tol if certify else None,
            )
            iterations += more
    else:
        stages.append("smoothed")
        lam, state, residual, iterations, gap = _smoothed_solve(
            problem, lam, lam0, kappa, float(tol), max_iter, history, patience, cold=start is None,
            gap_tol=gap_tol if certify else None,
        )
        last_step = step_size
    converged = residual <= tol and (gap is None or not certify or gap <= gap_tol)
    info = SteepestInfo(iterations, residual, converged, lam, lam - lam0, history, last_step, gap,
                        stages=tuple(stages), evaluations=problem.evaluations,
                        hessian_products=problem.hessian_products, relaxations=tuple(problem.relaxations))
    return DualSolution(info, transposed, problem, state)
