"""The C++ CPU kernels of the fused sphere residual: the path is taken where it applies, gives the
values and gradients of the ATen path and of plain autograd, and falls back cleanly elsewhere."""

from __future__ import annotations

import math

import pytest
import torch
from dispatch_ops import KernelRecorder  # tests/dispatch_ops.py (tests/ is on sys.path)
from test_sphere_residual import _along_h, _UserP3  # pytest puts this folder on sys.path

from manifoldlib import _cpu_kernels
from manifoldlib.nn import SphereResidual, sphere_residual, sphere_residual_reference
from manifoldlib.retractions import (
    CayleyRetraction,
    GnomonicRetraction,
    PRetraction,
    get_retraction,
)

pytestmark = pytest.mark.skipif(
    not _cpu_kernels.available(),
    reason=f"the C++ CPU kernels could not be built on this machine (see the RuntimeWarning), "
    f"or {_cpu_kernels.ENV_VAR}=0 switches them off",
)


RETRACTIONS = {
    "gnomonic": get_retraction("sphere", "gnomonic"),
    "cayley": get_retraction("sphere", "cayley"),
    "exp": get_retraction("sphere", "exp"),
    "p=1.5": PRetraction(1.5),
    "user-p3": _UserP3(),  # a user's retraction defined only by its angle (the generic VJP)
}
KERNELS = ("forward_dots", "forward_combine", "backward_dots", "backward_combine")  # separate passes
ROW_KERNELS = ("sphere_step_forward", "sphere_step_backward")  # the built-ins: the update row by row


def _kernels_of(name):
    """The kernels a retraction's update runs: the row kernels for the built-in angle retractions,
    the separate passes (per-row math in Python) for a user's own."""
    return KERNELS if name == "user-p3" else ROW_KERNELS


@pytest.fixture
def spy():
    """Records the C++ kernels the test runs (at dispatch level: none inside ``disabled()``)."""
    with KernelRecorder() as recorder:
        yield recorder


def _case(seed, shape, radius=1.7, f_scale=0.8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(shape, generator=g, dtype=torch.float64)
    h = radius * h / h.norm(dim=-1, keepdim=True)
    f = torch.randn(shape, generator=g, dtype=torch.float64)
    f = f_scale * radius * f / math.sqrt(shape[-1])
    return h.to(dtype), f.to(dtype)


def _values_and_grads(fn, h, f, scale, retraction, seed=7):
    h = h.detach().clone().requires_grad_(True)
    f = f.detach().clone().requires_grad_(True)
    s = torch.tensor(scale, dtype=h.dtype, requires_grad=True)
    out = fn(h, f, s, retraction)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(h.dtype)
    (out * w).sum().backward()
    return out.detach(), h.grad, f.grad, s.grad


def _aten(h, f, s, retraction):
    with _cpu_kernels.disabled():
        return sphere_residual(h, f, s, retraction)


def _err(a: torch.Tensor, truth: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.double() - truth.double()))


def test_kernel_path_runs_the_row_kernels_or_all_four_passes(spy):
    h, f = _case(0, (4, 3, 10), dtype=torch.float32)
    _values_and_grads(sphere_residual, h, f, 0.7, RETRACTIONS["gnomonic"])
    assert spy.calls == list(ROW_KERNELS)
    spy.calls.clear()
    _values_and_grads(sphere_residual, h, f, 0.7, RETRACTIONS["user-p3"])
    assert spy.calls == list(KERNELS)
    spy.calls.clear()
    _values_and_grads(_aten, h, f, 0.7, RETRACTIONS["gnomonic"])
    assert spy.calls == []


class _NamedCayley(CayleyRetraction):
    """A user's subclass that keeps the built-in's math (a name and a retract of its own)."""

    name = "my-cayley"

    def retract(self, x, v, radius=None):
        return super().retract(x, v, radius)


class _SteeperP(PRetraction):
    """A user's subclass that changes the angle: its own math, not the built-in's."""

    def angle(self, beta):
        return 1.1 * super().angle(beta)


class _HalfStepGnomonic(GnomonicRetraction):
    """A user's subclass that changes the coefficients only (theta = arctan(beta/2)): the
    gnomonic closed-form derivative it inherits is not the derivative of its coefficients."""

    def coefficients(self, sigma):
        c = torch.rsqrt(1.0 + 0.25 * sigma)
        return c, 0.5 * c


@pytest.mark.parametrize(
    ("retraction", "kernels", "reference"),
    [
        (_NamedCayley(), ROW_KERNELS, get_retraction("sphere", "cayley")),
        (_SteeperP(1.5), KERNELS, None),
        (_HalfStepGnomonic(), KERNELS, None),
    ],
    ids=["keeps-the-math", "overrides-the-angle", "overrides-the-coefficients"],
)
def test_a_subclass_runs_the_row_kernels_only_when_it_keeps_its_built_ins_math(spy, retraction, kernels, reference):
    h, f = _case(8, (5, 12))
    found = _values_and_grads(sphere_residual, h, f, 0.7, retraction)
    assert spy.calls == list(kernels)
    truth = _values_and_grads(sphere_residual_reference, h, f, 0.7, retraction)
    assert max(_err(a, b) for a, b in zip(found, truth)) <= 1e-12
    if reference is not None:  # the same update as the built-in it derives from
        built_in = _values_and_grads(sphere_residual, h, f, 0.7, reference)
        assert max(_err(a, b) for a, b in zip(found, built_in)) == 0.0


