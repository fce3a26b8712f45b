"""SphereResidual: the fused analytic backward against plain autograd, and the geometry of
docs/theory/hidden_state_connections.rst, section Related updates (norm preservation, Jacobian
at F = 0, nGPT and Post-LN equivalences)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib.nn import (
    DAMPINGS,
    SphereResidual,
    damping_factor,
    sphere_residual,
    sphere_residual_reference,
)
from manifoldlib.retractions import (
    AngleRetraction,
    GnomonicRetraction,
    PRetraction,
    get_retraction,
)


class _UserP3(AngleRetraction):
    """A user's retraction defined only by its angle: the fused path must use the generic VJP."""

    order = 2

    def angle(self, beta):
        return 3.0 * torch.atan(beta / 3.0)


RETRACTIONS = {
    "gnomonic": get_retraction("sphere", "gnomonic"),
    "cayley": get_retraction("sphere", "cayley"),
    "exp": get_retraction("sphere", "exp"),
    "p=1": PRetraction(1.0),
    "p=2": PRetraction(2.0),
    "p=0.5": PRetraction(0.5),
    "p=inf": PRetraction(math.inf),
    "user-p3": _UserP3(),
}
EPS64 = torch.finfo(torch.float64).eps


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-300)).item()


def _case(seed: int, rows: int, dim: int, radius: float, f_scale: float, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, dim, generator=g, dtype=torch.float64)
    h = radius * h / h.norm(dim=-1, keepdim=True)
    f = f_scale * radius * torch.randn(rows, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)
    return h.to(dtype), f.to(dtype)


def _values_and_grads(fn, h, f, scale, retraction, seed=7, w=None):
    """Values and gradients of ``fn`` for the upstream gradient ``w`` (default: drawn from ``seed``)."""
    h = h.clone().requires_grad_(True)
    f = f.clone().requires_grad_(True)
    s = torch.tensor(scale, dtype=h.dtype, requires_grad=True)
    out = fn(h, f, s, retraction)
    if w is None:
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(h.dtype)  # float32 draw
    (out * w).sum().backward()
    return out.detach(), h.grad, f.grad, s.grad


@pytest.mark.parametrize("name", list(RETRACTIONS))
@given(
    seed=st.integers(0, 2**31 - 1),
    radius=st.sampled_from([0.5, 1.0, 4.0, 27.7]),
    f_scale=st.sampled_from([0.0, 1e-6, 0.05, 1.0, 20.0]),
    scale=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
)
def test_fused_matches_autograd_float64(name, seed, radius, f_scale, scale):
    h, f = _case(seed, 6, 9, radius, f_scale)
    fused = _values_and_grads(sphere_residual, h, f, scale, RETRACTIONS[name])
    ref = _values_and_grads(sphere_residual_reference, h, f, scale, RETRACTIONS[name])
    assert _rel(fused[0], ref[0]) <= 32 * EPS64
    for a, b in zip(fused[1:], ref[1:]):
        assert torch.isfinite(a).all()
        assert float((a - b).abs().max()) <= 1e-11 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("name", ["gnomonic", "cayley", "exp", "p=0.5", "user-p3"])
@given(
    seed=st.integers(0, 2**31 - 1),
    f_scale=st.sampled_from([0.05, 1.0, 5.0]),
    scale=st.sampled_from([0.3, 1.0, 2.5]),
)
def test_fused_matches_autograd_float32(name, seed, f_scale, scale):
    # Against the float64 truth, the fused float32 path is as accurate as float32 autograd.
    h, f = _case(seed, 16, 48, radius=math.sqrt(48), f_scale=f_scale, dtype=torch.float32)
    fused = _values_and_grads(sphere_residual, h, f, scale, RETRACTIONS[name])
    ref = _values_and_grads(sphere_residual_reference, h, f, scale, RETRACTIONS[name])
    truth = _values_and_grads(sphere_residual_reference, h.double(), f.double(), scale, RETRACTIONS[name])
    w_norm = float(torch.randn(h.shape, generator=torch.Generator().manual_seed(7)).norm())
    # d(out)/ds is about P_h f in size, so the natural rounding scale of the scalar gradient is
    # ||w|| ||f|| (the sum over rows may cancel far below it); the others scale with themselves.
    floors = [float(t.norm()) for t in truth[:3]] + [w_norm * float(f.norm())]
    for a, b, t, floor in zip(fused, ref, truth, floors):
        err_fused = float(torch.linalg.vector_norm(a.double() - t))
        err_ref = float(torch.linalg.vector_norm(b.double() - t))
        assert err_fused <= 4 * err_ref + 1e-6 * floor


@pytest.mark.parametrize("name", list(RETRACTIONS))
@pytest.mark.parametrize("f_kind", ["random", "zero", "parallel"])
def test_gradcheck_fused_and_reference(name, f_kind):
    h, f = _case(11, 3, 5, radius=1.7, f_scale=0.8)
    if f_kind == "zero":
        f = torch.zeros_like(f)
    elif f_kind == "parallel":  # P_h f = 0: sigma = 0 with a nonzero f
        f = 0.6 * h
    s = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
    h.requires_grad_(True)
    f.requires_grad_(True)
    retraction = RETRACTIONS[name]
    for fn in (sphere_residual, sphere_residual_reference):
        assert torch.autograd.gradcheck(lambda a, b, c, fn=fn: fn(a, b, c, retraction), (h, f, s))


@pytest.mark.parametrize("name", list(RETRACTIONS))
@given(seed=st.integers(0, 2**31 - 1), radius=st.sampled_from([0.3, 1.0, 16.0]))
def test_output_keeps_the_norm_of_h(name, seed, radius):
    h, f = _case(seed, 8, 16, radius, f_scale=3.0)
    out = sphere_residual(h, f, 1.3, RETRACTIONS[name])
    assert float(((out.norm(dim=-1) - radius).abs() / radius).max()) <= 16 * EPS64


