"""The SEL forward rule on the C++ CPU kernels: the same values and gradients as the plain
expression, and the ATen fallback wherever the kernels do not apply."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from manifoldlib import _cpu_kernels
from manifoldlib.charts import SEL
from manifoldlib.charts.kernel import sel_forward_rule

pytestmark = pytest.mark.skipif(
    not _cpu_kernels.available(),
    reason=f"the C++ CPU kernels are not built here (no compiler, or {_cpu_kernels.ENV_VAR}=0)",
)


def _inputs(out=7, inn=11, dtype=torch.float64, seed=0, linear=True, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    raw = (spread * torch.randn(out, inn, generator=g)).to(dtype)

    def positive(*shape):
        return (0.5 + torch.rand(*shape, generator=g)).to(dtype)

    factors = [positive(out, 1), positive(1, inn), 2 * positive(out, 1), positive(1, inn)]
    factors += [positive(out, 1), positive(1, inn)] if linear else [None, None]
    return raw, factors


def _rule(raw, factors, max_exponent, impl="fused"):
    a_r, a_c, b_r, b_c, c_r, c_c = factors
    return sel_forward_rule(raw, (a_r, a_c), (b_r, b_c), None if c_r is None else (c_r, c_c), max_exponent, impl)


def _values_and_grads(raw, factors, max_exponent, probe, impl):
    leaves = [raw.clone().requires_grad_()] + [None if f is None else f.clone().requires_grad_() for f in factors]
    out = _rule(leaves[0], leaves[1:], max_exponent, impl)
    (out * probe).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves if leaf is not None], out.grad_fn


@pytest.mark.parametrize("linear", [True, False])
def test_the_kernel_path_runs_and_passes_gradcheck_in_float64(linear):
    raw, factors = _inputs(linear=linear)
    out = _rule(raw.requires_grad_(), factors, 50.0)
    assert type(out.grad_fn).__name__ == "_SELKernelRuleBackward"  # the C++ kernels, not ATen
    leaves = [raw] + [f.requires_grad_() for f in factors if f is not None]

    def fn(raw, *given):
        it = iter(given)
        full = [next(it) if f is not None else None for f in factors]
        return _rule(raw, full, 50.0)

    assert torch.autograd.gradcheck(fn, tuple(leaves))


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_kernels_agree_with_the_plain_expression(dtype, rtol):
    # 96 x 300: rows and columns split over threads and vector lanes with remainders; entries past
    # the clamp (b|w| > 3) take no gradient in b or w; exact zeros take the one-sided slope
    raw, factors = _inputs(96, 300, dtype, seed=3, spread=1.5)
    raw[0, :2] = 0.0
    probe = torch.randn(raw.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    mine = _values_and_grads(raw, factors, 3.0, probe, "fused")
    ref = _values_and_grads(raw, factors, 3.0, probe, "autograd")
    assert type(mine[2]).__name__ == "_SELKernelRuleBackward"
    assert bool((_rule(raw, factors, 1e9, "autograd") != _rule(raw, factors, 3.0, "autograd")).any())  # clamped
    # s a e + c t cancels for negative w: entrywise errors are relative to the weight's scale
    torch.testing.assert_close(mine[0], ref[0], rtol=rtol, atol=rtol * float(ref[0].abs().max()))
    for got, want in zip(mine[1], ref[1]):
        scale = want.abs().max()
        assert float((got - want).abs().max() / scale) <= 10 * rtol


def test_negative_zero_takes_the_sign_of_positive_zero():
    # s = +1 at w = -0.0 as at +0.0 (the chart's convention): the same weight and raw gradient
    raw, factors = _inputs(seed=5)
    probe = torch.ones_like(raw)
    raw[0, 0], twin = -0.0, raw.clone()
    twin[0, 0] = 0.0
    for impl in ("fused", "autograd"):
        with_neg = _values_and_grads(raw, factors, 50.0, probe, impl)
        with_pos = _values_and_grads(twin, factors, 50.0, probe, impl)
        assert float(with_neg[1][0][0, 0]) == float(with_pos[1][0][0, 0]) > 0
    with _cpu_kernels.disabled():  # the ATen autograd function keeps the same convention
        aten = _values_and_grads(raw, factors, 50.0, probe, "fused")
    assert float(aten[1][0][0, 0]) == float(with_pos[1][0][0, 0])


def test_the_aten_path_is_the_fallback_and_agrees():
    raw, factors = _inputs(20, 30, seed=6)
    probe = torch.randn(raw.shape, generator=torch.Generator().manual_seed(7), dtype=raw.dtype)
    kernel = _values_and_grads(raw, factors, 50.0, probe, "fused")
    with _cpu_kernels.disabled():  # switched off
        off = _values_and_grads(raw, factors, 50.0, probe, "fused")
    assert type(off[2]).__name__ == "_SELForwardRuleBackward"
    # a non-contiguous view of raw coordinates: ATen path, the same numbers
    wide = torch.zeros(30, 20, dtype=raw.dtype)
    wide.copy_(raw.T)
    view = wide.T  # (20, 30), not contiguous
    assert not view.is_contiguous()
    strided = _values_and_grads(view, factors, 50.0, probe, "fused")
    assert type(strided[2]).__name__ == "_SELForwardRuleBackward"
    for other in (off, strided):
        torch.testing.assert_close(other[0], kernel[0], rtol=1e-13, atol=0)
        for got, want in zip(other[1], kernel[1]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # a 16-bit weight takes the kernels too (computed in float32: the test below); mixed float32
    # raw coordinates with float64 factors are computed in float64, on ATen
    half = _rule(raw.bfloat16().requires_grad_(), [f.bfloat16() for f in factors], 20.0)
    assert type(half.grad_fn).__name__ == "_SELKernelRuleBackward" and half.dtype == torch.bfloat16
    mixed = _rule(raw.float().requires_grad_(), factors, 20.0)
    assert type(mixed.grad_fn).__name__ == "_SELForwardRuleBackward" and mixed.dtype == torch.float64


def _ulps_off(got, want):
    """The largest error of 16-bit ``got`` against float64 ``want``, in ``got``'s eps relative to
    ``|want|`` (correct rounding: 0.5; below the normal range, in its ulp), less a float32
    rounding of the tensor's scale (2^-22 of its largest entry: where two terms cancel, an entry
    computed in float32 keeps float32's error relative to the terms, not to itself)."""
    finfo = torch.finfo(got.dtype)
    excess = ((got.double() - want).abs() - 2.0**-22 * float(want.abs().max())).clamp_min(0.0)
    return float((excess / (want.abs().clamp_min(finfo.tiny) * finfo.eps)).max())


