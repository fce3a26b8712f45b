"""The normalized sphere step folded into the fused residual: the same values and gradients as
the unit tangent of ``functional.sphere_unit_tangent`` fed to the reference, on the C++ and the
ATen passes, degenerate rows included."""

from __future__ import annotations

import contextlib

import pytest
import torch

from manifoldlib import _cpu_kernels
from manifoldlib.functional import sphere_unit_tangent
from manifoldlib.nn import SphereResidual, sphere_residual, sphere_residual_reference
from manifoldlib.retractions import get_retraction

PATHS = ["kernels", "aten"]
RETRACTIONS = ["gnomonic", "cayley", "exp"]


def _path(name):
    return _cpu_kernels.disabled() if name == "aten" else contextlib.nullcontext()


def _case(seed=0, degenerate=False):
    g = torch.Generator().manual_seed(seed)
    h = 3.0 * torch.randn(6, 9, generator=g, dtype=torch.float64)
    f = torch.randn(6, 9, generator=g, dtype=torch.float64)
    if degenerate:
        f[0] = 2.5 * h[0]  # P_h f = 0: the floor makes the step the identity
        f[1] = 1e-3 * h[1] + 1e-9 * torch.randn(9, generator=g, dtype=torch.float64)  # nearly parallel
        f[2] = 0.0
    return h, f


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", RETRACTIONS)
def test_gradcheck_of_the_folded_normalized_step(path, name):
    retraction = get_retraction("sphere", name)
    h, f = _case()
    s = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    with _path(path):
        assert torch.autograd.gradcheck(
            lambda a, b, c: sphere_residual(a, b, c, retraction, normalize_eps=1e-6),
            (h.requires_grad_(), f.requires_grad_(), s),
        )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", RETRACTIONS)
def test_it_equals_the_unit_tangent_fed_to_the_reference(path, name):
    # degenerate rows too, where the gradients are ~1/eps large: compared with the reference's
    # autograd through sphere_unit_tangent (gradcheck's differences are unreliable there)
    retraction = get_retraction("sphere", name)
    h, f = _case(seed=1, degenerate=True)
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(2), dtype=h.dtype)
    results = []
    for fn in (sphere_residual, sphere_residual_reference):
        a, b = h.clone().requires_grad_(), f.clone().requires_grad_()
        c = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
        with _path(path):
            out = fn(a, b, c, retraction, normalize_eps=1e-6)
        (out * probe).sum().backward()
        results.append((out.detach(), a.grad, b.grad, c.grad))
    mine, ref = results
    # where P_h f is rounding (row 0), the floor turns it into a rotation of ~ eps_mach |f| / (eps r)
    # ~ 1e-10 in a rounding-dependent direction: the two orders of operations agree to that
    floor = 1e-9
    torch.testing.assert_close(mine[0], ref[0], rtol=1e-12, atol=floor)
    torch.testing.assert_close(mine[0][0], h[0], rtol=0, atol=floor)  # P_h f = 0: the identity
    torch.testing.assert_close(mine[0][3:], ref[0][3:], rtol=1e-12, atol=1e-13)  # generic rows: rounding
    for got, want in zip(mine[1:], ref[1:]):
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-8
    # the literal form is a different function (so the comparison above could fail)
    literal = sphere_residual(h, f, 0.4, retraction)
    assert float((literal - mine[0]).abs().max()) > 1e-3


