"""Scale-invariant maps at the edges of the float range: projections and the column-normalizing
retraction give points for every finite nonzero input, not zero rows or columns."""

from __future__ import annotations

import math

import pytest
import torch

from manifoldlib import DGram, Oblique, Sphere, Stiefel
from manifoldlib.functional import oblique_normalize

# (dtype, entry scale): squares that overflow (float32 1e20, float64 1e160) or fall into the
# subnormals / to zero (float32 1e-25 and 1e-40, float64 1e-170), and 1 as the reference
SCALES = [
    (torch.float64, 1.0),
    (torch.float64, 1e160),
    (torch.float64, 1e-170),
    (torch.float32, 1.0),
    (torch.float32, 1e20),
    (torch.float32, 1e-25),
    (torch.float32, 1e-40),
]
IDS = [f"{str(d).split('.')[-1]}-{s:g}" for d, s in SCALES]

# the ends of float64's range too, where squares of the entries leave it entirely
WIDE_SCALES = SCALES + [
    (torch.float64, 1e300),
    (torch.float64, 1e-300),
    (torch.float64, 1e-310),
    (torch.float32, 1e30),
    (torch.float32, 1e-30),
]
WIDE_IDS = [f"{str(d).split('.')[-1]}-{s:g}" for d, s in WIDE_SCALES]


def _reference(z: torch.Tensor, dim: int) -> torch.Tensor:
    """``z / ||z||`` along ``dim`` from the unscaled float64 copy (an exact float64 oracle: the
    entries of ``z`` are a float64 Gaussian times the scale, divided back here)."""
    return z / torch.linalg.vector_norm(z, dim=dim, keepdim=True)


@pytest.mark.parametrize(("dtype", "scale"), SCALES, ids=IDS)
@pytest.mark.parametrize("radius", [1.0, 3.0])
def test_sphere_projx_normalizes_rows_of_every_finite_scale(dtype, scale, radius):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 7, generator=g, dtype=torch.float64)  # (4, 7)
    x = (z * scale).to(dtype)
    y = Sphere(radius).projx(x)
    want = radius * _reference(x.to(torch.float64) / scale, -1)
    eps = torch.finfo(dtype).eps
    assert y.dtype == dtype
    assert torch.allclose(y.to(torch.float64), want, rtol=0.0, atol=8 * eps * radius)


@pytest.mark.parametrize(("dtype", "scale"), WIDE_SCALES, ids=WIDE_IDS)
@pytest.mark.parametrize("manifold", ["oblique", "stiefel"])
def test_oblique_and_stiefel_projx_are_scale_invariant_over_the_whole_range(dtype, scale, manifold):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 9, 4, generator=g, dtype=torch.float64)  # (2, 9, 4)
    x = (z * scale).to(dtype)
    unscaled = x.to(torch.float64) / scale
    if manifold == "oblique":
        y, want = Oblique().projx(x), _reference(unscaled, -2)
    else:
        y, want = Stiefel().projx(x), Stiefel().projx(unscaled)
    assert y.dtype == dtype
    assert torch.allclose(y.to(torch.float64), want, rtol=0.0, atol=8 * torch.finfo(dtype).eps)


@pytest.mark.parametrize(("dtype", "scale"), SCALES, ids=IDS)
def test_oblique_retraction_of_a_long_step_is_the_step_direction(dtype, scale):
    # a step of any finite size: R_W(V) = normalized columns of W + V, here V's own direction to
    # rounding once |V| dwarfs |W| = 1 (and W's for tiny steps)
    g = torch.Generator().manual_seed(2)
    manifold = Oblique()
    w = manifold.random(9, 4, generator=g, dtype=torch.float64)  # (9, 4)
    v = manifold.proju(w, torch.randn(9, 4, generator=g, dtype=torch.float64))
    y = manifold.retr(w.to(dtype), (v * scale).to(dtype))
    y_in = w.to(dtype).to(torch.float64) + (v * scale).to(dtype).to(torch.float64)  # W + V, exact
    want = _reference(y_in / max(scale, 1.0), -2)  # brought to unit size for the oracle
    assert torch.allclose(y.to(torch.float64), want, rtol=0.0, atol=8 * torch.finfo(dtype).eps)
    ok, reason = manifold.check_point_on_manifold(y, explain=True)
    assert ok, reason


def test_oblique_normalize_kernel_gives_unit_columns_for_huge_steps():
    w = torch.eye(5, 3, dtype=torch.float32)  # (5, 3)
    v = torch.full((5, 3), 3e20, dtype=torch.float32)
    y = oblique_normalize(w, v)
    assert torch.allclose(y, torch.full((5, 3), 5 ** -0.5), rtol=0.0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_projections_are_computed_in_float32(dtype):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 5, generator=g, dtype=torch.float64) * 200  # ||row||^2 ~ 2e5 > float16's max
    y = Sphere().projx(z.to(dtype))
    want = _reference(z.to(dtype).to(torch.float64), -1)
    assert torch.allclose(y.to(torch.float64), want, rtol=0.0, atol=torch.finfo(dtype).eps)
    y = Oblique().projx(z.to(dtype))
    want = _reference(z.to(dtype).to(torch.float64), -2)
    assert torch.allclose(y.to(torch.float64), want, rtol=0.0, atol=torch.finfo(dtype).eps)


def test_projections_keep_their_gradients():
    # the power-of-two scaling is a constant: the derivative of x / ||x|| is unchanged
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(Sphere(2.0).projx, (x,))
    assert torch.autograd.gradcheck(Oblique().projx, (x,))


