r"""Manifold Muon on FSDP2's row shards: each matrix gathered on one rank, solved, its rows sent back.

Under :func:`torch.distributed.fsdp.fully_shard` a parameter is a
:class:`~torch.distributed.tensor.DTensor` placed ``Shard(0)`` on a one-dimensional mesh of
:math:`W` ranks: rank :math:`r` holds a block of rows
(:func:`~manifoldlib.distributed.row_chunks`). The dual and the retraction need the whole
matrix, so one step of the row-sharded matrices of a mesh is:

1. **Momentum on the rows.** Each rank updates the momentum of the rows it holds,
   :math:`B' = \mu B + (1-\mu)G` and :math:`U = (1-\mu)G + \mu B'` (Nesterov) or :math:`U = B'`,
   elementwise as a whole matrix would, into a new buffer it does not keep yet.
2. **Rows to owners.** Each matrix has one owner rank
   (:func:`~manifoldlib.distributed.assign_owners` over the global shapes: longest processing
   time first by :math:`m\,n\min(m,n)`, the same on every rank without communication). One
   all-to-all (:func:`~manifoldlib.distributed.exchange`) moves every rank's rows of :math:`U` to
   the owner, and on a manifold also its rows of :math:`W` and of the dual's warm start
   :math:`\Lambda - \Lambda_0` (a ``(k, k)`` DTensor placed like :math:`W`, :math:`k = \min(m, n)`).
3. **Solve.** On a manifold each owner runs the single-process step
   (:func:`~manifoldlib.optim.core.muon_step`) on banks of its whole matrices, with :math:`U` given.
   On Euclidean space the owner only needs Muon's direction :math:`D = \mathrm{NS}(U)`: the update
   :math:`W \leftarrow \beta W - \eta D` is elementwise, so each rank applies it to its own rows.
4. **Rows back.** A second all-to-all returns to each rank its rows of the new :math:`W` (of
   :math:`D` on Euclidean space) and of the new :math:`\Lambda - \Lambda_0`, and to *every* rank the
   matrix's scalars: whether its update was finite, ``skipped_steps``, ``dual_iterations``,
   ``dual_residual``, ``retraction_residual``.
5. **Commit.** Each rank writes its rows, keeps :math:`B'` where the update was finite (else the
   old buffer: a non-finite gradient skips the matrix, as in a single process) and stores the
   scalars, so they are identical on every rank.

A Euclidean matrix so moves the minimum, its rows once each way (:math:`U` there, :math:`D` back);
a manifold's dual and retraction need the whole :math:`W` as well, and the warm start travels with
the rows (:func:`redistribution_plan` counts it; ``benchmarks/bench_fsdp_exchange.py`` prints it).

So the momentum and the warm start stay with the shards they belong to, and
:mod:`torch.distributed.checkpoint` saves and reshards them like the parameters (the scalars are
replicated 0-d tensors). The parameters equal a single process's to rounding: each matrix sees the
same operations, in a bank of other members. Two all-to-alls a step, no host synchronization on the
sync-free (products) path after a plan's first step; where the dual checks its points on the host
(every eigh step, the first step of a plan), the owners' refusals are shared before anything moves,
so every rank raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..distributed import assign_owners, exchange, get_rank_world, raise_together, row_chunks, row_range
from ..distributed.redistribute import piece_bytes
from ..functional.newton_schulz import newton_schulz
from .core import gradient_finite, make_banks, muon_step, step_sizes
from .execution import Execution, solve_dtype
from .options import MuonOptions

__all__ = ["SCALARS", "fsdp_step", "project_row_sharded", "redistribution_plan"]

#: What every rank receives about each matrix after its solve, in this order (float64 on the wire).
SCALARS = ("finite", "skipped_steps", "dual_iterations", "dual_residual", "retraction_residual")


@dataclass
class _Matrix:
    """One row-sharded matrix this step (this rank's view of it)."""

    options: MuonOptions
    param: Tensor  # DTensor, Shard(0)
    state: dict
    owner: int
    new_buf: Tensor  # local rows of B'
    fields: list[Tensor]  # local rows sent to the owner: U (Euclidean); W, U (and Λ - Λ0)
    field_rows: list[int]  # global rows of each field: m (Euclidean); m, m (and k)
    constrained: bool
    retraction: bool  # the step records a retraction residual
    returned: torch.dtype  # dtype of the rows sent back: W's, or the Newton-Schulz direction's

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.param.shape)

    @property
    def columns(self) -> int:
        return min(self.shape)


