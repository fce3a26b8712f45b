r"""Sharded per-matrix work: each matrix is solved by one owner rank, results shared with all.

Manifold Muon's per-matrix work (a dual solve of a few ``msign`` calls plus a retraction) costs
about :math:`m\,n\,\min(m, n)` flops per Newton–Schulz step for an ``(m, n)`` matrix and is
identical on every rank after DDP's gradient all-reduce. :func:`sharded_apply` removes the
duplication: :func:`assign_owners` gives each matrix one owner, the owner computes
``fn(i, tensor)``, and a single ``all_gather`` per dtype over a flat, per-rank padded buffer hands
every result to every rank. That single-buffer all_gather (``all_gather_single``, called
``all_gather_into_tensor`` before torch 2.13) is the only collective used; gloo (CPU) and nccl
(CUDA) both provide it.

Every rank must call :func:`sharded_apply` with the same list of shapes and dtypes in the same
order (true for the parameters of a DDP-replicated model), and ``fn`` must be deterministic for
the results to equal a single-process run bit for bit. With ``check_layout`` the ranks first
exchange an 8-byte digest of their shapes, dtypes and owners, so ranks that disagree (parameters
in another order, of another shape or dtype, another set of dtypes, or none at all) raise on
every rank before the per-dtype gathers, instead of waiting in different collectives or
unpacking each other's results as their own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .env import get_rank_world

__all__ = [
    "STRATEGIES",
    "assign_owners",
    "matrix_cost",
    "rank_loads",
    "sharded_apply",
]

#: Ownership strategies of :func:`assign_owners`.
STRATEGIES = ("round-robin", "size")


def matrix_cost(shape_or_numel: int | Sequence[int]) -> int:
    r"""Work estimate of one per-matrix solve.

    For a shape ``(..., m, n)`` the cost is :math:`b\,m\,n\min(m, n)` with :math:`b` the product
    of the leading (batch) dimensions: one Newton–Schulz step multiplies the small Gram matrix
    into the large side. A vector shape ``(n,)`` or a plain integer (a number of elements)
    costs its element count.

    Args:
        shape_or_numel: a shape (tuple, list or :class:`torch.Size`) or a non-negative int.

    Returns:
        A non-negative int.

    Raises:
        ValueError: a negative size or an entry that is not an integer.
    """
    if isinstance(shape_or_numel, bool) or not isinstance(shape_or_numel, (int, Sequence)):
        raise ValueError(
            f"expected a shape (sequence of ints) or a number of elements (int), got {shape_or_numel!r}"
        )
    if isinstance(shape_or_numel, int):
        if shape_or_numel < 0:
            raise ValueError(f"a number of elements must be >= 0, got {shape_or_numel}")
        return shape_or_numel
    dims = tuple(shape_or_numel)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"a shape must hold non-negative ints, got {shape_or_numel!r}")
    if len(dims) < 2:
        return dims[0] if dims else 1
    batch = 1
    for d in dims[:-2]:
        batch *= d
    m, n = dims[-2], dims[-1]
    return batch * m * n * min(m, n)


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


def assign_owners(
    shapes_or_numels: Sequence[int | Sequence[int]],
    world_size: int,
    strategy: str = "size",
) -> list[int]:
    """Deterministic owner rank of each matrix.

    - ``"round-robin"``: matrix ``i`` goes to rank ``i % world_size``.
    - ``"size"``: greedy longest-processing-time balancing by :func:`matrix_cost` — matrices
      in decreasing cost (ties: lower index first) each go to the rank with the least
      assigned cost so far (ties: lower rank). The heaviest rank then carries at most the
      mean load plus one matrix, and at most :math:`4/3 - 1/(3W)` times the optimum.

    The result depends only on the arguments, so every rank computes the same assignment
    without communication.

    Args:
        shapes_or_numels: one shape or element count per matrix (see :func:`matrix_cost`).
        world_size: number of ranks, ``>= 1``.
        strategy: one of :data:`STRATEGIES`.

    Returns:
        A list of ranks in ``[0, world_size)``, one per input.

    Raises:
        ValueError: an unknown strategy, a bad world size, or a bad shape.
    """
    _check_world_size(world_size)
    if strategy not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {strategy!r}; valid strategies: {', '.join(STRATEGIES)}"
        )
    costs = [matrix_cost(s) for s in shapes_or_numels]
    if strategy == "round-robin":
        return [i % world_size for i in range(len(costs))]
    owners = [0] * len(costs)
    loads = [0] * world_size
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return owners


def rank_loads(
    shapes_or_numels: Sequence[int | Sequence[int]], owners: Sequence[int], world_size: int
) -> list[int]:
    """Total :func:`matrix_cost` assigned to each rank by ``owners``.

    Raises:
        ValueError: lengths differ, or an owner outside ``[0, world_size)``.
    """
    _check_world_size(world_size)
    _check_owners(owners, len(shapes_or_numels), world_size)
    loads = [0] * world_size
    for shape, rank in zip(shapes_or_numels, owners):
        loads[rank] += matrix_cost(shape)
    return loads


def _check_owners(owners: Sequence[int], count: int, world_size: int) -> None:
    if len(owners) != count:
        raise ValueError(f"owners must have one entry per tensor ({count}), got {len(owners)}")
    bad = [
        r
        for r in owners
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size
    ]
    if bad:
        raise ValueError(f"owners must be ranks in [0, {world_size}), got {bad[0]!r}")


def _all_gather_flat(
    output: torch.Tensor, payload: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    # torch >= 2.13 names the single-buffer all_gather ``all_gather_single`` and deprecates
    # ``all_gather_into_tensor``; both are the same collective (gloo and nccl).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, payload, group=group)


def _checked_result(i: int, tensor: torch.Tensor, out: object) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"fn({i}, tensor) must return a tensor, got {type(out).__name__}")
    if out.shape != tensor.shape or out.dtype != tensor.dtype:
        raise ValueError(
            f"fn({i}, tensor) must return the input's shape and dtype "
            f"{tuple(tensor.shape)} {tensor.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    return out


#: Bytes of the layout digest the ranks exchange before any gather (:func:`_layout_digest`).
_DIGEST_BYTES = 8
#: Tensors of a layout an error message lists per rank before it abbreviates.
_LAYOUT_SHOWN = 4


def _layout(tensors: Sequence[torch.Tensor], owners: Sequence[int], world_size: int) -> list:
    return [[(tuple(t.shape), str(t.dtype)) for t in tensors], list(owners), world_size]


def _layout_digest(layout: list) -> torch.Tensor:
    """8 bytes (uint8) of a hash of what a call's layout is: shapes, dtypes, owners, world size
    (``hashlib``: the same in every process, unlike ``hash`` of a string)."""
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=_DIGEST_BYTES).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def _digest_device(process_group: dist.ProcessGroup | None) -> torch.device:
    # chosen from the backend alone, so that a rank with no tensors picks what the others pick
    if str(dist.get_backend(process_group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _describe(layout: list) -> str:
    """``2 tensors: (4, 4) torch.float32 on rank 0, (5,) torch.int64 on rank 1``."""
    specs, owners, _ = layout
    shown = [f"{shape} {dtype} on rank {owner}" for (shape, dtype), owner in
             zip(specs[:_LAYOUT_SHOWN], owners)]
    more = f", ... {len(specs) - _LAYOUT_SHOWN} more" if len(specs) > _LAYOUT_SHOWN else ""
    return f"{len(specs)} tensor{'' if len(specs) == 1 else 's'}" + (": " if specs else "") \
        + ", ".join(shown) + more


def _first_difference(layouts: list, rank: int) -> str:
    (specs_0, owners_0, _), (specs_r, owners_r, _) = layouts[0], layouts[rank]
    if len(specs_0) != len(specs_r):
        return f"rank 0 passed {len(specs_0)} tensors, rank {rank} {len(specs_r)}"
    i = next((i for i in range(len(specs_0)) if specs_0[i] != specs_r[i]), None)
    if i is not None:
        return (f"tensor {i} is {specs_0[i][0]} {specs_0[i][1]} on rank 0 and "
                f"{specs_r[i][0]} {specs_r[i][1]} on rank {rank}")
    i = next(i for i in range(len(owners_0)) if owners_0[i] != owners_r[i])
    return f"tensor {i} is owned by rank {owners_0[i]} on rank 0 and by rank {owners_r[i]} on rank {rank}"


def _check_same_layout(layout: list, rank: int, process_group: dist.ProcessGroup | None) -> None:
    """Raise on every rank, before any gather of results, where a rank's layout differs from
    another's: one all_gather of an 8-byte digest and one host read (all ranks see the same
    digests, so all take the same branch; the error path gathers the layouts themselves)."""
    world_size = layout[2]
    device = _digest_device(process_group)
    mine = _layout_digest(layout).to(device)
    digests = torch.empty(world_size * _DIGEST_BYTES, dtype=torch.uint8, device=device)
    _all_gather_flat(digests, mine, process_group)
    if bool((digests.view(world_size, _DIGEST_BYTES) == mine).all()):  # the host read
        return
    from .collectives import all_gather_objects  # the error path only: every rank is here

    layouts = all_gather_objects(layout, process_group)
    first = next((r for r in range(len(layouts)) if layouts[r] != layouts[0]), None)
    if first is None:  # equal layouts, different digests: the digests were damaged in transit
        raise ValueError("sharded_apply: the gathered layout digests differ although every rank "
                         "passed the same layout; the exchange is not trustworthy")
    groups: dict[str, list[int]] = {}
    for r, other in enumerate(layouts):
        groups.setdefault(_describe(other), []).append(r)
    seen = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        f"{' (this rank)' if rank in ranks else ''}: {text}" for text, ranks in groups.items())
    raise ValueError(f"sharded_apply: the ranks passed different tensors or owners "
                     f"({_first_difference(layouts, first)}); every rank must pass the same shapes "
                     f"and dtypes in the same order, and the same owners; passed: {seen}")


def sharded_apply(
    tensors: Sequence[torch.Tensor],
    fn: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    process_group: dist.ProcessGroup | None = None,
    strategy: str | None = None,
    owners: Sequence[int] | None = None,
    check_layout: bool = True,
) -> list[torch.Tensor]:
    r"""Compute ``fn(i, tensors[i])`` on the owner of each ``i`` only; every rank gets every result.

    Outside a distributed job (or in a group of one) this is ``[fn(i, t) for i, t in
    enumerate(tensors)]``. In a group of :math:`W > 1` ranks, rank :math:`r` calls ``fn`` only
    for the indices it owns, packs those results into a flat buffer padded to the largest
    per-rank payload, and one single-buffer ``all_gather`` per distinct dtype delivers all
    payloads to all ranks, which unpack them in place of the missing results.

    ``fn`` is where per-matrix, owner-only state belongs (e.g. a warm-started dual multiplier):
    it runs on exactly one rank per index, the same rank at every call with the same
    shapes, world size and strategy.

    Args:
        tensors: ``[(*shape_i)]``, the same shapes, dtypes and order on every rank; the
            tensors of one dtype on one device (CPU for gloo, CUDA for nccl). Only the
            owner's values are read; on the other ranks they are shape and dtype templates.
        fn: ``fn(i, tensor) -> tensor`` of the same shape and dtype; deterministic.
        process_group: the group to shard over; ``None`` for the default group.
        strategy: ownership strategy of :func:`assign_owners` (``None``: ``"size"``); not
            with ``owners``.
        owners: a precomputed owner rank per tensor (e.g. cached by an optimizer), instead of
            a ``strategy``.
        check_layout: before any gather of results, all_gather an 8-byte digest of every
            rank's shapes, dtypes and owners and compare them on the host (one small collective
            and one host read, which on CUDA waits for the work queued so far); a caller that
            repeats one layout call after call (an optimizer's step) checks it on the first
            call and passes ``False`` after, which adds nothing to the gathers. Every rank must
            pass the same value (a rank that checks waits in the digest's gather).

    Returns:
        ``[(*shape_i)]``: the results in input order, identical on every rank. Under
        :math:`W > 1` they are views into the gathered buffer, detached from autograd.

    Raises:
        ValueError: ``fn`` returned a wrong shape or dtype, a bad ``owners``/``strategy``, both
            of them (the strategy would not be used), or
            tensors of one dtype on different devices. Raised before any collective on the
            rank that detects it; the other ranks then fail at the process group's timeout.
            Also, with ``check_layout``, on every rank and before any gather of results, where
            the ranks passed different shapes, dtypes (or sets of dtypes), order, numbers of
            tensors (none included) or ``owners``: the message names the first difference and
            every rank's layout. Without the check such ranks wait in different collectives
            (the timeout), fail in one (a size error), or unpack each other's results.
    """
    rank, world_size = get_rank_world(process_group)
    tensors = list(tensors)
    if owners is None:
        owners = assign_owners([tuple(t.shape) for t in tensors], world_size, strategy or "size")
    elif strategy is not None:  # it was ignored: the owners decide
        raise ValueError(f"sharded_apply takes owners or a strategy, not both; got strategy={strategy!r} and owners")
    else:
        owners = list(owners)
        _check_owners(owners, len(tensors), world_size)
    if world_size == 1:
        return [_checked_result(i, t, fn(i, t)) for i, t in enumerate(tensors)]

    if check_layout:  # before the per-dtype gathers, whose number and sizes the layout sets
        _check_same_layout(_layout(tensors, owners, world_size), rank, process_group)
    results: list[torch.Tensor | None] = [None] * len(tensors)
    # one buffer per dtype, in first-appearance order (the same on every rank)
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    with torch.no_grad():
        for dtype, indices in groups.items():
            devices = {tensors[i].device for i in indices}
            if len(devices) > 1:
                raise ValueError(
                    f"tensors of dtype {dtype} must share one device for the gather, got "
                    f"{sorted(str(d) for d in devices)}"
                )
            device = devices.pop()
            offsets: list[int] = [0] * len(tensors)
            payload = [0] * world_size  # elements per rank
            for i in indices:
                offsets[i] = payload[owners[i]]
                payload[owners[i]] += tensors[i].numel()
            width = max(payload)
            send = torch.zeros(width, dtype=dtype, device=device)
            for i in indices:
                if owners[i] == rank:
                    out = _checked_result(i, tensors[i], fn(i, tensors[i]))
                    send[offsets[i] : offsets[i] + out.numel()].copy_(out.reshape(-1))
            gathered = torch.empty(world_size * width, dtype=dtype, device=device)
            if width > 0:  # every rank agrees: width depends only on shapes and owners
                _all_gather_flat(gathered, send, process_group)
            for i in indices:
                start = owners[i] * width + offsets[i]
                results[i] = gathered[start : start + tensors[i].numel()].view(tensors[i].shape)
    return results  # type: ignore[return-value]