@pytest.mark.parametrize("name", list(RETRACTIONS))
@pytest.mark.parametrize("f_kind", ["random", "zero", "parallel"])
def test_gradcheck_kernel_path_float64(spy, name, f_kind):
    h, f = _case(11, (2, 3, 7))
    if f_kind == "zero":
        f = torch.zeros_like(f)
    elif f_kind == "parallel":  # P_h f = 0: sigma = 0 with a nonzero f
        f = -0.4 * h
    h.requires_grad_(True)
    f.requires_grad_(True)
    s = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
    retraction = RETRACTIONS[name]
    assert torch.autograd.gradcheck(lambda a, b, c: sphere_residual(a, b, c, retraction), (h, f, s))
    assert set(spy.calls) == set(_kernels_of(name))


@pytest.mark.parametrize("name", list(RETRACTIONS))
@pytest.mark.parametrize("shape", [(33,), (5, 64), (2, 3, 70)])
def test_kernel_aten_and_reference_agree_float64(spy, name, shape):
    h, f = _case(3, shape, radius=4.0, f_scale=1.3)
    kernel = _values_and_grads(sphere_residual, h, f, 0.8, RETRACTIONS[name])
    assert set(spy.calls) == set(_kernels_of(name))
    aten = _values_and_grads(_aten, h, f, 0.8, RETRACTIONS[name])
    ref = _values_and_grads(sphere_residual_reference, h, f, 0.8, RETRACTIONS[name])
    for a, b, c in zip(kernel, aten, ref):
        assert a.shape == c.shape
        assert _err(a, b) <= 1e-13 * max(float(c.norm()), 1.0)
        assert _err(a, c) <= 1e-13 * max(float(c.norm()), 1.0)


@pytest.mark.parametrize("name", list(RETRACTIONS))
@pytest.mark.parametrize("f_scale", [0.05, 1.0, 5.0])
def test_kernel_path_float32_is_as_accurate_as_aten(spy, name, f_scale):
    # Against the float64 truth on the same float32 inputs, the kernel path is at least as
    # accurate as the ATen path up to a rounding-level slack; d(out)/ds rounds on the scale
    # ||w|| ||f|| (the row sum may cancel far below it).
    h, f = _case(5, (64, 96), radius=math.sqrt(96), f_scale=f_scale, dtype=torch.float32)
    retraction = RETRACTIONS[name]
    kernel = _values_and_grads(sphere_residual, h, f, 0.6, retraction)
    assert set(spy.calls) == set(_kernels_of(name))
    aten = _values_and_grads(_aten, h, f, 0.6, retraction)
    truth = _values_and_grads(sphere_residual_reference, h.double(), f.double(), 0.6, retraction)
    w_norm = float(torch.randn(h.shape, generator=torch.Generator().manual_seed(7)).norm())
    floors = [float(t.norm()) for t in truth[:3]] + [w_norm * float(f.norm())]
    for a, b, t, floor in zip(kernel, aten, truth, floors):
        assert a.dtype == torch.float32
        assert _err(a, t) <= 2 * _err(b, t) + 1e-6 * floor
        assert _err(a, t) <= 1e-5 * floor


def _dot_cases(dtype, rows=16, dim=8191):
    """Long rows with a common offset (sums of like-signed terms) and zero-mean rows (heavy
    cancellation), as ``[(kernel result, x, y), ...]`` for the five row dot products."""
    ops = _cpu_kernels.load()
    g = torch.Generator().manual_seed(1)
    x = (1.0 + 1e-2 * torch.randn(rows, dim, generator=g, dtype=torch.float64)).to(dtype)
    y = (1.0 + 1e-2 * torch.randn(rows, dim, generator=g, dtype=torch.float64)).to(dtype)
    z = torch.randn(rows, dim, generator=g, dtype=torch.float64).to(dtype)
    (fwd, factors, _), bwd = ops.forward_dots(x, y), ops.backward_dots(z, x, y)
    assert factors.numel() == 0  # rows in range: none rescaled
    assert fwd.dtype == bwd.dtype == dtype
    assert fwd.shape == (rows, 3) and bwd.shape == (rows, 2)
    return [
        (fwd[:, 0], x, x), (fwd[:, 1], x, y), (fwd[:, 2], y, y), (bwd[:, 0], z, x), (bwd[:, 1], z, y)
    ]


def test_float32_row_dots_are_rounded_once_and_beat_aten_sum():
    # float32 products are exact in double and summed there: the result is within one rounding
    # (half an ulp, plus double-level noise) of the true dot product, ATen's mul + sum is not.
    eps = torch.finfo(torch.float32).eps
    for dots, a, b in _dot_cases(torch.float32):
        truth = (a.double() * b.double()).sum(-1)  # exact products, double sum: ~1e-14 off
        err_kernel = float(((dots.double() - truth).abs() / truth.abs()).max())
        err_aten = float((((a * b).sum(-1).double() - truth).abs() / truth.abs()).max())
        assert err_kernel <= 0.51 * eps
        assert err_kernel <= err_aten


