r"""The functional core of Manifold Muon: Muon's spectral-norm steepest descent, kept on a manifold.

:func:`manifold_muon` is the step :class:`~manifoldlib.optim.ManifoldMuon` runs, and the only
implementation of it.

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
where it is native — there it equals ``torch.optim.Muon`` too — and float32 elsewhere.

Device-dependent choices (that dtype, the dual's spectral path and search precision, CPU solve
concurrency, batching) come in one :class:`~manifoldlib.optim.execution.ExecutionPolicy`, resolved
once per step by the caller; nothing below asks the device again. Where the policy batches (the
products path), the group's same-shape matrices are solved as one batched dual
(:mod:`~manifoldlib.optim.batched_step`) and each then retracted as below; what the batched solve
does not converge, and everything else, takes the per-matrix solve.

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

Weight decay: decoupled, :math:`W \leftarrow (1 - \eta\lambda)W` before the retraction, where the
manifold has a scale freedom (``decays``: DGram's column norms, Euclidean). Stiefel and Oblique
have none, so decay there is skipped (with a polar retraction it would only rescale the step).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from ..distributed import get_rank_world, sharded_apply
from ..functional.scaling import into_safe_range
from .batched_step import solve_batched
from .concurrent_solves import run_concurrently
from .dual_manifolds import dual_manifold
from .dual_options import DualOptions
from .execution import ExecutionPolicy
from .layouts import check_layout, tall
from .matmul_precision import ieee_float32_matmul
from .muon_finish import adjusted_lr, apply_solution, dual_msign
from .steepest import solve_dual

__all__ = ["ADJUST_LR_FNS", "DUAL_PATIENCE", "manifold_muon"]

#: Learning-rate adjustments (None picks "original" on Euclidean groups, "spectral" otherwise).
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral")
#: Stop a dual solve after this many iterations without a 10% residual improvement.
DUAL_PATIENCE = 6


def _zeropower(
    grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """Muon's Newton–Schulz in ``dtype``; in bfloat16 step for step as :class:`torch.optim.Muon` runs it."""
    a, b, c = ns_coefficients
    if torch.finfo(grad.dtype).max > torch.finfo(dtype).max:  # float64 into float32/bfloat16
        # a large gradient scaled down by a power of two (exact, and the normalization below
        # removes it), so that a finite float64 gradient beyond float32's range is not cast to inf
        grad = into_safe_range(grad, up=False)
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
    manifold,
    dual: DualOptions,
    fuse_retraction: bool,
    execution: ExecutionPolicy,
    layout: str,
) -> Tensor:
    """The new value of one matrix, in ``param``'s own orientation; writes only ``state``.

    ``param`` is read, never written (in sharded mode it is also the owner's input to
    :func:`~manifoldlib.distributed.sharded_apply`).
    """
    adjusted = adjusted_lr(lr, adjust_lr_fn, manifold.flat, param.shape, layout)
    if manifold.flat:
        direction = _zeropower(update, ns_coefficients, ns_steps, eps, execution.ns_dtype)
        state["dual_iterations"] = 0
        state["dual_residual"] = 0.0
        return param.mul(1 - lr * weight_decay).add_(direction, alpha=-adjusted)
    method, steps, coefficients = dual_msign(dual, ns_steps, ns_coefficients)
    # full float32 products: TF32 would blur a 1e-3 residual and the retraction's constraint
    with ieee_float32_matmul():
        solution = solve_dual(
            tall(param, layout),
            tall(update, layout),
            manifold,
            tol=dual.tol,
            max_iter=dual.max_iter,
            msign_method=method,
            ns_steps=steps,
            ns_coefficients=coefficients,
            eps=eps,
            correction=state.get("dual_correction") if dual.warm_start else None,
            patience=DUAL_PATIENCE,
            smoothing=dual.smoothing,
            dual_update=dual.update,
            gap_tol=None,  # the first smoothing that meets tol: a training step needs no certificate
            execution=execution,
        )
        return apply_solution(param, solution, state, lr=lr, weight_decay=weight_decay, adjusted=adjusted,
                              manifold=manifold, fuse_retraction=fuse_retraction, layout=layout)


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
    manifold,
    dual: DualOptions | dict | None = None,
    fuse_retraction: bool = False,
    execution: ExecutionPolicy | None = None,
    layout: str = "out_in",
    owners: list[int] | None = None,
    process_group=None,
) -> None:
    r"""One Manifold Muon step for the matrices of one group, in place: what :meth:`ManifoldMuon.step` runs.

    Args:
        params, grads, momentum_bufs, states: per matrix, the parameter (2-D), its gradient, its
            momentum buffer (updated in place) and its optimizer state; the dual correction
            (``"dual_correction"``), iterations (``"dual_iterations"``) and residual
            (``"dual_residual"``) of this step are written there.
        lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn: as
            :class:`~manifoldlib.optim.ManifoldMuon` (and :class:`torch.optim.Muon`).
        manifold: the manifold object (carrying its retraction) or a name
            (:func:`~manifoldlib.optim.dual_manifolds.dual_manifold`).
        dual: the dual-solver options (:class:`~manifoldlib.optim.dual_options.DualOptions`, a
            dict of its fields, or ``None`` for the defaults).
        fuse_retraction: ``manifold`` carries its default Gram-form retraction
            (``muon_retraction``); tall matrices then take it in the fused form of
            :mod:`~manifoldlib.optim.fused_retraction` (the same point to rounding, two ``m·n²``
            products fewer).
        execution: the device-dependent choices (:class:`~manifoldlib.optim.execution.ExecutionPolicy`:
            the Euclidean Newton–Schulz dtype, the dual's spectral path and precisions, how many
            constrained matrices are solved at once on CPU threads, whether same-shape matrices
            are solved as one batched problem); ``None`` resolves the defaults for the
            parameters' device (``ns_dtype="auto"``, ``dual.spectral``, one solve at a time,
            batching on the products path).
        layout: how the matrices are stored (:data:`~manifoldlib.optim.layouts.LAYOUTS`):
            ``"out_in"`` (``torch.nn.Linear``) or ``"in_out"`` (Hugging Face ``Conv1D``); the
            constraint and the shape adjustment apply to the map's matrix
            (:mod:`~manifoldlib.optim.layouts`).
        owners: sharded mode: the owner rank of each matrix; the owners solve (batching the
            matrices each owns), and the new matrices are shared by
            :func:`~manifoldlib.distributed.sharded_apply` (a collective over ``process_group``).
            ``None``: every matrix is solved here.
    """
    manifold = dual_manifold(manifold)
    dual = DualOptions.coerce(dual)
    check_layout(layout)
    if execution is None:
        execution = ExecutionPolicy.resolve(params[0].device if params else "cpu", spectral=dual.spectral)
    options: dict[str, Any] = {
        "lr": float(lr),
        "weight_decay": weight_decay,
        "ns_coefficients": tuple(ns_coefficients),
        "ns_steps": ns_steps,
        "eps": eps,
        "adjust_lr_fn": adjust_lr_fn,
        "manifold": manifold,
        "dual": dual,
        "fuse_retraction": fuse_retraction,
        "execution": execution,
        "layout": layout,
    }
    updates = [_momentum_update(g, b, momentum, nesterov) for g, b in zip(grads, momentum_bufs)]
    workers = execution.workers if not manifold.flat else 1
    if owners is None:
        batched = _batched(params, updates, states, range(len(params)), options)
        for i, value in batched.items():
            params[i].copy_(value)
        rest = [i for i in range(len(params)) if i not in batched]  # each written as soon as it is solved
        _run([functools.partial(_solve_into, params[i], updates[i], states[i], options) for i in rest],
             [params[i] for i in rest], workers)
        return
    rank = get_rank_world(process_group)[0]
    mine = [i for i, owner in enumerate(owners) if owner == rank]
    precomputed = _batched(params, updates, states, mine, options)
    rest = [i for i in mine if i not in precomputed]
    tasks = [functools.partial(_solve_one, params[i], updates[i], states[i], **options) for i in rest]
    precomputed.update(zip(rest, _run(tasks, [params[i] for i in rest], workers)))

    def solve(i: int, p: Tensor) -> Tensor:
        return precomputed.pop(i) if i in precomputed else _solve_one(p, updates[i], states[i], **options)

    for p, value in zip(params, sharded_apply(params, solve, process_group=process_group, owners=owners)):
        p.copy_(value)


def _batched(params, updates, states, indices, options: dict[str, Any]) -> dict[int, Tensor]:
    """The matrices among ``indices`` solved as batched problems (:mod:`~manifoldlib.optim.batched_step`)
    where the policy batches, by index; the rest are left to :func:`_solve_one`."""
    if not options["execution"].batch or options["manifold"].flat:
        return {}
    return solve_batched(params, updates, states, list(indices), options, DUAL_PATIENCE)


def _solve_into(param: Tensor, update: Tensor, state: dict, options: dict[str, Any]) -> None:
    """:func:`_solve_one`, written into ``param`` (what a concurrent worker runs)."""
    param.copy_(_solve_one(param, update, state, **options))


def _run(tasks: list, params: list[Tensor], workers: int) -> list:
    """``tasks`` (one per parameter) on the solve pool when ``workers > 1``, IEEE float32 held here
    so that the workers' own precision contexts write nothing."""
    if not tasks:
        return []
    if workers <= 1:
        return [task() for task in tasks]
    with ieee_float32_matmul():
        return run_concurrently(tasks, [tuple(p.shape) for p in params], workers)
