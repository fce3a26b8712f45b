r"""Same-shape matrices of one group solved as one batched dual (the products path), then retracted.

What GPU Muon implementations do for Newton–Schulz — stack the matrices of one shape and run one
batched product per step instead of one per matrix — done for the dual solve of Manifold Muon:
the constrained matrices of a group whose tall orientations share a shape (a ``(3072, 768)`` and
a ``(768, 3072)`` weight share ``(3072, 768)``), dtype and device are stacked and solved by
:func:`~manifoldlib.optim.batched_dual._batched_bb_solve`, one launch per ``n × n`` product for
the whole stack and one host synchronization per iteration. Each matrix then gets its own
retraction and state, by the code the per-matrix step runs
(:func:`~manifoldlib.optim.muon_finish.apply_solution`).

The contract is the per-matrix step's result, to rounding: a matrix is batched only where its
unbatched solve would run the plain Barzilai–Borwein dual on the products path — the execution
policy's :attr:`~manifoldlib.optim.execution.ExecutionPolicy.batch` on, a Newton–Schulz dual
msign (not ``"svd"``), BB dual updates (``update`` ``"auto"`` or ``"bb"``), and no smoothing
from the start (:func:`~manifoldlib.optim.dual_solvers._resolve_smoothing`: square DGram, or
``m < 2.5 n`` with ``smoothing="auto"``). A batched instance whose best
residual is above ``tol`` (a stall, the cap, a non-finite step) is *not* taken: it is left to the
per-matrix solve, which runs its plain dual again and continues on the smoothed dual as the
unbatched step does. So is a matrix with a zero or non-finite gradient, or a stored warm start of
the wrong shape (the per-matrix solve raises there). Gradients are first brought into range by an
exact power of two (:func:`~manifoldlib.functional.scaling.into_safe_range`), as the per-matrix
solve does, so that their norms neither overflow nor underflow.

A matrix alone of its shape is solved by the same loop, as a batch of one: an instance's
arithmetic does not depend on which others share its batch (a batched CPU product is a loop over
the batch), so a matrix gets the same result whether it is solved with all of its group
(replicated training, one process) or with only those its rank owns (sharded training) — the
distributed modes stay equal bit for bit on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..functional.scaling import into_safe_range
from .batched_dual import _batched_bb_solve
from .dual_problem import _DualProblem, _State
from .dual_solution import DualSolution, SteepestInfo
from .dual_solvers import _resolve_smoothing
from .layouts import tall
from .matmul_precision import ieee_float32_matmul
from .muon_finish import adjusted_lr, apply_solution, dual_msign

__all__ = ["solve_batched"]


def solve_batched(
    params: Sequence[Tensor],
    updates: Sequence[Tensor],
    states: Sequence[dict],
    indices: Sequence[int],
    options: dict[str, Any],
    patience: int | None,
) -> dict[int, Tensor]:
    """New values (each in its parameter's orientation) of the matrices ``indices`` whose batched
    solve converged, by index; writes their ``states``. The others are untouched, for the
    per-matrix solve. One batched solve per tall shape (and dtype and device).

    Args:
        params, updates, states: the group's matrices, their momentum updates and optimizer states.
        indices: which of them to consider (all, or those a rank owns).
        options: the keyword options of the per-matrix solve
            (:func:`~manifoldlib.optim.muon_step.manifold_muon` builds them).
        patience: the dual solve's stall patience.
    """
    manifold, dual, layout = options["manifold"], options["dual"], options["layout"]
    method, _, _ = dual_msign(dual, options["ns_steps"], options["ns_coefficients"])
    if manifold.flat or method == "svd" or options["execution"].spectral != "products":
        return {}
    if dual.update == "anderson":
        return {}  # Anderson steps need the eigh path: the per-matrix solve raises that
    classes: dict[tuple, list[int]] = {}
    for i in indices:
        shape = tuple(tall(params[i], layout).shape)
        if _resolve_smoothing(dual.smoothing, manifold, shape)[0] is not None:
            continue  # smoothed from the start: the eigh Newton solve, per matrix
        key = (shape, params[i].dtype, updates[i].dtype, params[i].device)
        classes.setdefault(key, []).append(i)
    done: dict[int, Tensor] = {}
    with ieee_float32_matmul():
        for members in classes.values():
            done.update(_solve_class(params, updates, states, members, options, patience))
    return done


def _warm_start(state: dict, n: int, warm: bool) -> Tensor | None | bool:
    """The stored correction of a matrix (``None``: none), or ``False`` when it has the wrong shape."""
    correction = state.get("dual_correction") if warm else None
    if correction is not None and tuple(correction.shape) != (n, n):
        return False
    return correction


def _solve_class(params, updates, states, members: list[int], options: dict[str, Any], patience):
    """One batched solve of same-shape matrices; the converged ones retracted, by index."""
    manifold, dual, execution = options["manifold"], options["dual"], options["execution"]
    layout = options["layout"]
    method, steps, coefficients = dual_msign(dual, options["ns_steps"], options["ns_coefficients"])
    n = tall(params[members[0]], layout).size(-1)
    work = execution.work_dtype(updates[members[0]].dtype, smoothed=False)  # float32 for 16-bit input
    g = into_safe_range(torch.stack([tall(updates[i], layout) for i in members]).to(work))  # (B, m, n)
    norms = torch.linalg.vector_norm(g, dim=(-2, -1))  # (B,)
    usable = (torch.isfinite(norms) & (norms > 0)).tolist()
    starts = [_warm_start(states[i], n, dual.warm_start) for i in members]
    keep = [j for j in range(len(members)) if usable[j] and starts[j] is not False]
    if not keep:
        return {}
    members = [members[j] for j in keep]
    g = g[keep] / norms[keep].view(-1, 1, 1)
    w = torch.stack([tall(params[i], layout) for i in members]).to(work)  # (B, m, n)
    problem = _DualProblem(w, g, manifold, method, steps, coefficients, options["eps"], policy=execution)
    lam0 = problem.initial_multiplier()  # (B, n, n)
    lam = lam0
    if any(starts[j] is not None for j in keep):
        given = torch.stack([torch.zeros_like(lam0[0]) if starts[j] is None else starts[j].to(lam0)
                             for j in keep])
        lam = lam0 + problem.mask(0.5 * (given + given.mT))
    residuals, lam, r, m, k, counts = _batched_bb_solve(problem, lam, float(dual.tol), dual.max_iter, patience)
    done = {}
    for j, i in enumerate(members):
        if not residuals[j] <= dual.tol:
            continue  # not converged: the per-matrix solve takes it (and may smooth)
        single = problem.select(j)  # this matrix's problem, for its answer and retraction
        state = _State(lam[j], r[j], m[j], k=k[j])
        info = SteepestInfo(counts[j], residuals[j], True, lam[j], lam[j] - lam0[j], [], None,
                            stages=("bb",), evaluations=counts[j] + 1)
        solution = DualSolution(info, False, single, state)  # solved in the tall orientation
        adjusted = adjusted_lr(options["lr"], options["adjust_lr_fn"], False, params[i].shape, layout)
        done[i] = apply_solution(params[i], solution, states[i], lr=options["lr"],
                                 weight_decay=options["weight_decay"], adjusted=adjusted, manifold=manifold,
                                 fuse_retraction=options["fuse_retraction"], layout=layout)
    return done
