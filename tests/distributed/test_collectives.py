"""The training loop's collectives in one process: the identity, and raise_together's rules.
(Under two gloo ranks they run in tests/distributed/test_train_ddp.py, through the trainer.)"""

from __future__ import annotations

import re

import pytest
import torch

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


@pytest.mark.parametrize("collective", [all_mean, from_rank0])
def test_a_value_the_float64_collective_cannot_carry_is_refused(collective):
    """They carry float64 between ranks but returned a value as given in one process: an int past
    2**53 arrived rounded on the other ranks (from_rank0(2**53 + 1) is 9007199254740992.0 there),
    a string or a list passed through one process and failed inside torch.tensor or after the
    collective under several; an int or a bool came back an int or a bool in one process only."""
    name = collective.__name__
    with pytest.raises(ValueError, match=rf"{name} carries float64, which holds integers exactly up to 2\*\*53 only, "
                                         r"got 9007199254740993 \(it would arrive as 9007199254740992.0\)"):
        collective(2**53 + 1)
    for value in ("1.5", [1.0, 2.0], torch.ones(2), 1j, None):
        with pytest.raises(ValueError, match=rf"{name} takes a real number \(int, float, bool or a one-element real "
                                             rf"tensor\), got {re.escape(repr(value))}"):
            collective(value)
    for value, number in ((3, 3.0), (True, 1.0), (torch.tensor(2.5), 2.5), (-(2**53), -(2.0**53))):
        result = collective(value)
        assert type(result) is float and result == number


def test_raise_together_raises_this_ranks_error_or_returns():
    raise_together(None)
    with pytest.raises(KeyError, match="mine"):
        raise_together(KeyError("mine"), wrap=RankFailedError)
    assert issubclass(RankFailedError, RuntimeError)
