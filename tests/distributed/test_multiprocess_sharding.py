"""Two gloo processes: sharded_apply gives every rank the single-process results, bit for bit.

One 2-process job (module-scoped fixture) runs every strategy; the parent compares it with
the same work done in this process without any process group. Spawning costs seconds, so the
checks share that one job.
"""

from __future__ import annotations

import pytest
import torch

from manifoldlib.distributed import STRATEGIES, assign_owners, run_workers

try:  # tests laid out as packages
    from . import workers
except ImportError:  # pytest's default rootdir-relative import puts this folder on sys.path
    import workers

WORLD_SIZE = 2
JOB_TIMEOUT_S = 120.0  # start-up of two interpreters on a contended 2-core machine included


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_workers(
        workers.sharding_job, WORLD_SIZE, timeout=JOB_TIMEOUT_S, collective_timeout=60.0
    )


@pytest.fixture(scope="module")
def single_process() -> list[torch.Tensor]:
    # the workers run one intra-op thread; match it so reductions happen in the same order
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [workers.reference_fn(i, t) for i, t in enumerate(workers.make_inputs())]
    finally:
        torch.set_num_threads(threads)


def _assert_bitwise_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, (i, g.shape, e.shape, g.dtype, e.dtype)
        assert torch.equal(g, e), (
            f"tensor {i} differs: max |diff| {(g.double() - e.double()).abs().max()}"
        )


def test_ranks_report_their_place(reports: list[dict]) -> None:
    assert [r["rank_world"] for r in reports] == [(0, WORLD_SIZE), (1, WORLD_SIZE)]
    assert [r["singleton_rank_world"] for r in reports] == [(0, 1), (0, 1)]


@pytest.mark.parametrize("strategy", [*STRATEGIES, "all-on-last"])
def test_every_rank_gets_the_single_process_results(
    reports: list[dict], single_process: list[torch.Tensor], strategy: str
) -> None:
    for report in reports:
        _assert_bitwise_equal(report["results"][strategy], single_process)


def test_in_worker_local_computation_matches_parent(
    reports: list[dict], single_process: list[torch.Tensor]
) -> None:
    # guards the comparison above: the same kernels in a worker give the parent's bits
    for report in reports:
        _assert_bitwise_equal(report["local"], single_process)
        _assert_bitwise_equal(report["singleton"], single_process)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fn_runs_only_on_the_owner(reports: list[dict], strategy: str) -> None:
    shapes = [shape for shape, _ in workers.CASES]
    owners = assign_owners(shapes, WORLD_SIZE, strategy)
    for rank, report in enumerate(reports):
        assert report["owners"][strategy] == owners
        assert sorted(report["calls"][strategy]) == [i for i, r in enumerate(owners) if r == rank]
    calls = [i for report in reports for i in report["calls"][strategy]]
    assert sorted(calls) == list(range(len(shapes)))  # each index solved exactly once
    assert {owners[i] for i in range(len(shapes))} == set(range(WORLD_SIZE))  # both ranks work


def test_sharded_parameters_are_rejected_on_every_rank(reports: list[dict]) -> None:
    for report in reports:
        messages = report["rejections"]
        assert len(messages) == 3
        for message in messages:
            assert message.startswith("UnsupportedParameterError: "), message
            assert "DTensor" in message and "DistributedDataParallel" in message
        assert "'tp.weight'" in messages[0] and "Shard(dim=0)" in messages[0]
        assert "'fsdp2.weight'" in messages[1] and "'fsdp2.bias'" in messages[2]


def test_ranks_passing_different_tensors_or_owners_fail_together_naming_the_first(
    reports: list[dict],
) -> None:
    # the same payload sizes on both ranks, so the gathers succeed: each rank used to unpack
    # the other's results as its own (a (2, 3) result read as (3, 2), int32 bits as float32)
    for report in reports:
        errors = report["mismatches"]
        assert "tensor 0 is (2, 3) torch.float64 on rank 0 and (3, 2) torch.float64 on rank 1" \
            in errors["order"]
        assert "tensor 0 is (4, 4) torch.float32 on rank 0 and (4, 4) torch.int32 on rank 1" \
            in errors["dtype"]
        assert "tensor 0 is owned by rank 0 on rank 0 and by rank 1 on rank 1" in errors["owners"]
        assert all("same shapes and dtypes in the same order" in e for e in errors.values())


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_ranks_passing_other_dtypes_or_no_tensors_fail_together_before_any_gather(
    reports: list[dict], rank: int
) -> None:
    # one gather per dtype: ranks with other dtype sets (or none) used to wait in different
    # collectives until the process group's timeout; now each names its own and the other's layout
    errors = reports[rank]["mismatches"]
    this = {0: " (this rank)", 1: ""} if rank == 0 else {0: "", 1: " (this rank)"}
    assert errors["dtype_sets"].startswith(
        "sharded_apply: the ranks passed different tensors or owners (tensor 1 is (4, 4) "
        "torch.float64 on rank 0 and (4, 4) torch.float32 on rank 1)")
    assert errors["dtype_sets"].endswith(
        f"passed: rank 0{this[0]}: 2 tensors: (4, 4) torch.float32 on rank 0, (4, 4) torch.float64 "
        f"on rank 1; rank 1{this[1]}: 2 tensors: (4, 4) torch.float32 on rank 0, (4, 4) "
        f"torch.float32 on rank 1")
    assert "(rank 0 passed 1 tensors, rank 1 0)" in errors["empty"]
    assert errors["empty"].endswith(
        f"passed: rank 0{this[0]}: 1 tensor: (3, 3) torch.float32 on rank 0; "
        f"rank 1{this[1]}: 0 tensors")


def test_the_layout_check_costs_one_small_gather_and_no_check_nothing(
    reports: list[dict],
) -> None:
    # workers.CASES: five dtypes, one of them (int32) with only empty tensors: four result gathers
    for report in reports:
        assert report["collectives"] == {True: (5, 1), False: (4, 0)}


MUON_STEPS = 10


@pytest.fixture(scope="module")
def muon_reports() -> list[dict]:
    return run_workers(
        workers.stiefel_muon_job,
        WORLD_SIZE,
        MUON_STEPS,
        timeout=JOB_TIMEOUT_S,
        collective_timeout=60.0,
    )


def test_sharded_optimizer_pattern_matches_one_process_after_ten_steps(
    muon_reports: list[dict],
) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        weights, multipliers, held = workers.stiefel_muon_pattern(MUON_STEPS)
    finally:
        torch.set_num_threads(threads)
    assert held == list(range(len(workers.STIEFEL_SHAPES)))  # one process owns everything
    for report in muon_reports:
        # bit for bit, stronger than the 1e-6: the same kernels ran on the same inputs
        _assert_bitwise_equal(report["weights"], weights)
        _assert_bitwise_equal(report["multipliers"], multipliers)
    # the loop really moved the weights, and they stayed on the Stiefel manifold
    initial, _, _ = workers.stiefel_muon_pattern(0)
    assert all((w - w0).abs().max() > 1e-2 for w, w0 in zip(weights, initial))
    for w in weights:
        eye = torch.eye(w.size(-1), dtype=w.dtype)
        assert torch.allclose(w.mT @ w, eye, atol=1e-12)


def test_owner_only_state_lives_on_exactly_one_rank(muon_reports: list[dict]) -> None:
    owners = muon_reports[0]["owners"]
    for rank, report in enumerate(muon_reports):
        assert report["owners"] == owners
        assert report["held"] == [i for i, r in enumerate(owners) if r == rank]
    assert sorted(muon_reports[0]["held"] + muon_reports[1]["held"]) == list(range(len(owners)))