@pytest.mark.parametrize("name", ["gnomonic", "cayley", "exp", "p=0.5", "user-p3"])
@pytest.mark.parametrize("fused", [True, False])
def test_jacobian_at_zero_update_is_scaled_tangent_projection(name, fused):
    layer, alpha = 3, 0.8
    res = SphereResidual(6, layer=layer, retraction=RETRACTIONS[name], step="literal", alpha_init=alpha,
                         fused=fused).double()
    h, _ = _case(5, 1, 6, radius=2.2, f_scale=0.0)
    h = h[0]
    jac = torch.autograd.functional.jacobian(lambda f: res(h, f), torch.zeros(6, dtype=torch.float64))
    projector = torch.eye(6, dtype=torch.float64) - torch.outer(h, h) / h.dot(h)
    expected = res.alpha.item() / math.sqrt(layer) * projector  # alpha was stored in float32
    assert float((jac - expected).abs().max()) <= 1e-14


@given(seed=st.integers(0, 2**31 - 1), alpha=st.floats(0.01, 0.5))
def test_ngpt_update_is_a_gnomonic_step(seed, alpha):
    # nGPT: h <- N(N(h) + alpha (N(h_A) - N(h))) equals the gnomonic retraction of
    # kappa P_h(hat h_A), kappa = alpha / (1 - alpha + alpha <h, hat h_A>), for unit h
    # (docs/theory/hidden_state_connections.rst, section Related updates).
    h, h_a = _case(seed, 8, 12, radius=1.0, f_scale=2.0)
    hat_a = h_a / h_a.norm(dim=-1, keepdim=True)
    ngpt = h + alpha * (hat_a - h)
    ngpt = ngpt / ngpt.norm(dim=-1, keepdim=True)
    kappa = alpha / (1 - alpha + alpha * (h * hat_a).sum(-1, keepdim=True))  # (rows, 1)
    ours = sphere_residual(h, kappa * hat_a, 1.0, GnomonicRetraction())  # R_h(1 * P_h(kappa hat_a))
    assert _rel(ours, ngpt) <= 16 * EPS64


@given(seed=st.integers(0, 2**31 - 1), radius=st.sampled_from([0.5, 1.0, 8.0]))
def test_post_ln_like_update_is_a_gnomonic_step(seed, radius):
    # r N(x + F) equals the gnomonic retraction of P_x F / (1 + <x, F>/r^2) where 1 + <x,F>/r^2 > 0.
    x, f = _case(seed, 8, 10, radius, f_scale=0.9)
    denom = 1 + (x * f).sum(-1, keepdim=True) / radius**2
    assert bool((denom > 0).all())  # |F| < r makes the gnomonic chart valid for every row
    post_ln = radius * (x + f) / (x + f).norm(dim=-1, keepdim=True)
    ours = sphere_residual(x, f / denom, 1.0, GnomonicRetraction())
    assert _rel(ours, post_ln) <= 16 * EPS64


def test_p_limits_inside_the_layer():
    h, f = _case(2, 4, 8, radius=3.0, f_scale=1.5)
    for p, other in [(1.0, "gnomonic"), (2.0, "cayley"), (math.inf, "exp")]:
        a = SphereResidual(8, retraction="p", p=p).double()(h, f)
        b = SphereResidual(8, retraction=other).double()(h, f)
        assert _rel(a, b) <= 16 * EPS64


def test_user_retraction_by_name_and_instance(user_p3_name):
    h, f = _case(4, 4, 8, radius=3.0, f_scale=1.5)
    by_name = SphereResidual(8, retraction=user_p3_name).double()(h, f)
    by_instance = SphereResidual(8, retraction=_UserP3()).double()(h, f)
    as_p3 = SphereResidual(8, retraction="p", p=3.0).double()(h, f)
    assert torch.equal(by_name, by_instance)
    assert _rel(by_name, as_p3) <= 64 * EPS64


def test_damping_schedules():
    for damping in DAMPINGS:  # every listed name is accepted, by the function and the layer
        assert SphereResidual(8, layer=4, damping=damping).damping_factor == damping_factor(damping, 4)
    with pytest.raises(ValueError, match="unknown damping 'cosine'; valid dampings: " + ", ".join(DAMPINGS)):
        damping_factor("cosine", 4)
    assert damping_factor("sqrt", 4) == 0.5
    assert damping_factor("linear", 4) == 0.25
    assert damping_factor("none", 4) == 1.0
    res = SphereResidual(8, layer=9, damping="sqrt", alpha_init=0.6)
    assert res.step_size().item() == pytest.approx(0.2, rel=1e-6)


def test_learnable_alpha_is_a_scalar_and_gets_gradients():
    for step in ("normalized", "literal"):
        res = SphereResidual(8, alpha_init=0.5, step=step)
        assert [name for name, _ in res.named_parameters()] == ["log_alpha"]
        assert res.log_alpha.dim() == 0 and res.alpha.item() == pytest.approx(0.5, rel=1e-7)
        h, f = _case(1, 5, 8, radius=2.0, f_scale=1.0, dtype=torch.float32)
        res(h, f).square().mul(torch.arange(8.0)).sum().backward()
        assert torch.isfinite(res.log_alpha.grad) and float(res.log_alpha.grad.abs()) > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layer": 0}, "layer must be an integer >= 1"),
        ({"layer": -2}, "layer must be an integer >= 1"),
        ({"layer": 1.5}, "layer must be an integer >= 1"),
        ({"damping": "cubic"}, "valid dampings: sqrt, linear, none"),
        ({"p": 0.0}, "p must be in"),
        ({"p": -1.0}, "p must be in"),
        ({"p": float("nan")}, "p must be in"),
        ({"retraction": "nope"}, "valid names:"),
        ({"retraction": "polar"}, "valid names:"),
        ({"alpha_init": float("inf")}, "alpha_init must be a finite number > 0, got inf"),
        ({"alpha_init": 0.0}, "alpha_init must be a finite number > 0, got 0.0"),
        ({"alpha_init": -0.5}, "alpha_init must be a finite number > 0, got -0.5"),
        ({"step": "scaled"}, "unknown step 'scaled'; valid step forms: normalized, literal"),
        ({"eps": 0.0}, r"eps must be in \(0, 1\), got 0.0"),
        ({"fused": "False"}, "fused must be True or False, got 'False'"),
    ],
)
def test_bad_arguments_raise_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SphereResidual(8, **kwargs)


