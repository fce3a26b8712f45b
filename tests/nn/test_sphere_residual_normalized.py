"""The normalized sphere step folded into the fused residual: the same values and gradients as
the unit tangent of ``functional.sphere_unit_tangent`` fed to the reference, on the C++ and the
ATen passes, degenerate rows included."""

from __future__ import annotations

import contextlib

import pytest
import torch

from manifoldlib import _cpu_kernels
from manifoldlib.functional import sphere_unit_tangent
from manifoldlib.nn import sphere_residual, sphere_residual_reference
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


@pytest.mark.parametrize("bad", [0.0, -1e-6, float("nan"), float("inf"), "1e-6"])
def test_a_bad_floor_is_refused_by_value(bad):
    h, f = _case()
    with pytest.raises(ValueError, match="normalize_eps must be None or a finite number > 0"):
        sphere_residual(h, f, 0.4, get_retraction("sphere", "gnomonic"), normalize_eps=bad)
