"""Newton inverses of the SEL magnitude maps: float64 property tests, a float32 tier, edge cases."""

from __future__ import annotations

import itertools
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


# Extreme coefficients: every root checked against mpmath at 50 digits by a sign change of
# f(t) - y across [t_lo, t_hi] around the returned t (f increasing there, so the exact root lies
# inside). The interval is one ulp of the dtype either side, widened by the root's condition
# number under relative perturbations of y, a, b, c when that is larger.

mpmath = pytest.importorskip("mpmath")

_GRIDS = {
    torch.float64: [0.0, 1e-300, 1e-100, 1e-5, 1.0, 1e5, 1e100, 1e300],
    torch.float32: [0.0, 1e-38, 1e-20, 1e-5, 1.0, 1e5, 1e20, 1e38],
}


def _mp_residual(t, y, a, b, c, sign):
    """f(t) - y in mpmath (a huge exponent settles the sign without forming e^u)."""
    u = b * t
    if u > 1e5:
        return mpmath.mpf(1)
    return a * mpmath.expm1(u) + sign * c * t - y


def _brackets_root(t: float, y, a, b, c, sign: float, dtype: torch.dtype) -> bool:
    with mpmath.workdps(50):
        y, a, b, c, t_mp = (mpmath.mpf(v) for v in (y, a, b, c, t))
        u = b * t_mp
        if t > 0 and u < 1e5:
            grow = a * u * mpmath.exp(u)  # t E'(t)
            num = y + a * mpmath.expm1(u) + c * t_mp + grow
            den = grow + sign * c * t_mp
            kappa = float(num / den) if den > 0 else math.inf
        else:
            kappa = 1.0
        ulp = torch.finfo(dtype).eps
        delta = max(ulp, 16 * EPS64 * kappa) * t + 2 * torch.finfo(dtype).smallest_normal * ulp
        if y == 0 and (sign > 0 or a * b >= c):
            return t == 0  # the root itself (the largest one for h when ab >= c)
        # Left end: not below 0, nor below the minimum of h (where h < 0 <= y).
        floor = mpmath.log(c / (a * b)) / b if sign < 0 and c > a * b else 0
        lo, hi = max(mpmath.mpf(t - delta), floor), mpmath.mpf(t + delta)
        return _mp_residual(lo, y, a, b, c, sign) < 0 < _mp_residual(hi, y, a, b, c, sign)


def _grid(dtype):
    values = _GRIDS[dtype]
    rows = [v for v in itertools.product(values, repeat=4) if v[1] > 0 and v[2] > 0]
    return [torch.tensor(col, dtype=dtype) for col in zip(*rows)]


def _overflows(y, a, b, c, sign, dtype) -> bool:
    """f(max) < y in mpmath: the root is beyond the dtype."""
    with mpmath.workdps(50):
        big = mpmath.mpf(torch.finfo(dtype).max)
        return _mp_residual(big, *(mpmath.mpf(v) for v in (y, a, b, c)), sign) < 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_roots_over_the_whole_range_agree_with_mpmath(dtype, sign):
    solve = solve_expm1_linear if sign > 0 else solve_expm1_minus_linear
    y, a, b, c = _grid(dtype)
    cases = list(zip(*(v.tolist() for v in (y, a, b, c))))
    beyond = torch.tensor([_overflows(*case, sign, dtype) for case in cases])
    t = solve(y[~beyond], a[~beyond], b[~beyond], c[~beyond])
    assert t.dtype == dtype and bool(torch.isfinite(t).all())
    kept = [case for case, out in zip(cases, beyond.tolist()) if not out]
    wrong = [(case, r) for case, r in zip(kept, t.tolist()) if not _brackets_root(r, *case, sign, dtype)]
    assert not wrong, f"{len(wrong)} roots off, e.g. {wrong[:3]}"
    for case in [case for case, out in zip(cases, beyond.tolist()) if out][:20]:
        with pytest.raises(ValueError, match="no root in"):
            solve(*(torch.tensor([v], dtype=dtype) for v in case))


@pytest.mark.parametrize(
    "solve, dtype, args, expected",
    [  # the old starting point log1p(y/a) overflowed and Newton stalled on inf
        (solve_expm1_minus_linear, torch.float64, (5.0, 1e-300, 1e-3, 1e-5), 693254.797746),
        (solve_expm1_linear, torch.float64, (1e300, 1.0, 1e-300, 1.0), 1e300),
        (solve_expm1_linear, torch.float64, (1e-300, 1e100, 1e-300, 0.0), 1e-100),  # y/a underflowed: 0
        (solve_expm1_linear, torch.float32, (1e30, 1e-30, 1.0, 1.0), 138.155106),  # was 1e30
        (solve_expm1_linear, torch.float32, (1e20, 1e-20, 1e20, 1e-20), 9.2103404e-19),  # was inf
    ],
)
def test_extreme_coefficients_regressions(solve, dtype, args, expected):
    y, a, b, c = (torch.tensor(v, dtype=dtype) for v in args)
    assert solve(y, a, b, c).item() == pytest.approx(expected, rel=1e-6, abs=0)


