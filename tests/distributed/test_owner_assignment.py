"""assign_owners: deterministic, complete, and balanced by matrix cost."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib.distributed import STRATEGIES, assign_owners, matrix_cost, rank_loads

dims = st.integers(min_value=1, max_value=64)
matrix_shapes = st.tuples(dims, dims)
shapes_lists = st.lists(
    st.one_of(matrix_shapes, st.tuples(dims), st.tuples(st.integers(1, 3), dims, dims)),
    max_size=24,
)
world_sizes = st.integers(min_value=1, max_value=8)


def test_matrix_cost_follows_the_newton_schulz_flop_count() -> None:
    assert matrix_cost((768, 3072)) == 768 * 3072 * 768
    assert matrix_cost((3072, 768)) == matrix_cost((768, 3072))
    assert matrix_cost(torch.Size([4, 10, 6])) == 4 * 10 * 6 * 6
    assert matrix_cost((17,)) == 17 and matrix_cost(17) == 17 and matrix_cost(()) == 1
    assert matrix_cost((0, 5)) == 0


@given(shapes=shapes_lists, world_size=world_sizes, strategy=st.sampled_from(STRATEGIES))
def test_every_matrix_gets_one_valid_owner_deterministically(
    shapes: list[tuple[int, ...]], world_size: int, strategy: str
) -> None:
    owners = assign_owners(shapes, world_size, strategy)
    assert len(owners) == len(shapes)
    assert all(0 <= r < world_size for r in owners)
    assert assign_owners(list(shapes), world_size, strategy) == owners
    # element counts and shapes of equal cost give the same assignment
    assert assign_owners([matrix_cost(s) for s in shapes], world_size, strategy) == owners


@given(count=st.integers(0, 40), world_size=world_sizes)
def test_round_robin_counts_differ_by_at_most_one(count: int, world_size: int) -> None:
    owners = assign_owners([(8, 8)] * count, world_size, "round-robin")
    counts = [owners.count(r) for r in range(world_size)]
    assert max(counts) - min(counts) <= 1 and sum(counts) == count
    assert owners[:world_size] == list(range(min(count, world_size)))


@given(shapes=shapes_lists, world_size=world_sizes)
def test_size_strategy_is_balanced_within_one_matrix(
    shapes: list[tuple[int, ...]], world_size: int
) -> None:
    owners = assign_owners(shapes, world_size, "size")
    loads = rank_loads(shapes, owners, world_size)
    costs = [matrix_cost(s) for s in shapes]
    assert sum(loads) == sum(costs)
    largest = max(costs, default=0)
    # list scheduling: each matrix joins the lightest rank, so the spread never exceeds one matrix
    assert max(loads) - min(loads) <= largest
    assert max(loads) * world_size <= sum(costs) + (world_size - 1) * largest


@given(
    shapes=st.lists(matrix_shapes, min_size=1, max_size=7),
    world_size=st.integers(min_value=2, max_value=3),
)
def test_size_strategy_meets_the_lpt_bound_against_brute_force(
    shapes: list[tuple[int, int]], world_size: int
) -> None:
    costs = [matrix_cost(s) for s in shapes]
    optimum = min(
        max(sum(c for c, r in zip(costs, assignment) if r == rank) for rank in range(world_size))
        for assignment in itertools.product(range(world_size), repeat=len(costs))
    )
    loads = rank_loads(shapes, assign_owners(shapes, world_size, "size"), world_size)
    # Graham's bound for longest-processing-time-first, in integers
    assert 3 * world_size * max(loads) <= (4 * world_size - 1) * optimum


@given(shapes=shapes_lists, world_size=world_sizes, data=st.data())
def test_size_loads_do_not_depend_on_the_input_order(
    shapes: list[tuple[int, ...]], world_size: int, data: st.DataObject
) -> None:
    permuted = data.draw(st.permutations(shapes))
    loads = rank_loads(shapes, assign_owners(shapes, world_size, "size"), world_size)
    permuted_loads = rank_loads(permuted, assign_owners(permuted, world_size, "size"), world_size)
    assert sorted(loads) == sorted(permuted_loads)


@given(shapes=st.lists(matrix_shapes, max_size=8), extra=st.integers(0, 4))
def test_size_strategy_spreads_few_matrices_one_per_rank(
    shapes: list[tuple[int, int]], extra: int
) -> None:
    owners = assign_owners(shapes, len(shapes) + extra or 1, "size")
    assert len(set(owners)) == len(owners)


def test_size_strategy_balances_transformer_layers_that_round_robin_does_not() -> None:
    # per layer: q, k, v, o are 768x768 (cost c), fc 768x3072 and proj 3072x768 (cost 4c each)
    layer = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]
    c = matrix_cost((768, 768))
    for n_layers in (1, 2, 3):
        shapes = layer * n_layers
        by_size = rank_loads(shapes, assign_owners(shapes, 3, "size"), 3)
        by_index = rank_loads(shapes, assign_owners(shapes, 3, "round-robin"), 3)
        assert by_size == [4 * c * n_layers] * 3  # 12c per layer split evenly
        assert max(by_index) > max(by_size)  # round-robin puts both 4c matrices on ranks 1, 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([(2, 2)], 0), "world_size must be an int >= 1, got 0"),
        (([(2, 2)], 2.0), "world_size must be an int >= 1, got 2.0"),
        (([(2, 2)], 2, "random"), "unknown strategy 'random'; valid strategies: round-robin, size"),
        (([(2, -1)], 2), r"a shape must hold non-negative ints, got \(2, -1\)"),
        (([-3], 2), "a number of elements must be >= 0, got -3"),
        (([2.5], 2), "expected a shape .* or a number of elements .*, got 2.5"),
    ],
)
def test_bad_arguments_name_the_value(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        assign_owners(*args)


def test_rank_loads_checks_the_owners() -> None:
    with pytest.raises(ValueError, match=r"owners must be ranks in \[0, 2\), got 2"):
        rank_loads([(2, 2)], [2], 2)
    with pytest.raises(ValueError, match=r"one entry per tensor \(2\), got 1"):
        rank_loads([(2, 2), (3, 3)], [0], 2)