def test_float64_row_dots_meet_the_blocked_summation_bound():
    # |error| <= m eps sum|a b| with m = products (1) + lanes within a block (kBlock / kLanes)
    # + the lane sum (kLanes) + the blocks (d / kBlock) + the truth's own rounding (1).
    eps = torch.finfo(torch.float64).eps
    dim = 8191
    m = 1 + 256 // 8 + 8 + math.ceil(dim / 256) + 1
    for dots, a, b in _dot_cases(torch.float64, rows=4, dim=dim):
        truth = torch.tensor([math.fsum(r) for r in (a * b).tolist()], dtype=torch.float64)
        scale = (a * b).abs().sum(-1)
        assert bool(((dots - truth).abs() <= m * eps * scale).all())


def test_non_contiguous_inputs_fall_back_to_aten(spy):
    big_h, big_f = _case(9, (6, 40))
    retraction = RETRACTIONS["exp"]
    results = []
    for fn in (sphere_residual, sphere_residual_reference):
        leaf_h = big_h.clone().requires_grad_(True)
        leaf_f = big_f.clone().requires_grad_(True)
        s = torch.tensor(1.1, dtype=torch.float64, requires_grad=True)
        h, f = leaf_h[:, ::2], leaf_f[:, 1::2]  # (6, 20) views, not contiguous
        assert not (h.is_contiguous() or f.is_contiguous())
        out = fn(h, f, s, retraction)
        (out * torch.linspace(-1.0, 2.0, 20, dtype=torch.float64)).sum().backward()
        results.append((out.detach(), leaf_h.grad, leaf_f.grad, s.grad))
    assert spy.calls == []
    for a, b in zip(*results):
        assert _err(a, b) <= 1e-13 * max(float(b.norm()), 1.0)


@pytest.mark.parametrize("name", ["gnomonic", "user-p3"])
def test_non_contiguous_upstream_gradient(spy, name):
    # out.sum() hands the backward an expanded (stride-0) gradient: the row kernels read a
    # contiguous copy of it; the separate passes read it with ATen (the forward ran the kernels)
    h, f = _case(4, (5, 12))
    retraction = RETRACTIONS[name]
    grads = []
    for fn in (sphere_residual, sphere_residual_reference):
        a = h.clone().requires_grad_(True)
        b = f.clone().requires_grad_(True)
        s = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        fn(a, b, s, retraction).sum().backward()
        grads.append((a.grad, b.grad, s.grad))
    assert spy.calls == (list(ROW_KERNELS) if name == "gnomonic" else ["forward_dots", "forward_combine"])
    for a, b in zip(*grads):
        assert _err(a, b) <= 1e-13 * max(float(b.norm()), 1.0)


@pytest.mark.parametrize("name", ["cayley", "user-p3"])
@pytest.mark.parametrize("which", ["h", "f"])
def test_one_input_gradient(spy, which, name):
    h, f = _case(8, (7, 16))
    retraction = RETRACTIONS[name]
    grads = []
    for fn in (sphere_residual, sphere_residual_reference):
        a = h.clone().requires_grad_(which == "h")
        b = f.clone().requires_grad_(which == "f")
        (fn(a, b, 0.5, retraction) * torch.arange(16.0, dtype=torch.float64)).sum().backward()
        grads.append(a.grad if which == "h" else b.grad)
        assert (b.grad if which == "h" else a.grad) is None
    assert spy.calls == list(_kernels_of(name))
    assert _err(grads[0], grads[1]) <= 1e-13 * float(grads[1].norm())


def test_bfloat16_goes_through_the_float32_kernels(spy):
    h, f = _case(2, (8, 32), radius=math.sqrt(32), f_scale=1.0, dtype=torch.bfloat16)
    retraction = RETRACTIONS["gnomonic"]
    low = _values_and_grads(sphere_residual, h, f, 0.9, retraction)
    assert spy.calls == list(ROW_KERNELS)
    high = _values_and_grads(sphere_residual_reference, h.float(), f.float(), 0.9, retraction)
    assert [t.dtype for t in low[:3]] == [torch.bfloat16] * 3
    for a, b in zip(low[:3], high[:3]):
        assert _err(a, b) <= 2e-2 * float(b.norm())
    assert abs(float(low[3]) - float(high[3])) <= 2e-2 * abs(float(high[3])) + 1e-2


def test_kernels_reject_bad_inputs():
    ops = _cpu_kernels.load()
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        ops.forward_dots(x.half(), x.half())
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.forward_dots(x.t(), x.t())
    with pytest.raises(RuntimeError, match="one per row"):
        ops.forward_combine(x, x, [torch.ones(3), torch.ones(4)], torch.empty(3, 4))
    step = torch.tensor(0.5)
    with pytest.raises(RuntimeError, match="family must be"):
        ops.sphere_step_forward(x, x, step, 7, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="p must be in"):
        ops.sphere_step_forward(x, x, step, 2, -1.0, 0.0)
    with pytest.raises(RuntimeError, match="s must be a one-element CPU tensor"):
        ops.sphere_step_forward(x, x, torch.ones(2), 0, 1.0, 0.0)
    out, stats = ops.sphere_step_forward(x, x, step, 0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="stats must be"):
        ops.sphere_step_backward(x, x, x, stats.float(), step, 0, 1.0, 0.0, True, True)