def test_root_beyond_the_dtype_raises_naming_the_values():
    with pytest.raises(ValueError, match=r"no root in torch.float32 at y=1e\+38, a=1e-38"):
        solve_expm1_linear(torch.tensor([1e38]), 1e-38, 1e-38, 1e-38)
    with pytest.raises(ValueError, match="no root in torch.float64"):
        solve_expm1_linear(_t([1e300]), 1e-300, 1e-307, 1e-300)
    with pytest.raises(ValueError, match="no root in torch.float64"):
        solve_expm1_minus_linear(_t([1e300]), 1e-300, 1e-307, 0.0)


@pytest.mark.parametrize("a", [2e21, 1.5e23, 4e23])
@pytest.mark.parametrize("c", [0.0, 0.5])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_target_below_a_by_a_subnormal_ratio_is_solved(a, c, sign):
    """y/a subnormal in float64 (4.9e-324 to 5e-322): torch.log1p is inexact there (log1p(4.9e-324)
    returned 0, log1p(4.9e-322) 1.2 % low), so the log-space start log(log1p(y/a)/b) fell left of
    the root (or to 0) and Newton, which only moves left, kept it: solve_expm1_linear(1e-300,
    2e23, 5e-24, 0) was 0.0, and 9.90e-301 at a = 2e21, instead of 1e-300."""
    solve = solve_expm1_linear if sign > 0 else solve_expm1_minus_linear
    y, b = 1e-300, 1.0 / a
    with mpmath.workdps(50):  # b t is below 1e-320: the map is linear to far below float64's eps
        Y, A, B, C = (mpmath.mpf(v) for v in (y, a, b, c))
        expected = float(Y / (A * B + sign * C))
    t = solve(_t([y]), a, b, c)
    assert t.item() == pytest.approx(expected, rel=4 * EPS64, abs=0)


@pytest.mark.parametrize(
    "sign, dtype, a, c",
    [
        (1.0, torch.float32, 1e-50, 1e-30),  # a was 0 in float32: the root y/c = 1e30, not 115.13
        (1.0, torch.float32, torch.tensor(1e-50, dtype=torch.float64), 1e-30),  # a float64 tensor too
        (1.0, torch.float16, 1e-8, 1e-3),  # a was 0 in float16: 999.5, not 18.40
        (-1.0, torch.float16, 1e-8, 1e-3),  # a was 0: nan ("no root"), not 18.44
    ],
)
def test_coefficients_are_not_rounded_to_the_targets_dtype(sign, dtype, a, c):
    """The coefficients were cast to y's dtype before the float64 work, so a coefficient below its
    range became 0 and the solvers solved another equation; the root is now that of the given
    coefficients, rounded once to y's dtype."""
    solve = solve_expm1_linear if sign > 0 else solve_expm1_minus_linear
    y, b = 1.0, 1.0
    with mpmath.workdps(50):
        A, C = mpmath.mpf(float(a)), mpmath.mpf(c)
        lo, hi = mpmath.mpf(12), mpmath.mpf(200)  # f increases on it (h's minimum is at 11.5)
        for _ in range(200):  # bisection
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if A * mpmath.expm1(mid) + sign * C * mid < y else (lo, mid)
        root = lo
    t = solve(torch.tensor([y], dtype=dtype), a, b, c)
    assert t.dtype == dtype
    assert t.item() == pytest.approx(float(root), rel=torch.finfo(dtype).eps, abs=0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_target_given_as_python_numbers_is_solved_in_float64(sign):
    """Python numbers have no dtype of their own; y went through torch's default dtype, float32,
    so y = 1e-50 became 0 and the root 0, y = 0.1 got a float32 root and y = 1e300 was refused as
    inf. Taken in float64 like the coefficients, they give the float64 tensor's roots."""
    solve = solve_expm1_linear if sign > 0 else solve_expm1_minus_linear
    y = [1e-50, 0.1, 1e300]
    t = solve(y, 1.0, 1.0, 0.5)
    assert t.dtype == torch.float64 and torch.equal(t, solve(_t(y), 1.0, 1.0, 0.5))
    assert t[0].item() == pytest.approx(1e-50 / (1.0 + sign * 0.5), rel=4 * EPS64, abs=0)
    scalar = solve(1e-50, 1.0, 1.0, 0.5)
    assert scalar.dtype == torch.float64 and scalar.item() == t[0].item()
    with pytest.raises(ValueError, match="y must be a floating-point tensor or real numbers"):
        solve(True, 1.0, 1.0, 0.5)


@pytest.mark.parametrize("solve", [solve_expm1_linear, solve_expm1_minus_linear])
def test_a_tolerance_that_is_not_a_finite_number_at_least_0_is_refused(solve):
    """A NaN or infinite tol stopped Newton after its first step (no step is larger than it) and
    returned that iterate as the root, without an error; True was taken as 1."""
    y = _t([1e6, 3.0])
    for tol in (math.nan, math.inf, -1e-3, True, "1e-3"):
        with pytest.raises(ValueError, match=rf"tol must be a finite number >= 0 .*, got {tol!r}"):
            solve(y, 0.5, 2.0, 0.25, tol=tol)
    exact = solve(y, 0.5, 2.0, 0.25)  # 0: iterate until no step is left
    assert torch.allclose(solve(y, 0.5, 2.0, 0.25, tol=0), exact, rtol=4 * EPS64, atol=0)
