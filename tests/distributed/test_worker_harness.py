"""run_workers: failures, hung collectives and runaway jobs end the job with a clear error."""

from __future__ import annotations

import multiprocessing
import re

import pytest
import torch

from manifoldlib.distributed import WorkerError, WorkerTimeoutError, run_workers

try:  # tests laid out as packages
    from . import workers
except ImportError:  # pytest's default rootdir-relative import puts this folder on sys.path
    import workers


@pytest.fixture
def no_leftover_workers():
    """Fails the test if it leaves a child process running that was not there before."""
    before = {p.pid for p in multiprocessing.active_children()}
    yield
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_worker_exception_is_reraised_with_its_rank(no_leftover_workers: None) -> None:
    with pytest.raises(WorkerError) as caught:
        run_workers(workers.raising_job, 2, timeout=120.0, collective_timeout=60.0)
    assert caught.value.rank == 1
    assert "ValueError: deliberate failure on rank 1" in str(caught.value)


def test_hung_collective_fails_at_the_collective_timeout(no_leftover_workers: None) -> None:
    # rank 0 waits in an all_reduce rank 1 never joins; the job timeout is far away, so the
    # error can only come from the process group's collective timeout
    with pytest.raises(WorkerError) as caught:
        run_workers(workers.hung_collective_job, 2, timeout=300.0, collective_timeout=2.0)
    assert caught.value.rank == 0
    message = str(caught.value)
    assert "hung_collective_job" in message and "all_reduce" in message
    assert "timed out" in message.lower()


def test_job_past_its_timeout_is_killed(no_leftover_workers: None) -> None:
    with pytest.raises(WorkerTimeoutError, match="did not finish within 2.0 s"):
        run_workers(workers.never_finishing_job, 2, timeout=2.0)


@pytest.mark.slow  # three 2-process jobs
@pytest.mark.parametrize(("how", "message"), [
    ("sys.exit", "worker rank 1 raised first in leaving_job"),
    ("KeyboardInterrupt", "worker rank 1 raised first in leaving_job"),
    ("os._exit", "worker rank 1 exited with code 0 in leaving_job without returning a result"),
])
def test_a_worker_that_exits_without_returning_is_named(how: str, message: str, no_leftover_workers: None) -> None:
    """torch's spawn wrapper turns SystemExit(0) and KeyboardInterrupt into exit code 0, as is
    os._exit(0): the job counted as a success and the harness then failed opening the missing
    result file (FileNotFoundError: .../result-rank1.pt)."""
    with pytest.raises(WorkerError, match=message) as caught:
        run_workers(workers.leaving_job, 2, how, timeout=120.0)
    assert caught.value.rank == 1


def test_results_come_back_in_rank_order_and_workers_see_torchrun_variables() -> None:
    """Workers had no RANK / WORLD_SIZE / LOCAL_RANK, so init_from_env() in a job ignored the
    group it was in and returned (0, 1, 0) on every rank of 3."""
    reports = run_workers(workers.rank_and_world_job, 3, timeout=120.0)
    assert [r["rank_world"] for r in reports] == [(0, 3), (1, 3), (2, 3)]
    assert [r["env"] for r in reports] == [[str(r), "3", str(r)] for r in range(3)]
    assert [r["init_from_env"] for r in reports] == [(0, 3, 0), (1, 3, 1), (2, 3, 2)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"world_size": 2, "timeout": 0.0}, "timeout must be a finite number of seconds > 0, got 0.0"),
        ({"world_size": 2, "collective_timeout": -1.0}, "collective_timeout must be a finite number of seconds > 0"),
        ({"world_size": 2, "backend": "mpi"}, "backend must be one of gloo, nccl, got 'mpi'"),
        # spawned workers that failed in init_process_group (or all shared cuda:0 where they ran)
        ({"world_size": torch.cuda.device_count() + 1, "backend": "nccl"},
         (f"backend='nccl' needs one CUDA device per rank: world_size={torch.cuda.device_count() + 1} but "
          f"{torch.cuda.device_count()} visible")),
        ({"world_size": 2, "num_threads": 0}, "num_threads must be an int >= 1, got 0"),
        ({"world_size": 2, "start_method": "fork"}, "start_method must be one of"),
    ],
)
def test_bad_arguments_raise_before_starting_anything(kwargs: dict, message: str) -> None:
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=message):
        run_workers(workers.rank_and_world_job, world_size, **kwargs)


_BAD_SECONDS = [True, False, float("inf"), float("nan"), -1, "5"]


@pytest.mark.parametrize(
    ("name", "value"),
    [("timeout", v) for v in [*_BAD_SECONDS, None]] + [("collective_timeout", v) for v in _BAD_SECONDS],
)
def test_timeouts_that_are_not_finite_positive_seconds_are_refused(name: str, value) -> None:
    # timeout=True was taken as 1 s and inf as no limit, silently; start_method="fork" (refused
    # after the timeouts) keeps a timeout that is wrongly accepted from starting workers
    message = f"{name} must be a finite number of seconds > 0, got {value!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        run_workers(workers.rank_and_world_job, 2, start_method="fork", **{name: value})


def test_functions_the_workers_cannot_import_are_refused() -> None:
    def local_job(rank: int) -> int:
        return rank

    for fn in (local_job, lambda rank: rank):
        with pytest.raises(ValueError, match="module-level function"):
            run_workers(fn, 2)


def test_destroying_the_group_after_ddp_stops_its_gloo_threads(no_leftover_workers: None) -> None:
    # torch.distributed.nn.functional, imported by DDP, binds the default group as a default
    # argument when first imported; imported after init it kept the group (and its gloo threads)
    # alive into interpreter shutdown, which aborted ~1 torchrun process in 7 at exit. The
    # harness (and init_from_env) call import_before_init() so that never happens.
    reports = run_workers(workers.ddp_teardown_job, 2, timeout=120.0, collective_timeout=60.0)
    for report in reports:
        assert report["before"], "gloo threads were expected while the group was alive"
        assert report["after"] == []
        assert report["warnings"] == []