def fsdp_step(items: Sequence[tuple[MuonOptions, Tensor, Tensor, Tensor, dict]],
              execution_of: Callable[[MuonOptions, torch.device, int], Execution], *,
              strategy: str = "size", check_points: bool = False) -> None:
    """One step of the row-sharded matrices ``items`` ``(options, param, grad, momentum_buffer,
    state)`` (DTensors on one mesh), in place; a collective over the mesh's group.

    Args:
        items: every rank passes the same matrices in the same order.
        execution_of: ``(options, device, columns) -> Execution`` (the optimizer's, cached).
        strategy: how matrices are given owners (:func:`~manifoldlib.distributed.assign_owners`).
        check_points: the owners check the points of sync-free banks too
            (:func:`~manifoldlib.optim.core.muon_step`), and every rank raises where one refuses
            (a host read; the optimizer checks on the first step of each plan and on the first
            after a matrix of the mesh changed in place: the same on every rank).
    """
    mesh = items[0][1].device_mesh
    group = mesh.get_group()
    device = items[0][1].to_local().device  # where the shards live: every exchange's buffers
    rank, world = get_rank_world(group)
    owners = assign_owners([tuple(p.shape) for _, p, *_ in items], world, strategy)
    matrices = [_prepare(item, owner, execution_of) for item, owner in zip(items, owners)]

    outgoing: list[list[Tensor]] = [[] for _ in range(world)]
    for matrix in matrices:
        outgoing[matrix.owner].extend(matrix.fields)
    incoming = [[spec for matrix in matrices if matrix.owner == rank for spec in _sent_rows(matrix, source, world)]
                for source in range(world)]
    received = exchange(outgoing, incoming, group, device=device)

    mine = [matrix for matrix in matrices if matrix.owner == rank]
    wholes, position = [], [0] * world
    for matrix in mine:
        count = len(matrix.fields)
        pieces = [received[s][position[s]:position[s] + count] for s in range(world)]
        for s in range(world):
            position[s] += count
        wholes.append([torch.cat([piece[f] for piece in pieces]) for f in range(count)])
    error = None
    try:
        results = _solve(mine, wholes, execution_of, check_points)
    except Exception as err:  # noqa: BLE001 - shared with the other ranks below
        error, results = err, None
    if check_points or any(not execution_of(m.options, m.param.device, m.columns).sync_free for m in matrices):
        raise_together(error, ValueError, group)  # a host-checked step: every rank raises
    elif error is not None:
        raise error

    back: list[list[Tensor]] = [[] for _ in range(world)]
    for matrix, (w, correction, scalars) in zip(mine, results):
        for d in range(world):
            start, stop = row_range(matrix.shape[0], world, d)
            back[d].append(w[start:stop])
            if matrix.constrained:
                start, stop = row_range(matrix.columns, world, d)
                back[d].append(correction[start:stop])
            back[d].append(scalars)
    expected = [[spec for matrix in matrices if matrix.owner == source for spec in _returned_rows(matrix, rank, world)]
                for source in range(world)]
    returned = exchange(back, expected, group, device=device)
    position = [0] * world
    for matrix in matrices:
        s = matrix.owner
        count = 3 if matrix.constrained else 2
        _commit(matrix, returned[s][position[s]:position[s] + count], mesh)
        position[s] += count


def _prepare(item, owner: int, execution_of) -> _Matrix:
    """This rank's momentum rows and the rows it sends to the owner."""
    options, param, grad, buf, state = item
    local_grad, local_buf = grad.to_local(), buf.to_local()
    new_buf = local_buf.lerp(local_grad, 1 - options.momentum)
    update = local_grad.lerp(new_buf, options.momentum) if options.nesterov else new_buf
    constrained = not options.manifold.flat
    execution = execution_of(options, param.device, min(param.shape))
    if not constrained:  # D comes back in the Newton-Schulz dtype (newton_schulz returns in it)
        return _Matrix(options, param, state, owner, new_buf, [update], [param.shape[0]], False, False,
                       execution.ns_dtype)
    fields, rows = [param.to_local(), update], [param.shape[0]] * 2
    correction = state.get("dual_correction") if options.dual.warm_start else None
    if correction is not None:
        fields.append(correction.to_local())
        rows.append(min(param.shape))
    return _Matrix(options, param, state, owner, new_buf, fields, rows, True, options.fused and execution.sync_free,
                   param.dtype)


