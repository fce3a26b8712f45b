"""The SEL chart on its own: inverses, the mismatched initialization, scales, gradients, options."""

from __future__ import annotations

import contextlib
import functools
import math
import re

import pytest
import torch
from torch import nn

from manifoldlib import _cpu_kernels
from manifoldlib.charts import (SEL, SEL_CALIBRATIONS, SEL_IMPLS, SEL_INITS, Chart, apply_chart,
                                merge_charts)

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def heavy_tailed(shape, dtype, seed=0, df=3.0):
    """Student-t weights at the usual 1/sqrt(fan_in) scale: a pretrained-like heavy tail."""
    g = torch.Generator().manual_seed(seed)
    # Student-t = normal / sqrt(chi2/df), drawn from one generator for reproducibility.
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    chi2 = torch.randn((*shape, int(df)), generator=g, dtype=torch.float64).pow(2).sum(-1)
    return (z / torch.sqrt(chi2 / df) / math.sqrt(shape[-1])).to(dtype)


def perturb_scales(chart: SEL, seed: int = 1, spread: float = 0.3) -> None:
    """Make the rank-1 scales non-uniform so tests see structured (i, j)-dependent scales."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in chart.named_parameters():
            if not name.startswith("delta"):
                p.add_(spread * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def rel_err(x, y):
    return ((x - y).abs() / y.abs()).max().item()


def within_conditioning(chart: SEL, raw, out, target, mask=None, k: float = 8.0, eps=None) -> bool:
    """|out - target| <= k eps (1 + b|w|)(E(|w|) + l_w|w|): the rounding of the forward rule itself.

    With non-uniform scales, ab < l_w can happen somewhere; there the forward rule on negatives is
    a difference of two larger terms and no inverse can beat this bound.
    """
    a, b, c = chart.coefficients()
    t = raw.abs()
    size = (1 + b * t) * (a * torch.expm1(b * t) + c * t)
    eps = torch.finfo(out.dtype).eps if eps is None else eps
    ok = (out - target).abs() <= k * eps * size
    return bool((ok if mask is None else ok[mask]).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("structured", [False, True])
def test_congruent_round_trip_is_exact_on_heavy_tailed_weights(dtype, structured):
    W = heavy_tailed((96, 64), dtype)
    chart = SEL(W, init="congruent")
    if structured:
        perturb_scales(chart)
    assert chart.exact_inverse
    raw = chart.right_inverse(W)
    out = chart(raw)
    assert out.dtype == dtype
    if structured:
        assert within_conditioning(chart, raw, out, W)
    else:  # default scales: ab = 3 l_w, no cancellation, so the error is relative to |W|
        assert rel_err(out, W) <= TOL[dtype]


def test_round_trip_covers_both_regimes():
    W = heavy_tailed((96, 64), torch.float64)
    _, b, _ = SEL(W, calibration="width").coefficients()
    raw = SEL(W, init="congruent", calibration="width").right_inverse(W)
    bx = (b * raw.abs()).max().item()
    assert bx > 3.0  # the exponential regime is exercised, not only the near-linear one
    assert (b * raw.abs()).min().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mismatched_init_realizes_positives_and_shrinks_negatives(dtype):
    W = heavy_tailed((80, 48), dtype, seed=2)
    chart = SEL(W)  # init="mismatched" is the default
    perturb_scales(chart, seed=3)
    assert not chart.exact_inverse
    raw = chart.right_inverse(W)
    out = chart(raw)
    _, _, c = chart.coefficients()
    pos, neg = W > 0, W < 0
    assert rel_err(out[pos], W[pos]) <= TOL[dtype]
    # docs/theory/sel.rst, Two composition rules: a negative target w0 is realized as
    # w0 + 2 l_w |w| (|w| the raw magnitude).
    predicted = W + 2 * c * raw.abs()
    assert within_conditioning(chart, raw, out, predicted, mask=neg)
    assert bool((out[neg].abs() < W[neg].abs()).all())
    assert torch.equal(torch.sign(raw), torch.sign(W))  # raw keeps the sign of the target


def test_mismatched_ratio_in_the_linear_regime():
    W = heavy_tailed((64, 32), torch.float64, seed=4) * 1e-7  # b|w| ~ 1e-7: linear regime
    chart = SEL(W, calibration="width")  # (calibrated from W itself, b|w| would be ~1)
    perturb_scales(chart, seed=5)
    out = chart(chart.right_inverse(W))
    a, b, c = chart.coefficients()
    ratio = (a * b - c) / (a * b + c)  # (ab - l_w) / (ab + l_w), elementwise
    neg = W < 0
    # The deviation from the linear-regime ratio is O(b|w|) ~ 1e-7.
    assert torch.allclose((out / W)[neg], ratio.expand_as(W)[neg], rtol=0, atol=1e-6)
    assert ratio.min().item() < 0.3 and ratio.max().item() > 0.7  # scales really vary
    assert torch.allclose((out / W)[~neg], torch.ones_like(W)[~neg], rtol=1e-12, atol=0)


def test_default_ratio_is_one_half():
    W = torch.full((4, 16), -1e-9, dtype=torch.float64)
    chart = SEL(W, calibration="width")
    ratio = chart(chart.right_inverse(W)).detach() / W
    assert torch.allclose(ratio, torch.full_like(W, 0.5), rtol=1e-6, atol=0)


def test_without_linear_path_both_inits_agree():
    W = heavy_tailed((32, 16), torch.float64, seed=6)
    mismatched, congruent = SEL(W, linear=False), SEL(W, init="congruent", linear=False)
    assert mismatched.exact_inverse
    assert torch.equal(mismatched.right_inverse(W), congruent.right_inverse(W))
    assert rel_err(mismatched(mismatched.right_inverse(W)), W) <= 1e-12
    assert "l_w" not in mismatched.scale_parameters()


@pytest.mark.parametrize("fan_in", [64, 256, 1024])
@pytest.mark.parametrize("kappa, gain, slope", [(1.0, 1.0, 0.75), (0.5, 2.0, 1.5)])
def test_curvature_from_width(fan_in, kappa, gain, slope):
    W = torch.zeros(8, fan_in, dtype=torch.float64)
    chart = SEL(W, kappa=kappa, gain=gain, slope=slope, scale_init={"m": 0.3, "n": 0.7},
                calibration="width")
    a, b, _ = chart.coefficients()
    sigma0 = gain / math.sqrt(fan_in)
    assert torch.allclose(b * sigma0, torch.full_like(b, kappa), rtol=1e-14, atol=0)
    assert torch.allclose(a * b, torch.full_like(a * b, slope), rtol=1e-14, atol=0)  # E'(0) fixed
    assert chart.beta.item() == pytest.approx(kappa * math.sqrt(fan_in) / (gain * 0.3), rel=1e-14)


@pytest.mark.parametrize("std", [0.02, 0.3])
def test_curvature_from_the_weight_it_is_built_on(std):
    # a GPT-2-style init (std 0.02) and a wider one: b * RMS(W) = kappa either way, so the
    # exponential regime starts at the weights' own scale rather than at 1/sqrt(fan_in)
    W = std * torch.randn(48, 256, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    chart = SEL(W, kappa=1.5, scale_init={"m": 0.3})
    _, b, _ = chart.coefficients()
    rms = float(W.square().mean().sqrt())
    assert chart.sigma0 == pytest.approx(rms, rel=1e-14) and chart.calibration == "weight"
    assert torch.allclose(b * rms, torch.full_like(b, 1.5), rtol=1e-14, atol=0)
    zero = SEL(torch.zeros(4, 16))  # no scale of its own: the width rule, and it says so
    assert zero.calibration == "width" and zero.sigma0 == pytest.approx(0.25, rel=1e-15)
    assert SEL_CALIBRATIONS == ("weight", "width")
    with pytest.raises(ValueError, match=r"calibration must be one of \('weight', 'width'\), got 'rms'"):
        SEL(W, calibration="rms")


def test_a_float64_weight_below_the_square_root_of_the_range_is_calibrated_by_its_own_rms():
    """The RMS was sqrt(mean(W^2)) in float64, whose squares underflow to 0 for entries below
    about 1e-162: a nonzero weight of scale 2^-550 read as all-zero and got the width rule,
    curved at 1/sqrt(fan_in) instead of its own scale. Its RMS is that of W times 2^-550 (exact:
    a power of two), and the congruent chart still round-trips."""
    W = torch.randn(4, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    tiny = W * 2.0**-550
    chart = SEL(tiny, init="congruent")
    assert chart.calibration == "weight"
    assert chart.sigma0 == pytest.approx(float(W.square().mean().sqrt()) * 2.0**-550, rel=1e-15)
    _, b, _ = chart.coefficients()
    assert torch.allclose(b * chart.sigma0, torch.ones_like(b), rtol=1e-14, atol=0)
    assert rel_err(chart(chart.right_inverse(tiny)), tiny) <= TOL[torch.float64]


def test_scale_parameter_count_and_structure():
    out_f, in_f, rank = 24, 40, 3
    chart = SEL(torch.zeros(out_f, in_f), rank=rank)
    scales = chart.scale_parameters()
    assert set(scales) == {"e_w", "l_w", "m", "n", "delta"}
    n_scales = sum(p.numel() for role, ps in scales.items() if role != "delta" for p in ps)
    assert n_scales == 4 * (out_f + in_f)
    assert sum(p.numel() for p in scales["delta"]) == rank * (out_f + in_f)
    a, b, c = chart.coefficients()
    for s in (a, b, c):  # positive and rank one
        assert bool((s > 0).all())
        assert torch.linalg.matrix_rank(s.expand(out_f, in_f).double()).item() == 1


def test_gradients_reach_raw_weights_and_every_scale():
    W = heavy_tailed((16, 12), torch.float64, seed=7)
    chart = SEL(W, rank=2)
    with torch.no_grad():
        chart.delta_b.normal_(generator=torch.Generator().manual_seed(8))
    raw = chart.right_inverse(W).requires_grad_(True)
    g = torch.Generator().manual_seed(9)
    probe = torch.randn(W.shape, generator=g, dtype=torch.float64)
    (chart(raw) * probe).sum().backward()
    assert raw.grad is not None and bool((raw.grad != 0).all())
    for name, p in chart.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
        assert p.grad.abs().sum().item() > 0, name


def test_gradcheck_away_from_zero():
    W = heavy_tailed((5, 4), torch.float64, seed=10)
    chart = SEL(W, rank=1)
    perturb_scales(chart, seed=11)
    raw = chart.right_inverse(W)
    raw = torch.where(raw.abs() < 1e-3, torch.full_like(raw, 0.05), raw).requires_grad_(True)
    assert torch.autograd.gradcheck(chart, (raw,))


def test_gradient_at_zero_is_finite_one_sided_slope():
    chart = SEL(torch.zeros(3, 8, dtype=torch.float64))
    raw = torch.zeros(3, 8, dtype=torch.float64, requires_grad=True)
    out = chart(raw)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    a, b, c = chart.coefficients()
    assert torch.allclose(raw.grad, (a * b + c).expand_as(raw), rtol=1e-14, atol=0)
    for name, p in chart.named_parameters():
        assert bool(torch.isfinite(p.grad).all()), name


def test_float32_overflow_guard_keeps_values_and_gradients_finite():
    chart = SEL(torch.zeros(4, 256))
    raw = torch.tensor([[1e4, -1e4, 50.0, 0.0]] * 4).repeat(1, 64).requires_grad_(True)
    out = chart(raw)
    assert bool(torch.isfinite(out).all())
    out.sum().backward()
    assert bool(torch.isfinite(raw.grad).all())
    for name, p in chart.named_parameters():
        assert bool(torch.isfinite(p.grad).all()), name
    with pytest.raises(ValueError, match="beyond what the chart represents"):
        chart.right_inverse(torch.full((4, 256), 1e30))


def test_right_inverse_subtracts_the_low_rank_residual():
    W = heavy_tailed((20, 10), torch.float64, seed=12)
    chart = SEL(W, init="congruent", rank=2)
    with torch.no_grad():
        chart.delta_b.normal_(generator=torch.Generator().manual_seed(13))
    assert chart.delta().abs().max().item() > 0
    assert rel_err(chart(chart.right_inverse(W)), W) <= 1e-12


def test_one_dimensional_tensor_has_scalar_scales():
    b = heavy_tailed((1, 50), torch.float64, seed=14)[0]
    chart = SEL(b, init="congruent")
    assert all(p.numel() == 1 for p in chart.parameters())
    assert rel_err(chart(chart.right_inverse(b)), b) <= 1e-12
    assert isinstance(chart, Chart)


BAD_OPTIONS = [
    ({"kappa": 0.0}, r"kappa must be a finite number > 0, got 0\.0"),
    ({"kappa": -1.0}, r"kappa .* got -1\.0"),
    ({"kappa": math.nan}, r"kappa .* got nan"),
    ({"gain": -2.0}, r"gain .* got -2\.0"),
    ({"slope": 0.0}, r"slope .* got 0\.0"),
    ({"scale_init": {"e_w": -1.0}}, r"scale_init\['e_w'\] .* got -1\.0"),
    ({"scale_init": {"l_w": 0.0}}, r"scale_init\['l_w'\] .* got 0\.0"),
    ({"scale_init": {"m": math.nan}}, r"scale_init\['m'\] .* got nan"),
    ({"scale_init": {"n": math.inf}}, r"scale_init\['n'\] .* got inf"),
    ({"scale_init": {"q": 1.0}}, r"scale_init keys must be among .* got \['q'\]"),
    ({"slope": 1.0, "scale_init": {"e_w": 1.0}}, r"either slope or scale_init\['e_w'\]"),
    ({"init": "symmetric"}, r"init must be one of \('mismatched', 'congruent'\), got 'symmetric'"),
    ({"rank": -1}, r"rank must be an int >= 0.* got -1"),
    ({"rank": 99}, r"rank must be <= min\(weight.shape\) = 8, got 99"),
    ({"fan_in": 0}, r"fan_in must be an int >= 1, got 0"),
    ({"rank": True}, r"rank must be an int >= 0.* got True"),  # was a TypeError from torch.randn
    ({"fan_in": True}, r"fan_in must be an int >= 1, got True"),  # was fan_in = 1, silently
    ({"scale_init": {"n": True}}, r"scale_init\['n'\] must be a finite number, got True"),
    ({"max_exponent": -5.0}, r"max_exponent .* got -5\.0"),
    ({"impl": "triton"}, r"impl must be one of \('fused', 'autograd', 'compile'\), got 'triton'"),
    # bools and strings were numbers through float(): kappa=True was 1.0, max_exponent="3" 3.0
    ({"kappa": True}, r"kappa must be a finite number > 0, got True"),
    ({"gain": "2"}, r"gain must be a finite number > 0, got '2'"),
    ({"slope": True}, r"slope must be a finite number > 0, got True"),
    ({"scale_init": {"m": True}}, r"scale_init\['m'\] must be a finite number > 0, got True"),
    ({"max_exponent": True}, r"max_exponent must be a finite number > 0, got True"),
    ({"max_exponent": "3"}, r"max_exponent must be a finite number > 0, got '3'"),
    # bool("False") is True: the linear path was kept
    ({"linear": "False"}, r"linear must be True or False, got 'False'"),
    ({"linear": 0}, r"linear must be True or False, got 0"),
    # a clamp past log(finfo.max) clamps nothing: expm1 was inf, so W was inf, silently
    ({"max_exponent": 89.0}, r"max_exponent must be at most log\(finfo.max\) = 88.72 for a "
                             r"torch.float32 weight .* got 89.0"),
    # beta = b / m overflowed float32 to inf (or b underflowed to 0) and failed later, unnamed
    ({"kappa": 1e300}, r"the curvature b = kappa / sigma0 = 1e\+300 / .* must be finite and > 0 in "
                       r"torch.float32"),
    ({"scale_init": {"m": 1e-300}}, r"beta = b / scale_init\['m'\] = .*e\+300 must be finite"),
]


@pytest.mark.parametrize("options, match", BAD_OPTIONS)
def test_bad_options_raise_value_error_naming_the_value(options, match):
    with pytest.raises(ValueError, match=match):
        SEL(torch.zeros(8, 16), **options)


def test_a_clamp_up_to_log_finfo_max_is_accepted_and_keeps_the_weight_finite():
    # a small a: the gradient of log m, a M e^M, must also fit (test_sel_clamp.py)
    w = torch.full((2, 2), 0.5)
    chart = SEL(w, max_exponent=88.0, scale_init={"e_w": 0.01})
    raw = torch.full((2, 2), 88.0 / float(chart.beta) * 10)  # b|w| = 880, clamped to 88
    assert torch.isfinite(chart(raw)).all()
    assert SEL(w.double(), max_exponent=700.0).max_exponent == 700.0
    assert SEL(w.bfloat16(), max_exponent=80.0).max_exponent == 80.0  # computed in float32
    assert SEL(w.half(), max_exponent=11.0,  # float16's range: 11.09
               scale_init={"e_w": 0.005}).max_exponent == 11.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # float16's range is smaller
def test_the_clamp_log_finfo_max_itself_rounds_up_in_float32_and_is_refused(dtype):
    # log(finfo(float32).max) = 88.72283905206835 rounds up to the float32 88.72283935546875, whose
    # expm1 is inf: the bound was accepted and every clamped entry of the weight was inf
    limit = math.log(torch.finfo(torch.float32).max)
    w = torch.full((2, 2), 0.5, dtype=dtype)
    with pytest.raises(ValueError, match=r"max_exponent must be at most .* got 88\.72283905206835"):
        SEL(w, max_exponent=limit)
    largest = torch.nextafter(torch.tensor(limit), torch.tensor(0.0)).item()  # 88.72283172607422
    chart = SEL(w.float(), max_exponent=largest, scale_init={"e_w": 0.005})  # a M e^M < max
    raw = torch.full((2, 2), 1e3 / float(chart.beta))  # b|w| = 1000, clamped
    a, _, c = chart.coefficients()
    want = a.double() * math.expm1(largest) + c.double() * raw.double()  # 0.005 e^88.72 ~ 1.7e36
    for impl in ("fused", "autograd"):
        chart.impl = impl
        torch.testing.assert_close(chart(raw).double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", [1000.0, -1000.0])
def test_a_large_offset_n_sets_e_w_in_logs(n):
    """scale_init={'n': 1000} raised OverflowError (math.exp(1000) in e_w = s0 / b * e^n); the
    chart only uses e_w e^{-n}, which is s0 / b whatever n."""
    w = 0.1 * torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    chart = SEL(w, init="congruent", scale_init={"n": n})
    a, b, _ = chart.coefficients()
    torch.testing.assert_close(a * b, torch.full_like(w, 0.75), rtol=1e-12, atol=0)
    torch.testing.assert_close(chart(chart.right_inverse(w)), w, rtol=1e-12, atol=1e-15)


def test_bad_weights_raise():
    with pytest.raises(ValueError, match="weight must be finite"):
        SEL(torch.tensor([[1.0, math.nan]]))
    with pytest.raises(ValueError, match=r"1-D or 2-D tensors, got shape \(2, 2, 2\)"):
        SEL(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="rank must be"):
        SEL(torch.zeros(5), rank=1)
    chart = SEL(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="weight must be finite"):
        chart.right_inverse(torch.tensor([[1.0, math.inf], [0.0, 0.0]]))


def _reference_forward(chart: SEL, raw):
    """The forward rule written independently with plain autograd ops (no custom backward)."""
    a, b, c = chart.coefficients()
    sign = (raw >= 0).to(raw.dtype) * 2 - 1
    mag = raw * sign
    return sign * a * torch.expm1((b * mag).clamp(max=chart.max_exponent)) + c * mag


def _values_and_grads(chart: SEL, fn, raw, probe):
    chart.zero_grad(set_to_none=True)
    r = raw.clone().requires_grad_(True)
    out = fn(r)
    (out * probe).sum().backward()
    return out.detach(), r.grad, [p.grad.clone() for p in chart.parameters()]


def _impl_case(dtype=torch.float64):
    W = heavy_tailed((12, 9), dtype, seed=15)
    chart = SEL(W, max_exponent=3.0)
    perturb_scales(chart, seed=16)
    raw = chart.right_inverse(W * 0.5).detach()
    raw[0, :3] = torch.tensor([0.0, 5.0, -5.0], dtype=dtype)  # zero and two clamped entries
    probe = torch.randn(
        W.shape, generator=torch.Generator().manual_seed(17), dtype=torch.float64
    ).to(dtype)
    reference = _values_and_grads(chart, lambda r: _reference_forward(chart, r), raw, probe)
    return chart, raw, probe, reference


def _assert_same(result, reference, rtol=1e-12):
    (o1, g1, p1), (o2, g2, p2) = result, reference
    assert torch.allclose(o1, o2, rtol=rtol, atol=0)
    assert torch.allclose(g1, g2, rtol=rtol, atol=1e-300)
    for x, y in zip(p1, p2):
        assert torch.allclose(x, y, rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("impl", ["fused", "autograd"])
def test_forward_impls_match_plain_autograd(impl):
    chart, raw, probe, reference = _impl_case()
    chart.impl = impl
    _assert_same(_values_and_grads(chart, chart, raw, probe), reference)


@pytest.mark.slow
def test_compiled_forward_matches_plain_autograd():
    chart, raw, probe, reference = _impl_case()
    chart.impl = "compile"
    _assert_same(_values_and_grads(chart, chart, raw, probe), reference)


def test_gradcheck_one_dimensional_chart():
    b = heavy_tailed((1, 7), torch.float64, seed=18)[0]
    chart = SEL(b)
    raw = (chart.right_inverse(b) + 0.01).requires_grad_(True)
    assert torch.autograd.gradcheck(chart, (raw,))


def test_bfloat16_round_trip_is_limited_only_by_storing_raw_in_bfloat16():
    # the forward rule is correctly rounded (half an ulp of the float64 rule on the chart's own
    # bfloat16 parameters), so the round trip is off by the rounding of raw to bfloat16, about
    # eps (1 + b|w|) E / 2, and the rounding of W: k = 1. Evaluated in bfloat16 the rule was off
    # by up to 2.3 ulps here and the round trip needed k = 1.12 (8 was accepted)
    W = heavy_tailed((32, 64), torch.float64, seed=19).to(torch.bfloat16)
    chart = SEL(W, init="congruent")
    raw = chart.right_inverse(W)
    assert raw.dtype == torch.bfloat16
    out = chart(raw)
    eps = torch.finfo(torch.bfloat16).eps
    want = _sel_weight_float64(chart, raw)
    assert _ulps_off(out, want) <= 0.5 * (1 + 2.0**-5)
    assert within_conditioning(chart, raw.double(), out.double(), W.double(), k=1.0, eps=eps)


def test_forward_rule_rejects_unknown_impl():
    from manifoldlib.charts import sel_forward_rule

    one = (torch.ones(2, 1), torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"impl must be one of .* got 'cuda'"):
        sel_forward_rule(torch.zeros(2, 3), one, one, one, 10.0, impl="cuda")


@pytest.mark.parametrize("impl", ["fused", "autograd"])
def test_forward_rule_refuses_a_clamp_that_is_not_a_number_above_0(impl):
    """The clamp min(b|w|, M) at M < 0 made expm1 negative: a positive raw coordinate came back as
    a negative weight (and a negative one as a positive), at M = 0 without its exponential part,
    at M = NaN as NaN, without an error on every implementation."""
    from manifoldlib.charts import sel_forward_rule

    one = (torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64))
    raw = torch.tensor([[0.5, -0.5, 2.0]], dtype=torch.float64)
    for clamp in (-1.0, 0.0, math.nan):
        with pytest.raises(ValueError, match=rf"max_exponent must be a number > 0 .*, got {clamp}"):
            sel_forward_rule(raw, one, one, None, clamp, impl=impl)
    want = raw.sign() * torch.expm1(raw.abs().clamp(max=1.0))  # e^0.5 - 1, its mirror, e - 1
    weight = sel_forward_rule(raw, one, one, None, 1.0, impl=impl)
    assert torch.allclose(weight, want, rtol=1e-15, atol=0)


@pytest.mark.parametrize("impl", ["fused", "autograd"])
def test_forward_rule_refuses_factors_and_raw_of_other_shapes(impl):
    """The kernels read the factors by their number of entries and the ATen paths broadcast them:
    on a square raw, factors given as vectors (n,) or transposed ((1, n), (n, 1)) gave the right
    weight on the kernels and another on ATen (5.1 and 4.0 off at n = 4), and a raw of shape
    (n,) or (2, out, in) was broadcast to one or two weights, without an error."""
    from manifoldlib.charts import sel_forward_rule

    g = torch.Generator().manual_seed(0)
    raw = torch.randn(4, 4, generator=g, dtype=torch.float64)
    a, b = ((0.5 + torch.rand(4, 1, generator=g, dtype=torch.float64),
             0.5 + torch.rand(1, 4, generator=g, dtype=torch.float64)) for _ in range(2))
    want = raw.sign() * (a[0] * a[1]) * torch.expm1(b[0] * b[1] * raw.abs())
    assert torch.allclose(sel_forward_rule(raw, a, b, None, 10.0, impl), want, rtol=1e-14, atol=0)
    for pairs in ((a[0].view(-1), a[1].view(-1)), (a[0].mT, a[1].mT)):
        with pytest.raises(ValueError, match=r"a must be a row factor \(4, 1\) and a column "
                                             r"factor \(1, 4\) .*, got \[\((1, )?4,?\)"):
            sel_forward_rule(raw, pairs, b, None, 10.0, impl)
        with pytest.raises(ValueError, match=r"c must be a row factor"):
            sel_forward_rule(raw, a, b, pairs, 10.0, impl)
    for bad in (raw[0], raw.expand(2, 4, 4)):
        with pytest.raises(ValueError, match=rf"raw must be an \(out, in\) matrix, got shape "
                                             rf"{re.escape(str(tuple(bad.shape)))}"):
            sel_forward_rule(bad, a, b, None, 10.0, impl)


def test_every_listed_init_and_impl_is_accepted():
    w = heavy_tailed((6, 5), torch.float64, seed=3)
    for init in SEL_INITS:
        chart = SEL(w, init=init)
        assert torch.isfinite(chart(chart.right_inverse(w))).all()
    exact = SEL(w, init="congruent")  # the congruent init inverts the forward rule exactly
    assert (exact(exact.right_inverse(w)) - w).abs().max() <= TOL[torch.float64]
    raw = SEL(w).right_inverse(w)
    for impl in [i for i in SEL_IMPLS if i != "compile"]:  # compiling is too slow for the default run
        assert (SEL(w, impl=impl)(raw) - SEL(w)(raw)).abs().max() <= TOL[torch.float64]
    with pytest.raises(ValueError, match="init must be one of"):
        SEL(w, init="exact")


def _sel_weight_float64(chart: SEL, raw: torch.Tensor, params=None, max_exponent=None):
    """The forward rule from the chart's own (rounded) raw coordinates and scales, in float64
    (``params``: float64 tensors by parameter name to use instead of the chart's; ``max_exponent``
    instead of the chart's)."""
    max_exponent = chart.max_exponent if max_exponent is None else max_exponent
    params = {n: p.double() for n, p in chart.named_parameters()} if params is None else params

    def full(name):
        row = params[f"{name}_row"]
        col = params.get(f"{name}_col")
        return row if col is None else row + col
    a = torch.exp(full("log_e_w") - full("n"))
    b = torch.exp(full("log_m")) * chart.beta.double()
    c = torch.exp(full("log_l_w"))
    w = raw.double()
    sign = torch.where(w >= 0, 1.0, -1.0).double()
    t = w * sign  # |w|, with the chart's one-sided slope at w = 0
    return sign * a * torch.expm1((b * t).clamp(max=max_exponent)) + c * t


def _ulps_off(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error of ``got`` (16-bit) against the float64 ``want`` in units of ``got``'s
    eps relative to ``|want|`` (correct rounding: 0.5; below the normal range, in its ulp)."""
    finfo = torch.finfo(got.dtype)
    scale = want.abs().clamp_min(finfo.tiny) * finfo.eps
    return float(((got.double() - want) / scale).abs().max())


@pytest.mark.parametrize(
    "impl", ["kernels", "aten", "autograd", pytest.param("compile", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_chart_rounds_the_float64_rule_once(dtype, impl):
    # the rule and every gradient (raw and each scale parameter) computed in float32 and rounded
    # once: within half an ulp of the float64 rule on the chart's own 16-bit parameters, for
    # b|w| up to 20 (bfloat16; float16's own clamp is 5.5). bfloat16 was evaluated in bfloat16:
    # up to 34 ulps off for b|w| in [6, 20), 540 where the two terms cancel, and hundreds of ulps
    # in the scale gradients (float16 passed)
    g = torch.Generator().manual_seed(23)
    W = (torch.randn(48, 40, generator=g, dtype=torch.float64) / 6.0).to(dtype)
    chart = SEL(W, impl="fused" if impl in ("kernels", "aten") else impl)
    perturb_scales(chart, seed=24)
    _, b, _ = chart.coefficients()
    b = b.detach().double()
    bw = 20.0 * torch.rand(W.shape, generator=g, dtype=torch.float64)  # b|w| in [0, 20)
    sign = torch.where(torch.rand(W.shape, generator=g) < 0.5, -1.0, 1.0).double()
    raw = (sign * bw / b).to(dtype)
    raw[0, :2] = torch.tensor([0.0, -0.0])
    probe = torch.randn(W.shape, generator=g, dtype=torch.float64).to(dtype)

    params = {n: p.detach().double().requires_grad_() for n, p in chart.named_parameters()}
    r64 = raw.double().requires_grad_()
    want = _sel_weight_float64(chart, r64, params)
    (want * probe.double()).sum().backward()

    r = raw.clone().requires_grad_()
    if impl == "aten":
        with _cpu_kernels.disabled():
            got = chart(r)
    else:
        got = chart(r)
    (got * probe).sum().backward()
    assert got.dtype == r.grad.dtype == dtype
    errors = {"weight": _ulps_off(got.detach(), want.detach()), "raw": _ulps_off(r.grad, r64.grad)}
    for name, p in chart.named_parameters():
        assert p.grad.dtype == dtype
        errors[name] = _ulps_off(p.grad, params[name].grad)
    assert max(errors.values()) <= 0.5 * (1 + 2.0**-5), errors
    rule = got.grad_fn.next_functions[0][0]  # the chart's view_as sits on the forward rule
    if impl == "kernels" and _cpu_kernels.available():
        assert type(rule).__name__ == "_SELKernelRuleBackward"
    if impl == "aten":
        assert type(rule).__name__ == "_SELForwardRuleBackward"


def test_float16_chart_evaluates_in_float32():
    # a float16 chart is evaluated in float32 and rounded once: expm1(b|w|) in float16 overflowed
    # from b|w| = 11.1 (a chart built in float32 kept its clamp of 44.4 after module.half(), so
    # b|w| = 12 gave an inf weight). The clamp a float16 weight accepts now ends there (11.09):
    # at b|w| = 10.5 the weight is about 5e2, expm1 3.6e4, each within one float16 rounding
    torch.manual_seed(0)
    lin = nn.Linear(64, 4, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02)
    apply_chart(lin, functools.partial(SEL, max_exponent=11.0))
    chart = lin.parametrizations.weight[0]
    _, b, _ = chart.coefficients()
    with torch.no_grad():
        original = lin.parametrizations.weight.original
        original[0, 0] = 10.5 / b[0, 0]
        original[1, 1] = -6.0 / b[1, 1]
        original[2, 2] = 12.0 / b[2, 2]  # clamped at 11
    lin.half()
    raw = lin.parametrizations.weight.original.detach()
    want = _sel_weight_float64(chart, raw)
    got = lin.weight.detach()
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    # float32 evaluation rounded once to float16: within one float16 rounding of the float64 rule
    rel = ((got.double() - want) / want.abs().clamp_min(2.0**-14)).abs().max()
    assert float(rel) <= torch.finfo(torch.float16).eps
    assert 4.0e2 < float(got[0, 0]) < 7.0e2 and 6.0e2 < float(got[2, 2]) < 1.0e3
    x = torch.randn(3, 64, dtype=torch.float16)
    before = lin(x).detach()
    merge_charts(lin)
    assert torch.equal(lin.weight.detach(), got) and torch.equal(lin(x).detach(), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chart_built_in_float64_and_cast_down_clamps_like_one_built_in_that_dtype(dtype):
    # the default clamp 0.5 log(finfo.max) was fixed at construction: built in float64 it is 354.9,
    # and after module.float() expm1(b|w|) overflowed float32 from b|w| = 88.7 (W = inf at 100)
    # while the scales' gradients were inf/NaN from 44.4 on; a chart built in float32 clamps there
    torch.manual_seed(0)
    lin = nn.Linear(16, 4).double()
    apply_chart(lin, SEL)
    lin.to(dtype)
    twin = nn.Linear(16, 4).to(dtype)
    apply_chart(twin, SEL)
    twin.load_state_dict(lin.state_dict())
    chart, built_here = lin.parametrizations.weight[0], twin.parametrizations.weight[0]
    assert built_here.max_exponent == 0.5 * math.log(torch.finfo(dtype).max)
    _, b, _ = chart.coefficients()
    with torch.no_grad():
        for module in (lin, twin):
            original = module.parametrizations.weight.original
            original[0, 0] = 100.0 / b[0, 0]  # beyond float32's expm1 range
            original[1, 1] = -60.0 / b[1, 1]  # expm1 finite, its gradient not
    got = lin.weight.detach()
    assert torch.equal(got, twin.weight.detach())
    a, _, c = (v.double() for v in chart.coefficients())
    t = lin.parametrizations.weight.original.detach().double().abs()
    rule_dtype = torch.float32 if dtype == torch.bfloat16 else dtype  # bfloat16 runs in float32
    clamp = torch.tensor(built_here.max_exponent, dtype=rule_dtype).double()  # the clamp as it runs
    for i, sign in ((0, 1.0), (1, -1.0)):  # clamped: s a expm1(M) + c t, about 3e17 in size
        want = sign * a[i, i] * torch.expm1(clamp) + c[i, i] * t[i, i]
        torch.testing.assert_close(got[i, i].double(), want, rtol=8 * torch.finfo(dtype).eps, atol=0)
    x = torch.randn(3, 16, dtype=dtype)
    lin(x).sum().backward()
    twin(x).sum().backward()
    for (name, p), q in zip(lin.named_parameters(), twin.parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert torch.equal(p.grad, q.grad), name
    with pytest.raises(ValueError, match="beyond what the chart represents"):
        lin.weight = torch.full((4, 16), 1e30, dtype=dtype)


F16_DEFAULT = 0.5 * math.log(torch.finfo(torch.float16).max)  # 5.545: expm1 255


@pytest.mark.parametrize(
    "impl", ["kernels", "aten", "autograd", pytest.param("compile", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("built", [torch.float64, torch.float32, torch.bfloat16])
def test_a_chart_cast_to_float16_clamps_like_one_built_in_float16(built, impl):
    # the default clamp after module.half() stayed the build dtype's (float32's 44.36, float64's
    # 354.9) while the weight is rounded to float16: a expm1(M) overflowed 65504 from b|w| ~ 11 + ln
    # (1/a), so entries at b|w| = 30 or 100 were inf (a float16-built chart, clamping at 5.545,
    # gives 27), entries at b|w| = 8 were 3e2 where the twin gives 27, the raw gradient overflowed
    # (inf) and right_inverse accepted a target of 1e3 that the twin refuses
    options = {"impl": "fused" if impl in ("kernels", "aten") else impl}
    torch.manual_seed(0)
    lin = nn.Linear(16, 4).to(built)
    apply_chart(lin, functools.partial(SEL, **options))
    lin.half()
    twin = nn.Linear(16, 4).half()
    apply_chart(twin, functools.partial(SEL, **options))
    twin.load_state_dict(lin.state_dict())
    chart, built_here = lin.parametrizations.weight[0], twin.parametrizations.weight[0]
    assert built_here.max_exponent == F16_DEFAULT
    perturb_scales(chart, seed=3, spread=0.2)
    twin.load_state_dict(lin.state_dict())
    _, b, _ = chart.coefficients()
    with torch.no_grad():
        for module in (lin, twin):
            original = module.parametrizations.weight.original
            for i, bw in enumerate((100.0, -30.0, 8.0, -3.0)):  # clamped but the last
                original[i, i] = bw / b[i, i].float()
    raw = lin.parametrizations.weight.original.detach().clone()
    x = torch.randn(3, 16).half()
    results = []
    for module in (lin, twin):
        with _cpu_kernels.disabled() if impl == "aten" else contextlib.nullcontext():
            weight = module.weight
            rule = type(weight.grad_fn.next_functions[0][0]).__name__  # under the view_as
            if impl == "kernels" and _cpu_kernels.available():
                assert rule == "_SELKernelRuleBackward"
            if impl == "aten":
                assert rule == "_SELForwardRuleBackward"
            module(x).float().square().sum().backward()
            weight.float().square().sum().backward()  # every entry's gradient, the clamped too
            results.append(weight.detach())
    got, want_twin = results
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert torch.equal(got, want_twin)
    for (name, p), q in zip(lin.named_parameters(), twin.parameters()):
        assert p.grad.dtype == torch.float16 and torch.isfinite(p.grad).all(), name
        assert torch.equal(p.grad, q.grad), name
    # against the float64 rule at float16's clamp (rounded to float32, as it runs): half an ulp
    clamp = float(torch.tensor(F16_DEFAULT, dtype=torch.float32))
    want = _sel_weight_float64(chart, raw, max_exponent=clamp)
    assert _ulps_off(got, want) <= 0.5 * (1 + 2.0**-5)
    a, _, c = (v.detach().double() for v in chart.coefficients())
    for i, sign in ((0, 1.0), (1, -1.0), (2, 1.0)):  # clamped: s a expm1(M) + c t
        clamped = sign * a[i, i] * math.expm1(clamp) + c[i, i] * raw[i, i].double().abs()
        torch.testing.assert_close(got[i, i].double(), clamped, rtol=torch.finfo(torch.float16).eps,
                                   atol=0)
    # right_inverse with the same clamp: a target beyond it (finite in float16) is refused by both
    after = []
    for module in (lin, twin):
        with pytest.raises(ValueError, match="beyond what the chart represents"):
            module.weight = torch.full((4, 16), 1e3, dtype=torch.float16)
        module.weight = torch.full((4, 16), 0.5, dtype=torch.float16)  # well inside: accepted
        after.append((module.parametrizations.weight.original.detach(), module.weight.detach()))
    assert all(torch.equal(u, v) for u, v in zip(*after))
    torch.testing.assert_close(after[0][1].float(), torch.full((4, 16), 0.5), rtol=1e-3, atol=0)


def test_a_chart_cast_up_keeps_the_clamp_it_was_built_with():
    # the default follows casts downwards only: a float16 chart cast to float32 computes the same
    # weight (clamped at 5.545, not float32's 44.4), so a trained model keeps its function
    torch.manual_seed(0)
    lin = nn.Linear(16, 4).half()
    apply_chart(lin, SEL)
    chart = lin.parametrizations.weight[0]
    _, b, _ = chart.coefficients()
    with torch.no_grad():
        lin.parametrizations.weight.original[0, 0] = 8.0 / b[0, 0]  # beyond float16's clamp
    before = lin.weight.detach()
    lin.float()
    assert lin.weight.dtype == torch.float32
    torch.testing.assert_close(lin.weight.detach(), before.float(),
                               rtol=torch.finfo(torch.float16).eps, atol=0)


@pytest.mark.parametrize(
    ("dtype", "largest"), [(torch.float16, 11.089865684509277), (torch.bfloat16, 88.71891784667969)]
)
def test_the_largest_clamp_of_a_16_bit_weight_keeps_it_finite_and_the_next_is_refused(dtype,
                                                                                        largest):
    # a 16-bit weight is computed in float32 and rounded to its dtype: the clamp must keep
    # expm1(M) within that dtype's range, not float32's. float16 accepted up to 88.72283 and gave
    # inf weights from b|w| ~ 11 + ln(1/a) (a max_exponent of 80 was inf at b|w| = 80); bfloat16
    # accepted 88.72283, whose expm1 (3.4028e38) rounds to inf in bfloat16 (max 3.3895e38)
    w = torch.full((2, 2), 0.5, dtype=dtype)  # sigma0 = 0.5, b = 2
    top = torch.tensor(largest, dtype=torch.float32)
    above = torch.nextafter(top, torch.tensor(math.inf)).item()
    for refused in (above, 80.0 if dtype == torch.float16 else 88.72283172607422):
        with pytest.raises(ValueError, match=(
            rf"max_exponent must be at most log\(finfo.max\) = .* for a {dtype} weight "
            rf"\({largest!r} computed in torch.float32: .* got {refused!r}$")):
            SEL(w, max_exponent=refused)
    # a = 0.01: W = 0.01 expm1(M) + c t (a = 1 keeps W finite, but its raw gradient a b e^M
    # overflows: refused, test_sel_clamp.py)
    chart = SEL(w, max_exponent=largest, scale_init={"e_w": 0.01})
    raw = torch.full((2, 2), 2.0 * largest / float(chart.beta), dtype=dtype)  # b|w| = 2M, clamped
    a, _, c = chart.coefficients()
    want = a.double() * math.expm1(largest) + c.double() * raw.double()
    for impl in ("fused", "autograd"):
        chart.impl = impl
        got = chart(raw)
        assert torch.isfinite(got).all(), impl
        torch.testing.assert_close(got.double(), want, rtol=torch.finfo(dtype).eps, atol=0)


def test_a_cast_to_a_dtype_beyond_an_explicit_clamp_is_refused():
    # an explicit max_exponent is the clamp in every dtype: a float32 chart clamping at 30 cast
    # to float16 gave inf weights from b|w| ~ 11 + ln(1/a) (silently), and a float64 chart clamping
    # at 500 cast to float32 was clamped at 88.72283 instead (silently another chart). Both casts
    # are refused before anything of the chart changes; a clamp within range casts as before
    torch.manual_seed(0)
    lin = nn.Linear(16, 4)
    apply_chart(lin, functools.partial(SEL, max_exponent=30.0))
    chart = lin.parametrizations.weight[0]
    with pytest.raises(ValueError, match=(
            r"max_exponent must be at most log\(finfo.max\) = 11.09 for a torch.float16 weight "
            r"\(11.089865684509277 computed in torch.float32: .* got 30.0 \(casting a "
            r"torch.float32 chart: lower its max_exponent first\)$")):
        lin.half()
    assert all(t.dtype == torch.float32 for t in (*chart.parameters(), *chart.buffers()))
    assert lin.parametrizations.weight.original.dtype == torch.float32
    raw = lin.parametrizations.weight.original.detach()
    with pytest.raises(ValueError, match=r"for a torch.float16 weight .* got 30.0$"):
        chart(raw.half())  # evaluated on float16 raw coordinates directly
    chart.max_exponent = 10.5  # a M e^M (the gradient of log m) within 65504: up to 10.93 here
    lin.half()
    twin = nn.Linear(16, 4).half()
    apply_chart(twin, functools.partial(SEL, max_exponent=10.5))
    twin.load_state_dict(lin.state_dict())
    _, b, _ = chart.coefficients()
    with torch.no_grad():
        for module in (lin, twin):
            module.parametrizations.weight.original[0, 0] = 10.0 / b[0, 0].float()
    assert torch.equal(lin.weight, twin.weight) and torch.isfinite(lin.weight).all()

    wide = nn.Linear(16, 4).double()
    apply_chart(wide, functools.partial(SEL, max_exponent=500.0))
    with pytest.raises(ValueError, match=r"= 88.72 for a torch.float32 weight \(88.72283172607422 "
                                         r"computed in torch.float32: .* got 500.0 \(casting"):
        wide.float()
    assert wide.parametrizations.weight.original.dtype == torch.float64
    wide.parametrizations.weight[0].max_exponent = 80.0
    wide.float()
    assert torch.isfinite(wide.weight).all()


@pytest.mark.parametrize("shape", [(4, 3), (5,)])
def test_a_tensor_of_another_shape_is_refused_not_broadcast(shape):
    # the rank-1 scales broadcast: assigning a (1, 3) weight to a charted (4, 3) layer stored
    # four copies of that row, silently; a 1-D chart's right_inverse turned a (1,) target into
    # (5,); raw coordinates with a batch dimension, (2, 4, 3), gave two weights (ATen path)
    torch.manual_seed(0)
    chart = SEL(torch.randn(shape))
    wrong = [(1, 3), (4, 1), (3, 4), (12,), (2, 4, 3)] if len(shape) == 2 else [(1,), (5, 1), (10,)]
    for other in wrong:
        for path in ("kernels", "aten"):
            with _cpu_kernels.disabled() if path == "aten" else contextlib.nullcontext():
                with pytest.raises(ValueError, match=re.escape(
                        f"raw must have the chart's shape {shape}, got {other}")):
                    chart(torch.randn(other))
        with pytest.raises(ValueError, match=re.escape(
                f"weight must have the chart's shape {shape}, got {other}")):
            chart.right_inverse(torch.full(other, 0.1))
    if len(shape) == 2:
        lin = nn.Linear(3, 4)
        apply_chart(lin, SEL)
        before = lin.weight.detach().clone()
        with pytest.raises(ValueError, match=r"weight must have the chart's shape \(4, 3\)"):
            lin.weight = torch.full((1, 3), 0.1)
        assert torch.equal(lin.weight.detach(), before)
    raw = chart.right_inverse(torch.full(shape, 0.1))  # the right shape: as before
    torch.testing.assert_close(chart(raw), torch.full(shape, 0.1), rtol=4 * torch.finfo().eps, atol=0)