@pytest.mark.parametrize("p", [0.3, 1.5, math.inf])
@pytest.mark.parametrize("normalize_eps", [None, 1e-3])
def test_row_kernels_across_the_series_switch_of_k_prime(spy, p, normalize_eps):
    # k'(sigma) switches from (cos θ/(1 + z²) - k)/(2σ) to its series below σ = 1e-5: steps whose
    # σ = s² ||P_h f||²/||h||² falls on either side agree with plain autograd to rounding
    h, f = _case(12, (6, 24), radius=2.0, f_scale=1.0)
    retraction = PRetraction(p)
    tangent = f - (f * h).sum(-1, keepdim=True) / (h * h).sum(-1, keepdim=True) * h  # P_h f
    sigma_of_unit_step = float((tangent**2).sum(-1).mean() / 4.0)  # ||P_h f||² / r², r = 2
    if normalize_eps is not None:
        sigma_of_unit_step = 1.0  # the normalized step has σ = s² (up to the floor)
    for sigma in (3e-6, 9e-6, 1.1e-5, 4e-5):
        scale = math.sqrt(sigma / sigma_of_unit_step)

        def fn(a, b, c, r):
            return sphere_residual(a, b, c, r, normalize_eps=normalize_eps)

        def ref(a, b, c, r):
            return sphere_residual_reference(a, b, c, r, normalize_eps=normalize_eps)

        spy.calls.clear()
        mine = _values_and_grads(fn, h, f, scale, retraction)
        assert spy.calls == list(ROW_KERNELS)
        truth = _values_and_grads(ref, h, f, scale, retraction)
        for a, b in zip(mine, truth):
            assert _err(a, b) <= 1e-12 * max(float(b.norm()), 1.0)


@pytest.mark.parametrize(("name", "normalize_eps"), [("gnomonic", None), ("cayley", 1e-6), ("p=1.5", None),
                                                     ("exp", 1e-6), ("user-p3", None)])
@pytest.mark.parametrize(("dtype", "exponent"), [(torch.float32, -66), (torch.float32, -100), (torch.float32, 40),
                                                 (torch.float64, -532), (torch.float64, -360), (torch.float64, 400)])
def test_kernels_compute_rows_out_of_range_rescaled_bit_for_bit(spy, dtype, exponent, name, normalize_eps):
    """Rows scaled by 2^exponent: tiny ones whose ||h||² underflows (float32 2^-66, 2^-100; float64
    2^-532) or whose per-row math does (float64 2^-360: terms like a <g, h> ~ ||h||³), and huge ones
    (float32 2^40, float64 2^400). The kernels compute a row out of range on its copy scaled by a
    power of two, so its values are 2^exponent times those of its twin in range and its gradients
    the twin's, bit for bit, next to rows in range that keep their own bits. Before, the row kernels
    floored ||h||² at float32's smallest normal and under- or overflowed in float64 (off the sphere
    by up to 1e6, gradients off by 100 % at 2^-360, NaN at 2^400), and the separate passes of a
    user's retraction, whose per-row math in the input dtype forms a² ~ ||h||⁴, lost the step
    (float32 2^40, float64 2^-360 and 2^400 included)."""
    retraction = RETRACTIONS[name]
    h, f = _case(10, (9, 40), radius=1.0, f_scale=1.5, dtype=dtype)
    factor = 2.0**exponent
    row_scale = torch.ones(9, 1, dtype=dtype)
    row_scale[4:] = factor

    def fn(a, b, s, r):
        return sphere_residual(a, b, s, r, normalize_eps=normalize_eps)

    unit = _values_and_grads(fn, h, f, 0.7, retraction)
    spy.calls.clear()
    mixed = _values_and_grads(fn, row_scale * h, row_scale * f, 0.7, retraction)
    assert spy.calls == list(_kernels_of(name))
    assert torch.equal(mixed[0], row_scale * unit[0])
    assert torch.equal(mixed[1], unit[1]) and torch.equal(mixed[2], unit[2])
    scaled = _values_and_grads(fn, factor * h, factor * f, 0.7, retraction)  # every row rescaled
    assert torch.equal(scaled[3], factor * unit[3])  # dL/ds: degree 1, a sum of exactly scaled rows
    ratio = (mixed[0] / row_scale).double().norm(dim=-1) / h.double().norm(dim=-1)  # (rows,)
    assert float((ratio - 1.0).abs().max()) <= 4 * torch.finfo(dtype).eps


@pytest.mark.parametrize(("name", "normalize_eps", "step"), [("gnomonic", 1e-6, 0.7), ("exp", 1e-6, 0.7),
                                                             ("p=1.5", None, 2.0**-510), ("user-p3", None, 2.0**-510)])
