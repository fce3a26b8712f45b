"""init_from_env outside torchrun, its argument checks, and beside a group that already exists
(a group of this one process, on an in-memory store)."""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import torch.distributed as dist

from manifoldlib.distributed import (
    BACKENDS,
    destroy_process_group,
    import_before_init,
    init_from_env,
    is_distributed,
)

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_plain_process_is_rank_zero_of_one(clean_env: pytest.MonkeyPatch) -> None:
    assert init_from_env() == (0, 1, 0)
    for backend in BACKENDS:  # every listed backend passes validation (no group outside torchrun)
        assert init_from_env(backend=backend) == (0, 1, 0)
    assert not is_distributed()
    destroy_process_group()  # nothing to destroy: a no-op
    assert not is_distributed()


def test_incomplete_torchrun_environment_names_the_missing_variables(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("RANK", "0")
    with pytest.raises(ValueError, match="RANK set but LOCAL_RANK, WORLD_SIZE missing"):
        init_from_env()
    assert not is_distributed()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "mpi"}, "backend must be one of gloo, nccl or None, got 'mpi'"),
        ({"timeout": 0}, "timeout must be a finite number > 0 of seconds or None, got 0"),
        # accepted outside torchrun, then a timedelta OverflowError inside it
        ({"timeout": math.inf}, "timeout must be a finite number > 0 of seconds or None, got inf"),
    ],
)
def test_bad_arguments(clean_env: pytest.MonkeyPatch, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        init_from_env(**kwargs)


@pytest.fixture
def group_of_one(clean_env: pytest.MonkeyPatch):
    """A default gloo group of this process alone, 77 s timeout; destroyed afterwards."""
    import_before_init()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=77))
    try:
        yield clean_env
    finally:
        destroy_process_group()


def _group_timeout() -> datetime.timedelta:
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


def test_an_existing_group_is_checked_against_the_environment_and_the_backend(group_of_one) -> None:
    """Beside an existing group, init_from_env returned RANK, WORLD_SIZE and LOCAL_RANK as they were
    ((1, 2, 1) here, in a group of one) and ignored backend (nccl for a gloo group)."""
    assert init_from_env() == (0, 1, 0)  # no torchrun variables: the group's rank and size
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        group_of_one.setenv(name, value)
    with pytest.raises(ValueError, match="RANK=1, WORLD_SIZE=2 in the environment, but the existing default process "
                                         "group has this process as rank 0 of 1"):
        init_from_env()
    group_of_one.setenv("RANK", "0")
    group_of_one.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"init_from_env\(backend='nccl'\): the default process group already "
                                         r"exists with backend 'gloo'"):
        init_from_env("nccl")
    assert init_from_env("gloo") == (0, 1, 1)
    assert is_distributed()


def test_a_timeout_given_beside_an_existing_group_becomes_its_timeout(group_of_one) -> None:
    # it was ignored: the group kept the 77 s it was started with
    assert init_from_env() == (0, 1, 0) and _group_timeout() == datetime.timedelta(seconds=77)
    assert init_from_env(timeout=5.0) == (0, 1, 0)
    assert _group_timeout() == datetime.timedelta(seconds=5)
