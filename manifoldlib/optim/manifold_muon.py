r"""Manifold Muon: Muon's spectral-norm steepest descent, kept on Stiefel or DGram.

One step for a matrix :math:`W` with gradient :math:`G` (all in the tall orientation):

.. math::

    B \leftarrow \mu B + (1-\mu) G,\qquad
    U = \begin{cases} (1-\mu) G + \mu B & \text{nesterov} \\ B & \text{otherwise}\end{cases},\qquad
    A = \operatorname*{arg\,max}_{\|A\|_2\le 1,\ A\in T_W} \langle U, A\rangle,\qquad
    W \leftarrow R_W(-\eta A).

Momentum is accumulated on the Euclidean gradient (exactly as :class:`torch.optim.Muon`); the
tangent space enters only through the dual solve of :func:`~manifoldlib.optim.steepest_direction`
at the *current* point, so a buffer built at older points is never transported, it is simply
re-projected by the solve. Each solve starts from the closed-form multiplier :math:`\Lambda_0` of
the new point plus the correction :math:`\Lambda - \Lambda_0` that the previous step's dual
iterations found (``state["dual_correction"]``): the closed-form part follows the point, the
learned part carries over. The dual *step size* is not carried over: the last Barzilai–Borwein
step of a converged solve is a ratio of tiny differences, and reusing it made the solve chaotic —
a 1e-15 relative change of the gradient grew to ~1e-2 in the weights within 10 steps (two
processes with all-reduced gradients then disagree). Each solve starts from the fixed step
:math:`1/(4\sqrt n)`; the iteration counts are the same (measured on 384- and 1536-row matrices),
and 10 warm-started steps now move by ~1e-10 under such a change.

With ``manifold="euclidean"`` and ``ns_dtype="bfloat16"`` the step is :class:`torch.optim.Muon`'s,
operation for operation (bfloat16 Newton–Schulz, the same learning-rate adjustment and decoupled
weight decay). Where bfloat16 products are not native (CPUs without AVX512-BF16 or AMX) that
Newton–Schulz is slow (emulated bfloat16), so the default ``ns_dtype="auto"`` takes bfloat16 only
where it is native — there it equals ``torch.optim.Muon`` too — and float32 elsewhere
(:mod:`~manifoldlib.optim.bfloat16_support`).

Learning rate for non-square matrices: on Stiefel and DGram ``adjust_lr_fn=None`` means
``"spectral"`` (no adjustment). The update has spectral norm :math:`\eta` and a Stiefel point has
spectral norm 1, so :math:`\eta` is already the relative spectral size of the step for every shape
(this is the scaling the modular-norm analysis prescribes). ``"original"`` and
``"match_rms_adamw"`` apply Muon's shape factors when asked for. On Euclidean groups ``None`` means
``"original"``, as in torch.

Retraction: by default the polar factor comes from the ``n × n`` Gram matrix
(:data:`DEFAULT_RETRACTIONS`, msign method ``"gram-eigh"``). The Gram matrix of a small step is
diagonal up to second-order terms, and its inverse square root takes a few matrix products and no
eigendecomposition (:mod:`~manifoldlib.functional.gram_rsqrt`); larger steps take the eigh.
With that default, tall matrices (``m >= 2n``) retract in the fused form of
:mod:`~manifoldlib.optim.fused_retraction`: the Gram matrix of :math:`W - \eta A` is assembled
from the solved dual's ``n × n`` pieces, two ``m·n²`` products instead of four.

Weight decay: decoupled, :math:`W \leftarrow (1 - \eta\lambda)W` before the retraction, on DGram
(it shrinks column norms, the manifold's scale freedom) and Euclidean. Stiefel has no scale
freedom, so decay there is skipped (with a polar retraction it would only rescale the step).

Distributed training (DDP): after DDP's gradient all-reduce every rank holds the same gradients.
``distributed="replicated"`` (default) lets every rank solve every matrix; ``"sharded"`` solves
each matrix on one owner rank (:func:`~manifoldlib.distributed.assign_owners`) and shares the new
matrices with one ``all_gather`` per dtype (:func:`~manifoldlib.distributed.sharded_apply`). The
momentum buffers stay replicated; the warm-start state of a matrix (``"dual_correction"``,
``"dual_iterations"``, ``"dual_residual"``) lives only on its owner until
:meth:`ManifoldMuon.consolidate_state_dict` shares it for a checkpoint. Both modes give every
rank the parameters of a single process running the same steps, bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from ..distributed import (
    STRATEGIES,
    assign_owners,
    get_rank_world,
    reject_unsupported_parameter,
    sharded_apply,
)
from ..manifolds import get_manifold
from ..retractions.base import available_retractions
from .bfloat16_support import NS_DTYPES, resolve_ns_dtype
from .concurrent_solves import resolve_workers, run_concurrently
from .fused_retraction import fused_retraction
from .matmul_precision import ieee_float32_matmul
from .dual_manifolds import STEEPEST_MANIFOLDS, dual_manifold
from .steepest import DUAL_UPDATES, SPECTRAL_PATHS, solve_dual

__all__ = [
    "ADJUST_LR_FNS",
    "DEFAULT_RETRACTIONS",
    "DISTRIBUTED_MODES",
    "MUON_MANIFOLDS",
    "ManifoldMuon",
    "manifold_muon",
]

# Defaults follow torch.optim.Muon (Keller Jordan's constants).
EPS = 1e-7
DEFAULT_A = 3.4445
DEFAULT_B = -4.7750
DEFAULT_C = 2.0315
DEFAULT_NS_STEPS = 5
DEFAULT_LR = 1e-3
DEFAULT_WEIGHT_DECAY = 0.1
DEFAULT_MOMENTUM = 0.95
DEFAULT_DUAL_TOL = 1e-3
DEFAULT_DUAL_MAX_ITER = 30
#: Stop a dual solve after this many iterations without a 10% residual improvement.
DUAL_PATIENCE = 6

#: Manifold names a ManifoldMuon group may use.
MUON_MANIFOLDS = ("euclidean",) + tuple(name for name in STEEPEST_MANIFOLDS if name != "euclidean")
#: Learning-rate adjustments (None picks "original" on Euclidean groups, "spectral" otherwise).
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral")
#: Default retraction and its options per manifold: both take their polar factor from the n x n
#: Gram matrix T (two m·n² products against about ten for convergent Newton–Schulz). For a small
#: step T is diagonal up to O(η²) and T^{-1/2} costs one to four n x n products
#: (functional.gram_rsqrt: a Taylor series when T is close to a multiple of I — Stiefel —, chord
#: iterations when its diagonal is graded — DGram, whose input Y·diag(‖y_j‖) has the squared
#: spread of the column norms); otherwise one eigh, whose eigenvalues give κ²ε and trigger a
#: refining pass (> 1e-6) or a float64 SVD (> 1e-4). A wide spread costs time, never accuracy.
#: (Each manifold class names its own: ``muon_retraction``; Oblique: column normalization.)
DEFAULT_RETRACTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    name: dual_manifold(name).muon_retraction for name in MUON_MANIFOLDS
}
#: Dual-solve msign methods; "ns" is the group's own Newton–Schulz (ns_coefficients, ns_steps).
DUAL_MSIGN_METHODS = ("ns", "jordan5", "polar-express", "newton-schulz", "svd")
#: ``distributed`` modes: every rank solves every matrix, or each matrix on its owner rank.
DISTRIBUTED_MODES = ("replicated", "sharded")
#: Per-matrix state that only the owner keeps in sharded mode.
OWNER_STATE_KEYS = ("dual_correction", "dual_iterations", "dual_residual")


def _zeropower(
    grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """Muon's Newton–Schulz in ``dtype``; in bfloat16 step for step as :class:`torch.optim.Muon` runs it."""
    a, b, c = ns_coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T  # (k, k), k = min(m, n)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, flat: bool, shape: torch.Size) -> float:
    rows, cols = shape[0], shape[1]
    fn = adjust_lr_fn if adjust_lr_fn is not None else ("original" if flat else "spectral")
    if fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _validate_group_options(group: MutableMapping) -> None:
    """Raise ``ValueError`` naming the option and the accepted values."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element, got {lr.numel()} elements")
    if not 0.0 <= float(lr):
        raise ValueError(f"lr must be >= 0, got {float(lr)}")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
    if not group["eps"] > 0.0:
        raise ValueError(f"eps must be > 0, got {group['eps']}")
    steps = group["ns_steps"]
    if not (isinstance(steps, int) and 0 <= steps < 100):
        raise ValueError(f"ns_steps must be an int in [0, 100), got {steps!r}")
    coeffs = group["ns_coefficients"]
    if len(tuple(coeffs)) != 3:
        raise ValueError(f"ns_coefficients must be three floats (a, b, c), got {coeffs!r}")
    fn = group["adjust_lr_fn"]
    if fn is not None and fn not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be None or one of {', '.join(ADJUST_LR_FNS)}, got {fn!r}")
    manifold = group["manifold"]
    if manifold not in MUON_MANIFOLDS:
        raise ValueError(f"unknown manifold {manifold!r}; valid: {', '.join(MUON_MANIFOLDS)}")
    retraction = group["retraction"]
    if retraction is not None and retraction not in available_retractions(manifold):
        raise ValueError(
            f"unknown {manifold} retraction {retraction!r}; valid: {', '.join(available_retractions(manifold))}"
        )
    method = group["msign_method"]
    if method not in DUAL_MSIGN_METHODS:
        raise ValueError(f"msign_method must be one of {', '.join(DUAL_MSIGN_METHODS)}, got {method!r}")
    if not (isinstance(group["dual_tol"], (int, float)) and group["dual_tol"] > 0):
        raise ValueError(f"dual_tol must be > 0, got {group['dual_tol']!r}")
    cap = group["dual_max_iter"]
    if not (isinstance(cap, int) and cap >= 0):
        raise ValueError(f"dual_max_iter must be an int >= 0, got {cap!r}")
    smoothing = group.get("dual_smoothing", "auto")
    if not (
        smoothing is None
        or smoothing == "auto"
        or (isinstance(smoothing, (int, float)) and not isinstance(smoothing, bool) and smoothing > 0)
    ):
        raise ValueError(f"dual_smoothing must be 'auto', None or a number > 0, got {smoothing!r}")
    update = group.get("dual_update", "auto")
    if update not in DUAL_UPDATES:
        raise ValueError(f"dual_update must be one of {', '.join(DUAL_UPDATES)}, got {update!r}")
    if update == "anderson" and method == "svd":
        raise ValueError("dual_update='anderson' needs a Newton-Schulz msign_method, got msign_method='svd'")
    ns_dtype = group.get("ns_dtype", "auto")
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {', '.join(NS_DTYPES)}, got {ns_dtype!r}")
    spectral = group.get("dual_spectral", "auto")
    if spectral not in SPECTRAL_PATHS:
        raise ValueError(f"dual_spectral must be one of {', '.join(SPECTRAL_PATHS)}, got {spectral!r}")
    if update == "anderson" and spectral == "products":
        raise ValueError(
            "dual_update='anderson' needs the eigenbasis of the dual's Gram matrix, got dual_spectral='products' "
            "(no eigendecomposition): use dual_update='auto' or 'bb'"
        )


def _group_manifold(group: MutableMapping):
    """The manifold object of a group, built from its plain-data options (once per distinct options)."""
    name = group["manifold"]
    default_name, default_opts = DEFAULT_RETRACTIONS[name]
    retraction = group["retraction"] or default_name
    options = dict(group.get("retraction_options") or {})
    if group["retraction"] is None:
        options = {**default_opts, **options}
    try:
        return _manifold_for(name, retraction, tuple(sorted(options.items())))
    except TypeError:  # an unhashable option value: build it afresh
        return get_manifold(name, retraction=retraction, **options)


@functools.lru_cache(maxsize=64)
def _manifold_for(name: str, retraction: str, options: tuple):
    return get_manifold(name, retraction=retraction, **dict(options))


def _tall(t: Tensor) -> Tensor:
    return t.mT if t.size(-2) < t.size(-1) else t


def _check_finite_gradients(group: MutableMapping, params: list[Tensor], grads: list[Tensor]) -> None:
    """Raise ``ValueError`` naming the first parameter of ``group`` whose gradient has a NaN or inf.

    One reduction per gradient, stacked, and one host synchronization per group: the sum of a
    tensor is finite exactly when its entries are (short of a float32 overflow of finite sums,
    which would also break the step). Called before any momentum buffer or parameter changes.
    """
    sums = torch.stack([g.sum(dtype=torch.float32) for g in grads])
    if bool(torch.isfinite(sums).all()):
        return
    bad = int((~torch.isfinite(sums)).nonzero()[0])
    p = params[bad]
    index = next(i for i, q in enumerate(group["params"]) if q is p)
    names = group.get("param_names")
    name = f" {names[index]!r}" if names is not None and index < len(names) else ""
    raise ValueError(
        f"ManifoldMuon: the gradient of parameter{name} (index {index} in its group, shape "
        f"{tuple(p.shape)}, manifold {group['manifold']!r}) has non-finite entries (NaN or inf); "
        f"no parameter or momentum buffer was changed this step"
    )


def _momentum_update(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Update the momentum buffer in place; return the update the step uses (every rank)."""
    if grad.ndim != 2:
        raise ValueError(f"ManifoldMuon needs 2-D gradients, got shape {tuple(grad.shape)}")
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def _solve_one(
    param: Tensor,
    update: Tensor,
    state: dict,
    *,
    lr: float,
    weight_decay: float,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    manifold: str,
    manifold_obj,
    msign_method: str,
    dual_tol: float,
    dual_max_iter: int,
    warm_start: bool,
    dual_smoothing: str | float | None = "auto",
    dual_update: str = "auto",
    dual_spectral: str = "auto",
    fuse_retraction: bool = False,
    ns_dtype: str = "auto",
) -> Tensor:
    """The new value of one matrix, in ``param``'s own orientation; writes only ``state``.

    ``fuse_retraction``: the group retracts with its default Gram-form retraction, which
    :func:`~manifoldlib.optim.fused_retraction.fused_retraction` can form from the solved dual.

    ``param`` is read, never written (in sharded mode it is also the owner's input to
    :func:`~manifoldlib.distributed.sharded_apply`).
    """
    adjusted = _adjusted_lr(lr, adjust_lr_fn, manifold_obj.flat, param.shape)
    if manifold_obj.flat:
        direction = _zeropower(update, ns_coefficients, ns_steps, eps, resolve_ns_dtype(ns_dtype, update.device))
        state["dual_iterations"] = 0
        state["dual_residual"] = 0.0
        return param.mul(1 - lr * weight_decay).add_(direction, alpha=-adjusted)
    method = "jordan5" if msign_method == "ns" else msign_method
    coefficients = tuple(ns_coefficients) if msign_method == "ns" else None
    steps = ns_steps if msign_method in ("ns", "jordan5") else None
    w = _tall(param)
    # full float32 products: TF32 would blur a 1e-3 residual and the retraction's constraint
    with ieee_float32_matmul():
        solution = solve_dual(
            w,
            _tall(update),
            manifold_obj,
            tol=dual_tol,
            max_iter=dual_max_iter,
            msign_method=method,
            ns_steps=steps,
            ns_coefficients=coefficients,
            eps=eps,
            correction=state.get("dual_correction") if warm_start else None,
            patience=DUAL_PATIENCE,
            smoothing=dual_smoothing,
            dual_update=dual_update,
            spectral=dual_spectral,
            gap_tol=None,  # the first smoothing that meets dual_tol: a training step needs no certificate
        )
        info = solution.info
        state["dual_correction"] = info.correction
        state["dual_iterations"] = int(info.iterations)
        state["dual_residual"] = float(info.residual)
        decay = 1 - lr * weight_decay if (manifold_obj.decays and weight_decay) else 1.0
        new = None
        if fuse_retraction and solution.problem is not None:  # the retraction from n x n pieces (tall matrices)
            new = fused_retraction(solution.problem, solution.state, adjusted, decay)
        if new is None:
            base = w.mul(decay) if decay != 1.0 else w
            new = manifold_obj.retr(base, solution.direction().to(w.dtype).mul(-adjusted))  # tall orientation
        new = new.to(w.dtype)
    return new.mT if param.size(-2) < param.size(-1) else new