def test_a_row_whose_f_outgrows_its_h_is_rescaled_by_the_references_rule(spy, name, normalize_eps, step):
    """float64 rows with ||f|| / ||h|| = 2^520 (a literal step of 2^-510: β about 2^10): h of norm
    2^-250 with f of 2^270, and its twin h of 2^-100 with f of 2^420. The kernels rescaled a row
    by the power of two of its largest |h_i| alone, so the first one's copy had f of 2^520, whose
    squares overflow a double: NaN, values and gradients, where the reference (and the row's own
    ||P_h f||²) is finite. Now they take the reference's exponent (the larger where f 2^-e would
    pass 2^400): both rows are computed on the same copy, so they are twins bit for bit, and they
    agree with the reference (its dL/ds, plain autograd, to β eps)."""
    retraction = RETRACTIONS[name]
    h, f = _case(21, (3, 24), radius=1.0, f_scale=1.0)
    f = f * 2.0**520

    def fn(a, b, s, r):
        return sphere_residual(a, b, s, r, normalize_eps=normalize_eps)

    tiny = _values_and_grads(fn, h * 2.0**-250, f * 2.0**-250, step, retraction)
    assert spy.calls == list(_kernels_of(name))
    twin = _values_and_grads(fn, h * 2.0**-100, f * 2.0**-100, step, retraction)
    assert all(bool(torch.isfinite(t).all()) for t in tiny)
    assert torch.equal(tiny[0], twin[0] * 2.0**-150)
    assert torch.equal(tiny[1], twin[1]) and torch.equal(tiny[2], twin[2])
    assert torch.equal(tiny[3], twin[3] * 2.0**-150)
    reference = _values_and_grads(lambda a, b, s, r: sphere_residual_reference(a, b, s, r, normalize_eps),
                                  h * 2.0**-250, f * 2.0**-250, step, retraction)
    for mine, truth, tolerance in zip(tiny, reference, (1e-13, 1e-13, 1e-13, 1e-11)):
        assert _err(mine, truth) <= tolerance * float(torch.linalg.vector_norm(truth))


@pytest.mark.parametrize(("name", "normalize_eps", "step", "dtype", "h_exp", "f_exp", "shift"), [
    ("gnomonic", 1e-6, 0.7, torch.float32, -20, 55, -10),
    ("user-p3", None, 2.0**-26, torch.float32, 20, 46, -20),
    ("user-p3", None, 2.0**-350, torch.float64, 100, 450, -100),
])
def test_a_row_in_range_with_a_far_larger_f_is_computed_rescaled(spy, name, normalize_eps, step, dtype, h_exp, f_exp,
                                                                 shift):
    """Rows whose ||h||² is in range but ||f|| or ||h|| ||f|| is past 2^K (K = 48 float32, 400 float64,
    the reference's bound on a copy's f): the kernels computed them as they were. The gradient's
    coefficient of f, of order ||h|| / ||P_h f||², was subnormal in float32 (h of norm 2^-20, f of
    2^55, normalized step) and lost bits that the row scaled out of range (its twin 2^-10 times it,
    rescaled) keeps; the separate passes' math in the input dtype formed a² ~ ||h||² ||f||² past its
    largest number, and a user's literal step left the row off its sphere (float32) or far from it
    (float64), without an error. Now such rows are rescaled by the reference's rule as well: they are
    their twins (2^shift times them) bit for bit, on their sphere, and agree with the float64 reference."""
    retraction = RETRACTIONS[name]
    h, f = _case(22, (3, 24), radius=1.0, f_scale=1.0, dtype=dtype)
    h, f = h * 2.0**h_exp, f * 2.0**f_exp

    def fn(a, b, s, r):
        return sphere_residual(a, b, s, r, normalize_eps=normalize_eps)

    mine = _values_and_grads(fn, h, f, step, retraction)
    assert spy.calls == list(_kernels_of(name))
    twin = _values_and_grads(fn, h * 2.0**shift, f * 2.0**shift, step, retraction)
    assert torch.equal(mine[0], twin[0] * 2.0**-shift)
    assert torch.equal(mine[1], twin[1]) and torch.equal(mine[2], twin[2])
    assert torch.equal(mine[3], twin[3] * 2.0**-shift)
    eps = torch.finfo(dtype).eps
    ratio = mine[0].double().norm(dim=-1) / h.double().norm(dim=-1)
    assert float((ratio - 1.0).abs().max()) <= 4 * eps
    reference = _values_and_grads(lambda a, b, s, r: sphere_residual_reference(a, b, s, r, normalize_eps),
                                  h.double(), f.double(), step, retraction)
    for value, truth, ulps in zip(mine, reference, (16, 16, 16, 64)):  # dL/ds: a sum over rows and terms
        assert _err(value, truth) <= ulps * eps * float(torch.linalg.vector_norm(truth))


def test_kernels_mark_the_rows_they_rescale():
    # forward_dots: the dots of the scaled row and its factor 2^-e (e of the largest |h_i|), 1 for
    # the rows in range; sphere_step_forward: the scaled row's stats, its q negated
    ops = _cpu_kernels.load()
    h, f = _case(3, (4, 16), radius=1.0, f_scale=1.0, dtype=torch.float32)
    # (a huge row whose own ||P_h f||² fits float32: beyond it the row is NaN, an update out of range)
    row_scale = torch.tensor([[1.0], [2.0**-90], [1.0], [2.0**50]])
    dots, factors, parallel = ops.forward_dots(row_scale * h, row_scale * f)
    _, e = torch.frexp(h.abs().amax(-1))  # the unit rows' exponents
    expected = torch.ones(4)
    expected[1], expected[3] = math.ldexp(1.0, 90 - int(e[1])), math.ldexp(1.0, -50 - int(e[3]))
    assert torch.equal(factors, expected)
    twin, _, _ = ops.forward_dots(expected[:, None] * row_scale * h, expected[:, None] * row_scale * f)
    assert torch.equal(dots, twin)
    assert parallel.numel() == 0  # random rows: none nearly parallel
    step = torch.tensor(0.5)
    _, stats = ops.sphere_step_forward(row_scale * h, row_scale * f, step, 0, 1.0, 0.0)
    _, twin_stats = ops.sphere_step_forward(expected[:, None] * row_scale * h, expected[:, None] * row_scale * f,
                                            step, 0, 1.0, 0.0)
    assert torch.equal(stats[:, 0], torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64) * twin_stats[:, 0])
    assert torch.equal(stats[:, 1:], twin_stats[:, 1:])


