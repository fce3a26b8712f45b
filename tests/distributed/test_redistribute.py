"""Row shards and the all-to-all of pieces, in one process (the multi-process exchange runs in
tests/distributed/test_muon_fsdp.py, through ManifoldMuon, and once here: a rank that sends nothing)."""

from __future__ import annotations

import re

import pytest
import torch

from manifoldlib.distributed import (
    exchange,
    exchange_bytes,
    is_row_sharded,
    row_chunks,
    row_range,
    run_workers,
)
from manifoldlib.distributed.redistribute import ALIGNMENT, piece_bytes

try:  # tests laid out as packages
    from . import workers
except ImportError:  # pytest's default rootdir-relative import puts this folder on sys.path
    import workers


@pytest.mark.parametrize("rows", [0, 1, 3, 5, 8, 10, 768, 3072])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_row_chunks_are_torch_chunk_splits_padded_with_empty_ranks(rows, world):
    chunks = [len(c) for c in torch.arange(rows).chunk(world)] if rows else []
    assert row_chunks(rows, world) == chunks + [0] * (world - len(chunks))
    starts = [row_range(rows, world, r) for r in range(world)]
    assert [stop - start for start, stop in starts] == row_chunks(rows, world)
    assert all(a[1] == b[0] for a, b in zip(starts, starts[1:]))  # contiguous, in rank order
    assert (starts[0][0], starts[-1][1]) == (0, rows)


def test_row_chunks_refuses_bad_sizes_naming_them():
    with pytest.raises(ValueError, match="rows=-1"):
        row_chunks(-1, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        row_chunks(4, 0)


@pytest.mark.parametrize("rows, world", [(5.0, 2), (True, 2), (5, True), (5, 2.0)])
def test_row_chunks_and_row_range_refuse_sizes_that_are_not_ints(rows, world):
    """row_chunks(5.0, 2) was [3.0, 2.0] and row_range(5.0, 2, 0) (0, 3.0), row_chunks(True, 2)
    [1, 0], row_chunks(5, True) [5]; a float world_size a TypeError from range()."""
    needle = re.escape(f"row_chunks needs an int rows >= 0 and an int world_size >= 1, got rows={rows!r}, "
                       f"world_size={world!r}")
    for call in (lambda: row_chunks(rows, world), lambda: row_range(rows, world, 0)):
        with pytest.raises(ValueError, match=needle):
            call()


@pytest.mark.parametrize("args, needle", [((8, 2, -1), "rank=-1"), ((8, 2, 2), "rank=2"),
                                          ((8, 0, 0), "world_size=0"), ((8, 2, 1.0), "rank=1.0")])
def test_row_range_refuses_a_rank_outside_the_world_naming_it(args, needle):
    # row_range(8, 2, -1) was (-4, 0), silently: Python's negative index into the chunks
    with pytest.raises(ValueError, match=re.escape(needle)):
        row_range(*args)


def test_exchange_in_one_process_returns_the_pieces_in_their_dtypes():
    pieces = [torch.randn(3, 5, dtype=torch.float64), torch.arange(7, dtype=torch.int64),
              torch.randn(2, 3).to(torch.bfloat16), torch.randn(0, 4), torch.randn(3, dtype=torch.float32)]
    out = exchange([pieces], [[(tuple(p.shape), p.dtype) for p in pieces]])
    assert len(out) == 1 and len(out[0]) == len(pieces)
    for got, sent in zip(out[0], pieces):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)


def test_exchange_needs_one_list_per_rank():
    with pytest.raises(ValueError, match="one outgoing and one incoming list per rank"):
        exchange([[], []], [[], []])


@pytest.mark.parametrize("expected, needle", [
    ([((2, 3), torch.float32)], r"piece 0 is \(3, 2\) torch.float32 in outgoing\[0\] and \(2, 3\) torch.float32"),
    ([((3, 2), torch.int32)], r"piece 0 is \(3, 2\) torch.float32 in outgoing\[0\] and \(3, 2\) torch.int32"),
    ([((3, 2), torch.float32), ((1,), torch.float32)], r"1 pieces and expects 2 .* piece 1 is nothing"),
])
def test_exchange_refuses_pieces_this_rank_sends_itself_in_another_layout(expected, needle):
    # the received bytes used to be unpacked as incoming says: a (3, 2) piece came back as
    # (2, 3), float32 bits as int32 (1.0 as 1065353216), silently
    with pytest.raises(ValueError, match=needle):
        exchange([[torch.ones(3, 2)]], [expected])