def test_bad_dim_and_shapes_raise():
    with pytest.raises(ValueError, match="dim must be an integer >= 1"):
        SphereResidual(0)
    with pytest.raises(ValueError, match="stiefel"):
        SphereResidual(8, retraction=get_retraction("stiefel", "polar"))
    res = SphereResidual(8)
    with pytest.raises(ValueError, match=r"\(\.\.\., 8\)"):
        res(torch.randn(3, 7), torch.randn(3, 7))
    with pytest.raises(ValueError, match="same shape"):
        res(torch.randn(3, 8), torch.randn(2, 8))
    h = torch.ones(2, 3)
    for fn in (sphere_residual, sphere_residual_reference):
        with pytest.raises(ValueError, match="h must be a floating-point tensor, got dtype torch.int64"):
            fn(h.long(), h.long(), 1.0, get_retraction("sphere", "gnomonic"))
        with pytest.raises(ValueError, match="retraction must be a sphere retraction, got .* of 'stiefel'"):
            fn(h, h, 1.0, get_retraction("stiefel", "polar"))
        # a name was an AttributeError ('str' object has no attribute 'manifold')
        with pytest.raises(ValueError, match=r"retraction must be a sphere Retraction instance \(e\.g\. "
                                             r"get_retraction\('sphere', 'p'\)\), got 'gnomonic'"):
            fn(h, h, 1.0, "gnomonic")
        # a NaN or infinite Python step turned every row NaN; a string was torch's TypeError
        for scale in (math.nan, math.inf, "0.5", True):
            with pytest.raises(ValueError, match=rf"scale must be a finite number or a scalar tensor, "
                                                 rf"got {scale!r}"):
                fn(h, h, scale, get_retraction("sphere", "gnomonic"))


def test_low_precision_update_keeps_the_stream_dtype():
    h, f = _case(6, 16, 32, radius=math.sqrt(32), f_scale=1.0, dtype=torch.float32)
    res = SphereResidual(32, alpha_init=1.0)
    mixed = res(h, f.bfloat16())  # a bf16 sub-layer output on a float32 stream
    assert mixed.dtype == torch.float32
    assert _rel(mixed, res(h, f.bfloat16().float())) <= 1e-6
    low = res(h.bfloat16(), f.bfloat16())  # an all-bf16 stream: computed in float32, returned bf16
    assert low.dtype == torch.bfloat16
    assert float(((low.float().norm(dim=-1) - math.sqrt(32)).abs() / math.sqrt(32)).max()) <= 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False])
def test_torch_compile_matches_eager(fused):
    # The benchmarks report compiled timings; compilation must not change values or gradients.
    h, f = _case(12, 32, 24, radius=math.sqrt(24), f_scale=1.0, dtype=torch.float32)
    res = SphereResidual(24, layer=2, retraction="gnomonic", alpha_init=0.9, fused=fused)
    compiled = torch.compile(res)
    eager = _values_and_grads(lambda a, b, s, r: res(a, b), h, f, 0.0, None)
    res.log_alpha.grad = None
    comp = _values_and_grads(lambda a, b, s, r: compiled(a, b), h, f, 0.0, None)
    for a, b in zip(eager[:3], comp[:3]):
        assert _rel(b, a) <= 1e-6


@pytest.mark.slow
def test_torch_compile_fullgraph_takes_a_non_contiguous_h():
    # a transposed h runs the ATen path (the kernels take contiguous rows), whose scratch tensor
    # took h's layout: dynamo refused its non-contiguous out= and fullgraph compilation failed
    h, f = _case(13, 24, 16, radius=4.0, f_scale=1.0, dtype=torch.float32)
    h = h.mT.contiguous().mT  # (24, 16), strides (1, 24)
    assert not h.is_contiguous()
    res = SphereResidual(16, layer=2, retraction="gnomonic", alpha_init=0.9)
    compiled = torch.compile(res, fullgraph=True)
    eager = _values_and_grads(lambda a, b, s, r: res(a, b), h, f, 0.0, None)
    res.log_alpha.grad = None
    comp = _values_and_grads(lambda a, b, s, r: compiled(a, b), h, f, 0.0, None)
    for a, b in zip(eager[:3], comp[:3]):
        assert _rel(b, a) <= 1e-6


