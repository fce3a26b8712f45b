"""SEL parameter groups and the scale-parameter LR annealing."""

from __future__ import annotations

import functools
import itertools
import math
import re

import pytest
import torch
from torch import nn

from manifoldlib.charts import (
    SEL,
    SEL_ROLES,
    SELLRMultiplier,
    apply_chart,
    sel_lr_lambdas,
    sel_lr_scheduler,
    sel_param_groups,
)


def charted_mlp(rank: int = 0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.LayerNorm(4))
    apply_chart(model, functools.partial(SEL, rank=rank))
    return model


def test_groups_partition_all_parameters_by_role():
    model = charted_mlp(rank=2)
    groups = sel_param_groups(model, lr=1e-3, scale_lr=5e-2, weight_decay=0.1)
    seen = [id(p) for g in groups for p in g["params"]]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    by_role = {g["sel_role"]: g for g in groups}
    assert list(by_role) == ["weight", "other", "e_w", "l_w", "m", "n", "delta"]
    assert list(by_role)[2:] == list(SEL_ROLES)
    assert by_role["weight"]["weight_decay"] == 0.1 and by_role["weight"]["lr"] == 1e-3
    raw = {id(m.parametrizations.weight.original) for m in (model[0], model[2])}
    assert raw <= {id(p) for p in by_role["weight"]["params"]}
    for role in ("e_w", "l_w", "m", "n"):
        assert by_role[role]["lr"] == 5e-2 and by_role[role]["weight_decay"] == 0.0
        assert len(by_role[role]["params"]) == 4  # row + column for each of the two charts
    assert by_role["delta"]["lr"] == 1e-3


def test_groups_of_a_plain_model_and_frozen_parameters():
    model = nn.Linear(3, 3)
    model.bias.requires_grad_(False)
    groups = sel_param_groups(model, lr=0.1)
    assert [g["sel_role"] for g in groups] == ["weight"]


@pytest.mark.parametrize(
    "kwargs", [{"lr": -1.0}, {"lr": 1.0, "scale_lr": math.nan}, {"lr": 1.0, "weight_decay": -0.1},
               {"lr": "0.1"}, {"lr": 1.0, "scale_lr": True}]  # a str was math.isfinite's TypeError
)
def test_groups_reject_bad_rates(kwargs):
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        sel_param_groups(nn.Linear(2, 2), **kwargs)


def test_multipliers_anneal_e_w_down_and_m_up():
    T = 50
    e_w = SELLRMultiplier("e_w", T, e_w_boost=8.0)
    m = SELLRMultiplier("m", T, m_start=0.2)
    other = SELLRMultiplier("l_w", T)
    steps = range(2 * T)
    e_vals, m_vals = [e_w(s) for s in steps], [m(s) for s in steps]
    assert e_vals[0] == pytest.approx(8.0) and m_vals[0] == pytest.approx(0.2)
    assert all(v == pytest.approx(1.0) for v in e_vals[T:] + m_vals[T:])
    assert all(x >= y for x, y in itertools.pairwise(e_vals))
    assert all(x <= y for x, y in itertools.pairwise(m_vals))
    assert all(other(s) == 1.0 for s in steps)
    with_base = SELLRMultiplier("e_w", T, e_w_boost=8.0, base=lambda s: 0.5)
    assert with_base(0) == pytest.approx(4.0)


def test_lambda_lr_applies_per_group_multipliers():
    model = charted_mlp()
    opt = torch.optim.AdamW(sel_param_groups(model, lr=1e-3, scale_lr=1e-2))
    sched = sel_lr_scheduler(opt, anneal_steps=4, e_w_boost=10.0, m_start=0.1)
    lrs = {g["sel_role"]: g["lr"] for g in opt.param_groups}
    assert (
        lrs["e_w"] == pytest.approx(0.1)
        and lrs["m"] == pytest.approx(1e-3)
        and lrs["weight"] == pytest.approx(1e-3)
    )
    for _ in range(4):
        opt.step()
        sched.step()
    lrs = {g["sel_role"]: g["lr"] for g in opt.param_groups}
    assert lrs["e_w"] == pytest.approx(1e-2) and lrs["m"] == pytest.approx(1e-2)
    state = sched.state_dict()
    assert len(sel_lr_lambdas(opt, 4)) == len(opt.param_groups)
    fresh = sel_lr_scheduler(opt, anneal_steps=4)
    fresh.load_state_dict(state)
    assert fresh.last_epoch == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"anneal_steps": 0}, "anneal_steps must be an int >= 1, got 0"),
        ({"anneal_steps": 5, "e_w_boost": 0.5}, "e_w_boost must be a finite number >= 1, got 0.5"),
        ({"anneal_steps": 5, "m_start": 0.0}, r"m_start must be in \(0, 1\], got 0.0"),
        ({"anneal_steps": True}, "anneal_steps must be an int >= 1, got True"),
        ({"anneal_steps": 5, "e_w_boost": "10"}, "e_w_boost must be a finite number >= 1, got '10'"),
        ({"anneal_steps": 5, "m_start": "0.1"}, r"m_start must be in \(0, 1\], got '0.1'"),
    ],
)
def test_multiplier_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SELLRMultiplier("e_w", **kwargs)


@pytest.mark.parametrize("role", ["e-w", "E_W", " m", "lw", "", None, 0])
def test_multiplier_refuses_an_unknown_role(role):
    """A misspelt role ("e-w") got the constant multiplier silently: no annealing at all."""
    with pytest.raises(ValueError, match=r"role must be one of \('weight', 'other', 'e_w'.*got "
                       + re.escape(repr(role))):
        SELLRMultiplier(role, 10)


def test_every_role_of_the_groups_is_accepted_and_a_bad_group_tag_is_named():
    for role in ("weight", "other", *SEL_ROLES):
        SELLRMultiplier(role, 10)(0)
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "sel_role": "e-w"}], lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0 has sel_role 'e-w'"):
        sel_lr_lambdas(opt, 10)


def test_multiplier_refuses_a_base_that_is_not_callable():
    """base=0.5 (a number where a schedule is meant) was accepted and failed at the first step."""
    with pytest.raises(ValueError, match=r"base must be None or a callable .*got 0.5"):
        SELLRMultiplier("e_w", 10, base=0.5)
