r"""Row shards to whole matrices and back: the exchange an FSDP2 optimizer step needs.

FSDP2 (:func:`torch.distributed.fsdp.fully_shard`) keeps each parameter as a
:class:`~torch.distributed.tensor.DTensor` placed ``Shard(0)`` on a one-dimensional mesh of
:math:`W` ranks: rank :math:`r` holds rows :math:`[rc, \min((r+1)c, m))` of an ``(m, ...)``
tensor, :math:`c = \lceil m/W\rceil` (:func:`row_chunks`; the last ranks may hold fewer rows, or
none). A manifold step needs whole matrices, so an optimizer moves every rank's rows of a matrix
to the rank that solves it and the new rows back (Dion's all-to-all of "megabatches", torchtitan's
DistMuon).

:func:`exchange` is that move for any set of pieces: each rank names what it sends to every rank
and what it expects from every rank (shapes and dtypes both sides compute from global shapes,
without communication); the pieces of all dtypes travel as bytes in one
:func:`torch.distributed.all_to_all_single`, each piece aligned to 8 bytes so it is unpacked as a
view, not a copy. :func:`exchange_bytes` counts what one call moves between ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .env import get_rank_world

__all__ = ["ALIGNMENT", "exchange", "exchange_bytes", "piece_bytes", "row_chunks", "row_range"]

#: Every piece starts at a multiple of this many bytes in the exchanged buffer (the widest dtype
#: a piece may have is 8 bytes), so a received piece is a view of the buffer in its own dtype.
ALIGNMENT = 8

Spec = tuple[tuple[int, ...], torch.dtype]


def row_chunks(rows: int, world_size: int) -> list[int]:
    """Rows of each rank under ``Shard(0)`` (:func:`torch.chunk`'s split: ``ceil(rows / W)``
    per rank, the last ranks fewer or none), e.g. ``row_chunks(5, 4) == [2, 2, 1, 0]``.

    Raises:
        ValueError: ``rows`` not an int ``>= 0`` or ``world_size`` not an int ``>= 1`` (bools
            and floats included: ``5.0`` rows would give float counts).
    """
    def is_int(n) -> bool:
        return isinstance(n, int) and not isinstance(n, bool)

    if not (is_int(rows) and is_int(world_size)) or rows < 0 or world_size < 1:
        raise ValueError(f"row_chunks needs an int rows >= 0 and an int world_size >= 1, got rows={rows!r}, "
                         f"world_size={world_size!r}")
    chunk = -(-rows // world_size)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world_size)]


def row_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of ``rank``'s rows under ``Shard(0)`` (see :func:`row_chunks`).

    Raises:
        ValueError: as :func:`row_chunks`, or ``rank`` not an int in ``[0, world_size)``.
    """
    chunks = row_chunks(rows, world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"row_range needs a rank in [0, {world_size}), got rank={rank!r}")
    chunk = -(-rows // world_size)
    start = min(rank * chunk, rows)
    return start, start + chunks[rank]


def piece_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a piece of ``shape`` and ``dtype`` takes in the exchanged buffer (aligned).

    Raises:
        ValueError: a size in ``shape`` that is not an int ``>= 0`` (a negative one gave a
            negative count, or a positive one from two negatives).
    """
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"piece_bytes needs sizes that are ints >= 0, got shape={tuple(shape)!r}")
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return -(-size // ALIGNMENT) * ALIGNMENT


def exchange_bytes(outgoing: Sequence[Sequence[Spec]], rank: int) -> int:
    """Bytes ``rank`` sends to *other* ranks when it sends ``outgoing[d]`` to rank ``d``
    (what it keeps for itself moves nowhere).

    Raises:
        ValueError: ``rank`` not an int in ``[0, len(outgoing))`` (one outside counted what it
            keeps as sent).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(outgoing):
        raise ValueError(f"exchange_bytes needs a rank in [0, {len(outgoing)}), got rank={rank!r}")
    return sum(piece_bytes(shape, dtype) for d, specs in enumerate(outgoing) if d != rank
               for shape, dtype in specs)


# Slices are taken with narrow, not [a:b], which also runs on the CUDA tensors of FakeTensorMode
# without CUDA (count_ops of an exchange on a CPU-only machine).
def _pack(pieces: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    offset = 0
    for piece in pieces:
        size = piece.numel() * piece.element_size()
        if size:
            out.narrow(0, offset, size).copy_(piece.contiguous().view(-1).view(torch.uint8))
        offset += piece_bytes(piece.shape, piece.dtype)


def _unpack(buffer: torch.Tensor, specs: Sequence[Spec]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape, dtype in specs:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append(buffer.narrow(0, offset, size).view(dtype).view(shape))
        offset += piece_bytes(shape, dtype)
    return out


def _buffer_device(outgoing: Sequence[Sequence[torch.Tensor]], process_group: dist.ProcessGroup | None,
                   world: int, device: torch.device | str | None) -> torch.device:
    """The device of :func:`exchange`'s buffers: ``device``, else the pieces', else the group's.

    A rank that sends nothing took the CPU, under nccl too: it then failed in the all-to-all, or
    received onto the host while the other ranks' pieces were on their GPUs."""
    devices = sorted({t.device for pieces in outgoing for t in pieces}, key=str)
    if device is not None:
        device = torch.device(device)  # "cuda" (the current device) admits pieces on cuda:i
        if any(d.type != device.type or device.index not in (None, d.index) for d in devices):
            raise ValueError(f"exchange(device={str(device)!r}) but outgoing pieces are on "
                             f"{', '.join(map(str, devices))}; move them to {device} first")
        return devices[0] if len(devices) == 1 else device
    if len(devices) > 1:
        raise ValueError(f"exchange needs every outgoing piece on one device, got pieces on "
                         f"{', '.join(map(str, devices))}")
    if devices:
        return devices[0]
    if world == 1 and not dist.is_initialized():
        return torch.device("cpu")
    backend = dist.get_backend(process_group)
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda")  # the current CUDA device, where nccl's other ranks put theirs
    raise ValueError(f"this rank sends nothing and the group's backend {backend!r} does not say where to "
                     f"receive; pass exchange(..., device=...)")


def exchange(outgoing: Sequence[Sequence[torch.Tensor]], incoming: Sequence[Sequence[Spec]],
             process_group: dist.ProcessGroup | None = None, *,
             device: torch.device | str | None = None) -> list[list[torch.Tensor]]:
    """Send ``outgoing[d]`` to rank ``d`` and receive what every rank sends here, in one
    all-to-all (a collective: every rank of the group calls it).

    Args:
        outgoing: one list of tensors per rank of the group (this rank's own entry included: it
            is copied, not sent), on one device (CPU for gloo, CUDA for nccl).
        incoming: per source rank, the ``(shape, dtype)`` of each tensor it sends here, in its
            order (every rank computes the same plan, so both sides agree).
        process_group: the group (``None``: the default group).
        device: where the buffers live and the received pieces come back. ``None``: the device
            of the outgoing pieces; where this rank sends nothing at all, the group's backend
            says (CPU for gloo, the current CUDA device for nccl; a group of one backend per
            device type needs ``device``), and CPU outside a group.

    Returns:
        Per source rank, its tensors as views of one received buffer, on ``device``.

    Raises:
        ValueError: ``outgoing`` or ``incoming`` does not have one entry per rank; outgoing
            pieces on several devices, or on another device than ``device``; nothing to send, no
            ``device``, and a group whose backend names no one device; or what this
            rank sends itself (``outgoing[rank]``) is not what it expects from itself
            (``incoming[rank]``), naming the first piece that differs. What another rank sends
            is not checked against ``incoming`` (that would cost communication): a plan that
            disagrees in byte counts fails in the all-to-all, one that agrees in bytes only
            unpacks the pieces as ``incoming`` says.
    """
    rank, world = get_rank_world(process_group)
    if len(outgoing) != world or len(incoming) != world:
        raise ValueError(f"exchange needs one outgoing and one incoming list per rank ({world}), got "
                         f"{len(outgoing)} and {len(incoming)}")
    sent = [(tuple(t.shape), t.dtype) for t in outgoing[rank]]
    expected = [(tuple(shape), dtype) for shape, dtype in incoming[rank]]
    if sent != expected:
        i = next((i for i, (a, b) in enumerate(zip(sent, expected)) if a != b), min(len(sent), len(expected)))
        got = f"{sent[i][0]} {sent[i][1]}" if i < len(sent) else "nothing"
        want = f"{expected[i][0]} {expected[i][1]}" if i < len(expected) else "nothing"
        raise ValueError(f"exchange: rank {rank} sends itself {len(sent)} pieces and expects {len(expected)} "
                         f"from itself; piece {i} is {got} in outgoing[{rank}] and {want} in incoming[{rank}]")
    device = _buffer_device(outgoing, process_group, world, device)
    send_sizes = [sum(piece_bytes(t.shape, t.dtype) for t in pieces) for pieces in outgoing]
    recv_sizes = [sum(piece_bytes(shape, dtype) for shape, dtype in specs) for specs in incoming]
    send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=device)
    starts = [0]
    for size in send_sizes:
        starts.append(starts[-1] + size)
    for d, pieces in enumerate(outgoing):
        _pack(pieces, send.narrow(0, starts[d], send_sizes[d]))
    if world == 1:
        received = send
    else:
        received = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=process_group)
    out, offset = [], 0
    for size, specs in zip(recv_sizes, incoming):
        out.append(_unpack(received.narrow(0, offset, size), specs))
        offset += size
    return out
