"""``Oblique.expmap`` takes every step whose column angles are finite, as ``Sphere.expmap`` does.

Before, a column whose :math:`\\theta_j^2 = \\|v_j\\|^2` overflowed (float32 steps of 1e30, float64
ones of 1e300; from 1.8e19 / 1.3e154) made the exponential coefficients NaN and ``expmap`` raised
a generic "the step is too long" while ``Sphere.expmap`` rotated the same row. Such a column is now
rotated from its angle, :math:`\\cos\\theta_j w_j + \\sin\\theta_j \\hat v_j`; only an angle that
itself overflows is refused, with its column, value and the accepted range.
"""

from __future__ import annotations

import math

import pytest
import torch

from manifoldlib import Oblique

# (dtype, the longest angle whose square is finite, the first whose square overflows): powers of
# two, so that theta e_1 has the norm theta exactly and cos/sin of it are the exact answer
BOUNDARY = [(torch.float32, 2.0**63, 2.0**64), (torch.float64, 2.0**511, 2.0**512)]
LONG = [(torch.float32, [1e20, 1e30, 3e38]), (torch.float64, [1e160, 1e300, 1.7e308])]


def _axis_step(dtype, theta, m=5, n=3):
    """Points e_0 in every column, steps theta along e_1, e_2, e_3: the exact map is
    cos(theta) e_0 + sin(theta) e_{j+1}."""
    x = torch.zeros(m, n, dtype=dtype)
    x[0] = 1.0
    u = torch.zeros(m, n, dtype=dtype)
    for j in range(n):
        u[j + 1, j] = theta
    want = torch.zeros(m, n, dtype=torch.float64)
    want[0] = math.cos(theta)  # Python's cos reduces the exact float argument correctly
    for j in range(n):
        want[j + 1, j] = math.sin(theta)
    return x, u, want


@pytest.mark.parametrize("side", ["below", "above"])
@pytest.mark.parametrize("dtype, below, above", BOUNDARY, ids=["float32", "float64"])
def test_both_sides_of_the_overflow_of_theta_squared_give_the_exact_rotation(dtype, below, above, side):
    # above: NaN coefficients and "the step is too long for ..." on the old code
    theta = below if side == "below" else above
    x, u, want = _axis_step(dtype, theta)
    y = Oblique().expmap(x, u)
    assert y.dtype == dtype
    assert torch.allclose(y.to(torch.float64), want, rtol=0, atol=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype, lengths", LONG, ids=["float32", "float64"])
def test_long_steps_give_points_on_each_columns_great_circle(dtype, lengths):
    ob = Oblique()
    g = torch.Generator().manual_seed(0)
    x = ob.random(2, 7, 4, generator=g, dtype=dtype)  # (2, 7, 4)
    z = ob.proju(x, torch.randn(x.shape, generator=g, dtype=dtype))
    direction = z / z.norm(dim=-2, keepdim=True)  # unit tangent columns
    eps = torch.finfo(dtype).eps
    for length in lengths:
        scale = torch.tensor([1e-3, 1.0, length, length], dtype=dtype)  # short and long columns side by side
        y = ob.expmap(x, direction * scale)
        ok, why = ob.check_point_on_manifold(y, explain=True, atol=0.0, rtol=16 * eps)
        assert ok, f"{length}: {why}"
        # in span(w_j, v_j): the component off the plane is rounding
        y64, x64, d64 = (t.to(torch.float64) for t in (y, x, direction))
        off_plane = y64 - (x64 * y64).sum(-2, keepdim=True) * x64 - (d64 * y64).sum(-2, keepdim=True) * d64
        assert float(off_plane.abs().max()) <= 16 * eps
        # the short columns are what they are without the long ones beside them (to the rounding
        # of a sum's order: the batch's shape changes the vectorization)
        alone = ob.expmap(x[..., :2], (direction * scale)[..., :2])
        assert torch.allclose(y[..., :2], alone, rtol=0, atol=2 * eps)


def test_gradients_stay_finite_beside_long_zero_and_short_columns():
    # the long form's norm and the short form's square root each see only their own columns
    x, u, _ = _axis_step(torch.float64, 2.0**600, n=3)
    u[2, 1] = 0.0  # column 1: a zero step
    u[3, 2] = 0.3  # column 2: a short one (column 0 stays long)
    u.requires_grad_(True)
    Oblique().expmap(x, u).sum().backward()
    assert bool(torch.isfinite(u.grad).all())
    # at a zero step the derivative is the tangent projection: d sum(y_1) / d u_1 = P(1) = (0, 1, 1, 1, 1)
    assert torch.equal(u.grad[:, 1], torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_angle_that_overflows_is_refused_naming_it(dtype):
    top = torch.finfo(dtype).max
    x, u, _ = _axis_step(dtype, 1.0)
    u[2, 1] = u[3, 1] = 0.75 * top  # finite entries; ||u_1|| = 1.06 max overflows
    with pytest.raises(ValueError) as info:
        Oblique().expmap(x, u)
    message = str(info.value)
    assert "column 1's step has the angle ||P_W u_j|| = " in message
    assert f"overflows {dtype}" in message and f"angles up to {top:.4g} are taken" in message
    assert "use retr (the 'normalize' retraction" in message
    y = Oblique().retr(x, u)  # what the message points to takes it
    Oblique().assert_check_point_on_manifold(y)


def test_a_non_finite_step_is_named_as_before():
    x, u, _ = _axis_step(torch.float64, 1.0)
    u[1, 0] = math.inf
    with pytest.raises(ValueError, match="'u' holds 1 non-finite value"):
        Oblique().expmap(x, u)
