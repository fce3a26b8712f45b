"""Gradients of the manifolds' maps at their degenerate points: a zero tangent vector, two equal
points. Where the map is smooth there its derivative comes back; where it is not (a norm at 0),
the subgradient its docstring names, never NaN."""

from __future__ import annotations

import pytest
import torch

from manifoldlib.manifolds import get_manifold

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
