"""The SEL clamp of b|w|: what ``max_exponent`` reads, where right_inverse checks it, and the scale."""

from __future__ import annotations

import contextlib
import functools
import io
import math
import re

import pytest
import torch
from torch import nn

from manifoldlib import _cpu_kernels
from manifoldlib.charts import SEL, apply_chart

F16_DEFAULT = 0.5 * math.log(torch.finfo(torch.float16).max)  # 5.545
F32_DEFAULT = 0.5 * math.log(torch.finfo(torch.float32).max)  # 44.36


def _charted_linear(dtype, **options):
    torch.manual_seed(0)
    lin = nn.Linear(16, 4).to(dtype)
    apply_chart(lin, functools.partial(SEL, **options))
    return lin, lin.parametrizations.weight[0]


def _float64_scales(chart: SEL):
    """``(a, b, c)`` in float64 from the chart's own (rounded) parameters, as the rule forms them."""
    params = {n: p.detach().double() for n, p in chart.named_parameters()}

    def full(name):
        return params[f"{name}_row"] + params.get(f"{name}_col", 0.0)
    a = torch.exp(full("log_e_w") - full("n"))
    b = torch.exp(full("log_m")) * chart.beta.double()
    return a, b, torch.exp(full("log_l_w"))


def _clamped_entry(lin, chart, bw: float) -> tuple[float, float]:
    """Set raw entry (0, 0) at b|w| = bw; return the weight there and ``s a expm1(M) + c t`` in
    float64 at the clamp ``M = chart.max_exponent``."""
    _, b, _ = _float64_scales(chart)
    with torch.no_grad():
        lin.parametrizations.weight.original[0, 0] = bw / b[0, 0]
    a, _, c = _float64_scales(chart)
    t = float(lin.parametrizations.weight.original[0, 0].double())
    want = float(a[0, 0]) * math.expm1(chart.max_exponent) + float(c[0, 0]) * t
    return float(lin.weight[0, 0].detach().double()), want


@pytest.mark.parametrize(("built", "cast"), [
    (torch.float32, torch.float16), (torch.float64, torch.float16),
    (torch.float64, torch.float32), (torch.float64, torch.bfloat16),
])
def test_max_exponent_reads_the_clamp_in_effect_after_a_cast(built, cast):
    # max_exponent kept the value the chart was built with (44.36 in float32) after .half(),
    # whose clamp is 5.545: an entry at b|w| = 8 is 27.5 = a expm1(5.545) + c t, not the 318 that
    # the 44.36 read promises
    lin, chart = _charted_linear(built)
    lin.to(cast)
    clamp = 0.5 * math.log(torch.finfo(cast).max)  # that of a chart built in the cast dtype
    assert chart.max_exponent == clamp
    got, want = _clamped_entry(lin, chart, 2.0 * clamp)  # beyond the clamp: s a expm1(M) + c t
    assert got == pytest.approx(want, rel=2 * torch.finfo(cast).eps)
    assert chart.requested_max_exponent is None  # left to the default


def test_an_explicit_clamp_reads_the_same_in_every_dtype():
    lin, chart = _charted_linear(torch.float32, max_exponent=10.5)  # a M e^M within float16's
    assert chart.max_exponent == chart.requested_max_exponent == 10.5
    lin.half()
    assert chart.max_exponent == chart.requested_max_exponent == 10.5
    got, want = _clamped_entry(lin, chart, 20.0)
    assert got == pytest.approx(want, rel=2 * torch.finfo(torch.float16).eps)


def test_assigning_max_exponent_sets_the_clamp_in_effect():
    # assigned to a chart left to its default, a clamp above that default was ignored silently
    # (min(80, 44.36): an entry at b|w| = 60 came back a expm1(44.36) + c t, 1e7 times smaller)
    lin, chart = _charted_linear(torch.float32)
    chart.max_exponent = 80.0
    got, want = _clamped_entry(lin, chart, 100.0)
    assert got == pytest.approx(want, rel=4 * torch.finfo(torch.float32).eps)
    assert chart.max_exponent == chart.requested_max_exponent == 80.0
    lin.double()  # an explicit clamp is kept through casts
    assert chart.max_exponent == 80.0
    chart.max_exponent = None  # back to the default, of the dtype the chart is in now
    assert chart.requested_max_exponent is None
    assert chart.max_exponent == 0.5 * math.log(torch.finfo(torch.float64).max)
    lin.half()
    assert chart.max_exponent == F16_DEFAULT


