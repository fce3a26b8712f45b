"""batch_shard: equal, disjoint slices that cover the global batch, and the mean-loss identity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib.distributed import batch_shard


@given(world_size=st.integers(1, 8), per_rank=st.integers(1, 16))
def test_shards_partition_the_global_batch_equally(world_size: int, per_rank: int) -> None:
    batch = world_size * per_rank
    rows = [list(range(batch))[batch_shard(batch, r, world_size)] for r in range(world_size)]
    assert [len(r) for r in rows] == [per_rank] * world_size
    assert [row for shard in rows for row in shard] == list(range(batch))  # in order, no overlap


def test_plain_process_takes_the_whole_batch() -> None:
    assert batch_shard(12) == slice(0, 12)


def test_averaged_shard_gradients_equal_the_global_batch_gradient() -> None:
    # what DDP computes: the mean over ranks of each rank's mean-loss gradient
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(12, 5, generator=generator, dtype=torch.float64)
    y = torch.randn(12, generator=generator, dtype=torch.float64)
    w = torch.randn(5, generator=generator, dtype=torch.float64, requires_grad=True)
    (full,) = torch.autograd.grad(((x @ w - y) ** 2).mean(), w)
    world_size = 3
    shards = []
    for rank in range(world_size):
        rows = batch_shard(len(x), rank, world_size)
        (g,) = torch.autograd.grad(((x[rows] @ w - y[rows]) ** 2).mean(), w)
        shards.append(g)
    torch.testing.assert_close(torch.stack(shards).mean(0), full, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 0, 4), "global_batch_size 10 is not divisible by world_size 4"),
        ((0, 0, 1), "global_batch_size must be an int >= 1, got 0"),
        ((8, 2, 2), r"rank must be an int in \[0, 2\), got 2"),
        ((8, 0, 0), "world_size must be an int >= 1, got 0"),
        ((8, 1, None), "give both rank and world_size or neither"),
    ],
)
def test_bad_arguments_name_the_value(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        batch_shard(*args)
