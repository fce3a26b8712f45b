"""SphereResidual runs the map a retraction class defines: a class that overrides ``retract`` gets
that ``retract`` on every path (C++ kernels, ATen, reference, torch.compile), values and gradients,
so the map ``assert_retraction`` and ``Sphere.retr`` check is the one the network trains with. A
pure ``super()`` forward keeps the fast path of the math it forwards to (module docstring of
``manifoldlib.nn._fused``, *Whose map runs*)."""

from __future__ import annotations

import math

import pytest
import torch
from dispatch_ops import KernelRecorder  # tests/dispatch_ops.py (tests/ is on sys.path)

from manifoldlib import Sphere, _cpu_kernels
from manifoldlib.functional import sphere_unit_tangent
from manifoldlib.functional.sphere import sphere_project_tangent
from manifoldlib.nn import SphereResidual, sphere_residual, sphere_residual_reference
from manifoldlib.retractions import (
    AngleRetraction,
    CayleyRetraction,
    ExponentialRetraction,
    GnomonicRetraction,
    PRetraction,
    get_retraction,
)

ROW_KERNELS = ["sphere_step_forward", "sphere_step_backward"]
needs_kernels = pytest.mark.skipif(not _cpu_kernels.available(), reason="the C++ CPU kernels are not built here")


def _tangent(x, v, radius):
    r_sq = (x * x).sum(-1, keepdim=True) if radius is None else radius * radius
    return sphere_project_tangent(x, v, r_sq), r_sq


def _cayley_map(x, v, radius=None):
    """((1 - σ/4) x + v) / (1 + σ/4), σ = ||P_x v||² / r², written out (not the class's math)."""
    v, r_sq = _tangent(x, v, radius)
    sigma = (v * v).sum(-1, keepdim=True) / r_sq
    return ((1.0 - 0.25 * sigma) * x + v) / (1.0 + 0.25 * sigma)


def _exponential_map(x, v, radius=None):
    v, r_sq = _tangent(x, v, radius)
    beta = torch.sqrt((v * v).sum(-1, keepdim=True) / r_sq)
    return torch.cos(beta) * x + torch.sinc(beta / math.pi) * v


def _gnomonic_map(x, v, radius=None):
    v, r_sq = _tangent(x, v, radius)
    y = x + v
    return y * torch.sqrt(r_sq / (y * y).sum(-1, keepdim=True))


class _ArctanAngleCayleyRetract(AngleRetraction):
    """The review's case: the angle is arctan's (gnomonic), ``retract`` is Cayley's."""

    order = 2

    def angle(self, beta):
        return torch.atan(beta)

    def retract(self, x, v, radius=None):
        return _cayley_map(x, v, radius)


class _GnomonicExpRetract(GnomonicRetraction):
    """A subclass of a built-in whose ``retract`` is another valid retraction (the exponential map)."""

    def retract(self, x, v, radius=None):
        return _exponential_map(x, v, radius)


class _ExponentialGnomonicRetract(ExponentialRetraction):
    """GeoNorm's class with the gnomonic map as its ``retract``."""

    def retract(self, x, v, radius=None):
        return _gnomonic_map(x, v, radius)


class _PCayleyRetract(PRetraction):
    """A p-family member (p = 1.5 below) whose ``retract`` is Cayley's."""

    def retract(self, x, v, radius=None):
        return _cayley_map(x, v, radius)


class _DoubledStep(CayleyRetraction):
    """Forwards to the built-in, but not unchanged: R_x(2v) is this class's map."""

    def retract(self, x, v, radius=None):
        return super().retract(x, 2.0 * v, radius)


OWN = {
    "arctan-angle-cayley-retract": _ArctanAngleCayleyRetract(),
    "gnomonic-exp-retract": _GnomonicExpRetract(),
    "exp-gnomonic-retract": _ExponentialGnomonicRetract(),
    "p1.5-cayley-retract": _PCayleyRetract(1.5),
    "cayley-doubled-step": _DoubledStep(),
}
PATHS = ["kernels", "aten", "reference", "module-fused", "module-reference"]


def _points(seed, shape, radius, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(shape, generator=g, dtype=torch.float64)
    h = radius * h / h.norm(dim=-1, keepdim=True)
    f = 1.5 * radius * torch.randn(shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1])
    return h.to(dtype), f.to(dtype)


def _run(path, h, f, s, retraction, eps):
    if path == "kernels":
        return sphere_residual(h, f, s, retraction, eps)
    if path == "aten":
        with _cpu_kernels.disabled():
            return sphere_residual(h, f, s, retraction, eps)
    return sphere_residual_reference(h, f, s, retraction, eps)


def _step(h, f, s, eps):
    """The tangent step the module takes: s P_h f (literal) or s times the normalized tangent."""
    step = f if eps is None else sphere_unit_tangent(h, f, eps)
    return s * sphere_project_tangent(h, step, (h * h).sum(-1, keepdim=True))


def _own(retraction, h, f, s, eps):
    """The class's own ``retract`` applied row by row to the step the module takes."""
    return retraction.retract(h, _step(h, f, s, eps))


