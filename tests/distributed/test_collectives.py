"""The training loop's collectives in one process: the identity, and raise_together's rules.
(Under two gloo ranks they run in tests/distributed/test_train_ddp.py, through the trainer.)"""

from __future__ import annotations

import pytest

from manifoldlib.distributed import (
    RankFailedError,
    all_gather_objects,
    all_mean,
    from_rank0,
    raise_together,
)


def test_collectives_are_the_identity_in_one_process():
    assert all_mean(2.5) == 2.5 and from_rank0(-1.0) == -1.0
    assert all_gather_objects({"a": 1}) == [{"a": 1}]


def test_raise_together_raises_this_ranks_error_or_returns():
    raise_together(None)
    with pytest.raises(KeyError, match="mine"):
        raise_together(KeyError("mine"), wrap=RankFailedError)
    assert issubclass(RankFailedError, RuntimeError)
