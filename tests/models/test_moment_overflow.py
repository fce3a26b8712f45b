"""models.moment_overflow: an unclipped gradient entry whose square overflows Adam's second moment."""

from __future__ import annotations

import pytest
import torch

from models.moment_overflow import SecondMomentOverflow, check_second_moments, square_limit


def _with_grad(shape, entry, dtype=torch.float32):
    p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
    p.grad = torch.full(shape, 1e-3, dtype=dtype)
    p.grad[0, 0] = entry
    return p


@pytest.mark.parametrize("entry, beta2, steps", [(1e21, 0.999, 1), (2e19, 0.95, 60)],
                         ids=["at-once", "sustained"])
def test_the_premise_torch_adamw_freezes_an_entry_whose_square_overflows(entry, beta2, steps):
    # (1 - beta2) g^2 overflows at once past sqrt(max / (1 - beta2)); v tends to g^2 under a
    # sustained gradient, so past sqrt(max) it overflows within about 1 / (1 - beta2) steps
    p = _with_grad((2, 2), entry)
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, beta2), weight_decay=0.0)
    for _ in range(steps):
        p.grad = torch.full_like(p, 1e-3)
        p.grad[0, 0] = entry
        opt.step()
    assert torch.isinf(opt.state[p]["exp_avg_sq"][0, 0])
    before = p.detach().clone()
    for _ in range(3):
        p.grad = torch.ones_like(p)
        opt.step()
    assert p[0, 0] == before[0, 0]  # frozen for good
    assert bool((p.detach() != before).flatten()[1:].all())  # the others moved


def test_an_overflowing_entry_is_named_before_the_step():
    p = _with_grad((3, 4), 2e19)
    opt = torch.optim.AdamW([{"params": [p], "param_names": ["blocks.0.w"]}], lr=0.1)
    with pytest.raises(SecondMomentOverflow, match=r"parameter 'blocks.0.w' has a gradient entry of 2e\+19 "
                                                   r"\(global norm 3e\+19\) with grad_clip 0.*float32 second "
                                                   r"moment \(past 1.84e\+19\)") as info:
        check_second_moments(opt, 3e19, loss=4.5)
    assert (info.value.loss, info.value.grad_norm) == (4.5, 3e19)
    assert not opt.state  # nothing stepped


def test_entries_below_the_limit_pass_and_so_do_large_norms_of_small_entries():
    p = _with_grad((3, 4), 1.8e19)
    opt = torch.optim.AdamW([p], lr=0.1)
    check_second_moments(opt, 2e19, loss=1.0)  # the norm passes the limit, no entry does
    check_second_moments(opt, 1e3, loss=1.0)  # the norm bounds every entry: no pass needed


def test_the_limit_is_the_parameter_dtype():
    assert square_limit(torch.float16) == pytest.approx(255.94, abs=0.01)
    assert square_limit(torch.bfloat16) == pytest.approx(1.84e19, rel=1e-2)
    p = _with_grad((2, 2), 300.0, dtype=torch.float16)
    with pytest.raises(SecondMomentOverflow, match=r"a parameter of shape \(2, 2\) .*float16 second moment"):
        check_second_moments(torch.optim.Adam([p]), 300.0, loss=1.0)
    check_second_moments(torch.optim.Adam([_with_grad((2, 2), 200.0, dtype=torch.float16)]), 200.0, loss=1.0)


def test_groups_without_second_moments_are_not_checked():
    p = _with_grad((3, 4), 1e22)
    check_second_moments(torch.optim.SGD([p], lr=0.1), 1e22, loss=1.0)