@pytest.mark.parametrize(("dtype", "scale"), WIDE_SCALES, ids=WIDE_IDS)
def test_dgram_projx_is_scale_equivariant_over_the_whole_range(dtype, scale):
    # DGram is a cone: projx(sX) = s projx(X). Float64 entries of 1e300 were refused as "rank 0"
    # (the rank check's column norms overflowed), entries of 1e-300 and 1e-310 projected to the
    # zero matrix (no error)
    g = torch.Generator().manual_seed(5)
    z = torch.randn(2, 7, 3, generator=g, dtype=torch.float64)  # (2, 7, 3)
    x = (z * scale).to(dtype)
    manifold = DGram()
    y = manifold.projx(x)
    want = manifold.projx(x.to(torch.float64) / scale)  # the stored values at unit scale
    # 8 eps of rounding, and the spacing of the subnormals where the output lies among them
    atol = 8 * torch.finfo(dtype).eps + 2 * torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / scale
    assert y.dtype == dtype
    assert torch.allclose(y.to(torch.float64) / scale, want, rtol=0.0, atol=atol * float(want.abs().max()))
    ok, reason = manifold.check_point_on_manifold(y, explain=True)
    assert ok, reason



DGRAM_RETRACTIONS = [("alternating", m) for m in ("auto", "svd", "newton", "gram-eigh")] + [
    ("colnorm-polar", m) for m in ("auto", "svd", "newton")]


@pytest.mark.parametrize(("dtype", "scale"), WIDE_SCALES, ids=WIDE_IDS)
@pytest.mark.parametrize(("name", "method"), DGRAM_RETRACTIONS, ids=[f"{n}-{m}" for n, m in DGRAM_RETRACTIONS])
def test_dgram_retractions_are_scale_equivariant_over_the_whole_range(dtype, scale, name, method):
    # R(sW, sV) = s R(W, V). Float64 points of 1e-300 retracted to the zero matrix (alternating,
    # svd: no error), float64 1e150 and 1e300 and float32 1e30 failed in the SVD or eigh, float64
    # 1e-300 and float32 1e-30 in colnorm-polar's 0/0
    scale = 2.0 ** round(math.log2(scale))  # exact scaling: the kernels are bit for bit equivariant
    g = torch.Generator().manual_seed(7)
    manifold = DGram(retraction=name, method=method)
    w = manifold.random(9, 4, generator=g, dtype=torch.float64)  # (9, 4)
    v = manifold.proju(w, torch.randn(9, 4, generator=g, dtype=torch.float64))
    w_s, v_s = (w * scale).to(dtype), (v * scale).to(dtype)
    y = manifold.retr(w_s, v_s)
    want = manifold.retr(w_s.to(torch.float64) / scale, v_s.to(torch.float64) / scale)
    atol = 8 * torch.finfo(dtype).eps + 2 * torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / scale
    assert y.dtype == dtype
    assert torch.allclose(y.to(torch.float64) / scale, want, rtol=0.0, atol=atol * float(want.abs().max()))
    ok, reason = manifold.check_point_on_manifold(y, explain=True)
    assert ok, reason


@pytest.mark.parametrize("method", ["auto", "svd", "newton", "gram-eigh"])
def test_dgram_alternating_computes_16_bit_points_in_float32(method):
    # float16 columns of norm ~300: Y diag(c) ~ 1e5 overflowed float16 (non-finite result, an
    # SVD or eigh failure)
    g = torch.Generator().manual_seed(8)
    manifold = DGram(retraction="alternating", method=method)
    w = manifold.random(9, 4, generator=g, dtype=torch.float64) * 100  # (9, 4)
    v = manifold.proju(w, torch.randn(9, 4, generator=g, dtype=torch.float64))
    y = manifold.retr(w.to(torch.float16), v.to(torch.float16))
    want = manifold.retr(w.to(torch.float16).double(), v.to(torch.float16).double())
    assert y.dtype == torch.float16
    assert torch.allclose(y.double(), want, rtol=torch.finfo(torch.float16).eps, atol=0.0)
    ok, reason = manifold.check_point_on_manifold(y, explain=True)
    assert ok, reason


@pytest.mark.parametrize("manifold", [Sphere(1.0), Sphere(1e-10), Oblique()], ids=["sphere", "sphere-1e-10", "oblique"])
@pytest.mark.parametrize("dtype, scale", [(torch.float32, 1e20), (torch.bfloat16, 1e30), (torch.float64, 1e200)],
                         ids=["float32-1e20", "bfloat16-1e30", "float64-1e200"])
def test_a_large_normal_vector_fails_the_tangent_check(manifold, dtype, scale):
    # u = s x is all normal; ||u|| (and u / r) overflowed, so the bound atol + rtol ||u|| was inf
    # and the check passed it; a tangent vector of the same size still passes
    g = torch.Generator().manual_seed(6)
    shape = (3, 5) if isinstance(manifold, Sphere) else (5, 3)
    x = manifold.random(*shape, generator=g, dtype=torch.float64)
    tangent = manifold.proju(x, torch.randn(shape, generator=g, dtype=torch.float64))
    ok, reason = manifold.check_vector_on_tangent(x.to(dtype), (scale * x).to(dtype), explain=True)
    assert not ok and "exceeds" in reason
    assert manifold.check_vector_on_tangent(x.to(dtype), (scale * tangent).to(dtype))