def _sent_rows(matrix: _Matrix, source: int, world: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``(shape, dtype)`` of the pieces ``source`` sends to the owner of ``matrix``."""
    return [((row_chunks(rows, world)[source], field.size(1)), field.dtype)
            for field, rows in zip(matrix.fields, matrix.field_rows)]


def _returned_rows(matrix: _Matrix, rank: int, world: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``(shape, dtype)`` of the pieces the owner of ``matrix`` sends back to ``rank``."""
    m, n = matrix.shape
    out = [((row_chunks(m, world)[rank], n), matrix.returned)]
    if matrix.constrained:
        k = matrix.columns
        out.append(((row_chunks(k, world)[rank], k), solve_dtype(matrix.param.dtype)))
    out.append(((len(SCALARS),), torch.float64))
    return out


def _solve(mine: Sequence[_Matrix], wholes: Sequence[Sequence[Tensor]], execution_of, check_points: bool = False):
    """The owner's part: per matrix ``(new W or Euclidean direction D, new Λ - Λ0 or None, scalars)``."""
    results: list = [None] * len(mine)
    flat = [j for j, matrix in enumerate(mine) if not matrix.constrained]
    for j, found in zip(flat, _directions([mine[j] for j in flat], [wholes[j] for j in flat], execution_of)):
        results[j] = found
    solved = [j for j, matrix in enumerate(mine) if matrix.constrained]
    for j, found in zip(solved, _steps([mine[j] for j in solved], [wholes[j] for j in solved], execution_of,
                                       check_points)):
        results[j] = found
    return results


def _scalars(finite: Tensor, state: dict) -> Tensor:
    """The :data:`SCALARS` of one matrix as a float64 vector (where the state has none: 0 counts, a
    NaN residual, as :func:`~manifoldlib.optim.optimizer_diagnostics` reports one not measured)."""
    values = [finite.to(torch.float64)]
    for key in SCALARS[1:]:
        value = state.get(key)
        missing = float("nan") if key.endswith("residual") else 0.0
        values.append(value.to(torch.float64) if value is not None else
                      torch.full((), missing, dtype=torch.float64, device=finite.device))
    return torch.stack(values)


def _directions(mine: Sequence[_Matrix], wholes: Sequence[Sequence[Tensor]], execution_of):
    r"""Muon's direction :math:`\mathrm{NS}(U)` of the owner's Euclidean matrices, banked by shape:
    per matrix ``(D, None, scalars)`` (``D`` in the stored orientation)."""
    if not mine:
        return []
    items = [(matrix.options, whole[0], whole[0], None, {}) for matrix, whole in zip(mine, wholes)]
    out: list = [None] * len(mine)
    for bank in make_banks(items, execution_of, updates_given=True):
        opts = bank.options
        update = bank.stack(bank.grads)
        finite = gradient_finite(update)
        direction = newton_schulz(update, opts.ns_coefficients, opts.ns_steps, eps=opts.eps,
                                  dtype=bank.execution.ns_dtype)
        for index, d, ok in zip(bank.indices, bank.unstack(direction), finite.unbind(0)):
            out[index] = (d, None, _scalars(ok, {}))
    return out


def _steps(mine: Sequence[_Matrix], wholes: Sequence[Sequence[Tensor]], execution_of, check_points: bool = False):
    """The owner's manifold step on whole matrices: per matrix ``(new W, new Λ - Λ0, scalars)``."""
    if not mine:
        return []
    items, finites = [], []
    for matrix, whole in zip(mine, wholes):
        w, update = whole[0], whole[1]
        state = {key: matrix.state[key] for key in SCALARS[1:] if key in matrix.state}
        if len(whole) == 3:
            state["dual_correction"] = whole[2]
        items.append((matrix.options, w, update, None, state))
        finites.append(gradient_finite(update.unsqueeze(0))[0])

    muon_step(make_banks(items, execution_of, updates_given=True), check_points=check_points)
    return [(w, state.get("dual_correction"), _scalars(finite, state))
            for (_, w, _, _, state), finite in zip(items, finites)]


def _commit(matrix: _Matrix, pieces: Sequence[Tensor], mesh) -> None:
    """Write this rank's rows of the new matrix, keep the momentum where the update was finite,
    store the dual's warm-start rows and the scalars."""
    from torch.distributed.tensor import DTensor, Shard

    rows, scalars = pieces[0], pieces[-1]
    state = matrix.state
    finite = scalars[0].bool()
    w = matrix.param.to_local()
    buf = state["momentum_buffer"].to_local()
    buf.copy_(torch.where(finite, matrix.new_buf, buf))
    if not matrix.constrained:  # rows of D: W <- beta W - eta D here, as the single-process step does
        lr, decay = step_sizes(matrix.options, matrix.shape)
        new = w * decay if decay != 1.0 else w.clone()
        w.copy_(torch.where(finite, new.add_(rows, alpha=-lr), w))
        previous = state.get("skipped_steps")
        skipped = (~finite).to(torch.long)
        state["skipped_steps"] = skipped if previous is None else previous + skipped
        return
    w.copy_(rows)
    state["skipped_steps"] = scalars[1].to(torch.long)
    work = solve_dtype(matrix.param.dtype)
    state["dual_iterations"] = scalars[2].to(torch.long)
    state["dual_residual"] = scalars[3].to(work)
    if matrix.retraction:
        state["retraction_residual"] = scalars[4].to(work)
    k = matrix.columns
    correction = state.get("dual_correction")
    if correction is not None and tuple(correction.to_local().shape) == tuple(pieces[1].shape) \
            and correction.dtype == work:
        correction.to_local().copy_(pieces[1])
    else:
        state["dual_correction"] = DTensor.from_local(pieces[1].clone(), mesh, [Shard(0)], run_check=False,
                                                      shape=torch.Size((k, k)), stride=(k, 1))


@torch.no_grad()
def project_row_sharded(param: Tensor, project: Callable[[Tensor], Tensor]) -> None:
    """Replace a row-sharded ``param`` by ``project(whole matrix)``: the whole matrix gathered on
    every rank (a collective), projected there, and each rank's rows kept (at construction only)."""
    whole = param.full_tensor()
    start, stop = row_range(param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank())
    param.to_local().copy_(project(whole)[start:stop])


def redistribution_plan(shapes: Sequence[tuple[int, int]], dtype: torch.dtype, world: int, *,
                        constrained: bool = True, ns_dtype: torch.dtype | None = None,
                        strategy: str = "size") -> dict[str, int]:
    """Bytes one step moves between ranks for matrices of ``shapes`` (stored orientation, all of
    ``dtype``, row-sharded over ``world`` ranks), by what moves, next to the minimum: each matrix's
    rows that are not on its owner moved once to it and once back. A step after the first (the
    dual's warm start exists and travels with the rows) with ``constrained``; Euclidean matrices
    move :math:`U` there and :math:`D` back only, :math:`D` in ``ns_dtype`` (the Newton–Schulz dtype
    of the step, :class:`~manifoldlib.optim.execution.Execution`; default ``dtype``).

    Returns:
        ``{"to_owners": ..., "to_shards": ..., "total": ..., "minimum": ...}`` in bytes, summed over
        ranks (pieces a rank keeps for itself are not counted).
    """
    owners = assign_owners([tuple(s) for s in shapes], world, strategy)
    work = solve_dtype(dtype)
    out = {"to_owners": 0, "to_shards": 0, "minimum": 0}
    for (m, n), owner in zip(shapes, owners):
        k = min(m, n)
        for rank, (rows, krows) in enumerate(zip(row_chunks(m, world), row_chunks(k, world))):
            if rank == owner:
                continue
            matrix = piece_bytes((rows, n), dtype)
            correction = piece_bytes((krows, k), work) if constrained else 0
            out["to_owners"] += (2 if constrained else 1) * matrix + correction
            back = matrix if constrained else piece_bytes((rows, n), ns_dtype or dtype)
            out["to_shards"] += back + correction + piece_bytes((len(SCALARS),), torch.float64)
            out["minimum"] += 2 * rows * n * torch.empty((), dtype=dtype).element_size()
    out["total"] = out["to_owners"] + out["to_shards"]
    return out
