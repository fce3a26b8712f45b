"""ScaleNorm puts vectors on a sphere of learnable radius; DyT is gamma * tanh(alpha x) + beta."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib.nn import DyT, ScaleNorm


@given(seed=st.integers(0, 2**31 - 1), dim=st.integers(1, 40), magnitude=st.sampled_from([1e-3, 1.0, 1e3]))
def test_scalenorm_output_lies_on_the_sphere_of_radius_g(seed, dim, magnitude):
    norm = ScaleNorm(dim).double()
    assert norm.scale.item() == pytest.approx(math.sqrt(dim), rel=1e-7)  # g = sqrt(d) at init
    x = magnitude * torch.randn(5, 3, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    y = norm(x).detach()
    assert (y.norm(dim=-1) - norm.scale.item()).abs().max().item() <= 1e-13 * math.sqrt(dim)
    assert float((y / y.norm(dim=-1, keepdim=True) - x / x.norm(dim=-1, keepdim=True)).abs().max()) <= 1e-14


def test_scalenorm_float32_tier():
    norm = ScaleNorm(64)
    x = 1e3 * torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    y = norm(x).detach()
    eps32 = torch.finfo(torch.float32).eps
    assert y.dtype == torch.float32
    assert float((y.norm(dim=-1) / norm.scale.detach() - 1).abs().max()) <= 8 * eps32


def test_scalenorm_zero_input_has_finite_gradients():
    norm = ScaleNorm(6)
    x = torch.zeros(2, 6, requires_grad=True)
    y = norm(x)
    assert torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(norm.scale.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scalenorm_half_precision_zero_and_large_inputs(dtype):
    # in float16, g / eps overflows (0 * inf = NaN for a zero input) and the norm of entries of
    # 3,000 over d = 768 (83,000 > 65,504) overflows to a zero output; both stay exact here
    norm = ScaleNorm(768)
    zero = torch.zeros(2, 768, dtype=dtype, requires_grad=True)
    y = norm(zero)
    assert y.dtype == dtype and torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert torch.isfinite(zero.grad).all()  # float16 had g / eps = 2.8e7 > 65504: inf
    large = torch.full((2, 768), 3000.0, dtype=dtype)
    radius = norm(large).float().norm(dim=-1)
    assert torch.allclose(radius, norm.scale.detach().expand(2), rtol=4 * torch.finfo(dtype).eps)


def test_scalenorm_gradcheck_and_small_norm_floor():
    norm = ScaleNorm(4, eps=1e-3).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))
    tiny = torch.full((1, 4), 1e-5, dtype=torch.float64)  # ||x|| = 2e-5 < eps: divided by eps
    assert torch.allclose(norm(tiny), norm.scale * tiny / 1e-3, rtol=1e-14, atol=0)


def _scalenorm_oracle(x: torch.Tensor, g: float) -> torch.Tensor:
    """g x / ||x|| row by row from the input's values in Python floats, the norm formed from the
    entries divided by the row's largest (no over/underflow at any scale)."""
    rows = []
    for row in x.double().tolist():
        m = max(abs(v) for v in row)
        norm = m * math.sqrt(math.fsum((v / m) ** 2 for v in row))
        rows.append([g * v / norm for v in row])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("dtype, scales, fits", [
    (torch.float32, [1e19, 1e25, 1e38], 1e17),  # ||x||^2 overflows float32 from 1e19 (d = 64)
    (torch.bfloat16, [1e20, 3e38], 1e17),  # normalized in float32, as above
    (torch.float64, [1e155, 1e200, 1e307], 1e152),
])
def test_scalenorm_rows_whose_norm_overflows_come_out_nan_and_the_others_on_the_sphere(dtype, scales, fits):
    # an overflowing ||x|| gave x g / inf = a zero row, silently; now NaN. Rows of the largest
    # scale that fits, and ordinary rows, in the same batch stay right.
    g = torch.Generator().manual_seed(5)
    norm = ScaleNorm(64)
    if dtype == torch.float64:
        norm = norm.double()
    base = torch.randn(len(scales) + 2, 64, generator=g, dtype=torch.float64)
    sizes = torch.tensor([*scales, fits, 0.1], dtype=torch.float64)[:, None]
    x = (base / base.abs().amax(-1, keepdim=True) * sizes * 0.999).to(dtype)
    y = norm(x).detach()
    k = len(scales)
    assert y.dtype == dtype
    assert bool(y[:k].isnan().all())
    want = _scalenorm_oracle(x[k:], 8.0)
    eps = torch.finfo(dtype).eps
    assert float((y[k:].double() - want).abs().max()) <= 8 * eps  # entries of size up to 8
    assert float((y[k:].double().norm(dim=-1) / 8 - 1).abs().max()) <= 8 * eps


@pytest.mark.parametrize("kwargs, message", [({"dim": 0}, "dim must be"), ({"dim": 4, "eps": 0.0}, "eps must be"),
                                             ({"dim": 4, "eps": float("nan")}, "eps must be"),
                                             ({"dim": 4, "eps": True}, "eps must be a finite number > 0, got True")])
def test_scalenorm_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScaleNorm(**kwargs)


def test_scalenorm_wrong_width_raises():
    with pytest.raises(ValueError, match=r"\(\.\.\., 4\)"):
        ScaleNorm(4)(torch.randn(2, 5))