def _solve_into(param: Tensor, update: Tensor, state: dict, options: dict[str, Any]) -> None:
    """:func:`_solve_one`, written into ``param`` (what a concurrent worker runs)."""
    param.copy_(_solve_one(param, update, state, **options))


def _side_by_side(items: list, indices, workers: int) -> list[int]:
    """The ``indices`` whose items a step solves side by side: Stiefel/DGram ones when ``workers > 1``."""
    return [i for i in indices if workers > 1 and not items[i][3]["manifold_obj"].flat]


def _run_side_by_side(tasks: list, items: list, indices: list[int], workers: int) -> list:
    """``tasks`` (one per ``items[i]``, ``i`` in ``indices``) on the solve pool, IEEE float32 held
    here so that the workers' own precision contexts write nothing."""
    if not tasks:
        return []
    with ieee_float32_matmul():
        return run_concurrently(tasks, [tuple(items[i][0].shape) for i in indices], workers)


def manifold_muon(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_bufs: list[Tensor],
    states: list[dict],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    manifold: str,
    manifold_obj,
    msign_method: str,
    dual_tol: float,
    dual_max_iter: int,
    warm_start: bool,
    dual_smoothing: str | float | None = "auto",
    dual_update: str = "auto",
    dual_spectral: str = "auto",
    fuse_retraction: bool = False,
    ns_dtype: str = "auto",
) -> None:
    r"""Functional core of :class:`ManifoldMuon`: one step for a list of matrices of one group.

    ``fuse_retraction=True`` declares ``manifold_obj`` to carry the default Gram-form retraction
    (:data:`DEFAULT_RETRACTIONS`); tall matrices then take it in the fused form of
    :mod:`~manifoldlib.optim.fused_retraction` (the same point to rounding, two ``m·n²`` products
    fewer).

    ``states[i]`` is the optimizer state of ``params[i]``; the dual correction (``"dual_correction"``),
    the dual iterations (``"dual_iterations"``) and residual (``"dual_residual"``) of this step are
    written there.
    """
    options = {
        "lr": float(lr),
        "weight_decay": weight_decay,
        "ns_coefficients": ns_coefficients,
        "ns_steps": ns_steps,
        "eps": eps,
        "adjust_lr_fn": adjust_lr_fn,
        "manifold": manifold,
        "manifold_obj": manifold_obj,
        "msign_method": msign_method,
        "dual_tol": dual_tol,
        "dual_max_iter": dual_max_iter,
        "warm_start": warm_start,
        "dual_smoothing": dual_smoothing,
        "dual_update": dual_update,
        "dual_spectral": dual_spectral,
        "fuse_retraction": fuse_retraction,
        "ns_dtype": ns_dtype,
    }
    for param, grad, buf, state in zip(params, grads, momentum_bufs, states):
        update = _momentum_update(grad, buf, momentum, nesterov)
        param.copy_(_solve_one(param, update, state, **options))