def test_the_folded_step_equals_the_explicit_tangent_in_float32():
    retraction = get_retraction("sphere", "gnomonic")
    h, f = (t.float() for t in _case(seed=3))
    folded = sphere_residual(h, f, 0.5, retraction, normalize_eps=1e-6)
    explicit = sphere_residual(h, sphere_unit_tangent(h, f, 1e-6), 0.5, retraction)
    torch.testing.assert_close(folded, explicit, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("bad", [0.0, -1e-6, float("nan"), float("inf"), "1e-6", True])
def test_a_bad_floor_is_refused_by_value(bad):
    h, f = _case()
    with pytest.raises(ValueError, match="normalize_eps must be None or a finite number > 0"):
        sphere_residual(h, f, 0.4, get_retraction("sphere", "gnomonic"), normalize_eps=bad)


@pytest.mark.parametrize("path", [*PATHS, "reference"])
def test_a_floor_whose_square_is_not_a_normal_number_of_the_dtype_is_refused(path):
    """The floor eps² r² of D = ||P_h f||² + eps² r² in the dtype the rows are computed in: with eps²
    below its normal range a zero update (P_h f = 0: f = 0, f parallel to h) had D = 0 and came out
    NaN, values and gradients, on the ATen path and the reference, and with a NaN gradient in f on
    the C++ kernels, without an error. Such a floor is refused naming it; float64 takes that
    eps, and there a zero update is the identity with finite gradients on every path."""
    retraction = get_retraction("sphere", "gnomonic")
    fn = sphere_residual_reference if path == "reference" else sphere_residual
    h, f = _case(degenerate=True)
    for dtype, eps in [(torch.float32, 1e-30), (torch.bfloat16, 1e-30), (torch.float64, 1e-170)]:
        with _path(path), pytest.raises(ValueError, match=f"normalize_eps must be at least .* for {dtype} rows"):
            fn(h.to(dtype), f.to(dtype), 0.4, retraction, normalize_eps=eps)
    with _path(path), pytest.raises(ValueError, match="must be at least"):
        SphereResidual(9, eps=1e-30, fused=path != "reference")(h.float(), f.float())
    a, b = h.clone().requires_grad_(), f.clone().requires_grad_()
    s = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    with _path(path):
        out = fn(a, b, s, retraction, normalize_eps=1e-30)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    assert torch.equal(out[2], h[2])  # f = 0: the step 0
    assert all(bool(t.isfinite().all()) for t in (out, a.grad, b.grad, s.grad))


# (exponent of ||h||, exponent of ||f||) per row: rows 1 and 3 with ||P_h f|| / ||h|| past 2^63
# (float32) or 2^511 (float64), where (s rho)² and ||h||²/D leave the normal range; float32 row 3
# is one the C++ kernels rescale (||h|| below 2^-24)
FAR_ROWS = {torch.float32: [(0, 0), (-20, 50), (0, 0), (-25, 45)], torch.float64: [(0, 0), (-180, 340), (0, 0)]}


def _far_rows_truth(h, f, w, retraction, exponents):
    """Values and gradients of the normalized step, each row from the float64 reference on (h 2^-i,
    f 2^-j) with the floor eps 2^(i-j) (at least 2^-511), where its numbers are of order 1: the step is homogeneous
    of degree 1 in (h, f), of degree 0 in (f, eps) together (D scales by 2^-2j, rho by 2^(j-i)), so
    the row's value is 2^i times that one's, its gradient in h the same, in f 2^(i-j) times, in s
    2^i times (exact scalings)."""
    rows = []
    for k, (i, j) in enumerate(exponents):
        a = (h[k : k + 1].double() * 2.0**-i).requires_grad_()
        b = (f[k : k + 1].double() * 2.0**-j).requires_grad_()
        s = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        # the floor eps 2^(i-j), or the smallest float64 takes where that one's square is not a
        # normal number (the floor is then far below ||P_h f|| / ||h|| of these rows: the same D)
        floor = max(1e-6 * 2.0 ** (i - j), 2.0**-511)
        out = sphere_residual_reference(a, b, s, retraction, normalize_eps=floor)
        (out * w[k : k + 1].double()).sum().backward()
        rows.append((out.detach() * 2.0**i, a.grad, b.grad * 2.0 ** (i - j), s.grad * 2.0**i))
    return [torch.cat([row[m] for row in rows]) for m in range(3)] + [sum(row[3] for row in rows)]


@pytest.mark.parametrize("path", [*PATHS, "reference"])
@pytest.mark.parametrize("name", ["gnomonic", "exp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_step_far_longer_than_its_row_is_exact_on_every_path(dtype, name, path):
    """Rows whose ||P_h f|| / ||h|| is past 2^63 (float32) or 2^511 (float64), h and f in range. The
    old code formed sigma = (s rho)² n/q and rho = sqrt(q/D) from numbers of order ||h||²/||P_h f||²,
    subnormal there: the ATen path left the float32 rows off their sphere with inf h-gradients, the
    reference rotated them by the wrong angle, every path made the float64 row's step the identity
    (and the kernels' float32 rescaled row lost its gradient in f). Now every path gives the values
    and gradients of the same step on rows of moderate scale, to a few roundings."""
    retraction = get_retraction("sphere", name)
    exponents = FAR_ROWS[dtype]
    g = torch.Generator().manual_seed(5)
    h = torch.randn(len(exponents), 16, generator=g, dtype=torch.float64)
    f = torch.randn(len(exponents), 16, generator=g, dtype=torch.float64) / 4.0
    scale = torch.tensor([[2.0**i] for i, _ in exponents], dtype=torch.float64)
    h = (scale * h / h.norm(dim=-1, keepdim=True)).to(dtype)
    f = (torch.tensor([[2.0**j] for _, j in exponents], dtype=torch.float64) * f).to(dtype)
    w = torch.randn(h.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)
    fn = sphere_residual_reference if path == "reference" else sphere_residual
    a, b = h.clone().requires_grad_(), f.clone().requires_grad_()
    s = torch.tensor(0.7, dtype=dtype, requires_grad=True)
    with _path(path):
        out = fn(a, b, s, retraction, normalize_eps=1e-6)
    (out * w).sum().backward()
    truth = _far_rows_truth(h, f, w, retraction, exponents)
    eps = torch.finfo(dtype).eps
    ratio = (out.double() * scale.reciprocal()).norm(dim=-1) / (h.double() * scale.reciprocal()).norm(dim=-1)
    assert float((ratio - 1.0).abs().max()) <= 4 * eps
    for got, want in zip((out, a.grad, b.grad), truth[:3]):  # row by row: their scales differ
        error = (got.double() - want).norm(dim=-1) / want.norm(dim=-1)
        assert float(error.max()) <= 16 * eps
    assert abs(float(s.grad) - float(truth[3])) <= 16 * eps * abs(float(truth[3]))
