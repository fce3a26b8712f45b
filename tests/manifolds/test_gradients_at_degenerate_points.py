"""Gradients of the manifolds' maps at their degenerate points: a zero tangent vector, two equal
points. Where the map is smooth there its derivative comes back; where it is not (a norm at 0),
the subgradient its docstring names, never NaN."""

from __future__ import annotations

import pytest
import torch

from manifoldlib.functional import msign
from manifoldlib.manifolds import Sphere, Stiefel, get_manifold

SHAPES = {"sphere": (3, 4), "stiefel": (3, 5, 3), "oblique": (3, 5, 3), "dgram": (3, 5, 3), "euclidean": (3, 4)}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_norm_of_a_zero_tangent_has_the_zero_subgradient(name):
    # geoopt's norm is inner ** 0.5: at u = 0 the square root's infinite derivative times the zero
    # gradient of inner gave NaN; the other points of the batch keep the norm's gradient u / ||u||
    manifold = get_manifold(name, ndim=1) if name == "euclidean" else get_manifold(name)
    g = torch.Generator().manual_seed(3)
    x = manifold.random(*SHAPES[name], generator=g, dtype=torch.float64)
    u = manifold.proju(x, torch.randn(x.shape, generator=g, dtype=torch.float64))
    u[1] = 0.0  # the middle point of the batch: a zero tangent
    u.requires_grad_(True)
    norms = manifold.norm(x, u)  # (3,)
    assert torch.equal(norms, manifold.inner(x, u) ** 0.5)
    (grad,) = torch.autograd.grad(norms.sum(), u)
    assert torch.equal(grad[1], torch.zeros_like(grad[1]))
    dims = tuple(range(1, u.dim()))
    expected = u.detach() / u.detach().norm(dim=dims, keepdim=True)
    for i in (0, 2):
        assert torch.allclose(grad[i], expected[i], rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("radius", [1.0, 1e-3])
def test_sphere_logmap_at_equal_points_has_the_tangent_projection_as_derivative(radius):
    # log_x(y) is smooth at y = x, r (||x|| / <x, y>) P_x y to first order: its Jacobian there is
    # P_x in y and -P_x in x. theta * w / ||w|| is 0 * 0 at w = 0, and autograd gave the zero
    # matrix for both. Checked against finite differences at y = x and at a generic y (rows 0
    # and 1 of one batch), and the Jacobian at y = x against P_x itself
    s = Sphere(radius)
    g = torch.Generator().manual_seed(4)
    x = s.random(2, 5, generator=g, dtype=torch.float64)
    y = x.clone()
    y[1] = s.expmap(x[1], s.proju(x[1], torch.randn(5, generator=g, dtype=torch.float64)))
    inputs = (x.clone().requires_grad_(True), y.clone().requires_grad_(True))
    assert torch.autograd.gradcheck(s.logmap, inputs, eps=1e-6 * radius, atol=1e-8, rtol=1e-6)
    tangent = torch.eye(5, dtype=torch.float64) - torch.outer(x[0], x[0]) / radius**2  # P_x
    jac_x, jac_y = torch.autograd.functional.jacobian(s.logmap, (x, y))  # (2, 5, 2, 5) each
    assert torch.allclose(jac_y[0, :, 0], tangent, rtol=0, atol=1e-15)
    assert torch.allclose(jac_x[0, :, 0], -tangent, rtol=0, atol=1e-15)


@pytest.mark.parametrize("singular_values", [(1.0, 1.0, 1e-6), (1.0, 1.0, 1.0, 2e-7)], ids=["n3", "n4"])
def test_stiefel_projx_of_an_ill_conditioned_matrix_with_repeated_singular_values(singular_values):
    # kappa^2 eps above GRAM_EIGH_REFINE sends projx to the SVD; autograd through it divides by
    # sigma_i^2 - sigma_j^2 and gave NaN where two singular values repeat, though the polar factor
    # is smooth at full rank. The reference differentiates another algorithm: autograd through the
    # QR steps of msign's Newton iteration (a vector-Jacobian product of order 1e6; finite
    # differences resolve it only to about eps kappa / h ~ 1e-6 relative)
    n = len(singular_values)
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(6, n, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    x = (u * torch.tensor(singular_values, dtype=torch.float64)) @ v.mT  # (6, n)
    w = torch.randn(x.shape, generator=g, dtype=torch.float64)
    grads = []
    for polar in (Stiefel().projx, lambda t: msign(t, "newton")):
        leaf = x.clone().requires_grad_(True)
        grads.append(torch.autograd.grad((polar(leaf) * w).sum(), leaf)[0])
    assert bool(torch.isfinite(grads[0]).all())
    assert float((grads[0] - grads[1]).abs().max()) <= 1e-8 * float(grads[1].abs().max())
