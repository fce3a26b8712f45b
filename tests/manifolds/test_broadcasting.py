"""Leading batch dimensions of a point and a vector broadcast: every method gives, at each point of
the broadcast batch, what it gives for that point and vector alone (geoopt's convention)."""

from __future__ import annotations

import re

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
    (DGram(retraction="colnorm-polar"), "retr"), (Sphere(2.0), "retr"), (Sphere(2.0), "expmap")] + [
    (Euclidean(ndim=ndim), "retr") for ndim in (0, 1, 2)]
MAP_IDS = ["stiefel-polar", "stiefel-qr", "stiefel-cayley", "stiefel-exp", "stiefel-expmap", "oblique-retr",
           "oblique-expmap", "dgram-alternating", "dgram-colnorm-polar", "sphere-retr", "sphere-expmap",
           "euclidean-0-add", "euclidean-1-add", "euclidean-2-add"]


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


def _batch_calls(manifold):
    """(name, the argument names, call) of every public method of several tensors."""
    calls = [
        ("proju", "xu", manifold.proju), ("egrad2rgrad", "xu", manifold.egrad2rgrad),
        ("retr", "xu", manifold.retr), ("inner", "xu", manifold.inner),
        ("inner", "xuv", manifold.inner), ("transp", "xyv", manifold.transp),
        ("retr_transp", "xuv", manifold.retr_transp),
        ("transp_follow_retr", "xuv", manifold.transp_follow_retr),
    ]
    if not isinstance(manifold, DGram):  # no exponential map
        calls += [("expmap", "xu", manifold.expmap), ("expmap_transp", "xuv", manifold.expmap_transp),
                  ("transp_follow_expmap", "xuv", manifold.transp_follow_expmap)]
    if isinstance(manifold, (Sphere, Euclidean)):
        calls.append(("logmap", "xy", manifold.logmap))
    if isinstance(manifold, Sphere):
        calls.append(("dist", "xy", manifold.dist))
    return calls


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@pytest.mark.parametrize("odd", ["first", "last"])
def test_batches_that_do_not_broadcast_are_refused_naming_every_shape(manifold, odd):
    # x (2, *point) with u (3, *point): torch's RuntimeError from deep inside (the size of tensor
    # a (2) must match ...), or for transp(x, y, v) with x (2,) and y, v (3,) a result; now a
    # ValueError naming the method and every argument's shape
    g = torch.Generator().manual_seed(4)
    point = _point_shape(manifold)
    two = manifold.random(2, *point, generator=g, dtype=torch.float64)
    three = manifold.random(3, *point, generator=g, dtype=torch.float64)
    step = 0.1 * manifold.proju(three, torch.randn(three.shape, generator=g, dtype=torch.float64))
    failures = []
    for name, args, method in _batch_calls(manifold):
        # the first argument (2,), the others (3,); or only the last (2,)
        values = [two if (i == 0) == (odd == "first") else (three if a in "xy" else step)
                  for i, a in enumerate(args)]
        shapes = [f"{a} of shape {tuple(t.shape)}" for a, t in zip(args, values)]
        want = f"{manifold.name}.{name}: {', '.join(shapes[:-1])} and {shapes[-1]} are not one batch"
        try:
            method(*values)
        except ValueError as error:
            if not str(error).startswith(want):
                failures.append(f"{name}({args}): {error}")
        except Exception as error:  # noqa: BLE001 - the old code's RuntimeError is the failure shown
            failures.append(f"{name}({args}): {type(error).__name__}: {error}")
        else:
            failures.append(f"{name}({args}): no error")
    assert not failures, failures


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_the_tangent_check_fails_for_batches_that_do_not_broadcast(manifold):
    # geoopt's convention for a shape it cannot take: (False, reason), and ValueError(reason) from
    # the assert twin; the old code raised torch's RuntimeError (Sphere, Stiefel, ...) or returned
    # True (Euclidean)
    point = _point_shape(manifold)
    x = manifold.random(2, *point, dtype=torch.float64)
    u = torch.zeros((3, *point), dtype=torch.float64)
    ok, reason = manifold.check_vector_on_tangent(x, u, explain=True)
    assert not ok
    assert f"x of shape {tuple(x.shape)} and u of shape {tuple(u.shape)} are not one batch" in reason
    assert manifold.check_vector_on_tangent(x, u, ok_point=True) is False
    with pytest.raises(ValueError, match="are not one batch"):
        manifold.assert_check_vector_on_tangent(x, u)


