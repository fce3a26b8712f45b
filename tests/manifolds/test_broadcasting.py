"""Leading batch dimensions of a point and a vector broadcast: every method gives, at each point of
the broadcast batch, what it gives for that point and vector alone (geoopt's convention)."""

from __future__ import annotations

import pytest
import torch

from manifoldlib import DGram, Euclidean, Oblique, Sphere, Stiefel

MANIFOLDS = [Sphere(2.0), Stiefel(), Oblique(), DGram(), Euclidean(ndim=0), Euclidean(ndim=1), Euclidean(ndim=2)]
IDS = ["sphere", "stiefel", "oblique", "dgram", "euclidean-0", "euclidean-1", "euclidean-2"]


def _point_shape(manifold) -> tuple[int, ...]:
    return {0: (), 1: (5,), 2: (6, 4)}[manifold.ndim]


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("batched", ["x", "u"])
def test_inner_has_one_value_per_point_of_the_broadcast_batch(manifold, keepdim, batched):
    # x (3, *point) with u (*point): the inner product of u at each of the three points, shape
    # (3,) -- it was () (u's own batch), one value where geoopt gives three
    g = torch.Generator().manual_seed(0)
    x = manifold.random(3, *_point_shape(manifold), generator=g, dtype=torch.float64)
    u = manifold.proju(x[0], torch.randn(_point_shape(manifold), generator=g, dtype=torch.float64))
    if batched == "u":
        x, u = x[0], manifold.proju(x[0], torch.randn(x.shape, generator=g, dtype=torch.float64))
    got = manifold.inner(x, u, keepdim=keepdim)
    want = torch.stack([manifold.inner(xi, ui, keepdim=keepdim) for xi, ui in zip(*torch.broadcast_tensors(x, u))])
    assert got.shape == want.shape == (3,) + (1,) * (manifold.ndim * keepdim)
    assert torch.equal(got, want)


@pytest.mark.parametrize("manifold", [Euclidean(ndim=1), Euclidean(ndim=2)], ids=["euclidean-1", "euclidean-2"])
def test_euclidean_proju_and_egrad2rgrad_broadcast_to_the_batch_of_x(manifold):
    g = torch.Generator().manual_seed(1)
    x = manifold.random(3, *_point_shape(manifold), generator=g, dtype=torch.float64)
    u = torch.randn(_point_shape(manifold), generator=g, dtype=torch.float64)
    for method in (manifold.proju, manifold.egrad2rgrad):
        got = method(x, u)
        assert got.shape == x.shape  # was u's shape: one vector for three points
        assert torch.equal(got, u.expand_as(x))


@pytest.mark.parametrize("method", ["expmap", "retr"])
@pytest.mark.parametrize("batched", ["x", "u"])
def test_stiefel_exponential_broadcasts_like_the_other_retractions(method, batched):
    # x (6, 4) with u (3, 6, 4) raised a RuntimeError from torch.cat inside stiefel_exp
    manifold = Stiefel(retraction="exp")
    g = torch.Generator().manual_seed(2)
    x = manifold.random(3, 6, 4, generator=g, dtype=torch.float64)  # (3, 6, 4)
    u = 0.5 * torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    x, u = (x, u[0]) if batched == "x" else (x[0], u)
    got = getattr(manifold, method)(x, u)
    assert got.shape == (3, 6, 4)
    xs, us = torch.broadcast_tensors(x, u)
    for i in range(3):
        want = getattr(manifold, method)(xs[i], us[i])
        # the batch shares one scaling-and-squaring count: equal to a few rounding errors
        assert torch.allclose(got[i], want, rtol=0.0, atol=64 * torch.finfo(torch.float64).eps)


MAPS = [(Stiefel(retraction=name), "retr") for name in ("polar", "qr", "cayley", "exp")] + [
    (Stiefel(), "expmap"), (Oblique(), "retr"), (Oblique(), "expmap"), (DGram(), "retr"),
    (DGram(retraction="colnorm-polar"), "retr"), (Sphere(2.0), "retr"), (Sphere(2.0), "expmap")]
MAP_IDS = ["stiefel-polar", "stiefel-qr", "stiefel-cayley", "stiefel-exp", "stiefel-expmap", "oblique-retr",
           "oblique-expmap", "dgram-alternating", "dgram-colnorm-polar", "sphere-retr", "sphere-expmap"]


@pytest.mark.parametrize("layout", ["both (3, 2)", "x (2,) u (3, 2)", "x (3, 2) u ()"])
@pytest.mark.parametrize("manifold, method", MAPS, ids=MAP_IDS)
def test_retractions_and_exponentials_take_two_batch_dimensions(manifold, method, layout):
    # Stiefel's exponential raised a RuntimeError from newton_schulz's batched products for two
    # batch dimensions (both (3, 2)), its 'cayley' one from torch.cat for a vector batch larger
    # than the point's (x (2,) u (3, 2))
    g = torch.Generator().manual_seed(3)
    point = _point_shape(manifold)
    x = manifold.random(3, 2, *point, generator=g, dtype=torch.float64)  # (3, 2, *point)
    u = manifold.proju(x, 0.4 * torch.randn(x.shape, generator=g, dtype=torch.float64))
    if layout == "x (2,) u (3, 2)":
        x = x[0]
        u = manifold.proju(x, u)
    elif layout == "x (3, 2) u ()":
        u = manifold.proju(x[0, 0], u[0, 0])
    got = getattr(manifold, method)(x, u)
    assert got.shape == (3, 2, *point)
    xs, us = torch.broadcast_tensors(x, u)
    for i in range(3):
        for j in range(2):
            want = getattr(manifold, method)(xs[i, j], us[i, j])
            # a batch shares one scaling-and-squaring count (the Stiefel exponential): a few roundings
            assert torch.allclose(got[i, j], want, rtol=0.0, atol=64 * torch.finfo(torch.float64).eps)