def test_exchange_bytes_counts_aligned_pieces_sent_to_other_ranks():
    specs = [[((3, 5), torch.float32)], [((3,), torch.bfloat16), ((2, 2), torch.float64)]]
    assert piece_bytes((3,), torch.bfloat16) == ALIGNMENT  # 6 bytes, aligned to 8
    assert exchange_bytes(specs, rank=0) == 8 + 32
    assert exchange_bytes(specs, rank=1) == 64  # 60 bytes of float32, aligned
    for rank in (2, -1):  # counted what the rank keeps as sent too: 104 bytes, silently
        with pytest.raises(ValueError, match=re.escape(f"exchange_bytes needs a rank in [0, 2), got rank={rank}")):
            exchange_bytes(specs, rank=rank)


@pytest.mark.parametrize("shape", [(-3,), (-2, -4), (2, -1), (0, -1), (True, 2), (2.0, 3)])
def test_piece_bytes_refuses_sizes_that_are_not_ints_at_least_zero(shape):
    # (-3,) counted -16 bytes and (-2, -4) as many as (2, 4), silently
    with pytest.raises(ValueError, match=re.escape(f"piece_bytes needs sizes that are ints >= 0, got shape={shape!r}")):
        piece_bytes(shape, torch.float32)
    assert piece_bytes((0, 3), torch.float32) == 0  # an empty piece takes no room


def test_a_whole_tensor_is_not_row_sharded():
    assert not is_row_sharded(torch.zeros(4, 4))
    assert not is_row_sharded(torch.nn.Parameter(torch.zeros(4, 4)))


def test_exchange_refuses_pieces_on_several_devices_or_off_the_given_device():
    # pieces on the CPU and on meta were packed into one buffer on the first one's device, a
    # NotImplementedError from the copy out of meta; device= did not exist
    cpu, meta = torch.ones(2), torch.ones(3, device="meta")
    specs = [((2,), torch.float32), ((3,), torch.float32)]
    with pytest.raises(ValueError, match="exchange needs every outgoing piece on one device, got pieces on cpu, meta"):
        exchange([[cpu, meta]], [specs])
    with pytest.raises(ValueError, match=r"exchange\(device='meta'\) but outgoing pieces are on cpu; move them"):
        exchange([[cpu]], [specs[:1]], device="meta")
    out = exchange([[]], [[]], device="meta")  # nothing to send or receive: on the device named
    assert out == [[]]


def test_a_rank_that_sends_nothing_under_nccl_receives_on_the_gpu(monkeypatch):
    """Rank 1 of a two-rank nccl group that sends nothing took the CPU for its buffers (the first
    outgoing piece's device, else the CPU): an all-to-all of host tensors under nccl. A fake
    group (torch.distributed's queries patched) and fake CUDA tensors stand in for the GPUs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.distributed, "all_to_all_single",
                        lambda out, send, *args, **kwargs: seen.append((out.device.type, send.device.type)))
    with FakeTensorMode():
        out = exchange([[], []], [[((3, 2), torch.float64), ((5,), torch.int32)], []])
    assert seen == [("cuda", "cuda")]
    assert [(p.shape, p.dtype, p.device.type) for p in out[0]] == [
        ((3, 2), torch.float64, "cuda"), ((5,), torch.int32, "cuda")]
    assert out[1] == []


@pytest.mark.slow  # a 2-process job
def test_a_rank_that_sends_nothing_receives_its_pieces_on_the_group_device():
    # its buffer's device came from its own (absent) pieces, the CPU whatever the backend; under
    # gloo that is right, and a device named with device= must agree
    reports = run_workers(workers.exchange_from_one_side_job, 2, timeout=120.0)
    for device in ("None", "cpu"):
        kept, received = reports[0][device], reports[1][device]
        assert [(d, dtype) for d, dtype, _ in kept[0]] == [("cpu", "torch.bfloat16")] and kept[1] == []
        assert [(d, dtype) for d, dtype, _ in received[0]] == [("cpu", "torch.float64"), ("cpu", "torch.int32")]
        assert torch.equal(received[0][0][2], torch.arange(6, dtype=torch.float64).view(3, 2))
        assert torch.equal(received[0][1][2], torch.arange(5, dtype=torch.int32)) and received[1] == []