@pytest.mark.parametrize("name", ["cayley", "user-p3"])
@pytest.mark.parametrize("which", ["h", "f", "expanded"])
def test_rescaled_rows_with_one_input_gradient_or_an_expanded_upstream_gradient(spy, which, name):
    # the backward's other branches (one gradient; an expanded upstream gradient, which the
    # separate passes' backward reads with ATen) on rows the forward rescaled: the twin's gradients
    h, f = _case(8, (7, 16))
    retraction = RETRACTIONS[name]
    grads = []
    for factor in (1.0, 2.0**-600):
        a = (factor * h).requires_grad_(which != "f")
        b = (factor * f).requires_grad_(which != "h")
        out = sphere_residual(a, b, 0.5, retraction)
        if which == "expanded":
            out.sum().backward()
        else:
            (out * torch.arange(16.0, dtype=torch.float64)).sum().backward()
        grads.append((a.grad, b.grad))
    assert _kernels_of(name)[0] in spy.calls and set(spy.calls) <= set(_kernels_of(name))
    (grad_h, grad_f), (twin_h, twin_f) = grads
    assert (grad_h is None, grad_f is None) == {"h": (False, True), "f": (True, False)}.get(which, (False, False))
    for mine, twin in ((grad_h, twin_h), (grad_f, twin_f)):
        assert (mine is None and twin is None) or torch.equal(mine, twin)


def test_forward_dots_flags_the_nearly_parallel_rows():
    # A row whose ||f||² - <h, f>²/||h||² (double sums) is below ||f||² / 8: [a/q, ν, ||P_h f||²]
    # from one more sweep over the row (ν = <h, u>/q of u = f - (a/q) h: what rounding left of h),
    # NaN a/q for the other rows; an empty tensor when no row is flagged.
    ops = _cpu_kernels.load()
    for dtype in (torch.float32, torch.float64):
        h, f = _along_h(1.0, dtype, rows=6)  # ||f||²/||P_h f||² = 2: none flagged
        assert ops.forward_dots(h, f)[2].numel() == 0
        along = torch.tensor([[1e4], [0.0], [3.0], [2.5], [-1e3], [1.0]], dtype=torch.float64)  # ratios 1 + along²
        f = (along * h.double() + (f.double() - h.double())).to(dtype)
        _, factors, parallel = ops.forward_dots(h, f)
        assert factors.numel() == 0 and parallel.shape == (6, 3) and parallel.dtype == torch.float64
        flagged = ~parallel[:, 0].isnan()
        assert flagged.tolist() == [True, False, True, False, True, False]  # 1 + along² > 8
        hd, fd = h.double(), f.double()
        ratio = (hd * fd).sum(-1) / (hd * hd).sum(-1)
        tangent = fd - ratio[:, None] * hd
        tangent = tangent - (hd * tangent).sum(-1, keepdim=True) / (hd * hd).sum(-1, keepdim=True) * hd
        assert torch.allclose(parallel[flagged, 0], ratio[flagged], rtol=1e-15, atol=0)
        assert float(parallel[flagged, 1].abs().max()) <= 1e-13 * float(ratio.abs().max())
        assert torch.allclose(parallel[flagged, 2], (tangent**2).sum(-1)[flagged], rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("dtype", "along", "exponent"),
    [(torch.float32, 1e2, -100), (torch.float32, 1e4, 40), (torch.float32, 1e5, -70),
     (torch.float64, 1e2, -600), (torch.float64, 1e6, 400), (torch.float64, 1e8, -532)],
)
def test_separate_passes_nearly_parallel_rows_beside_ordinary_and_rescaled_ones(spy, dtype, along, exponent):
    """A user's literal step on the separate passes, a batch of ordinary rows (random f), rows
    nearly parallel (f = along * h + a tangent of norm r) and copies of both scaled by 2^exponent
    (computed rescaled). The nearly parallel rows left the sphere (float32 along 1e4: by 12 %,
    float64 1e8: by 30 %); now every row is on its sphere to a few eps. The ordinary rows get the
    bits of the old path (forward_dots, the coefficient math, forward_combine of A h + B f: what
    ran before, reproduced here with the kernels themselves), and their gradients the bits they
    get in a batch of ordinary rows alone; the rescaled rows are their twins' bit for bit."""
    ops = _cpu_kernels.load()
    retraction = RETRACTIONS["user-p3"]
    h_par, f_par = _along_h(along, dtype, rows=6, dim=48)
    h_ord, f_ord = _case(14, (6, 48), radius=8.0, f_scale=1.0, dtype=dtype)
    h = torch.cat([h_ord, h_par, h_ord, h_par])
    f = torch.cat([f_ord, f_par, f_ord, f_par])
    row_scale = torch.ones(24, 1, dtype=dtype)
    row_scale[12:] = 2.0**exponent
    h, f = row_scale * h, row_scale * f
    leaf_h, leaf_f = h.clone().requires_grad_(True), f.clone().requires_grad_(True)
    out = sphere_residual(leaf_h, leaf_f, torch.tensor(0.6, dtype=dtype, requires_grad=True), retraction)
    w = torch.randn(6, 48, generator=torch.Generator().manual_seed(7)).to(dtype)
    (out * torch.cat([w] * 4)).sum().backward()  # a row and its twin: the same upstream gradient
    out, grad_h, grad_f = out.detach(), leaf_h.grad, leaf_f.grad
    assert spy.calls == list(KERNELS)
    eps = torch.finfo(dtype).eps
    ratio = (out / row_scale).double().norm(dim=-1) / (h / row_scale).double().norm(dim=-1)
    assert float((ratio - 1.0).abs().max()) <= 4 * eps
    # rescaled rows: their twins' bits
    assert torch.equal(out[12:], row_scale[12:] * out[:12])
    assert torch.equal(grad_h[12:], grad_h[:12]) and torch.equal(grad_f[12:], grad_f[:12])
    # ordinary rows: the old path's values, and the gradients of a batch of ordinary rows alone
    dots, _, parallel = ops.forward_dots(h_ord, f_ord)
    assert parallel.numel() == 0
    q, a, f_sq = dots.split(1, dim=-1)
    q = q.clamp_min(torch.finfo(dtype).tiny)
    s = torch.tensor(0.6, dtype=dtype)
    n = (f_sq - a * a / q).clamp_min(0.0)
    c, k = retraction.coefficients(s * s * n / q)
    ks = k * s
    old = torch.empty_like(h_ord)
    ops.forward_combine(h_ord, f_ord, [(c - ks * a / q).contiguous(), ks.contiguous()], old)
    assert torch.equal(out[:6], old) and torch.equal(out[12:18], row_scale[12:18] * old)
    alone_h, alone_f = h_ord.clone().requires_grad_(True), f_ord.clone().requires_grad_(True)
    alone = sphere_residual(alone_h, alone_f, torch.tensor(0.6, dtype=dtype, requires_grad=True), retraction)
    (alone * w).sum().backward()
    assert torch.equal(alone.detach(), old)
    assert torch.equal(grad_h[:6], alone_h.grad) and torch.equal(grad_f[:6], alone_f.grad)


