"""SphereResidual's two step forms: the literal update :math:`\\alpha\\lambda P_h F` and the
normalized one whose angle is :math:`\\theta_R(\\alpha\\lambda)` — angles, scale invariance,
gradients (float64 gradcheck), the degenerate points and the positivity of :math:`\\alpha`."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib.functional import sphere_unit_tangent
from manifoldlib.nn import STEP_FORMS, SphereResidual, sphere_residual_reference
from manifoldlib.nn.residual import DEFAULT_ALPHA
from manifoldlib.retractions import get_retraction

RETRACTIONS = ("gnomonic", "cayley", "exp")
EPS64 = torch.finfo(torch.float64).eps


def _case(seed: int, rows: int, dim: int, radius: float, f_scale: float):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, dim, generator=g, dtype=torch.float64)
    h = radius * h / h.norm(dim=-1, keepdim=True)
    f = f_scale * torch.randn(rows, dim, generator=g, dtype=torch.float64)
    return h, f


def _layer(step: str, retraction: str = "gnomonic", layer: int = 3, alpha: float = 0.7,
           fused: bool = True, eps: float = 1e-6) -> SphereResidual:
    return SphereResidual(8, layer=layer, retraction=retraction, step=step, alpha_init=alpha,
                          eps=eps, fused=fused).double()


@pytest.mark.parametrize("retraction", RETRACTIONS)
@given(seed=st.integers(0, 2**31 - 1), f_scale=st.sampled_from([1e-4, 0.02, 1.0, 300.0]),
       radius=st.sampled_from([1.0, math.sqrt(8), 30.0]))
def test_normalized_angle_is_set_by_alpha_and_damping_alone(retraction, seed, f_scale, radius):
    res = _layer("normalized", retraction)
    h, f = _case(seed, 6, 8, radius, f_scale)
    radius_sq = (h * h).sum(-1, keepdim=True)
    tangent_sq = ((f - (h * f).sum(-1, keepdim=True) / radius_sq * h) ** 2).sum(-1, keepdim=True)
    # beta = alpha * lambda, up to the documented relative floor eps on ||P_h f|| / r
    beta = res.step_size().item() * torch.sqrt(tangent_sq / (tangent_sq + res.eps**2 * radius_sq))
    expected = get_retraction("sphere", retraction).angle(beta)
    theta = res.angle(h, f)  # (6, 1)
    assert float((theta - expected).abs().max()) <= 1e-12
    # against theta_R(alpha * lambda) itself the floor costs at most s (eps r / ||P_h f||)^2 / 2
    bare = get_retraction("sphere", retraction).angle(res.step_size().detach())
    bound = res.step_size().item() * res.eps**2 * radius_sq / tangent_sq / 2 + 1e-13
    assert bool(((theta - bare).abs() <= bound).all())
    out = res(h, f)  # the norm of every row is kept
    assert float(((out.norm(dim=-1) - radius).abs() / radius).max()) <= 16 * EPS64


@pytest.mark.parametrize("retraction", RETRACTIONS)
@given(seed=st.integers(0, 2**31 - 1), f_scale=st.sampled_from([1e-3, 0.05, 1.0, 20.0]))
def test_literal_angle_follows_the_update_norm_and_respects_the_cap(retraction, seed, f_scale):
    res = _layer("literal", retraction)
    h, f = _case(seed, 6, 8, 2.0, f_scale)
    radius_sq = (h * h).sum(-1, keepdim=True)
    tangent = f - (h * f).sum(-1, keepdim=True) / radius_sq * h
    beta = res.step_size().item() * tangent.norm(dim=-1, keepdim=True) / radius_sq.sqrt()
    retr = get_retraction("sphere", retraction)
    expected = retr.angle(beta)
    if float(expected.max()) < math.pi - 1e-6:  # angle() reads the rotation back in [0, pi]
        assert float((res.angle(h, f) - expected).abs().max()) <= 1e-12
    cap = {"gnomonic": math.pi / 2, "cayley": math.pi, "exp": math.inf}[retraction]
    assert float(res.angle(h, 1e6 * f).max()) < cap


@given(seed=st.integers(0, 2**31 - 1), c=st.sampled_from([1e-3, 0.5, 7.0, 1e4]))
def test_normalized_form_ignores_the_scale_of_f(seed, c):
    res = _layer("normalized", eps=1e-12)  # the floor's relative effect is (eps r/||P_h f||)^2
    h, f = _case(seed, 5, 8, 3.0, 1.0)
    assert float((res(h, c * f) - res(h, f)).abs().max()) <= 64 * EPS64 * 3.0


@given(seed=st.integers(0, 2**31 - 1))
def test_normalized_form_is_the_literal_form_of_the_radius_scaled_direction(seed):
    h, f = _case(seed, 5, 8, 2.5, 0.3)
    tangent = f - (h * f).sum(-1, keepdim=True) / (h * h).sum(-1, keepdim=True) * h
    scaled = f * h.norm(dim=-1, keepdim=True) / tangent.norm(dim=-1, keepdim=True)
    ours = _layer("normalized", "cayley", eps=1e-12)(h, f)
    reference = sphere_residual_reference(h, scaled, _layer("literal").step_size().detach(),
                                          get_retraction("sphere", "cayley"))
    assert float((ours - reference).abs().max()) <= 1e-13


@pytest.mark.parametrize("step", STEP_FORMS)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("retraction", RETRACTIONS)
def test_gradcheck_float64(step, fused, retraction):
    res = _layer(step, retraction, fused=fused)
    h, f = _case(11, 4, 8, 2.0, 0.8)
    h.requires_grad_(True)
    f.requires_grad_(True)
    log_alpha = res.log_alpha.detach().clone().requires_grad_(True)

    assert torch.autograd.gradcheck(lambda a, b: res(a, b), (h, f), eps=1e-6, atol=1e-9)
    h0, f0 = h.detach(), f.detach()

    def of_alpha(log_alpha):
        alpha_layer = SphereResidual(8, layer=3, retraction=retraction, step=step, fused=fused).double()
        del alpha_layer.log_alpha
        alpha_layer.log_alpha = log_alpha  # a plain tensor in place of the parameter
        return alpha_layer(h0, f0)

    assert torch.autograd.gradcheck(of_alpha, (log_alpha,), eps=1e-6, atol=1e-9)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("degenerate", ["zero", "parallel"])
def test_normalized_form_is_the_identity_with_finite_gradients_where_p_h_f_vanishes(fused, degenerate):
    res = _layer("normalized", fused=fused)
    h, _ = _case(3, 4, 8, 2.0, 1.0)
    f = torch.zeros_like(h) if degenerate == "zero" else 0.7 * h
    f.requires_grad_(True)
    out = res(h, f)
    # what rounding leaves of P_h f (~eps |f|) is scaled by 1/eps at most: a step of ~s * 1e-10
    assert float((out - h).abs().max()) <= 1e-9
    out.mul(torch.arange(8.0, dtype=torch.float64)).sum().backward()
    assert bool(torch.isfinite(f.grad).all()) and torch.isfinite(res.log_alpha.grad)


@pytest.mark.parametrize("fused", [True, False])
def test_literal_jacobian_at_zero_update_is_the_scaled_tangent_projection(fused):
    res = _layer("literal", "cayley", fused=fused)
    h, _ = _case(5, 1, 8, 2.2, 0.0)
    h = h[0]
    jac = torch.autograd.functional.jacobian(lambda f: res(h, f), torch.zeros(8, dtype=torch.float64))
    projector = torch.eye(8, dtype=torch.float64) - torch.outer(h, h) / h.dot(h)
    assert float((jac - res.step_size().item() * projector).abs().max()) <= 1e-14


def test_unit_tangent_has_the_radius_and_the_floor():
    h, f = _case(2, 3, 8, 2.0, 1.0)
    unit = sphere_unit_tangent(h, f, eps=1e-6)
    assert float(((unit.norm(dim=-1) / h.norm(dim=-1)) - 1).abs().max()) <= 1e-11
    assert float((unit * h).sum(-1).abs().max()) <= 1e-14
    assert float(sphere_unit_tangent(h, torch.zeros_like(h)).abs().max()) == 0.0


@pytest.mark.parametrize("step", STEP_FORMS)
def test_alpha_stays_positive_under_adversarial_optimizer_steps(step):
    # alpha = exp(log_alpha): Adam moves log_alpha by about lr per step, so alpha changes by a
    # factor of at most ~exp(lr) and never crosses 0; plain SGD with a huge step can at worst
    # underflow it to 0.0, never below.
    h, f = _case(1, 4, 8, 2.0, 1.0)
    for opt_cls, lr, steps in ((torch.optim.Adam, 0.05, 200), (torch.optim.SGD, 1e3, 2)):
        res = SphereResidual(8, step=step)
        opt = opt_cls(res.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            loss = (res(h.float(), f.float()) * torch.arange(8.0)).sum().mul(1e3)
            if opt_cls is torch.optim.SGD:  # one huge step straight down in alpha
                loss = res.step_size() * 1e6
            loss.backward()
            opt.step()
            assert res.alpha.item() >= 0.0 and math.isfinite(res.alpha.item())
        if opt_cls is torch.optim.Adam:
            assert res.alpha.item() >= DEFAULT_ALPHA[step] * math.exp(-lr * steps * 1.01) > 0.0
    assert SphereResidual(8, step="normalized").alpha.item() == pytest.approx(0.5)
    assert SphereResidual(8, step="literal").alpha.item() == pytest.approx(1.0)
