"""A map whose formula assumes ``x`` on the manifold refuses an ``x`` off it, as the Sphere's do.

``Sphere`` refused such an ``x`` in every method; the matrix manifolds accepted it everywhere, and
three maps then returned wrong points with no error: Stiefel's ``cayley`` retraction and
``Oblique.expmap`` points off the manifold (``max |X^T X - I|`` = 8.0 and ``max | ||w_j||^2 - 1 |``
= 8.0 from ``3X``; 3e-3 and 1.7e-3 from ``X`` plus noise of 1e-3), the Stiefel exponential
(``expmap`` and the ``exp`` retraction) a geodesic of another start (``R(3X, 0) = X``). They now
raise ``ValueError`` beyond the dtype's default tolerances (a value check). The projections of
``x + u`` (``polar``, ``qr``, ``normalize``, DGram's) map any ``x`` and still do.
"""

from __future__ import annotations

import re

import pytest
import torch

from manifoldlib import DGram, Oblique, Stiefel
from manifoldlib.manifolds import skip_value_checks
from manifoldlib.testing import count_ops

F64 = torch.float64

# (name, manifold, method, what the message names as the way out)
NEEDS_A_POINT = [
    ("stiefel-exp-retr", Stiefel(retraction="exp"), "retr", "('polar', 'qr')"),
    ("stiefel-cayley-retr", Stiefel(retraction="cayley"), "retr", "('polar', 'qr')"),
    ("stiefel-expmap", Stiefel(), "expmap", "('polar', 'qr')"),
    ("oblique-expmap", Oblique(), "expmap", "('normalize')"),
]
IDS = [case[0] for case in NEEDS_A_POINT]


def _point_and_step(manifold, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = manifold.random(7, 3, generator=g, dtype=F64)  # (7, 3)
    u = manifold.proju(x, 0.3 * torch.randn(7, 3, generator=g, dtype=F64))
    noise = torch.randn(7, 3, generator=g, dtype=F64)
    return x.to(dtype), u.to(dtype), noise


def _off(x, noise, how):
    return 3.0 * x if how == "3x" else x + 1e-3 * noise


@pytest.mark.parametrize("how", ["3x", "noise-1e-3"])
@pytest.mark.parametrize("name, manifold, method, instead", NEEDS_A_POINT, ids=IDS)
def test_an_x_off_the_manifold_is_refused_naming_it(name, manifold, method, instead, how):
    # no error on the old code
    x, u, noise = _point_and_step(manifold)
    with pytest.raises(ValueError) as info:
        getattr(manifold, method)(_off(x, noise, how), u)
    message = str(info.value)
    kind = type(manifold).__name__
    assert message.startswith(f"{manifold.name}.{method}: 'x' is not a point of {kind}: max |")
    assert "(the default tolerances for torch.float64)" in message
    assert f"project x first ({kind}.projx), or use a retraction that maps any x + u {instead}" in message


@pytest.mark.parametrize("how", ["3x", "noise-1e-3"])
@pytest.mark.parametrize("name, manifold, method, instead", NEEDS_A_POINT, ids=IDS)
def test_what_the_refused_maps_return_unchecked_is_wrong(name, manifold, method, instead, how):
    # why they are refused: off the manifold, or R(x, 0) != x (a geodesic of another start)
    x, u, noise = _point_and_step(manifold)
    bad = _off(x, noise, how)
    with skip_value_checks():
        y = getattr(manifold, method)(bad, u)
        y0 = getattr(manifold, method)(bad, torch.zeros_like(u))
    off = not manifold.check_point_on_manifold(y)
    moved = float((y0 - bad).abs().max()) > 1e-4
    assert off or moved


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name, manifold, method, instead", NEEDS_A_POINT, ids=IDS)
def test_points_within_the_tolerance_are_taken(name, manifold, method, instead, dtype):
    # the other side: a point rounded to its dtype, and a float64 one perturbed by 1e-7
    x, u, noise = _point_and_step(manifold, dtype)
    inputs = [x] + ([x + 1e-7 * noise] if dtype == F64 else [])
    for point in inputs:
        y = getattr(manifold, method)(point, u)
        assert manifold.check_point_on_manifold(y)
        y0 = getattr(manifold, method)(point, torch.zeros_like(u))
        assert float((y0.to(F64) - point.to(F64)).abs().max()) <= 8 * torch.finfo(dtype).eps + 2e-7


@pytest.mark.parametrize("name, manifold, method, instead", NEEDS_A_POINT, ids=IDS)
def test_the_check_is_a_value_check(name, manifold, method, instead):
    x, u, noise = _point_and_step(manifold)
    with skip_value_checks():
        getattr(manifold, method)(3.0 * x, u)  # no error: the caller vouches for its points
    with pytest.raises(ValueError, match="'x' holds 21 non-finite value"):
        getattr(manifold, method)(x * float("nan"), u)


@pytest.mark.parametrize("manifold", [Stiefel(), Stiefel(retraction="qr"), Oblique(), DGram(),
                                      DGram(retraction="colnorm-polar")],
                         ids=["stiefel-polar", "stiefel-qr", "oblique-normalize", "dgram-alternating",
                              "dgram-colnorm-polar"])
def test_projection_retractions_still_map_any_x(manifold):
    # the projection of x + u is a point whatever x is (geoopt's convention): not refused
    x, u, noise = _point_and_step(Stiefel())
    for bad in (3.0 * x, x + 1e-3 * noise):
        assert manifold.check_point_on_manifold(manifold.retr(bad, u))


STIEFEL_REPAIRS = [case for case in NEEDS_A_POINT if case[0].startswith("stiefel")]


def _equal_cosines(m, n, cosine, dtype):
    """``(m, n)`` columns of norm 1 at ``cosine`` with each other, rounded to ``dtype``."""
    g = torch.Generator().manual_seed(n)
    gram = (1 - cosine) * torch.eye(n, dtype=F64) + cosine * torch.ones(n, n, dtype=F64)
    q = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=F64))[0]
    return (q @ torch.linalg.cholesky(gram).mT).to(dtype)