def _solve_options(group: MutableMapping) -> dict[str, Any]:
    """The keyword options of :func:`_solve_one` for one parameter group."""
    return {
        "lr": float(group["lr"]),
        "weight_decay": group["weight_decay"],
        "ns_coefficients": tuple(group["ns_coefficients"]),
        "ns_steps": group["ns_steps"],
        "eps": group["eps"],
        "adjust_lr_fn": group["adjust_lr_fn"],
        "manifold": group["manifold"],
        "manifold_obj": _group_manifold(group),
        "msign_method": group["msign_method"],
        "dual_tol": group["dual_tol"],
        "dual_max_iter": group["dual_max_iter"],
        "warm_start": group["warm_start"],
        "dual_smoothing": group.get("dual_smoothing", "auto"),
        "dual_update": group.get("dual_update", "auto"),
        "dual_spectral": group.get("dual_spectral", "auto"),
        "fuse_retraction": group["retraction"] is None and not group.get("retraction_options"),
        "ns_dtype": group.get("ns_dtype", "auto"),
    }


class ManifoldMuon(Optimizer):
    r"""Muon on Stiefel, DGram or Euclidean space, per parameter group.

    Args:
        params: parameters or parameter groups (2-D matrices only).
        lr: learning rate :math:`\eta` (default ``1e-3``, as torch.optim.Muon).
        weight_decay: decoupled weight decay :math:`\lambda` (default ``0.1``; skipped on Stiefel).
        momentum: momentum factor :math:`\mu \in [0, 1)` (default ``0.95``).
        nesterov: Nesterov momentum (default ``True``).
        ns_coefficients: Newton–Schulz ``(a, b, c)`` (default Muon's quintic).
        eps: added to the Newton–Schulz normalizing norm (default ``1e-7``).
        ns_steps: Newton–Schulz steps (default 5).
        adjust_lr_fn: ``None``, ``"original"``, ``"match_rms_adamw"`` or ``"spectral"`` (see the
            module docstring; ``None`` is ``"original"`` on Euclidean groups, ``"spectral"`` else).
        manifold: ``"euclidean"`` (default), ``"stiefel"``, ``"dgram"`` or ``"oblique"``.
        retraction: a registered retraction name of that manifold; ``None`` picks
            :data:`DEFAULT_RETRACTIONS` (Stiefel: polar; DGram: alternating; both take their polar
            factor from the ``n × n`` Gram matrix — products only for a small step, else its
            eigendecomposition, which checks its own error and falls back to a float64 SVD).
        retraction_options: plain-data options of the retraction (e.g. ``{"method": "svd"}``).
        msign_method: msign inside the dual solve: ``"ns"`` (the group's Newton–Schulz:
            ``ns_coefficients`` and ``ns_steps``), ``"jordan5"``, ``"polar-express"``,
            ``"newton-schulz"`` or ``"svd"`` (exact, slow). Default ``"ns"``: the dual sees the same
            msign Muon uses, and its smoothing of tiny singular values helps the dual converge.
        dual_tol: relative tangent residual at which the dual solve stops (default ``1e-3``).
        dual_max_iter: cap on dual iterations per step (default 30).
        dual_smoothing: smoothing of the dual solve (see
            :func:`~manifoldlib.optim.steepest_direction`): ``"auto"`` (default: the smoothed
            Newton–CG dual for square DGram matrices, whose plain dual stalls at a residual of
            ~1e-1; converged but costly at large n), ``None`` (plain dual everywhere, cheap), or a
            number > 0 (smoothing strength for every shape). Elsewhere ``"auto"`` continues a
            stalled plain dual on the smoothed one.
        dual_update: steps of the plain dual: ``"auto"`` (default; ``"anderson"`` on the eigh
            path, ``"bb"`` with ``msign_method="svd"`` or on the products path), ``"anderson"``
            (eigenbasis-preconditioned approximate Newton steps with Anderson mixing) or ``"bb"``
            (Barzilai–Borwein gradient steps).
        dual_spectral: how a plain dual evaluation gets its spectral factor: ``"auto"`` (default:
            ``"products"`` on CUDA, ``"eigh"`` elsewhere), ``"eigh"`` (one ``n × n``
            eigendecomposition per evaluation) or ``"products"`` (Newton–Schulz in Gram form,
            about twenty ``n × n`` products: on an H200 a 768² eigh costs 8 ms, the products
            1.1 ms). Smoothed solves (square DGram) take the eigh either way.
        ns_dtype: the dtype of the Euclidean groups' Newton–Schulz: ``"auto"`` (default:
            bfloat16 where bfloat16 products are native, float32 elsewhere:
            :func:`~manifoldlib.optim.bfloat16_support.native_bfloat16`), ``"bfloat16"``
            (always, as :class:`torch.optim.Muon`: with it the Euclidean steps equal
            ``torch.optim.Muon``'s to 1e-6 on any device), or ``"float32"``. On a CPU without
            AVX512-BF16 or AMX bfloat16 products are emulated, 40–80 times slower than float32
            at 768 columns. Stiefel and DGram solves do not use it (they run in the parameter's
            dtype, float32 for 16-bit parameters).
        warm_start: start each dual solve from the previous step's multiplier (default ``True``).
        project_init: project every parameter onto its group's manifold now (default ``True``).
        distributed: ``"replicated"`` (default; every rank solves every matrix, nothing to set
            up beyond DDP) or ``"sharded"`` (each matrix solved by one owner rank, the results
            shared with one ``all_gather`` per dtype every step; call
            :meth:`consolidate_state_dict` on every rank before rank 0 saves
            :meth:`state_dict`). Outside a distributed job both are the single-process step.
        process_group: the group to shard over (``None``: the default group).
        shard_strategy: owner assignment of :func:`~manifoldlib.distributed.assign_owners`,
            ``"size"`` (default, balances the solve cost) or ``"round-robin"``.
        workers: how many Stiefel/DGram matrices to solve at once on CPU threads
            (:mod:`~manifoldlib.optim.concurrent_solves`): ``"auto"`` (default: as many as
            ``torch.get_num_threads()`` when there are that many, they are not small (about
            128 wide and up) and their estimated costs split evenly, else one at a time), or an
            int ``>= 1`` (1: one at a time, the calling thread's settings). With ``k > 1``
            workers each matrix runs with
            ``torch.get_num_threads() // k`` intra-op threads, so its result is that of a
            one-at-a-time step at that thread count; Euclidean groups and non-CPU matrices
            always run one at a time in the calling thread. On the 2-core development machine
            a GPT-small block's Stiefel step took 0.82–0.86 of its one-at-a-time time
            (``benchmarks/bench_concurrent_solves.py``).

    Group options are plain data (names, numbers, dicts), so ``state_dict()`` round-trips through
    ``torch.load(weights_only=True)``. Wide matrices are handled in their tall orientation: a
    ``(256, 1024)`` weight on Stiefel has orthonormal *rows*.

    Parameters must be whole tensors: DTensor (FSDP2, tensor parallel) and FSDP1-flattened
    parameters raise :class:`~manifoldlib.distributed.UnsupportedParameterError` here, since a
    manifold step on a shard would be silently wrong. ``distributed``, ``process_group``,
    ``shard_strategy`` and ``workers`` are attributes of the optimizer, not group options.

    Example:
        >>> opt = ManifoldMuon([{"params": [w], "manifold": "stiefel"}], lr=0.02)  # doctest: +SKIP
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = DEFAULT_LR,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        momentum: float = DEFAULT_MOMENTUM,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        manifold: str = "euclidean",
        retraction: str | None = None,
        retraction_options: dict | None = None,
        msign_method: str = "ns",
        dual_tol: float = DEFAULT_DUAL_TOL,
        dual_max_iter: int = DEFAULT_DUAL_MAX_ITER,
        warm_start: bool = True,
        dual_smoothing: str | float | None = "auto",
        dual_update: str = "auto",
        dual_spectral: str = "auto",
        ns_dtype: str = "auto",
        project_init: bool = True,
        distributed: str = "replicated",
        process_group=None,
        shard_strategy: str = "size",
        workers: int | str = "auto",
    ) -> None:
        resolve_workers(workers, [])  # raises on a bad value
        if distributed not in DISTRIBUTED_MODES:
            raise ValueError(
                f"distributed must be one of {', '.join(DISTRIBUTED_MODES)}, got {distributed!r}"
            )
        if shard_strategy not in STRATEGIES:
            raise ValueError(
                f"shard_strategy must be one of {', '.join(STRATEGIES)}, got {shard_strategy!r}"
            )
        self.distributed = distributed
        self.process_group = process_group
        self.shard_strategy = shard_strategy
        self.workers = workers
        self._owner_cache: tuple[tuple[int, ...], int, dict[int, int]] | None = None
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "manifold": manifold,
            "retraction": retraction,
            "retraction_options": dict(retraction_options or {}),
            "msign_method": msign_method,
            "dual_tol": dual_tol,
            "dual_max_iter": dual_max_iter,
            "warm_start": warm_start,
            "dual_smoothing": dual_smoothing,
            "dual_update": dual_update,
            "dual_spectral": dual_spectral,
            "ns_dtype": ns_dtype,
        }
        _validate_group_options(defaults)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _validate_group_options(group)
            _group_manifold(group)  # fails early on bad retraction options
            names = group.get("param_names") or [None] * len(group["params"])
            for p, name in zip(group["params"], names):
                reject_unsupported_parameter(p, name)
                if p.ndim != 2:
                    raise ValueError(
                        f"ManifoldMuon only takes 2-D matrices; a parameter of shape {tuple(p.shape)} "
                        f"is in a group with manifold {group['manifold']!r}"
                    )
                if torch.is_complex(p):
                    raise ValueError("ManifoldMuon does not support complex parameters")
        if project_init:
            self.project_parameters()

    @torch.no_grad()
    def project_parameters(self) -> None:
        """Move every parameter onto its group's manifold (no-op on Euclidean groups).

        Raises:
            ValueError: naming the parameter, for an all-zero matrix (a zero-initialized layer:
                every Stiefel point is equally near, and DGram has none) and for a DGram matrix
                without full column rank.
        """
        for group in self.param_groups:
            manifold = _group_manifold(group)
            if manifold.flat:
                continue
            names = group.get("param_names") or [None] * len(group["params"])
            for index, (p, name) in enumerate(zip(group["params"], names)):
                label = repr(name) if name is not None else f"#{index} of its group"
                if not bool(p.detach().ne(0).any()):
                    raise ValueError(
                        f"parameter {label} of shape {tuple(p.shape)} is all zeros and cannot be "
                        f"projected onto {group['manifold']}: initialize it with nonzero values (e.g. "
                        f"torch.nn.init.orthogonal_) or assign it to 'euclidean' / AdamW"
                    )
                w = _tall(p)
                work = w.to(torch.float64) if w.dtype in (torch.float16, torch.bfloat16) else w
                try:
                    with ieee_float32_matmul():
                        w.copy_(manifold.projx(work))
                except ValueError as err:
                    raise ValueError(f"parameter {label} of shape {tuple(p.shape)}: {err}") from err

    def _init_group(
        self,
        group: MutableMapping,
        params_with_grad: list[Tensor],
        grads: list[Tensor],
        momentum_bufs: list[Tensor],
        states: list[dict],
    ) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("ManifoldMuon does not support sparse gradients")
            params_with_grad.append(p)
            grads.append(p.grad)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            momentum_bufs.append(state["momentum_buffer"])
            states.append(state)

    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def owners(self) -> dict[int, int]:
        """``id(param) -> owner rank`` in sharded mode, over every parameter of every group.

        Computed from the shapes alone (the same on every rank) and cached, so each matrix
        keeps its owner, and its owner-only warm-start state, from step to step.
        """
        params = self._all_params()
        key = tuple(id(p) for p in params)
        _, world_size = get_rank_world(self.process_group)
        if self._owner_cache is None or self._owner_cache[:2] != (key, world_size):
            ranks = assign_owners([tuple(p.shape) for p in params], world_size, self.shard_strategy)
            self._owner_cache = (key, world_size, dict(zip(key, ranks)))
        return self._owner_cache[2]

    def _resolved_workers(self, items: list) -> int:
        """Solves to run at once this step (:func:`~manifoldlib.optim.concurrent_solves.resolve_workers`).

        Decided from every Stiefel/DGram matrix of the step, not only this rank's, so all ranks
        (and a single process) solve each matrix with the same intra-op thread count. CPU only:
        with a matrix on another device every solve runs in the calling thread.
        """
        solved = [p for p, _, _, options in items if not options["manifold_obj"].flat]
        if any(p.device.type != "cpu" for p in solved):
            return 1
        return resolve_workers(self.workers, [tuple(p.shape) for p in solved])

    def _sharded(self) -> bool:
        return self.distributed == "sharded" and get_rank_world(self.process_group)[1] > 1

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the loss (optional).

        In sharded mode this is a collective: every rank of the group must call it.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items: list[tuple[Tensor, Tensor, dict, dict[str, Any]]] = []
        gathered = []
        for group in self.param_groups:
            params_with_grad: list[Tensor] = []
            grads: list[Tensor] = []
            momentum_bufs: list[Tensor] = []
            states: list[dict] = []
            self._init_group(group, params_with_grad, grads, momentum_bufs, states)
            if params_with_grad:
                _check_finite_gradients(group, params_with_grad, grads)  # before any buffer moves
                gathered.append((group, params_with_grad, grads, momentum_bufs, states))
        for group, params_with_grad, grads, momentum_bufs, states in gathered:
            options = _solve_options(group)
            for p, grad, buf, state in zip(params_with_grad, grads, momentum_bufs, states):
                update = _momentum_update(grad, buf, group["momentum"], group["nesterov"])
                items.append((p, update, state, options))
        workers = self._resolved_workers(items)
        if not self._sharded():
            side = _side_by_side(items, range(len(items)), workers)
            pooled = set(side)
            for i, (p, update, state, options) in enumerate(items):  # the rest (Euclidean: Muon's step) here
                if i not in pooled:
                    p.copy_(_solve_one(p, update, state, **options))
            _run_side_by_side([functools.partial(_solve_into, *items[i]) for i in side], items, side, workers)
            return loss
        owners = self.owners()
        rank = get_rank_world(self.process_group)[0]
        mine = _side_by_side(items, [i for i, item in enumerate(items) if owners[id(item[0])] == rank], workers)
        tasks = [functools.partial(_solve_one, items[i][0], items[i][1], items[i][2], **items[i][3]) for i in mine]
        precomputed = dict(zip(mine, _run_side_by_side(tasks, items, mine, workers)))  # before the exchange

        def solve(i: int, p: Tensor) -> Tensor:
            if i in precomputed:
                return precomputed.pop(i)
            _, update, state, options = items[i]
            return _solve_one(p, update, state, **options)

        new = sharded_apply(
            [p for p, _, _, _ in items],
            solve,
            process_group=self.process_group,
            owners=[owners[id(p)] for p, _, _, _ in items],
        )
        for (p, _, _, _), value in zip(items, new):
            p.copy_(value)
        return loss

    @torch.no_grad()
    def consolidate_state_dict(self) -> None:
        """Give every rank the owner-only state of every matrix (sharded mode; a collective).

        Every rank of the group must call it, then any rank (usually rank 0) may call
        :meth:`state_dict` and get the complete state, as one process would. A no-op in
        replicated mode and outside a distributed job. Non-owners keep the copies they
        receive; only the owner's copy is updated by later steps, and a later
        :meth:`load_state_dict` on every rank restores every matrix's state everywhere.
        """
        if not self._sharded():
            return
        params = self._all_params()
        owners = self.owners()
        ranks = [owners[id(p)] for p in params]
        corrections = []  # (k, k) per matrix, k = min(m, n), in the dual solve's dtype
        for p in params:
            k = min(p.shape)
            dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
            corrections.append(torch.zeros(k, k, dtype=dtype, device=p.device))
        # [has state, has correction, iterations, residual] per matrix
        scalars = [torch.zeros(4, dtype=torch.float64, device=p.device) for p in params]

        def owned_correction(i: int, template: Tensor) -> Tensor:
            value = self.state.get(params[i], {}).get("dual_correction")
            return template if value is None else value.to(template.dtype)

        def owned_scalars(i: int, template: Tensor) -> Tensor:
            state = self.state.get(params[i], {})
            if "dual_iterations" not in state:
                return template
            return torch.tensor(
                [
                    1.0,
                    float(state.get("dual_correction") is not None),
                    float(state["dual_iterations"]),
                    float(state["dual_residual"]),
                ],
                dtype=torch.float64,
                device=template.device,
            )

        shared_corrections = sharded_apply(
            corrections, owned_correction, process_group=self.process_group, owners=ranks
        )
        shared_scalars = sharded_apply(
            scalars, owned_scalars, process_group=self.process_group, owners=ranks
        )
        euclidean = {
            id(p) for group in self.param_groups if _group_manifold(group).flat
            for p in group["params"]
        }
        for p, correction, values in zip(params, shared_corrections, shared_scalars):
            has_state, has_correction, iterations, residual = values.tolist()
            if not has_state:
                continue
            state = self.state[p]
            state["dual_iterations"] = int(iterations)
            state["dual_residual"] = residual
            if id(p) not in euclidean:  # a dual solve writes the correction, possibly None
                state["dual_correction"] = correction.clone() if has_correction else None