@pytest.mark.parametrize(("value", "match"), [
    (-1.0, r"max_exponent must be a finite number > 0, got -1\.0"),
    (True, r"max_exponent must be a finite number > 0, got True"),
    (89.0, r"max_exponent must be at most log\(finfo.max\) = 88.72 for a torch.float32 weight "
           r".* got 89\.0"),
])
def test_assigning_a_bad_max_exponent_is_refused(value, match):
    # the assignment was stored as is: -1 clamped every b|w| at -1 (negative weights for positive
    # raw coordinates), 89 gave inf weights from b|w| = 88.7
    _, chart = _charted_linear(torch.float32)
    with pytest.raises(ValueError, match=match):
        chart.max_exponent = value
    assert chart.max_exponent == F32_DEFAULT and chart.requested_max_exponent is None


def _boundary_case(dtype, root_at: float, clamp_at: float):
    """A ``dtype`` chart (b = 2) whose clamp lies ``clamp_at`` of a raw ulp above a raw grid point
    ``r_lo`` near b|w| = 10, and a target whose root lies ``root_at`` of that ulp above it."""
    w = torch.full((1, 8), 0.5, dtype=dtype)  # sigma0 = 0.5: b = beta = 2 (default scales)
    r_lo = torch.tensor(5.2, dtype=dtype)
    r_hi = torch.nextafter(r_lo, torch.tensor(math.inf, dtype=dtype))
    lo, ulp = float(r_lo), float(r_hi) - float(r_lo)
    chart = SEL(w, init="congruent", max_exponent=2.0 * (lo + clamp_at * ulp),
                scale_init={"e_w": 0.1})  # a = 0.1: a M e^M (the gradient of log m) < 65504
    a, b, c = (float(v[0, 0]) for v in _float64_scales(chart))
    root = lo + root_at * ulp
    target = w.clone()
    target[0, 0] = a * math.expm1(b * root) + c * root  # rounded to dtype: its root moves < ulp/30
    return chart, target, lo, float(r_hi)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_right_inverse_checks_the_clamp_on_the_rounded_raw_coordinates(dtype):
    # the check ran on the float32 root, before rounding to the weight's dtype. A root inside the
    # clamp that rounds past it was accepted: bfloat16 raw 5.21875 (b|w| = 10.44 > M = 10.425),
    # clamped by the forward, no gradient through expm1 (float16 likewise); a root past the clamp
    # that rounds inside it was refused, though the rounded raw coordinate is within the clamp
    chart, target, _, r_hi = _boundary_case(dtype, root_at=0.7, clamp_at=0.8)
    with pytest.raises(ValueError, match=rf"beyond what the chart represents .* rounded to {dtype}"):
        chart.right_inverse(target)
    chart, target, r_lo, _ = _boundary_case(dtype, root_at=0.4, clamp_at=0.3)
    raw = chart.right_inverse(target).requires_grad_()
    assert float(raw[0, 0]) == r_lo and 2.0 * r_lo <= chart.max_exponent
    chart(raw)[0, 0].backward()
    a, b, c = (float(v[0, 0]) for v in _float64_scales(chart))
    slope = a * b * math.exp(b * r_lo) + c  # the exponential part's gradient, not only c
    assert float(raw.grad[0, 0]) == pytest.approx(slope, rel=2 * torch.finfo(dtype).eps)


def _scale_refusal(dtype, then="", what=r"the weight a expm1\(M\)"):
    return (rf"max_exponent = .* overflows a {dtype} weight or its gradient at the chart's scales "
            rf"\(largest a = e_w e\^-n = .*, largest a b = .*\): {what} = .* > finfo.max = .*; "
            rf"accepted: max_exponent at most (?P<bound>[0-9.]+) for these scales "
            rf"\(or a at most .* for this max_exponent\){re.escape(then)}$")


