"""The few collectives a training loop needs, as plain functions of Python values.

Each works on the default process group and is the identity in a single process (nothing
initialized, or a world of one), so a loop calls them unconditionally:

- :func:`all_mean` — the mean of a number over ranks (``sum / W``; gloo has no ``AVG``);
- :func:`from_rank0` — rank 0's number on every rank, so that decisions (stop, diverge) are
  taken together;
- :func:`all_gather_objects` — ``[obj_0, ..., obj_{W-1}]`` on every rank (picklable objects);
- :func:`raise_together` — raise on *every* rank when any rank failed its checks, instead of
  leaving the others waiting in a collective until the timeout.
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from .env import get_rank_world

__all__ = ["RankFailedError", "all_gather_objects", "all_mean", "from_rank0", "raise_together"]


class RankFailedError(RuntimeError):
    """Another rank failed: ``"rank R failed (KIND): MESSAGE"``."""


def _world() -> int:
    return get_rank_world()[1]


#: Integers of larger magnitude are not all float64 numbers: 2**53 + 1 would travel as 2**53.
_EXACT_INTEGERS = 2**53


def _number(value, where: str) -> float:
    """``value`` as the float64 number the collective carries; ``ValueError`` naming it where it
    is not a real number (a bool counts as 0 or 1; a one-element tensor as its value) or an
    integer that float64 does not hold exactly."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(  # noqa: TRY004 - the project's convention for bad input
            f"{where} takes a real number (int, float, bool or a one-element real tensor), got {value!r}")
    if isinstance(value, numbers.Integral) and abs(int(value)) > _EXACT_INTEGERS:
        raise ValueError(f"{where} carries float64, which holds integers exactly up to 2**53 only, got {value!r} "
                         f"(it would arrive as {float(value)!r})")
    return float(value)


def all_mean(value: float, device: torch.device | str = "cpu") -> float:
    """The mean of ``value`` over the ranks (a float64 ``all_reduce`` on ``device``), a float.

    Raises:
        ValueError: ``value`` not a real number (an int, float, bool or one-element real tensor),
            or an int past :math:`2^{53}` (float64 would round it), on the rank that passed it,
            before the collective (its peers then wait until the process group's timeout).
    """
    value = _number(value, "all_mean")
    world = _world()
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t) / world


def from_rank0(value: float, device: torch.device | str = "cpu") -> float:
    """Rank 0's ``value`` on every rank (a float64 ``broadcast`` on ``device``), a float.

    Raises:
        ValueError: as :func:`all_mean`.
    """
    value = _number(value, "from_rank0")
    if _world() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t)


def all_gather_objects(obj, process_group: dist.ProcessGroup | None = None) -> list:
    """``[obj_rank0, obj_rank1, ...]`` on every rank (of ``process_group``; ``None``: the default)."""
    world = get_rank_world(process_group)[1]
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=process_group)
    return out


def raise_together(error: BaseException | None,
                   wrap: type[Exception] = RankFailedError,
                   process_group: dist.ProcessGroup | None = None) -> None:
    """Raise ``error`` on this rank, or ``wrap("rank R failed (KIND): MESSAGE")`` where another
    rank passed one; return on every rank when none did. Also a barrier.

    Args:
        error: this rank's failure, or ``None``.
        wrap: the exception type raised for another rank's failure (a caller's own, so that
            its handlers treat both alike).
        process_group: the ranks that decide together (``None``: the default group; ``R`` is
            then a rank of that group).
    """
    reports = all_gather_objects(None if error is None else (type(error).__name__, str(error)), process_group)
    if error is not None:
        raise error
    failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    if failed:
        r, (kind, message) = failed[0]
        raise wrap(f"rank {r} failed ({kind}): {message}")
