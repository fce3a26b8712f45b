"""into_safe_range: exact power-of-two rescaling of matrices outside 2^+-32, per matrix."""

from __future__ import annotations

import pytest
import torch

from manifoldlib.functional.scaling import SAFE_EXPONENT, into_safe_range, out_of_range_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_out_of_range_matrices_are_scaled_exactly_and_in_range_ones_kept(dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 5, 3, generator=g, dtype=torch.float64).to(dtype)  # (B, m, n)
    scales = [2.0 ** 70, 1.0, 2.0 ** -70, 2.0 ** 20]
    x = torch.stack([b * s for b, s in zip(base, scales)])
    y = into_safe_range(x)
    for i, s in enumerate(scales):
        top = float(y[i].abs().max())
        if s in (1.0, 2.0 ** 20):                         # inside the range: untouched
            assert torch.equal(y[i], x[i])
        else:                                             # largest entry now in [0.5, 1)
            assert 0.5 <= top < 1.0
            factor = float(y[i].abs().max() / x[i].abs().max())
            assert factor == 2.0 ** round(torch.log2(torch.tensor(factor)).item())
            assert torch.equal(y[i] / factor, x[i])       # exact: only the exponent moved
    down = into_safe_range(x, up=False)
    assert torch.equal(down[2], x[2]) and not torch.equal(down[0], x[0])


def test_beyond_a_single_power_of_two_and_degenerate_matrices():
    tiny = torch.full((2, 2), 2.0 ** -140, dtype=torch.float32)  # subnormal: 2^140 > float32 max
    assert 0.5 <= float(into_safe_range(tiny).abs().max()) < 1.0
    huge = torch.full((2, 2), 2.0 ** 127, dtype=torch.float32)
    assert float(into_safe_range(huge).abs().max()) == 0.5
    zero = torch.zeros(3, 2)
    assert torch.equal(into_safe_range(zero), zero)
    bad = torch.tensor([[float("inf"), 1.0], [2.0 ** 40, 0.0]])
    assert torch.equal(into_safe_range(bad), bad)         # a non-finite matrix is left alone
    assert SAFE_EXPONENT == 32
    assert into_safe_range(torch.empty(0, 3)).shape == (0, 3)


def test_bfloat16_is_scaled_exactly_and_non_float_input_is_refused_by_name():
    # bfloat16 has float32's exponent range: a matrix of entries ~2^125 is brought into [1/2, 1)
    # by a power of two, each entry's mantissa unchanged (the float32 scaling, rounded exactly)
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(2, 4, 3, generator=gen) + 1.0).to(torch.bfloat16)
    huge = x * 2.0**125
    scaled = into_safe_range(huge)
    assert scaled.dtype == torch.bfloat16
    assert torch.equal(scaled, into_safe_range(huge.float()).to(torch.bfloat16))
    assert torch.equal(torch.frexp(scaled)[0], torch.frexp(huge)[0])  # mantissas kept
    shift = torch.frexp(huge)[1] - torch.frexp(scaled)[1]  # one power of two per matrix
    assert (shift == shift[:, :1, :1]).all() and int(shift.min()) > 0
    assert float(scaled.float().abs().amax()) < 1.0 <= 2 * float(scaled.float().abs().amax())
    assert torch.equal(into_safe_range(x), x)  # in range: bit for bit
    half = torch.full((2, 2), 60000.0, dtype=torch.float16)  # float16 is never out of range
    assert torch.equal(into_safe_range(half), half)
    with pytest.raises(ValueError, match="floating-point matrices, got torch.int64"):
        into_safe_range(torch.ones(2, 2, dtype=torch.long))


def test_out_of_range_scale_moves_only_matrices_outside_the_window_exactly():
    # largest entries 2^-20, 2^-17 (exponent -16: inside), 1, 2^15.5 (inside), 2^16 (exponent 17),
    # 2^40; a zero matrix and a NaN one keep scale 1
    tops = [2.0**-20, 2.0**-17, 1.0, 2.0**15.5, 2.0**16, 2.0**40, 0.0, float("nan")]
    x = torch.rand(len(tops), 5, 3, generator=torch.Generator().manual_seed(0)) * 0.5
    x = x * torch.tensor(tops).nan_to_num().view(-1, 1, 1)  # every other entry below the largest
    x[:, 0, 0] = torch.tensor(tops)
    u = out_of_range_scale(x, 16)
    assert u.shape == (len(tops), 1, 1) and u.dtype == x.dtype
    assert u.flatten().tolist()[1:4] == [1.0, 1.0, 1.0] and u.flatten().tolist()[6:] == [1.0, 1.0]
    for k in (0, 4, 5):
        top = float((x[k] * u[k]).abs().max())
        assert 0.5 <= top < 1.0
        assert torch.equal(x[k] * u[k] / u[k], x[k])  # a power of two: exact both ways
    # a subnormal float32 matrix gets a finite scale that brings it into the normal range
    tiny = torch.full((1, 2, 2), 1e-40)
    scale = out_of_range_scale(tiny, 16)
    assert bool(torch.isfinite(scale).all()) and float((tiny * scale).abs().max()) >= torch.finfo(torch.float32).tiny