@pytest.mark.parametrize("name", list(OWN))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("step", ["literal", "normalized"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_update_is_the_classs_own_retract_on_every_path(name, path, step, dtype):
    retraction = OWN[name]
    radius = 3.0
    h, f = _points(1, (4, 6, 16), radius, dtype)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    if path.startswith("module"):
        module = SphereResidual(16, layer=2, retraction=retraction, step=step, alpha_init=1.7,
                                fused=path == "module-fused")
        s = module.step_size().detach().to(dtype)
        with torch.no_grad():
            out = module(h, f)
        eps = None if step == "literal" else module.eps
    else:
        s, eps = torch.tensor(1.2, dtype=dtype), None if step == "literal" else 1e-6
        out = _run(path, h, f, s, retraction, eps)
    own = _own(retraction, h, f, s, eps)
    assert float((out - own).norm(dim=-1).max()) <= tol * radius
    # and Sphere.retr, the manifold's map with the same class (all rows on one radius)
    on_sphere = Sphere(radius=radius, retraction=retraction).retr(h, _step(h, f, s, eps))
    assert float((out - on_sphere).norm(dim=-1).max()) <= tol * radius
    # the old fast path ran the class's angle math instead: a gap of order 0.1 r and more here
    angle_form = AngleRetraction.retract(retraction, h, _step(h, f, s, eps))
    assert float((own - angle_form).norm(dim=-1).max()) > 0.05 * radius


@pytest.mark.parametrize("name", list(OWN))
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_gradients_are_those_of_the_classs_own_retract(name, eps):
    retraction = OWN[name]
    h, f = _points(2, (3, 5), 1.7)
    h.requires_grad_(True)
    f.requires_grad_(True)
    s = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
    for path in ("kernels", "aten"):
        assert torch.autograd.gradcheck(lambda a, b, c, p=path: _run(p, a, b, c, retraction, eps), (h, f, s))
    w = torch.randn(3, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    truth = torch.autograd.grad((_own(retraction, h, f, s, eps) * w).sum(), (h, f, s))
    for path in ("kernels", "aten"):
        found = torch.autograd.grad((_run(path, h, f, s, retraction, eps) * w).sum(), (h, f, s))
        for a, b in zip(found, truth):
            assert float((a - b).norm()) <= 1e-12 * max(float(b.norm()), 1.0)


class _Forward(CayleyRetraction):
    def retract(self, x, v, radius=None):
        return super().retract(x, v, radius)


class _ForwardByKeyword(PRetraction):
    def retract(self, point: torch.Tensor, step: torch.Tensor, r=None) -> torch.Tensor:
        """Same map as PRetraction, forwarded by keyword under other parameter names."""
        return super().retract(point, step, radius=r)


class _ForwardTwice(_Forward):
    def retract(self, x, v, radius=None):
        return super().retract(x, v, radius=radius)


class _ForwardExponential(ExponentialRetraction):
    def retract(self, x, v, radius=None):
        return super().retract(x, v, radius)


def _nested_forward():
    class Gnomonic(GnomonicRetraction):  # defined in a function (a nested code object)
        def retract(self, x, v, radius=None):
            return super().retract(x, v, radius)

    return Gnomonic()


FORWARDS = [
    (_Forward(), get_retraction("sphere", "cayley")),
    (_ForwardByKeyword(1.5), PRetraction(1.5)),
    (_ForwardTwice(), get_retraction("sphere", "cayley")),
    (_ForwardExponential(), get_retraction("sphere", "exp")),
    (_nested_forward(), get_retraction("sphere", "gnomonic")),
]


@needs_kernels
@pytest.mark.parametrize(("retraction", "built_in"), FORWARDS, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_a_pure_super_forward_keeps_the_row_kernels_bit_for_bit(retraction, built_in, eps):
    h, f = _points(4, (5, 12), 1.3)

    def values_and_grads(r):
        a, b = h.clone().requires_grad_(True), f.clone().requires_grad_(True)
        s = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        out = sphere_residual(a, b, s, r, eps)
        out.square().sum().backward()
        return out.detach(), a.grad, b.grad, s.grad

    with KernelRecorder() as spy:
        found = values_and_grads(retraction)
    assert spy.calls == ROW_KERNELS
    for a, b in zip(found, values_and_grads(built_in)):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("name", list(OWN))
def test_an_own_retract_runs_no_kernel(name):
    h, f = _points(5, (5, 12), 1.3)
    with KernelRecorder() as spy:
        sphere_residual(h, f, torch.tensor(0.7, dtype=torch.float64), OWN[name])
    assert spy.calls == []


def test_a_retract_set_on_the_instance_is_the_map():
    retraction = CayleyRetraction()
    retraction.retract = _exponential_map  # one instance patched: its map is the exponential map
    h, f = _points(6, (4, 10), 2.0)
    s = torch.tensor(1.1, dtype=torch.float64)
    truth = _own(retraction, h, f, s, None)
    for path in ("kernels", "aten"):
        assert float((_run(path, h, f, s, retraction, None) - truth).abs().max()) <= 1e-13
    assert float((sphere_residual(h, f, s, CayleyRetraction()) - truth).abs().max()) > 0.1  # a different map


@pytest.mark.slow
@pytest.mark.parametrize("step", ["literal", "normalized"])
def test_torch_compile_runs_the_classs_own_retract(step):
    retraction = OWN["arctan-angle-cayley-retract"]
    h, f = _points(7, (8, 16), 4.0, torch.float32)
    module = SphereResidual(16, retraction=retraction, step=step, alpha_init=1.3)
    compiled = torch.compile(module)
    with torch.no_grad():
        out = compiled(h, f)
    s = module.step_size().detach()
    own = _own(retraction, h, f, s, None if step == "literal" else module.eps)
    assert float((out - own).norm(dim=-1).max()) <= 2e-5 * 4.0