@pytest.mark.parametrize("manifold", [m for m in MANIFOLDS if m.ndim], ids=[i for m, i in zip(MANIFOLDS, IDS) if m.ndim])
def test_a_second_point_of_another_shape_is_refused_naming_it(manifold):
    point = _point_shape(manifold)
    other = tuple(s + 1 for s in point)
    x = manifold.random(*point, dtype=torch.float64)
    y = manifold.random(*other, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"{manifold.name}\.transp: 'y' must have the point shape "
                                         rf"{re.escape(str(point))} of x on {manifold.name}, got shape "
                                         rf"{re.escape(str(other))}"):
        manifold.transp(x, y, torch.zeros(point, dtype=torch.float64))


@pytest.mark.parametrize("manifold", [Stiefel(), Oblique(), DGram()], ids=["stiefel", "oblique", "dgram"])
def test_the_dual_helpers_refuse_batches_that_do_not_broadcast(manifold):
    # torch's RuntimeError on the old code (the size of tensor a (2) must match ...)
    g = torch.Generator().manual_seed(7)
    two = manifold.random(2, 6, 4, generator=g, dtype=torch.float64)
    three = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    for name, second in [("normal_multiplier", "z"), ("normal_component", "z"), ("tangent_residual", "a")]:
        want = (f"{manifold.name}.{name}: w of shape (2, 6, 4) and {second} of shape (3, 6, 4) are not one "
                f"batch")
        with pytest.raises(ValueError, match=re.escape(want)):
            getattr(manifold, name)(two, three)
    # and a batch that broadcasts is one: a vector taken at two points counts at each
    # (to rounding: a broadcast (6, 4) operand may take another matmul kernel than a batched one —
    # it did on an AMX Xeon — so the two agree to a few units of float64 rounding, not bit for bit)
    one = three[0]  # (6, 4)
    tight = {"rtol": 1e-14, "atol": 1e-14}
    torch.testing.assert_close(manifold.normal_component(two, one), manifold.normal_component(two, one.expand(2, 6, 4)),
                               **tight)
    torch.testing.assert_close(manifold.tangent_residual(two, one), manifold.tangent_residual(two, one.expand(2, 6, 4)),
                               **tight)


@pytest.mark.parametrize("ndim", [0, 1, 2])
def test_euclidean_add_broadcasts_like_every_other_retraction(ndim):
    # 'add' refused any u of another shape than x's ("'v' must have the shape (3, 4) of x"), where
    # every other manifold's retr broadcasts x and u to one batch in their promoted dtype
    g = torch.Generator().manual_seed(8)
    manifold = Euclidean(ndim=ndim)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    u = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    for a, b in [(x, u), (u, x), (x.float(), u), (x, u.float())]:
        got = manifold.retr(a, b)
        assert got.shape == (2, 3, 4) and got.dtype == torch.float64
        assert torch.equal(got, a.double() + b.double())  # float32 to float64 is exact
    assert torch.equal(manifold.retr_transp(x, u, u)[0], x + u)


@pytest.mark.parametrize("ndim", [0, 1])
def test_euclidean_add_refuses_batches_that_do_not_broadcast_naming_both_shapes(ndim):
    x, u = torch.zeros(3, 4, dtype=torch.float64), torch.ones(5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape("euclidean.retr: x of shape (3, 4) and u of shape (5, 4) are "
                                                   "not one batch")):
        Euclidean(ndim=ndim).retr(x, u)