@pytest.mark.parametrize("retraction", ["gnomonic", "user-p3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_reference_matches_the_fused_path(retraction, dtype):
    """The reference path computed half-precision inputs in their own dtype: NaN where the
    normalized step's floor eps² r² underflows."""
    ret = _UserP3() if retraction == "user-p3" else RETRACTIONS[retraction]
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, 8, generator=g)
    h = (100.0 * h / h.norm(dim=-1, keepdim=True)).to(dtype)
    f = torch.randn(6, 8, generator=g).to(dtype)
    scale = torch.tensor(0.5)
    ref = sphere_residual_reference(h, f, scale, ret, normalize_eps=1e-6)
    fused = sphere_residual(h, f, scale, ret, normalize_eps=1e-6)
    assert ref.dtype == dtype and bool(torch.isfinite(ref).all())
    assert torch.allclose(ref.float(), fused.float(), rtol=0, atol=2 * torch.finfo(dtype).eps * 100)


@pytest.mark.parametrize("retraction", ["gnomonic", "exp", "user-p3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normalized_step_keeps_the_norm_for_an_update_parallel_to_h(retraction, dtype):
    """A*h + B*f with B up to 1/eps cancelled: an update that is a multiple of h (whose tangent
    part is rounding) gave norms from 90 to 210 for rows of norm 100 in float32."""
    ret = _UserP3() if retraction == "user-p3" else RETRACTIONS[retraction]
    h = torch.randn(16, 64, generator=torch.Generator().manual_seed(6), dtype=dtype)
    h = 100.0 * h / h.norm(dim=-1, keepdim=True)
    for f in (h, 10.0 * h, -100.0 * h):
        out = sphere_residual(h, f, torch.tensor(0.7, dtype=dtype), ret, normalize_eps=1e-6)
        # a few roundings of the float32 passes (the built-ins' C++ rows work in double)
        assert torch.allclose(out.norm(dim=-1), h.norm(dim=-1), rtol=16 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("retraction", ["gnomonic", "exp", "p=0.5"])
@pytest.mark.parametrize(("dtype", "along"), [(torch.float32, 1e3), (torch.float64, 1e6)])
def test_literal_step_keeps_the_norm_for_an_update_mostly_along_h(retraction, dtype, along, kernels):
    """f = along * h + (a tangent of norm r): ||P_h f||² as ||f||² - <h, f>²/r² and the output as
    A h + B f both cancel. The old ATen path (CUDA, switched-off kernels) left the sphere by 3 % in
    float32 at along = 1e3 and by 9e-5 in float64 at along = 1e6; the C++ rows by 1.5e-5 and 8e-5.
    """
    from manifoldlib import _cpu_kernels

    g = torch.Generator().manual_seed(8)
    h = torch.randn(16, 64, generator=g, dtype=torch.float64)
    h = 8.0 * h / h.norm(dim=-1, keepdim=True)
    t = torch.randn(16, 64, generator=g, dtype=torch.float64)
    t = t - (t * h).sum(-1, keepdim=True) / 64.0 * h
    t = 8.0 * t / t.norm(dim=-1, keepdim=True)
    h, f = h.to(dtype), (along * h + t).to(dtype)
    ret = RETRACTIONS[retraction]
    if kernels:
        out = sphere_residual(h, f, torch.tensor(0.5, dtype=dtype), ret)
    else:
        with _cpu_kernels.disabled():
            out = sphere_residual(h, f, torch.tensor(0.5, dtype=dtype), ret)
    assert torch.allclose(out.norm(dim=-1), h.norm(dim=-1), rtol=16 * torch.finfo(dtype).eps, atol=0)
    # and the step itself: theta(0.5 ||P_h f|| / r) from the reference in float64
    want = sphere_residual_reference(h.double(), f.double(), 0.5, ret)
    assert _rel(out.double(), want) <= (1e-6 if dtype == torch.float32 else 1e-9)


def _along_h(along: float, dtype, rows: int = 16, dim: int = 64, radius: float = 8.0, seed: int = 8):
    """Rows f = along * h + (a tangent of norm r): nearly parallel to h for along >> 1."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, dim, generator=g, dtype=torch.float64)
    h = radius * h / h.norm(dim=-1, keepdim=True)
    t = torch.randn(rows, dim, generator=g, dtype=torch.float64)
    t = t - (t * h).sum(-1, keepdim=True) / (h * h).sum(-1, keepdim=True) * h
    t = radius * t / t.norm(dim=-1, keepdim=True)
    return h.to(dtype), (along * h + t).to(dtype)


def _exact_reference(h, f, scale, retraction, seed=7):
    """Values and gradients (as :func:`_values_and_grads`) of the literal step in float64 from
    u = P_h f formed exactly (fractions) on the given inputs, then rounded: the update depends on f
    only through u, so out and the gradients in f and s are those at (h, u), where u is tangent
    and nothing cancels; the gradient in h at (h, f) is that at (h, u) minus (a/q) grad_f
    (d(P_h f)/dh carries a/q times the tangent projection of the upstream gradient)."""
    from fractions import Fraction

    tangents, ratios = [], []
    for h_row, f_row in zip(h.double().tolist(), f.double().tolist()):
        x, y = [Fraction(v) for v in h_row], [Fraction(v) for v in f_row]
        ratio = sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x)
        tangents.append([float(b - ratio * a) for a, b in zip(x, y)])
        ratios.append([float(ratio)])
    u = torch.tensor(tangents, dtype=torch.float64)
    out, grad_h, grad_f, grad_s = _values_and_grads(sphere_residual_reference, h.double(), u, scale, retraction, seed)
    return out, grad_h - torch.tensor(ratios, dtype=torch.float64) * grad_f, grad_f, grad_s


def _literal_step_gradient_truth(h, f, w, s, p):
    """dL/ds of L = <w, R_h(s P_h f)> for the p-family (the update as cos θ h + sin θ / ratio u,
    ratio = ||u|| / ||h||, θ = p arctan(β/p)) at the exact values of the inputs, by mpmath's
    numerical differentiation at 50 digits."""
    mp = pytest.importorskip("mpmath").mp
    mp.dps = 50
    total = mp.mpf(0)
    for row_h, row_f, row_w in zip(h.double().tolist(), f.double().tolist(), w.double().tolist()):
        row_h, row_f, row_w = ([mp.mpf(x) for x in row] for row in (row_h, row_f, row_w))
        along = mp.fsum(x * y for x, y in zip(row_h, row_f)) / mp.fsum(x * x for x in row_h)
        u = [y - along * x for x, y in zip(row_h, row_f)]
        ratio = mp.sqrt(mp.fsum(x * x for x in u) / mp.fsum(x * x for x in row_h))
        w_h, w_u = mp.fsum(x * y for x, y in zip(row_w, row_h)), mp.fsum(x * y for x, y in zip(row_w, u))

        def loss(t, ratio=ratio, w_h=w_h, w_u=w_u):
            theta = p * mp.atan(t * ratio / p)
            return mp.cos(theta) * w_h + mp.sin(theta) / ratio * w_u

        total += mp.diff(loss, mp.mpf(s))
    return float(total)


@pytest.mark.parametrize(("retraction", "p", "dtype", "kernels"), [
    ("gnomonic", 1.0, torch.float64, True), ("gnomonic", 1.0, torch.float64, False),
    ("gnomonic", 1.0, torch.float32, False), ("p=1.5", 1.5, torch.float64, True),
    ("p=1.5", 1.5, torch.float64, False), ("p=1.5", 1.5, torch.float32, False),
    ("cayley", 2.0, torch.float64, True), ("cayley", 2.0, torch.float32, False),
], ids=lambda v: {True: "kernels", False: "aten"}.get(v, str(v)) if isinstance(v, bool) else str(v))
def test_the_literal_steps_gradient_in_s_is_exact_at_a_long_step(retraction, p, dtype, kernels):
    """dL/ds at s = 1e6 (β about 1e6) against mpmath. It was formed as k <g, u> + 2 g_σ s n/q,
    whose k + 2σ k'(σ) cancels to c/(1 + σ/p²) (gnomonic c³ ~ 1/β³ from terms ~ 1/β) and lost
    about β eps of the dtype, on the kernels (in double) and the ATen path (in the dtype); Cayley's
    c k does not cancel (a pin). The closed forms d(k s)/ds = c/(1 + z²) and
    2 cos θ'(σ) = -k/(1 + z²), z² = σ/p², give it to a few eps."""
    g = torch.Generator().manual_seed(5)
    h, f, w = (torch.randn(3, 6, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    s = torch.tensor(1e6, dtype=dtype, requires_grad=True)
    ret = PRetraction(p) if retraction == "p=1.5" else RETRACTIONS[retraction]
    out = _on_path(kernels, lambda: sphere_residual(h, f, s, ret))
    (out * w).sum().backward()
    truth = _literal_step_gradient_truth(h, f, w, 1e6, p)
    assert abs(float(s.grad) - truth) <= 16 * torch.finfo(dtype).eps * abs(truth)


@pytest.mark.parametrize(
    ("dtype", "along"),
    [(torch.float32, a) for a in (1e2, 1e3, 1e4, 1e5)] + [(torch.float64, a) for a in (1e2, 1e4, 1e6, 1e7, 1e8)],
)
def test_user_retraction_literal_step_for_an_update_nearly_parallel_to_h(dtype, along):
    """A user's retraction in the literal step (on CPU: the C++ separate passes), f = along * h + (a
    tangent of norm r). ||P_h f||² as ||f||² - <h, f>²/r² from dots rounded to the input dtype and
    the output as A h + B f in that dtype both cancelled: off the sphere by 6.5 eps (float32, along
    1e2), 2e-5 (1e3) and 12 % (1e4); float64 by 2700 eps (1e2), 6e-5 (1e6), 30 % (1e8), the
    gradients off by up to 8 %. Now on the sphere to rounding, values to a few eps of the exact
    reference, gradients within the problem's conditioning (the inputs' rounding, eps along
    relative to ||f||, moves P_h f by eps along relative to itself)."""
    ret = RETRACTIONS["user-p3"]
    h, f = _along_h(along, dtype)
    eps = torch.finfo(dtype).eps
    out, grad_h, grad_f, grad_s = _values_and_grads(sphere_residual, h, f, 0.5, ret)
    ratio = out.double().norm(dim=-1) / h.double().norm(dim=-1)
    assert float((ratio - 1.0).abs().max()) <= 4 * eps
    truth = _exact_reference(h, f, 0.5, ret)
    assert _rel(out.double(), truth[0]) <= 8 * eps
    assert _rel(grad_h.double(), truth[1]) <= 0.25 * along * eps
    assert _rel(grad_f.double(), truth[2]) <= 0.25 * along * eps
    assert abs(float(grad_s) - float(truth[3])) <= 4 * along * eps * abs(float(truth[3]))


def _exact_on(kernels: bool, retraction: str, normalize_eps) -> bool:
    """Whether the path a call takes computes rows of tiny norm exactly (rescaled by powers of two):
    the C++ kernels (the row kernels of the built-ins; the separate passes of a user's literal step)
    where they are built and switched on; the ATen path returns such rows NaN."""
    from manifoldlib import _cpu_kernels

    return kernels and _cpu_kernels.available() and (retraction != "user-p3" or normalize_eps is None)


def _on_path(kernels: bool, fn):
    from manifoldlib import _cpu_kernels

    if kernels:
        return fn()
    with _cpu_kernels.disabled():
        return fn()


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "aten"])
@pytest.mark.parametrize("normalize_eps", [None, 1e-6], ids=["literal", "normalized"])
@pytest.mark.parametrize("retraction", ["gnomonic", "cayley", "exp", "p=0.5", "user-p3"])
@pytest.mark.parametrize(("dtype", "norm"), [(torch.float32, 1e-20), (torch.float32, 1e-30), (torch.float64, 1e-160)])
def test_rows_of_tiny_norm_stay_on_their_sphere_or_come_out_nan(dtype, norm, retraction, normalize_eps, kernels):
    """Rows whose ||h||² underflows. With ||h||² floored at the dtype's smallest normal every fused
    path returned them off their sphere without a sign: here ||out||/||h|| of 1.6 (literal) and 5
    to 1.2e6 (normalized), gradients off by 50 % to inf, or NaN. The C++ kernels now compute them
    rescaled by a power of two: on the sphere to rounding, values and gradients those of the float64
    reference on the rows scaled up by a power of two (the update is homogeneous of degree 1 in
    (h, f), its gradients in h, f of degree 0 and in s of degree 1). The ATen path returns them
    NaN, values and gradients."""
    ret = RETRACTIONS[retraction]
    h, f = _case(31, 7, 40, radius=norm, f_scale=1.5, dtype=dtype)
    up = 2.0 ** -math.floor(math.log2(norm))  # brings the rows to norm in [1, 2)

    def fn(a, b, s, r):
        return sphere_residual(a, b, s, r, normalize_eps=normalize_eps)

    def reference(a, b, s, r):
        return sphere_residual_reference(a, b, s, r, normalize_eps=normalize_eps)

    out, grad_h, grad_f, grad_s = _on_path(kernels, lambda: _values_and_grads(fn, h, f, 0.7, ret))
    if not _exact_on(kernels, retraction, normalize_eps):
        assert all(bool(torch.isnan(t).all()) for t in (out, grad_h, grad_f, grad_s))
        return
    eps = torch.finfo(dtype).eps
    ratio = (up * out.double()).norm(dim=-1) / (up * h.double()).norm(dim=-1)  # (rows,), norms in range
    assert float((ratio - 1.0).abs().max()) <= 4 * eps
    truth = _values_and_grads(reference, up * h.double(), up * f.double(), 0.7, ret)  # exact scaling
    assert _rel(up * out.double(), truth[0]) <= 4 * eps
    assert _rel(grad_h.double(), truth[1]) <= 8 * eps
    assert _rel(grad_f.double(), truth[2]) <= 8 * eps
    assert abs(up * float(grad_s) - float(truth[3])) <= 8 * eps * abs(float(truth[3]))


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "aten"])
@pytest.mark.parametrize(("retraction", "normalize_eps"), [("gnomonic", None), ("exp", 1e-6), ("user-p3", None),
                                                          ("user-p3", 1e-6)])
@pytest.mark.parametrize(("dtype", "exponent", "edge"), [(torch.float32, -100, -30), (torch.float64, -532, -290)])
def test_rows_of_tiny_norm_leave_the_other_rows_alone(dtype, exponent, edge, retraction, normalize_eps, kernels):
    """A batch of rows in range, rows just above the ATen path's floor (norm 2^edge) and rows of
    tiny norm (2^exponent): the rows in range get the bits they get in a batch without the others,
    the rows at the edge are right on every path, and the tiny rows are exact multiples of their
    twins in range where the path computes them (C++ kernels), NaN where it does not (ATen)."""
    ret = RETRACTIONS[retraction]
    h, f = _case(32, 9, 24, radius=1.0, f_scale=1.5, dtype=dtype)
    row_scale = torch.ones(9, 1, dtype=dtype)
    row_scale[3:6], row_scale[6:] = 2.0**edge, 2.0**exponent  # powers of two: exact

    def fn(a, b, s, r):
        return sphere_residual(a, b, s, r, normalize_eps=normalize_eps)

    unit = _on_path(kernels, lambda: _values_and_grads(fn, h, f, 0.7, ret))
    mixed = _on_path(kernels, lambda: _values_and_grads(fn, row_scale * h, row_scale * f, 0.7, ret))
    assert torch.equal(mixed[0][:3], unit[0][:3])
    assert torch.equal(mixed[1][:3], unit[1][:3]) and torch.equal(mixed[2][:3], unit[2][:3])
    # at the edge: the values and gradients of the twins in range, to the rounding of the path
    tolerance = 64 * torch.finfo(dtype).eps
    assert _rel(mixed[0][3:6] / row_scale[3:6], unit[0][3:6]) <= tolerance
    for k in (1, 2):
        assert _rel(mixed[k][3:6], unit[k][3:6]) <= tolerance
    tiny = [mixed[0][6:], mixed[1][6:], mixed[2][6:]]
    if _exact_on(kernels, retraction, normalize_eps):
        assert torch.equal(tiny[0], unit[0][6:] * 2.0**exponent)
        assert torch.equal(tiny[1], unit[1][6:]) and torch.equal(tiny[2], unit[2][6:])
        assert bool(torch.isfinite(mixed[3]))
    else:
        assert all(bool(torch.isnan(t).all()) for t in tiny)
        assert bool(torch.isnan(mixed[3]))  # the gradient in s sums over the rows


@pytest.mark.parametrize("normalize_eps", [None, 1e-6], ids=["literal", "normalized"])
@pytest.mark.parametrize("retraction", ["gnomonic", "exp", "user-p3"])
@pytest.mark.parametrize(("dtype", "exponents"), [(torch.float32, (-76, -100, 40)), (torch.float64, (-540, -900, 300))])
def test_the_reference_computes_rows_of_tiny_and_huge_norm_as_their_twins_in_range(dtype, exponents, retraction,
                                                                                   normalize_eps):
    """sphere_residual_reference on rows scaled by 2^k out of range (entries normal numbers): their
    values are their twins' in range times 2^k, their gradients in h and f the twins', their dL/ds
    2^k times the twins', bit for bit (the update is homogeneous of degree 1 in (h, f)). Its plain
    autograd computed them as they were, where ||h||² underflows or the gradient's terms of higher
    degree leave the range: inf gradients in h, values off their sphere, or NaN."""
    ret = RETRACTIONS[retraction]
    h, f = _case(33, 3, 24, radius=1.0, f_scale=1.5, dtype=dtype)

    def reference(a, b, s, r):
        return sphere_residual_reference(a, b, s, r, normalize_eps=normalize_eps)

    twin = _values_and_grads(reference, h, f, 0.7, ret)
    for k in exponents:
        out, grad_h, grad_f, grad_s = _values_and_grads(reference, h * 2.0**k, f * 2.0**k, 0.7, ret)
        assert torch.equal(out, twin[0] * 2.0**k)
        assert torch.equal(grad_h, twin[1]) and torch.equal(grad_f, twin[2])
        assert torch.equal(grad_s, twin[3] * 2.0**k)


@pytest.mark.parametrize("normalize_eps", [None, 1e-6], ids=["literal", "normalized"])
def test_the_reference_computes_a_tiny_row_with_a_zero_f_as_its_twin_in_range(normalize_eps):
    """float64 rows of norm 2^-1000 whose f is 0 (a zero-initialized sub-layer): the reference's
    rule took a zero f's frexp exponent 0 for a bound on the rescaling, 2^e at least 2^-400, so the
    copy's ||h||² (2^-1200) underflowed and the row came out NaN. A zero f now sets no bound, as in
    the C++ kernels: the row is its twin's (of norm 1) bit for bit, its values 2^-1000 times them."""
    h, _ = _case(34, 3, 24, radius=1.0, f_scale=1.0)
    f = torch.zeros_like(h)

    def reference(a, b, s, r):
        return sphere_residual_reference(a, b, s, r, normalize_eps=normalize_eps)

    twin = _values_and_grads(reference, h, f, 0.7, RETRACTIONS["exp"])
    out, grad_h, grad_f, grad_s = _values_and_grads(reference, h * 2.0**-1000, f, 0.7, RETRACTIONS["exp"])
    assert torch.equal(out, twin[0] * 2.0**-1000)
    assert torch.equal(grad_h, twin[1]) and torch.equal(grad_f, twin[2]) and torch.equal(grad_s, twin[3] * 2.0**-1000)


def _zero_rows_kept(path, h, f, w, ret, normalize_eps, dtype):
    """Rows 1 and 4 (zero rows of h) kept, ``out = h = 0``, with the identity's gradients (``w`` in h,
    0 in f); the other rows' values and gradients those of a batch without them, the gradient in s
    theirs to the rounding of another order of its additions (a sum over rows; over entries on the
    reference)."""
    rest, zero = [0, 2, 3, 5], [1, 4]
    call = sphere_residual_reference if path == "reference" else sphere_residual

    def fn(a, b, s, r):
        return call(a, b, s, r, normalize_eps=normalize_eps)

    out, grad_h, grad_f, grad_s = _on_path(path != "aten", lambda: _values_and_grads(fn, h, f, 0.7, ret, w=w))
    assert torch.equal(out[zero], torch.zeros(2, 16, dtype=dtype))
    assert torch.equal(grad_h[zero], w[zero])
    assert torch.equal(grad_f[zero], torch.zeros(2, 16, dtype=dtype))
    alone = _on_path(path != "aten", lambda: _values_and_grads(fn, h[rest], f[rest], 0.7, ret, w=w[rest]))
    assert torch.equal(out[rest], alone[0])
    assert torch.equal(grad_h[rest], alone[1]) and torch.equal(grad_f[rest], alone[2])
    assert abs(float(grad_s) - float(alone[3])) <= 64 * torch.finfo(dtype).eps * max(1.0, abs(float(alone[3])))


@pytest.mark.parametrize("path", ["kernels", "aten", "reference"])
@pytest.mark.parametrize("normalize_eps", [None, 1e-6], ids=["literal", "normalized"])
@pytest.mark.parametrize("retraction", ["gnomonic", "cayley", "exp", "p=0.5", "user-p3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_zero_row_of_h_is_kept_with_the_gradients_of_the_identity_on_every_path(dtype, retraction,
                                                                                  normalize_eps, path):
    """A zero row of h (a sphere of radius 0; rows 1 and 4, the second with a zero update too).
    The paths disagreed: the ATen path and the reference gave NaN values and gradients (and a NaN
    gradient in s for the whole batch); the C++ row kernels 0 in float32 but +-1e-155 in float64
    for the normalized step (q floored at the smallest normal double), NaN for Cayley and the
    exponential map, a NaN h-gradient for the literal step; the separate passes (user-p3, literal)
    s f, off the sphere. Now every path keeps the row, out = h = 0, with the gradients of the
    identity: g in h, 0 in f and nothing added to the gradient in s; the other rows get the bits
    they get in a batch without the zero rows."""
    ret = RETRACTIONS[retraction]
    h, f = _case(41, 6, 16, radius=2.0, f_scale=1.5, dtype=dtype)
    h[1], h[4], f[4] = 0.0, 0.0, 0.0
    w = torch.randn(6, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
    _zero_rows_kept(path, h, f, w, ret, normalize_eps, dtype)


@pytest.mark.parametrize("path", ["kernels", "aten", "reference"])
@pytest.mark.parametrize("normalize_eps", [None, 1e-6], ids=["literal", "normalized"])
@pytest.mark.parametrize("retraction", ["gnomonic", "cayley", "exp", "p=0.5", "user-p3"])
@pytest.mark.parametrize(("dtype", "big"), [(torch.float32, 1e20), (torch.float64, 1e160)])
def test_a_zero_row_of_h_is_kept_whatever_the_scale_of_f(dtype, big, retraction, normalize_eps, path):
    """A zero row of h is kept whatever f is: P_0 f = 0, so neither ||f||² nor <g, f> enters it.
    Row 1's f has entries whose squares overflow the dtype, row 4's entries half its largest
    number, of the signs of the upstream gradient (<g, f> overflows too). The old code formed
    ||f||² (and <g, f>) of the row and multiplied it by the step 0: NaN values and gradients on
    the ATen path and the separate passes (user-p3), on the row kernels in float64 (whose double
    sums overflow there), and on the reference's Cayley and exponential maps. Every path now gives
    the kept row and the gradients of the identity, the other rows as in a batch without them."""
    ret = RETRACTIONS[retraction]
    h, f = _case(43, 6, 16, radius=2.0, f_scale=1.5, dtype=dtype)
    w = torch.randn(6, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
    h[1], h[4] = 0.0, 0.0
    f[1] = big * f[1]
    f[4] = 0.5 * torch.finfo(dtype).max * w[4].sign()
    _zero_rows_kept(path, h, f, w, ret, normalize_eps, dtype)


def _nan_rows_beside_rows_alone(path, fn, h, f, ret, bad, dtype):
    """The rows ``bad`` NaN, values and gradients (and the gradient in s, a sum over rows); the other
    rows' values and gradients those of a batch without them."""
    rest = [i for i in range(h.shape[0]) if i not in bad]
    w = torch.randn(h.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    out, grad_h, grad_f, grad_s = _on_path(path != "aten", lambda: _values_and_grads(fn, h, f, 0.7, ret, w=w))
    assert all(bool(torch.isnan(t[bad]).all()) for t in (out, grad_h, grad_f)) and bool(torch.isnan(grad_s))
    alone = _on_path(path != "aten", lambda: _values_and_grads(fn, h[rest], f[rest], 0.7, ret, w=w[rest]))
    assert torch.equal(out[rest], alone[0])
    assert torch.equal(grad_h[rest], alone[1]) and torch.equal(grad_f[rest], alone[2])


@pytest.mark.parametrize("path", ["kernels", "aten", "reference"])
@pytest.mark.parametrize("normalize_eps", [None, 1e-6], ids=["literal", "normalized"])
@pytest.mark.parametrize("retraction", ["gnomonic", "cayley", "exp", "p=0.5", "user-p3"])
@pytest.mark.parametrize(("dtype", "big", "huge"), [(torch.float32, 1e20, 2.0**30), (torch.float64, 1e160, 2.0**300)],
                         ids=["float32", "float64"])
def test_an_update_whose_squares_overflow_comes_out_nan_on_every_path(dtype, big, huge, retraction, normalize_eps,
                                                                      path):
    """Nonzero rows of h whose ||P_h f||² overflows the dtype: row 1 of norm 2, row 4 of a norm the
    C++ kernels rescale (its scaled copy's ||P_h f||² fits). The paths disagreed: the float32 row
    kernels computed such rows in double, finite; the ATen path, the separate passes and the
    reference gave NaN, or values with NaN gradients (the gnomonic map's literal step: the row 0,
    off its sphere); float64 rows likewise, the kernels' too. Every path now returns them NaN,
    values and gradients, which is what the ATen path, forming ||P_h f||² in the dtype, can give
    without another pass over every row; the other rows as in a batch without them."""
    h, f = _case(44, 6, 16, radius=2.0, f_scale=1.5, dtype=dtype)
    h[4] = huge * h[4]
    f[1], f[4] = big * f[1], big * f[4]
    call = sphere_residual_reference if path == "reference" else sphere_residual

    def fn(a, b, s, r):
        return call(a, b, s, r, normalize_eps=normalize_eps)

    _nan_rows_beside_rows_alone(path, fn, h, f, RETRACTIONS[retraction], [1, 4], dtype)


@pytest.mark.parametrize("path", ["kernels", "aten", "reference"])
@pytest.mark.parametrize("retraction", ["gnomonic", "cayley", "exp", "p=0.5", "user-p3"])
@pytest.mark.parametrize(("dtype", "h_norm", "f_norm"), [(torch.float32, 2.0**-20, 2.0**50),
                                                         (torch.float64, 2.0**-100, 2.0**500)],
                         ids=["float32", "float64"])
def test_a_literal_step_whose_sigma_overflows_comes_out_nan_on_every_path(dtype, h_norm, f_norm, retraction, path):
    """Row 2: ||P_h f||² fits the dtype, sigma = s²||P_h f||²/||h||² does not (h in the kernels'
    range, above the ATen path's floor). The float32 row kernels computed it in double, on its
    sphere; the ATen path and the reference formed sigma = inf and returned the row 0 (gnomonic,
    and about 0 for user-p3: off its sphere, with NaN h-gradients and a finite gradient in s) or
    NaN; in float64 the kernels too (their p = 0.5 row off its sphere as well). Every path now
    returns it NaN, values and gradients; the other rows as in a batch without it."""
    h, f = _case(45, 4, 16, radius=1.0, f_scale=1.0, dtype=dtype)
    h[2], f[2] = h_norm * h[2], f_norm * f[2]
    call = sphere_residual_reference if path == "reference" else sphere_residual
    _nan_rows_beside_rows_alone(path, call, h, f, RETRACTIONS[retraction], [2], dtype)


@pytest.mark.parametrize("path", ["kernels", "aten", "reference"])
@pytest.mark.parametrize("normalize_eps", [None, 1e-6], ids=["literal", "normalized"])
@pytest.mark.parametrize(("retraction", "dtype"), [("gnomonic", torch.float32), ("user-p3", torch.float64)])
def test_a_zero_row_of_h_with_a_non_finite_f_comes_out_nan_on_every_path(dtype, retraction, normalize_eps, path):
    """Zero rows of h whose f has a NaN (row 1) or an infinite entry (row 4); row 2 a zero row with a
    finite f, kept. The paths disagreed: the row kernels gave NaN only at those entries (values and
    h- and f-gradients) and a gradient in s of 0, the ATen path and the separate passes a NaN row
    with a gradient in s of 0, the reference a NaN row with a finite h-gradient and a NaN gradient in
    s. Every path now gives such a row NaN, values and gradients, and the gradient in s NaN, as for
    any row with a non-finite input; the other rows as in a batch without them."""
    h, f = _case(46, 6, 16, radius=2.0, f_scale=1.5, dtype=dtype)
    h[1], h[2], h[4] = 0.0, 0.0, 0.0
    f[1, 3], f[4, 7] = math.nan, -math.inf
    call = sphere_residual_reference if path == "reference" else sphere_residual

    def fn(a, b, s, r):
        return call(a, b, s, r, normalize_eps=normalize_eps)

    _nan_rows_beside_rows_alone(path, fn, h, f, RETRACTIONS[retraction], [1, 4], dtype)


def _module_with_a_zero_row(step, fused, kernels, compiled):
    h, f = _case(42, 4, 8, radius=math.sqrt(8), f_scale=1.0, dtype=torch.float32)
    h[2] = 0.0
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    res = SphereResidual(8, layer=2, retraction="cayley", step=step, fused=fused)
    run = torch.compile(res) if compiled else res
    values = _on_path(kernels, lambda: _values_and_grads(lambda a, b, s, r: run(a, b), h, f, 0.0, None, w=w))
    return (*values[:3], res.log_alpha.grad), w


@pytest.mark.parametrize("step", ["literal", "normalized"])
@pytest.mark.parametrize(("fused", "kernels", "compiled"), [
    (True, True, False), (True, False, False), (False, True, False),
    pytest.param(True, True, True, marks=pytest.mark.slow), pytest.param(False, True, True, marks=pytest.mark.slow),
], ids=["kernels", "aten", "reference", "compiled-fused", "compiled-reference"])
def test_a_zero_row_of_h_is_kept_by_the_module_eager_and_compiled(step, fused, kernels, compiled):
    """SphereResidual with a zero row of h, fused (C++ kernels, ATen), reference and torch.compile:
    the kept row and identity gradients, and the other rows as on the C++ kernels."""
    (out, grad_h, grad_f, grad_alpha), w = _module_with_a_zero_row(step, fused, kernels, compiled)
    anchor, _ = _module_with_a_zero_row(step, True, True, False)
    assert torch.equal(out[2], torch.zeros(8)) and torch.equal(grad_h[2], w[2])
    assert torch.equal(grad_f[2], torch.zeros(8)) and bool(torch.isfinite(grad_alpha))
    assert _rel(out, anchor[0]) <= 1e-6 and _rel(grad_h, anchor[1]) <= 1e-6 and _rel(grad_f, anchor[2]) <= 1e-6
    assert abs(float(grad_alpha) - float(anchor[3])) <= 1e-5 * max(1.0, abs(float(anchor[3])))


def test_rotation_angle_of_a_kept_zero_row_is_zero():
    """rotation_angle divided by ||h|| = 0: NaN for the zero row that SphereResidual keeps."""
    h, f = _case(42, 4, 8, radius=math.sqrt(8), f_scale=1.0, dtype=torch.float32)
    h[2] = 0.0
    angle = SphereResidual(8, layer=2, retraction="cayley").angle(h, f)
    assert float(angle[2]) == 0.0 and bool(torch.isfinite(angle).all())