@pytest.mark.parametrize("n", [8, 32])
@pytest.mark.parametrize(("name", "manifold", "method", "instead"), STIEFEL_REPAIRS,
                         ids=[case[0] for case in STIEFEL_REPAIRS])
def test_a_16_bit_matrix_within_the_entry_tolerance_but_beyond_the_repair_is_refused(name, manifold, method,
                                                                                      instead, n):
    # bfloat16's entrywise tolerance took columns at cosine 0.24 (||X^T X - I||_inf = 0.24 (n - 1)),
    # from which the repair of x's rounding diverged: Cayley returned points 1.7e3 (n = 32) off the
    # manifold with no error, exp a non-finite result or a step past its limit
    x = _equal_cosines(2 * n, n, 0.24, torch.bfloat16)
    assert manifold.check_point_on_manifold(x)
    u = manifold.proju(x, 1e-2 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype))
    expected = 0.24 * (n - 1)
    with pytest.raises(ValueError, match=rf"stiefel\.{method}: 'x' is not a point of Stiefel: \|\|X\^T X - I\|\|_inf "
                                         r"= (\S+) \(its largest row sum\) exceeds 0\.25") as refused:
        getattr(manifold, method)(x, u)
    named = float(re.search(r"_inf = (\S+) ", str(refused.value)).group(1))
    assert named == pytest.approx(expected, rel=0.02)  # bfloat16 rounding of the cosines


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("name", "manifold", "method", "instead"), STIEFEL_REPAIRS,
                         ids=[case[0] for case in STIEFEL_REPAIRS])
def test_rounded_16_bit_points_are_far_inside_the_repair_bound(name, manifold, method, instead, dtype):
    x = Stiefel().random(512, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    u = manifold.proju(x, 1e-2 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    y = getattr(manifold, method)(x, u)
    assert y.dtype == dtype and Stiefel().check_point_on_manifold(y)


PRODUCTS = ("mm", "bmm", "matmul")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("name", "manifold", "method", "instead"), STIEFEL_REPAIRS,
                         ids=[case[0] for case in STIEFEL_REPAIRS])
def test_the_point_check_forms_x_t_x_once_and_reads_the_host_once(name, manifold, method, instead, dtype):
    # the entrywise tolerance check and the repair bound were two m n^2 products and two host
    # reads; one D = X^T X - I now serves both (the other read is check_finite_result's)
    x = Stiefel().random(3, 12, 5, generator=torch.Generator().manual_seed(0), dtype=F64)  # (3, 12, 5)
    u = manifold.proju(x, 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=F64))
    x, u = x.to(dtype), u.to(dtype)
    checked = count_ops(lambda: getattr(manifold, method)(x, u))
    with skip_value_checks():
        unchecked = count_ops(lambda: getattr(manifold, method)(x, u))
    assert torch.equal(checked.result, unchecked.result)
    products = sum(checked.by_name[op] - unchecked.by_name[op] for op in PRODUCTS)
    assert products == 1
    assert checked.flops - unchecked.flops == 2 * 3 * 12 * 5 * 5  # one batched (12, 5)^T (12, 5)
    assert checked.syncs - unchecked.syncs == 2