@given(seed=st.integers(0, 2**31 - 1))
def test_dyt_formula(seed):
    g = torch.Generator().manual_seed(seed)
    dyt = DyT(7).double()
    assert dyt.alpha.item() == 0.5 and dyt.alpha.dim() == 0
    with torch.no_grad():
        dyt.weight.copy_(torch.randn(7, generator=g, dtype=torch.float64))
        dyt.bias.copy_(torch.randn(7, generator=g, dtype=torch.float64))
        dyt.alpha.fill_(1.7)
    x = 3 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    expected = (dyt.weight * torch.tanh(1.7 * x) + dyt.bias).detach()
    assert float((dyt(x).detach() - expected).abs().max()) <= 1e-15 * 8


def test_dyt_gradcheck_and_bad_arguments():
    dyt = DyT(3, alpha_init=0.9).double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(dyt, (x,))
    with pytest.raises(ValueError, match="dim must be"):
        DyT(0)
    with pytest.raises(ValueError, match="alpha_init must be"):
        DyT(3, alpha_init=float("nan"))
    with pytest.raises(ValueError, match="alpha_init must be a finite number, got True"):  # was 1.0
        DyT(3, alpha_init=True)
    with pytest.raises(ValueError, match=r"\(\.\.\., 3\)"):
        dyt(torch.randn(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dyt_keeps_the_input_dtype_like_layernorm(dtype):
    # float32 parameters, half input: the output is the float32 formula rounded once to the input
    # dtype, as nn.LayerNorm returns the input dtype
    torch.manual_seed(0)
    dyt = DyT(16, alpha_init=0.7)
    with torch.no_grad():
        dyt.weight.uniform_(0.5, 1.5)
        dyt.bias.uniform_(-0.1, 0.1)
    x = torch.randn(3, 16).to(dtype)
    y = dyt(x)
    want = (torch.tanh(0.7 * x.float()) * dyt.weight + dyt.bias).to(dtype)
    assert y.dtype == dtype == torch.nn.LayerNorm(16)(x).dtype
    assert torch.equal(y, want)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_dyt_refuses_non_real_float_inputs(dtype):
    # the output is returned in the input's dtype: an integer input came back as the formula
    # truncated to integers (tanh(0.5 * [1, 2, 3]) = [0.46, 0.76, 0.91] as [0, 0, 0]), silently
    dyt = DyT(3)
    with pytest.raises(ValueError, match=f"real floating-point input.*got dtype {dtype}"):
        dyt(torch.tensor([[1, 2, 3]]).to(dtype))
    assert torch.equal(dyt(torch.tensor([[1.0, 2.0, 3.0]])).detach(),
                       torch.tanh(0.5 * torch.tensor([[1.0, 2.0, 3.0]])))


def test_scalenorm_gradient_of_a_zero_input_is_g_over_eps():
    # the docstring said "zero gradient"; below the floor the map is g x / eps, whose gradient in
    # x is g / eps (in g: 0, the output being 0)
    norm = ScaleNorm(6, eps=1e-3).double()
    x = torch.zeros(2, 6, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (norm(x) * probe).sum().backward()
    torch.testing.assert_close(x.grad, probe * norm.scale.detach() / 1e-3, rtol=1e-15, atol=0)
    assert float(norm.scale.grad) == 0.0


@pytest.mark.parametrize("dim", [6, 768, 4096])
def test_scalenorm_float16_zero_row_gradient_is_finite_and_normal_rows_keep_their_values(dim):
    """A float16 zero row's gradient in x was g/eps = sqrt(d)/1e-6 (2.8e7 at d = 768): inf in float16
    (max 65504). float16 inputs now have the norm floor max(eps, sqrt(d * eps32)), eps32 float32's
    machine epsilon: the gradient of a zero row is g/sqrt(d) / sqrt(eps32) = 2896 at g = sqrt(d),
    the one torch.nn.functional.rms_norm gives float16 (it computes in float32 with float32's
    epsilon on the mean square). Rows above that floor (RMS entry above sqrt(eps32) = 3.5e-4) keep
    their values bit for bit; the other dtypes keep eps."""
    norm = ScaleNorm(dim)
    zero = torch.zeros(2, dim, dtype=torch.float16, requires_grad=True)
    norm(zero).sum().backward()
    want = math.sqrt(dim) / math.sqrt(dim * torch.finfo(torch.float32).eps)
    assert torch.allclose(zero.grad.float(), torch.full((2, dim), want), rtol=1e-3)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, dim, generator=g)
    x = x / x.norm(dim=-1, keepdim=True) * torch.tensor([[1.0], [0.05], [1.01 * math.sqrt(dim) * 3.46e-4]])
    x16 = x.half()
    work = x16.float()
    want = (work * (norm.scale / work.norm(dim=-1, keepdim=True))).half()
    assert torch.equal(norm(x16), want)
    for dtype in (torch.bfloat16, torch.float32):  # a row of RMS 1e-5: still put on the sphere
        small = norm(torch.full((1, dim), 1e-5, dtype=dtype)).float()
        assert torch.allclose(small.norm(), norm.scale.detach(), rtol=8 * torch.finfo(dtype).eps)
