"""Newton inverses of the SEL magnitude maps: float64 property tests, a float32 tier, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib.charts import solve_expm1_linear, solve_expm1_minus_linear

EPS64 = torch.finfo(torch.float64).eps

positive = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)
curvature = st.floats(min_value=1e-2, max_value=100.0, allow_nan=False, allow_infinity=False)
slope = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)
magnitudes = st.lists(
    st.floats(min_value=0.0, max_value=1e3, allow_nan=False), min_size=1, max_size=16
)


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _backward_stable(x, y, a, b, c, sign: float, k: float = 8.0) -> bool:
    """|f(x) - y| within k eps of the rounding of f's terms, amplified by exp's conditioning b x."""
    grow, lin = a * torch.expm1(b * x), c * x
    f = grow + sign * lin
    bound = k * EPS64 * (1.0 + b * x) * (grow + lin) + 1e-300
    return bool(((f - y).abs() <= bound).all())


@given(y=magnitudes, a=positive, b=curvature, c=slope)
def test_congruent_inverse_is_a_root_float64(y, a, b, c):
    y = _t(y)
    x = solve_expm1_linear(y, a, b, c)
    assert bool((x >= 0).all())
    # Both terms are >= 0, so the residual is relative to y itself (no cancellation).
    assert _backward_stable(x, y, a, b, c, +1.0)


@given(y=magnitudes, a=positive, b=curvature, c=slope)
def test_congruent_inverse_is_monotone_and_unique(y, a, b, c):
    y, _ = torch.sort(_t(y))
    x = solve_expm1_linear(y, a, b, c)
    assert bool((x[1:] >= x[:-1]).all())  # f is increasing, so its inverse is too


@given(y=magnitudes, a=positive, b=curvature, c=slope)
def test_forward_negative_inverse_is_root_beyond_minimum_float64(y, a, b, c):
    y = _t(y)
    t = solve_expm1_minus_linear(y, a, b, c)
    # h is a difference: its rounding error scales with the size of the two terms.
    assert _backward_stable(t, y, a, b, c, -1.0)
    slope_at_root = a * b * torch.exp(b * t) - c
    assert bool((slope_at_root >= -1e-9 * (a * b + c)).all())  # on the increasing branch
    t_min = max((math.log(c) - math.log(a * b)) / b, 0.0) if c > 0 else 0.0
    assert bool((t >= t_min - 1e-12 * (1 + t_min)).all())


@given(y=magnitudes, a=positive, b=curvature)
def test_degenerate_c_zero_is_the_log_closed_form(y, a, b):
    y = _t(y)
    expected = torch.log1p(y / a) / b
    assert torch.allclose(solve_expm1_linear(y, a, b, 0.0), expected, rtol=8 * EPS64, atol=0)
    assert torch.allclose(solve_expm1_minus_linear(y, a, b, 0.0), expected, rtol=8 * EPS64, atol=0)


@given(y=magnitudes, b=curvature, c=positive)
def test_degenerate_a_zero_is_the_linear_closed_form(y, b, c):
    y = _t(y)
    assert torch.allclose(solve_expm1_linear(y, 0.0, b, c), y / c, rtol=4 * EPS64, atol=0)


def test_forward_negative_without_exponential_has_no_root():
    t = solve_expm1_minus_linear(_t([0.0, 1.0]), 0.0, 1.0, 0.5)
    assert t[0].item() == 0.0
    assert math.isnan(t[1].item())


def test_forward_negative_zero_target_returns_largest_root():
    a, b, c = 0.1, 2.0, 0.5  # ab = 0.2 < c: h dips below 0 and returns to 0 at t* > 0
    t = solve_expm1_minus_linear(_t([0.0]), a, b, c)
    assert t.item() > 0
    assert abs(a * math.expm1(b * t.item()) - c * t.item()) < 1e-14


def test_broadcasting_and_float32_tier():
    g = torch.Generator().manual_seed(1)
    y = torch.distributions.StudentT(2.0).sample((64, 32)).abs().float() * 0.1
    a = torch.rand(64, 1, generator=g) + 0.05
    b = 10 * torch.rand(1, 32, generator=g) + 0.5
    c = torch.rand(64, 1, generator=g)
    x = solve_expm1_linear(y, a, b, c)
    assert x.dtype == torch.float32 and x.shape == (64, 32)
    f = a * torch.expm1(b * x) + c * x
    assert torch.allclose(f, y, rtol=1e-6, atol=1e-30)


def test_large_targets_converge_in_log_space():
    y = _t([1e-300, 1e-8, 1.0, 1e10, 1e100])
    x = solve_expm1_linear(y, 1e-3, 50.0, 1e-6)
    assert _backward_stable(x, y, 1e-3, 50.0, 1e-6, +1.0)
    assert x[-1].item() == pytest.approx(math.log(1e103) / 50.0, rel=1e-14)  # log-space regime
    t = solve_expm1_minus_linear(y[1:], 1e-3, 50.0, 1.0)
    assert _backward_stable(t, y[1:], 1e-3, 50.0, 1.0, -1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"y": _t([-1.0]), "a": 1.0, "b": 1.0, "c": 1.0}, "y must be finite and >= 0"),
        ({"y": _t([math.nan]), "a": 1.0, "b": 1.0, "c": 1.0}, "y must be finite"),
        ({"y": _t([1.0]), "a": -1.0, "b": 1.0, "c": 1.0}, "a must be"),
        ({"y": _t([1.0]), "a": 1.0, "b": 0.0, "c": 1.0}, "b must be"),
        ({"y": _t([1.0]), "a": 1.0, "b": 1.0, "c": math.inf}, "c must be"),
        ({"y": _t([1.0]), "a": 0.0, "b": 1.0, "c": 0.0}, "both 0"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        solve_expm1_linear(**kwargs)
