"""sharded_apply without a process group: the plain per-matrix loop, with the same checks."""

from __future__ import annotations

import pytest
import torch

from manifoldlib.distributed import get_rank_world, is_distributed, sharded_apply
from manifoldlib.functional import msign


def _inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randn(6, 4, generator=generator, dtype=torch.float64),
        torch.randn(3, 9, generator=generator, dtype=torch.float32),
        torch.randn(5, generator=generator, dtype=torch.float64),
    ]


def _solve(i: int, x: torch.Tensor) -> torch.Tensor:
    return msign(x, "svd") + i if x.dim() == 2 else x - i


def test_not_distributed_here() -> None:
    assert not is_distributed()
    assert get_rank_world() == (0, 1)


def test_single_process_result_is_the_per_matrix_loop() -> None:
    tensors = _inputs()
    calls: list[int] = []

    def recording(i: int, x: torch.Tensor) -> torch.Tensor:
        calls.append(i)
        return _solve(i, x)

    results = sharded_apply(tensors, recording)
    assert calls == [0, 1, 2]
    for i, (got, x) in enumerate(zip(results, tensors)):
        assert torch.equal(got, _solve(i, x))
    # the matrices really went through msign: orthonormal columns / rows
    eye = torch.eye(4, dtype=torch.float64)
    assert torch.allclose(results[0].mT @ results[0], eye, atol=1e-12)


def test_empty_list_gives_empty_list() -> None:
    assert sharded_apply([], _solve) == []


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda i, x: x[:-1], r"fn\(0, tensor\) must return the input's shape and dtype \(6, 4\)"),
        (lambda i, x: x.float(), r"torch.float64, got \(6, 4\) torch.float32"),
        (lambda i, x: x.tolist(), r"fn\(0, tensor\) must return a tensor, got list"),
    ],
)
def test_results_of_the_wrong_shape_or_dtype_are_refused(fn, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sharded_apply(_inputs(), fn)


def test_bad_owners_and_strategy_are_refused() -> None:
    with pytest.raises(ValueError, match=r"owners must be ranks in \[0, 1\), got 1"):
        sharded_apply(_inputs(), _solve, owners=[0, 1, 0])
    with pytest.raises(ValueError, match=r"owners must have one entry per tensor \(3\), got 2"):
        sharded_apply(_inputs(), _solve, owners=[0, 0])
    with pytest.raises(ValueError, match="unknown strategy 'largest'"):
        sharded_apply(_inputs(), _solve, strategy="largest")


@pytest.mark.parametrize("strategy", ["round-robin", "largest"])
def test_a_strategy_beside_owners_is_refused_not_ignored(strategy: str) -> None:
    # the owners decided and the strategy, even an unknown one, was dropped without a word
    with pytest.raises(ValueError, match=f"sharded_apply takes owners or a strategy, not both; got strategy='{strategy}'"):
        sharded_apply(_inputs(), _solve, strategy=strategy, owners=[0, 0, 0])


def test_a_process_group_without_initialization_is_refused() -> None:
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        sharded_apply(_inputs(), _solve, process_group=object())  # type: ignore[arg-type]