_IMPLS = ("kernels", "aten", "autograd")


def _run(chart, impl, raw):
    """``chart(raw)`` on ``impl``: the C++ kernels, the ATen fallback or plain autograd."""
    chart.impl = "autograd" if impl == "autograd" else "fused"
    with _cpu_kernels.disabled() if impl == "aten" else contextlib.nullcontext():
        return chart(raw)


@pytest.mark.parametrize(("dtype", "clamp", "e_w", "what"), [
    (torch.float32, 88.0, 4.0, "the weight"),  # 4 expm1(88) = 6.6e38 > 3.4e38
    (torch.bfloat16, 88.0, 4.0, "the weight"),
    (torch.float16, 11.0, 2.0, "the weight"),  # 2 expm1(11) = 1.2e5 > 65504
    (torch.float16, None, 300.0, "the weight"),  # the default 5.545: 300 expm1(5.545) = 7.6e4
    (torch.float32, 88.0, 1.5, "the raw gradient"),  # W 2.5e38, a b e^88 = 3 * 1.65e38 = 4.9e38
    (torch.float32, 88.0, None, "the gradient of log m"),  # a = 0.375: a M e^M = 5.4e39
    (torch.float16, 11.0, None, "the gradient of log m"),  # 0.375 * 11 * 59874 = 2.5e5
])
def test_a_clamp_that_overflows_at_the_charts_scale_is_refused(dtype, clamp, e_w, what):
    # the clamp keeps expm1(M) in range, but a = e_w e^-n > 1 multiplied it past finfo.max: every
    # entry from b|w| = log(max / a) on was inf, silently, on every impl. And where the weight
    # stayed finite its gradients did not: just below the clamp the raw gradient is a b e^{b|w|}
    # and that of log m a b|w| e^{b|w|}, inf with a finite weight (float32 at M = 88: a = 1.5,
    # b = 2, W = 2.5e38 and the raw gradient inf; a = 0.375, the default, W = 6e37 and the
    # gradient of log m inf), so training turned NaN without an error. The largest clamp accepted
    # keeps the weight finite at b|w| = 2 M and every gradient finite just below M
    w = torch.full((2, 2), 0.5, dtype=dtype)  # sigma0 = 0.5: b = 2
    scale_init = {} if e_w is None else {"e_w": e_w}
    with pytest.raises(ValueError, match=_scale_refusal(dtype, what=what + ".*")) as refused:
        SEL(w, max_exponent=clamp, scale_init=scale_init)
    bound = float(re.search(_scale_refusal(dtype, what=".*"), str(refused.value)).group("bound"))
    above = torch.nextafter(torch.tensor(bound), torch.tensor(math.inf)).item()
    with pytest.raises(ValueError, match=_scale_refusal(dtype, what=".*")):
        SEL(w, max_exponent=above, scale_init=scale_init)  # the bound named is the largest
    chart = SEL(w, max_exponent=bound, scale_init=scale_init)
    raw = torch.full((2, 2), 2.0 * bound, dtype=dtype) / chart.beta  # b|w| = 2 M: clamped
    a, b, c = _float64_scales(chart)
    want = a * math.expm1(bound) + c * raw.double()  # the linear part c t of a few units on top
    for impl in _IMPLS:
        got = _run(chart, impl, raw).detach()
        assert torch.isfinite(got).all(), impl
        torch.testing.assert_close(got.double(), want, rtol=4 * torch.finfo(dtype).eps, atol=0)
    below = torch.zeros(2, 2, dtype=dtype)  # one entry two ulps below the clamp, the rest 0
    below[0, 0] = bound / float(b[0, 0])
    for _ in range(2):
        below[0, 0] = torch.nextafter(below[0, 0], torch.zeros((), dtype=dtype))
    for impl in _IMPLS:
        chart.zero_grad()
        leaf = below.clone().requires_grad_()
        _run(chart, impl, leaf)[0, 0].backward()
        for name, grad in [("raw", leaf.grad)] + [(n, p.grad) for n, p in chart.named_parameters()]:
            assert torch.isfinite(grad).all(), (impl, name)
        slope = float(a[0, 0] * b[0, 0]) * math.exp(float(b[0, 0]) * float(below[0, 0]))
        assert float(leaf.grad[0, 0]) > 0.5 * slope, impl  # the exponential part, not clamped