# ---- torch.compile keeps the row kernels: operators with fake functions and an autograd formula ----

# every retraction the row kernels run (the p-family at p = 1.5 besides its named members), both steps
_COMPILED_LAYERS = [(name, step) for name in ("gnomonic", "cayley", "exp", "p") for step in ("literal", "normalized")]


def _kernel_calls(fn):
    """The C++ kernels ``fn()`` runs, by name, as the profiler records them, the calls of a compiled
    graph included (not the ``spy`` fixture's dispatch mode: dynamo does not compile a function
    first called under one, it runs it eagerly)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name.split("::")[1] for e in prof.events() if e.name.startswith("manifoldlib_cpu::")]


def _layers_values_and_grads(layers, run, hs, fs, ws):
    """Each layer's output on its own (h, f), and its gradients in h, f and log alpha."""
    hs = [h.clone().requires_grad_(True) for h in hs]
    fs = [f.clone().requires_grad_(True) for f in fs]
    for layer in layers:
        layer.log_alpha.grad = None
    outs = run(hs, fs)
    sum((out * w).sum() for out, w in zip(outs, ws)).backward()
    return [(out.detach(), h.grad, f.grad, layer.log_alpha.grad)
            for out, h, f, layer in zip(outs, hs, fs, layers)]


@pytest.mark.slow  # one inductor compilation per dtype (forward and backward graph): about 10 s cold
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_compile_fullgraph_runs_the_row_kernels(dtype):
    """torch.compile(fullgraph=True) of SphereResidual layers of every built-in retraction, both step
    forms, forward and backward: each layer runs the row kernels once forward and once backward
    (inductor traced the ATen path before: no kernel ran), with the eager kernels' values and
    gradients (float64 to 1e-14, float32 to 4 ulps of each tensor's largest entry), and a zero row of
    h is kept with the identity's gradients (the convention of _fused.py, "A zero row of h")."""
    layers = torch.nn.ModuleList(
        SphereResidual(24, layer=2, retraction=name, p=1.5, step=step, alpha_init=0.9)
        for name, step in _COMPILED_LAYERS
    ).to(dtype)
    cases = [_case(20 + i, (3, 5, 24), radius=math.sqrt(24), f_scale=1.0, dtype=dtype) for i in range(len(layers))]
    hs, fs = [h for h, _ in cases], [f for _, f in cases]
    for h in hs:
        h[1, 2] = 0.0  # a zero row
    g = torch.Generator().manual_seed(7)
    ws = [torch.randn(3, 5, 24, generator=g).to(dtype) for _ in layers]

    def forward(hs, fs):
        return [layer(h, f) for layer, h, f in zip(layers, hs, fs)]

    compiled = torch.compile(forward, fullgraph=True)
    eager = _layers_values_and_grads(layers, forward, hs, fs, ws)
    _layers_values_and_grads(layers, compiled, hs, fs, ws)  # compiles the forward and backward graphs
    calls = _kernel_calls(lambda: _layers_values_and_grads(layers, compiled, hs, fs, ws))
    assert calls == ["sphere_step_forward"] * len(layers) + ["sphere_step_backward"] * len(layers)
    found = _layers_values_and_grads(layers, compiled, hs, fs, ws)
    tol = 1e-14 if dtype == torch.float64 else 4 * torch.finfo(dtype).eps
    for (name, step), want, got, w in zip(_COMPILED_LAYERS, eager, found, ws):
        for a, b in zip(got, want):
            assert float((a - b).abs().max()) <= tol * float(b.abs().max()), (name, step)
        out, grad_h, grad_f, grad_alpha = got
        assert torch.equal(out[1, 2], torch.zeros(24, dtype=dtype))
        assert torch.equal(grad_h[1, 2], w[1, 2]) and torch.equal(grad_f[1, 2], torch.zeros(24, dtype=dtype))
        assert bool(torch.isfinite(grad_alpha))


