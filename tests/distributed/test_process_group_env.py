"""init_from_env outside torchrun, and its argument checks (no process group is created)."""

from __future__ import annotations

import pytest

from manifoldlib.distributed import BACKENDS, destroy_process_group, init_from_env, is_distributed

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
        ({"timeout": 0}, "timeout must be > 0 seconds, got 0"),
    ],
)
def test_bad_arguments(clean_env: pytest.MonkeyPatch, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        init_from_env(**kwargs)