@pytest.mark.parametrize("linear", [True, False])
@pytest.mark.parametrize(("dtype", "max_exponent"), [(torch.bfloat16, 12.0), (torch.float16, 5.0)])
def test_16_bit_inputs_are_computed_in_float32_and_rounded_once(dtype, max_exponent, linear):
    # bfloat16/float16 raw coordinates and factors: the kernels (converting entry by entry), the
    # ATen function and the plain expression compute in float32 and round the weight and each
    # gradient once to its input's dtype, so each is within half an ulp of the float64 rule on
    # the same 16-bit inputs (the ATen function and the plain expression ran in bfloat16: ulps
    # off). 96 x 300 with entries past the clamp and exact zeros, as above
    raw, factors = _inputs(96, 300, torch.float64, seed=8, linear=linear, spread=1.5)
    raw[0, :2] = torch.tensor([0.0, -0.0])
    raw, factors = raw.to(dtype), [None if f is None else f.to(dtype) for f in factors]
    probe = torch.randn(raw.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    wide = [None if f is None else f.double() for f in factors]
    want = _values_and_grads(raw.double(), wide, max_exponent, probe.double(), "autograd")
    bw = wide[2] * wide[3] * raw.double().abs()
    assert bool((bw > max_exponent).any()) and bool(((bw > max_exponent - 3) & (bw < max_exponent)).any())
    results = {"kernels": _values_and_grads(raw, factors, max_exponent, probe, "fused")}
    with _cpu_kernels.disabled():
        results["aten"] = _values_and_grads(raw, factors, max_exponent, probe, "fused")
    results["autograd"] = _values_and_grads(raw, factors, max_exponent, probe, "autograd")
    for path, (out, grads, _) in results.items():
        assert out.dtype == dtype and all(g.dtype == dtype for g in grads), path
        errors = [_ulps_off(out, want[0])] + [_ulps_off(g, w) for g, w in zip(grads, want[1])]
        assert max(errors) <= 0.5 * (1 + 2.0**-5), (path, errors)
    assert type(results["kernels"][2]).__name__ == "_SELKernelRuleBackward"
    assert type(results["aten"][2]).__name__ == "_SELForwardRuleBackward"


def test_a_charted_layer_trains_on_the_kernels_as_on_aten():
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 16)
    chart = SEL(layer.weight.detach())
    raw = chart.right_inverse(layer.weight.detach()).requires_grad_()
    x = torch.randn(32, 24)
    out = x @ chart(raw).T
    rule = chart(raw).grad_fn.next_functions[0][0]  # the chart's view_as sits on the forward rule
    assert type(rule).__name__ == "_SELKernelRuleBackward"
    out.square().mean().backward()
    grads = [raw.grad.clone()] + [p.grad.clone() for p in chart.parameters()]
    raw.grad = None
    chart.zero_grad()
    with _cpu_kernels.disabled():
        (x @ chart(raw).T).square().mean().backward()
    for got, want in zip(grads, [raw.grad] + [p.grad for p in chart.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_clamp_beyond_the_kernels_exponent_range_gives_the_plain_values(dtype):
    # the kernels' expm1 builds 2^n from exponent bits: for b|w| past ln(max) - ln 2 those bits
    # wrapped into the sign (float32, b|w| = 90: E = -a, i.e. W = c|w| instead of inf; b|w| = 88.5:
    # NaN instead of a e^88.5). A max_exponent there must give the plain expression's values.
    log_max = math.log(torch.finfo(dtype).max)
    exponents = torch.tensor([0.5, 1.0, 0.99, 0.997, 1.0005, 1.02, 1.5], dtype=torch.float64) * log_max
    raw = exponents.to(dtype).reshape(1, -1).repeat(3, 1)  # b = 1: b|w| = the exponent
    raw[1] = -raw[1]
    ones_r, ones_c = torch.ones(3, 1, dtype=dtype), torch.ones(1, raw.shape[1], dtype=dtype)
    tiny = torch.full((3, 1), float(torch.finfo(dtype).tiny) ** 0.5, dtype=dtype)  # a: finite a e^x
    factors = [tiny, ones_c, ones_r, ones_c, 0.25 * ones_r, ones_c]
    for max_exponent in (0.98 * log_max, log_max, 2.0 * log_max, 1e4):
        want = _rule(raw, factors, max_exponent, "autograd")
        got = _rule(raw, factors, max_exponent, "fused")
        finite = torch.isfinite(want)
        assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got[finite], want[finite], rtol=4 * torch.finfo(dtype).eps, atol=0)


def test_float32_expm1_of_the_kernels_is_within_two_ulps_up_to_the_top_of_the_range():
    # the float32 kernel split ln 2 with the double constants: ln2_hi = 0.6931471803691238
    # rounds to a float 1.9e-9 above ln 2, so r = x - n ln 2 was off by n 1.9e-9 and the weight
    # by up to 4.9 float32 ulps near b|w| = 88, where torch.expm1 (the ATen path) is within 0.51.
    # With a float split (n ln2_hi exact) the polynomial's own rounding remains: 1.63 ulps
    x = torch.linspace(0.0, 88.0, 100_001).reshape(1, -1)  # b = 1: b|w| = x
    ones_r, ones_c = torch.ones(1, 1), torch.ones(1, x.shape[1])
    got = _rule(x, [ones_r, ones_c, ones_r, ones_c, None, None], 88.0)
    want = torch.expm1(x.double())
    _, exponent = torch.frexp(want.clamp_min(torch.finfo(torch.float32).tiny))
    ulp = torch.ldexp(torch.ones_like(want), exponent - 24)  # float32's spacing at |want|
    assert float(((got.double() - want).abs() / ulp).max()) <= 2.0


@pytest.mark.parametrize("path", ["kernels", "aten"])
def test_the_gradient_of_b_near_the_top_of_the_float32_range_is_finite(path):
    # dL/db = q a w (q = G e^{b|w|}) was formed as (q w) a: q w = e^87.8 * 43.9 = 5.9e39
    # overflowed float32 though dL/db = a e^{b|w|} |w| is 5.9e36 for a = 1e-3, so the gradient of
    # b (and of log m) came back inf on the C++ kernels and on the ATen fallback (plain autograd:
    # finite). a multiplies q first now
    raw = torch.tensor([[43.9, 30.0, -43.9, 0.0], [-20.0, 43.5, 1.0, -0.0]])  # b = 2: b|w| <= 87.8
    rows, cols = torch.ones(2, 1), torch.ones(1, 4)
    factors = [1e-3 * rows, cols, 2.0 * rows, cols, 0.25 * rows, cols]
    probe = torch.where(raw < 0, -1.0, 1.0)  # every entry's dL/db > 0: no cancellation
    want = _values_and_grads(raw.double(), [f.double() for f in factors], 88.0, probe.double(),
                             "autograd")
    with _cpu_kernels.disabled() if path == "aten" else contextlib.nullcontext():
        got = _values_and_grads(raw, factors, 88.0, probe, "fused")
    rule = "_SELKernelRuleBackward" if path == "kernels" else "_SELForwardRuleBackward"
    assert type(got[2]).__name__ == rule
    for mine, ref in zip(got[1], want[1]):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine.double(), ref, rtol=8 * torch.finfo(torch.float32).eps,
                                   atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_entry_below_the_clamp_keeps_its_gradient_on_every_path(dtype):
    # the paths mask the gradient where e reaches their own expm1(M) (the kernels' polynomial,
    # torch.expm1 on ATen): the entries without a gradient through e must be exactly those at
    # b|w| >= M on each, whatever their values differ by (a rounding or two in float32)
    g = torch.Generator().manual_seed(11)
    for clamp in (torch.rand(40, generator=g, dtype=torch.float64) * 87.9 + 0.05).tolist():
        m = torch.tensor(clamp, dtype=dtype)
        entries = [torch.nextafter(m, torch.tensor(math.inf, dtype=dtype)), m]
        for _ in range(64):
            entries.append(torch.nextafter(entries[-1], torch.zeros((), dtype=dtype)))
        raw = torch.stack(entries).reshape(1, -1)  # b = 1: b|w| = the entry
        ones_r, ones_c = torch.ones(1, 1, dtype=dtype), torch.ones(1, raw.shape[1], dtype=dtype)
        factors = [ones_r, ones_c, ones_r, ones_c, None, None]
        for path in ("kernels", "aten"):
            with _cpu_kernels.disabled() if path == "aten" else contextlib.nullcontext():
                _, grads, _ = _values_and_grads(raw, factors, float(m), torch.ones_like(raw), "fused")
            assert torch.equal(grads[0] == 0, raw >= m), (path, clamp)