def test_a_cast_whose_clamp_overflows_at_the_charts_scale_is_refused():
    # a = 300 is fine under float32's default clamp (300 expm1(44.36) = 5.5e21); after .half() the
    # default is float16's 5.545 and 300 expm1(5.545) = 7.6e4 > 65504: the weight was inf from
    # b|w| = 5.39 on. The cast is refused before anything is converted
    lin, chart = _charted_linear(torch.float32, scale_init={"e_w": 300.0})
    with pytest.raises(ValueError, match=_scale_refusal(torch.float16,
                                                        " (casting a torch.float32 chart)")):
        lin.half()
    assert all(t.dtype == torch.float32 for t in (*chart.parameters(), *chart.buffers()))
    assert lin.parametrizations.weight.original.dtype == torch.float32
    chart.max_exponent = 3.0  # 300 expm1(3) = 5.7e3; a b e^3 = 4.2e4 (5.0: 3.1e5, refused)
    lin.half()
    got, want = _clamped_entry(lin, chart, 100.0)
    assert math.isfinite(got) and got == pytest.approx(want, rel=2 * torch.finfo(torch.float16).eps)


def test_an_assignment_that_overflows_at_the_charts_scale_is_refused():
    # a = 4 under an explicit 80 (4 expm1(80) = 2.2e35); assigning 88 made the weight inf from
    # b|w| = 87.3 on, and so did a scale grown to 1e5 (in training), silently
    lin, chart = _charted_linear(torch.float32, max_exponent=80.0, scale_init={"e_w": 4.0})
    with pytest.raises(ValueError, match=_scale_refusal(torch.float32)):
        chart.max_exponent = 88.0
    assert chart.max_exponent == 80.0
    with torch.no_grad():
        chart.log_e_w_row.add_(math.log(1e5 / 4.0))
    with pytest.raises(ValueError, match=_scale_refusal(torch.float32)):
        lin.weight = torch.full((4, 16), 0.5)
    # refused only where a expm1(M) overflows: a = 1e6 under float32's default clamp is 1.9e25
    chart = SEL(torch.full((2, 2), 0.5), scale_init={"e_w": 1e6})
    assert torch.isfinite(chart(torch.full((2, 2), 1e3))).all()


@pytest.mark.parametrize("built", [torch.float32, torch.float64])
def test_a_chart_cast_down_and_back_up_keeps_its_weight(built):
    # a default clamp followed casts down and returned to the build dtype's on the way back up:
    # charted in float32, trained in float16 (clamp 5.545), cast with .float() for evaluation,
    # an entry at b|w| = 8 went from 27.5 to 318 (clamp 44.36), another function
    lin, chart = _charted_linear(built)
    lin.half()
    _, b, _ = _float64_scales(chart)
    with torch.no_grad():
        lin.parametrizations.weight.original[0, 0] = 8.0 / b[0, 0]
    before = lin.weight.detach()
    for dtype in (torch.float32, built):
        lin.to(dtype)
        torch.testing.assert_close(lin.weight.detach(), before.to(dtype),
                                   rtol=torch.finfo(torch.float16).eps, atol=0)
        assert chart.max_exponent == F16_DEFAULT


def _saved_and_loaded(source: nn.Linear, twin: nn.Linear) -> None:
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    twin.load_state_dict(torch.load(buffer, weights_only=True))