def test_torch_compile_takes_the_aten_path_where_the_kernels_do_not_run():
    """Under torch.compile the ATen path runs where eager takes it: inside disabled() (a recompilation,
    guarded on it; outside the block the kernels again) and for a user's own retraction (the
    separate passes are eager only); a bfloat16 stream runs the float32 kernels, as in eager."""
    res = SphereResidual(16, retraction="cayley", step="literal")
    compiled = torch.compile(res, fullgraph=True, backend="aot_eager")
    h, f = _case(5, (6, 16), radius=4.0, dtype=torch.float32)

    def step(h, f):
        return lambda: compiled(h.clone().requires_grad_(True), f).sum().backward()

    step(h, f)()
    assert _kernel_calls(step(h, f)) == list(ROW_KERNELS)
    with _cpu_kernels.disabled():
        assert _kernel_calls(step(h, f)) == []
    assert _kernel_calls(step(h, f)) == list(ROW_KERNELS)
    step(h.bfloat16(), f.bfloat16())()
    assert _kernel_calls(step(h.bfloat16(), f.bfloat16())) == list(ROW_KERNELS)
    # (not fullgraph: the generic coefficients_vjp calls torch.autograd.grad, which dynamo does not trace)
    user = torch.compile(SphereResidual(16, retraction=RETRACTIONS["user-p3"], step="literal"), backend="aot_eager")
    user(h.clone().requires_grad_(True), f).sum().backward()
    assert _kernel_calls(lambda: user(h.clone().requires_grad_(True), f).sum().backward()) == []


def _kernel_op_args(dtype, requires_grad):
    h, f = _case(2, (5, 12), radius=2.0, dtype=dtype)
    h[3] = 0.0  # a zero row: stats q = 0
    h[4] *= 2.0**-100  # a rescaled row: stats q < 0
    f[4] *= 2.0**-100  # (its update in range: an f of its scale, so sigma is that of a row of norm 2)
    step = torch.tensor(0.7, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (h, f, step)]


@pytest.mark.parametrize(("dtype", "family", "p", "eps"), [
    (torch.float32, 0, 1.0, 0.0), (torch.float64, 1, 2.0, 1e-6), (torch.float32, 2, 1.5, 1e-3),
    (torch.float64, 2, math.inf, 0.0),
], ids=["gnomonic-float32", "cayley-float64-normalized", "p1.5-float32-normalized", "exp-float64"])
def test_opcheck_the_row_kernel_operators(dtype, family, p, eps):
    """torch.library.opcheck: the schemas, the fake functions against the kernels (shapes, dtypes,
    strides), the autograd registration, and AOTAutograd tracing with dynamic shapes; the backward
    with each subset of gradients asked for."""
    ops = _cpu_kernels.load()
    for requires_grad in (False, True):
        args = (*_kernel_op_args(dtype, requires_grad), family, p, eps)
        torch.library.opcheck(ops.sphere_step_forward.default, args)
    h, f, step = _kernel_op_args(dtype, False)
    _, stats = ops.sphere_step_forward(h, f, step, family, p, eps)
    grad = torch.randn(h.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    for want_h, want_f in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(ops.sphere_step_backward.default,
                              (grad, h, f, stats, step, family, p, eps, want_h, want_f))


def test_the_row_kernels_refuse_a_second_derivative():
    """The backward kernel has no derivative: a double backward through the kernel path raises (it
    did through the once_differentiable function before); a first backward with create_graph works."""
    h, f = _case(4, (3, 8))
    h.requires_grad_(True)
    out = sphere_residual(h, f, 0.5, RETRACTIONS["gnomonic"])
    (grad_h,) = torch.autograd.grad(out.sum(), h, create_graph=True)
    (plain,) = torch.autograd.grad(sphere_residual(h, f, 0.5, RETRACTIONS["gnomonic"]).sum(), h)
    assert torch.equal(grad_h.detach(), plain)
    with pytest.raises(RuntimeError, match="no second derivative"):
        grad_h.sum().backward()


def test_the_compile_decision_is_marked_constant_as_the_public_decorator_marks():
    """loader._built carries the mark torch.compiler.assume_constant_result sets (set by hand there, so
    that importing manifoldlib does not import torch._dynamo): without it a first call under
    torch.compile(fullgraph=True) would trace into load()'s lock and fail."""
    from manifoldlib._cpu_kernels import loader

    marked = torch.compiler.assume_constant_result(lambda: True)
    names = [name for name in vars(marked) if name.startswith("_dynamo")]
    assert names and all(getattr(loader._built, name) == getattr(marked, name) for name in names)