@pytest.mark.parametrize("case", ["cast-down-and-up", "explicit-into-default", "default-into-explicit"])
def test_a_state_dict_carries_the_clamp(case):
    # the clamp was not in the state dict: a default chart trained after .half() and cast back
    # with .float() (clamp 5.545) loaded into a fresh float32 chart ran at 44.36, an explicit
    # clamp of 2 loaded into a default chart at 44.36, and the other way round at 2: entries
    # beyond the smaller clamp changed (a weight of 27.5 at b|w| = 8 became 318) without an error
    source_options, twin_options = {}, {}
    if case == "explicit-into-default":
        source_options = {"max_exponent": 2.0}
    elif case == "default-into-explicit":
        twin_options = {"max_exponent": 2.0}
    lin, chart = _charted_linear(torch.float32, **source_options)
    if case == "cast-down-and-up":
        lin.half().float()
    _, b, _ = _float64_scales(chart)
    with torch.no_grad():
        lin.parametrizations.weight.original[0, 0] = 8.0 / b[0, 0]  # beyond 2 and 5.545
    twin, twin_chart = _charted_linear(torch.float32, **twin_options)
    _saved_and_loaded(lin, twin)
    assert twin_chart.max_exponent == chart.max_exponent
    assert twin_chart.requested_max_exponent == chart.requested_max_exponent
    assert torch.equal(twin.weight, lin.weight)
    if case != "default-into-explicit":  # the clamp in effect is the smaller one
        assert lin.weight[0, 0].abs() < 100.0


def test_a_loaded_default_clamp_follows_the_charts_dtype_down():
    # a default float32 clamp (44.36) loaded into a float16 chart is its default 5.545, as a cast
    lin, _ = _charted_linear(torch.float32)
    twin, twin_chart = _charted_linear(torch.float16)
    twin.load_state_dict(lin.state_dict())
    assert twin_chart.max_exponent == F16_DEFAULT and twin_chart.requested_max_exponent is None


@pytest.mark.parametrize(("state", "match"), [
    ({"max_exponent": 30.0, "default": False}, r"for a torch.float16 weight .* got 30.0$"),
    ({"max_exponent": float("nan"), "default": False}, r"max_exponent must be a finite number > 0, got nan"),
    ({"max_exponent": 3.0, "default": 1}, r"'default' must be a bool, got 1"),
    ({"max_exponent": 3.0}, r"must be a dict with keys \['default', 'max_exponent'\]"),
])
def test_a_clamp_the_chart_cannot_take_from_a_state_dict_is_refused(state, match):
    lin, chart = _charted_linear(torch.float16)
    saved = lin.state_dict()
    saved["parametrizations.weight.0._extra_state"] = state
    with pytest.raises(ValueError, match=match):
        lin.load_state_dict(saved)
    assert chart.max_exponent == F16_DEFAULT


def test_a_state_dict_without_the_clamp_is_refused_by_a_strict_load():
    # a checkpoint written before the clamp was saved: strict loading names the missing key
    # rather than running at whatever clamp the fresh chart has
    lin, _ = _charted_linear(torch.float32)
    saved = lin.state_dict()
    del saved["parametrizations.weight.0._extra_state"]
    with pytest.raises(RuntimeError, match=r"parametrizations\.weight\.0\._extra_state"):
        lin.load_state_dict(saved)


@pytest.mark.parametrize(("key", "value"), [
    ("log_l_w_row", math.inf), ("log_l_w_col", math.nan), ("log_e_w_row", -math.inf), ("beta", 0.0),
])
def test_a_state_dict_with_scales_the_chart_cannot_take_is_refused(key, value):
    # a non-finite log_l_w loaded silently and gave inf / NaN weights, log_e_w = -inf (e_w = 0)
    # an exponential part of 0, beta = 0 a ZeroDivisionError; refused by name, before any of the
    # chart is copied, also from a state dict without the clamp loaded non-strictly
    lin, chart = _charted_linear(torch.float32)
    before = {name: t.clone() for name, t in chart.state_dict().items() if torch.is_tensor(t)}
    weight = lin.weight.detach().clone()
    saved = lin.state_dict()
    name = f"parametrizations.weight.0.{key}"
    saved[name] = torch.full_like(saved[name], value)
    del saved["parametrizations.weight.0._extra_state"]
    with pytest.raises(ValueError, match=rf"parametrizations\.weight\.0\.{key}.* (must be finite|"
                                         rf"must be a finite number > 0, got tensor\(0\.\))"):
        lin.load_state_dict(saved, strict=False)
    assert all(torch.equal(t, before[name]) for name, t in chart.state_dict().items() if name in before)
    assert torch.equal(lin.weight, weight) and torch.isfinite(lin.weight).all()
