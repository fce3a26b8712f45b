"""Tensors of several dtypes promote, as torch's arithmetic does: every method of every manifold,
and every built-in retraction object, computes in ``torch.promote_types`` of its tensor arguments
and returns that dtype.

Before, there was no rule: Stiefel's and DGram's ``proju`` (and ``egrad2rgrad``, and every
``transp`` of a float64 point) raised torch's ``RuntimeError`` ("expected m1 and m2 to have the
same dtype") for a float32 ``x`` with a float64 ``u``; ``retr`` returned the promoted float64 for
the projections (``polar``, ``normalize``, DGram's) but ``x``'s float32 for Sphere's retractions
and Stiefel's ``qr``, ``cayley`` and ``exp`` (``expmap`` too); ``inner(x, u)`` and
``Euclidean.proju`` ignored ``x``'s dtype.
"""

from __future__ import annotations

import re

import pytest
import torch

from manifoldlib import DGram, Euclidean, Oblique, Sphere, Stiefel
from manifoldlib.manifolds import skip_value_checks
from manifoldlib.retractions import available_retractions, get_retraction

F64 = torch.float64

MANIFOLDS = [
    *(Sphere(2.0, retraction=name) for name in ("gnomonic", "exp", "cayley")),
    Sphere(2.0, retraction="p", p=3.0),
    *(Stiefel(retraction=name) for name in ("polar", "qr", "cayley", "exp")),
    DGram(), DGram(retraction="colnorm-polar"), Oblique(),
    Euclidean(ndim=0), Euclidean(ndim=1), Euclidean(ndim=2),
]
IDS = ["sphere-gnomonic", "sphere-exp", "sphere-cayley", "sphere-p3", "stiefel-polar", "stiefel-qr",
       "stiefel-cayley", "stiefel-exp", "dgram-alternating", "dgram-colnorm-polar", "oblique",
       "euclidean-0", "euclidean-1", "euclidean-2"]
# (x's dtype, the others' dtype)
PAIRS = [(torch.float32, F64), (F64, torch.float32), (torch.bfloat16, torch.float32),
         (torch.float16, torch.bfloat16)]
PAIR_IDS = ["x32-u64", "x64-u32", "xbf16-u32", "x16-ubf16"]


def _point_shape(manifold) -> tuple[int, ...]:
    return {0: (), 1: (5,), 2: (6, 4)}[manifold.ndim]


def _arguments(manifold, x_dtype, other_dtype, seed=0):
    """A batch of 3 points ``x`` in ``x_dtype``; tangent vectors ``u``, ``v`` and another point
    ``y`` in ``other_dtype`` (drawn in float64, then rounded)."""
    g = torch.Generator().manual_seed(seed)
    x = manifold.random(3, *_point_shape(manifold), generator=g, dtype=F64)
    u = manifold.proju(x, 0.3 * torch.randn(x.shape, generator=g, dtype=F64))
    v = manifold.proju(x, torch.randn(x.shape, generator=g, dtype=F64))
    y = manifold.retr(x, u)
    return x.to(x_dtype), u.to(other_dtype), v.to(other_dtype), y.to(other_dtype)


def _calls(manifold):
    """(name, call(x, u, v, y)) for every public method of several tensors."""
    calls = [
        ("proju", lambda x, u, v, y: manifold.proju(x, u)),
        ("egrad2rgrad", lambda x, u, v, y: manifold.egrad2rgrad(x, u)),
        ("retr", lambda x, u, v, y: manifold.retr(x, u)),
        ("inner", lambda x, u, v, y: manifold.inner(x, u)),
        ("inner-uv", lambda x, u, v, y: manifold.inner(x, u, v)),
        ("norm", lambda x, u, v, y: manifold.norm(x, u)),
        ("transp", lambda x, u, v, y: manifold.transp(x, y, v)),
        ("retr_transp-point", lambda x, u, v, y: manifold.retr_transp(x, u, v)[0]),
        ("retr_transp-vector", lambda x, u, v, y: manifold.retr_transp(x, u, v)[1]),
        ("transp_follow_retr", lambda x, u, v, y: manifold.transp_follow_retr(x, u, v)),
    ]
    if not isinstance(manifold, DGram):  # no exponential map
        calls += [
            ("expmap", lambda x, u, v, y: manifold.expmap(x, u)),
            ("expmap_transp-point", lambda x, u, v, y: manifold.expmap_transp(x, u, v)[0]),
            ("expmap_transp-vector", lambda x, u, v, y: manifold.expmap_transp(x, u, v)[1]),
            ("transp_follow_expmap", lambda x, u, v, y: manifold.transp_follow_expmap(x, u, v)),
        ]
    if isinstance(manifold, (Sphere, Euclidean)):
        calls.append(("logmap", lambda x, u, v, y: manifold.logmap(x, y)))
    if isinstance(manifold, Sphere):
        calls.append(("dist", lambda x, u, v, y: manifold.dist(x, y)))
    return calls


@pytest.mark.parametrize("x_dtype, other_dtype", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_every_method_computes_in_and_returns_the_promoted_dtype(manifold, x_dtype, other_dtype):
    # on the old code: RuntimeError from Stiefel's and DGram's proju, x's dtype from Sphere's and
    # Stiefel's qr / cayley / exp retr, u's from inner and Euclidean.proju
    x, u, v, y = _arguments(manifold, x_dtype, other_dtype)
    dtype = torch.promote_types(x_dtype, other_dtype)
    failures = []
    for name, call in _calls(manifold):
        got = call(x, u, v, y)
        # the same as every argument cast to the promoted dtype first (unchecked: a float16 point
        # is judged at float16's tolerance, not at the promoted dtype's)
        with skip_value_checks():
            want = call(x.to(dtype), u.to(dtype), v.to(dtype), y.to(dtype))
        if got.dtype != dtype or not torch.equal(got, want):
            failures.append(f"{name}: {got.dtype}, max |got - want| = {float((got.double() - want.double()).abs().max()):.3g}")
    assert not failures, failures


@pytest.mark.parametrize("x_dtype, other_dtype", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_a_point_is_judged_in_its_own_dtype(manifold, x_dtype, other_dtype):
    # a float16 Stiefel point is off by float16's rounding (~1e-3), past float32's tolerance: a
    # float32 step does not make it a point off the manifold, in any map that needs a point
    x, u, v, y = _arguments(manifold, x_dtype, other_dtype)
    for name, call in _calls(manifold):
        call(x, u, v, y)  # no ValueError


def _retractions():
    cases = []
    for family, shape in [("sphere", (3, 5)), ("stiefel", (3, 6, 4)), ("dgram", (3, 6, 4)),
                          ("oblique", (3, 6, 4)), ("euclidean", (3, 5))]:
        for name in available_retractions(family):
            options = {"p": 3.0} if (family, name) == ("sphere", "p") else {}
            cases.append(pytest.param(family, name, options, shape, id=f"{family}-{name}"))
    return cases


@pytest.mark.parametrize("x_dtype, other_dtype", PAIRS[:2], ids=PAIR_IDS[:2])
@pytest.mark.parametrize("family, name, options, shape", _retractions())
def test_every_retraction_object_returns_the_promoted_dtype(family, name, options, shape, x_dtype, other_dtype):
    # on the old code x's dtype for Sphere's angle retractions and Stiefel's qr, cayley and exp
    manifold = {"sphere": Sphere(), "stiefel": Stiefel(), "dgram": DGram(), "oblique": Oblique(),
                "euclidean": Euclidean(ndim=1)}[family]
    retraction = get_retraction(family, name, **options)
    g = torch.Generator().manual_seed(1)
    x = manifold.random(*shape, generator=g, dtype=F64)
    u = manifold.proju(x, 0.3 * torch.randn(shape, generator=g, dtype=F64))
    x, u = x.to(x_dtype), u.to(other_dtype)
    got = retraction.retract(x, u)
    assert got.dtype == F64
    assert torch.equal(got, retraction.retract(x.to(F64), u.to(F64)))
    if family == "sphere":
        long = retraction.retract_long_step(x, u)
        assert long.dtype == F64
        assert torch.equal(long, retraction.retract_long_step(x.to(F64), u.to(F64)))


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_a_method_of_one_tensor_keeps_its_dtype(manifold):
    for dtype in (torch.float32, F64, torch.bfloat16):
        x = manifold.random(3, *_point_shape(manifold), dtype=dtype)
        assert manifold.projx(x).dtype == dtype


# the matrix manifolds' dual helpers follow the same rule; on the old code torch's RuntimeError
# (expected m1 and m2 to have the same dtype) from Stiefel's and DGram's four and Oblique's
# normal_multiplier
MATRIX = [Stiefel(), DGram(), Oblique()]
MATRIX_IDS = ["stiefel", "dgram", "oblique"]
HELPERS = ["normal_multiplier", "normal_component", "tangent_residual"]


@pytest.mark.parametrize("x_dtype, other_dtype", PAIRS[:2], ids=PAIR_IDS[:2])
@pytest.mark.parametrize("manifold", MATRIX, ids=MATRIX_IDS)
def test_the_dual_helpers_compute_in_the_promoted_dtype(manifold, x_dtype, other_dtype):
    g = torch.Generator().manual_seed(2)
    w = manifold.random(3, 6, 4, generator=g, dtype=F64)
    z = torch.randn(w.shape, generator=g, dtype=F64)
    w, z = w.to(x_dtype), z.to(other_dtype)
    dtype = torch.promote_types(x_dtype, other_dtype)
    for name in HELPERS:
        got = getattr(manifold, name)(w, z)
        assert got.dtype == dtype, name
        assert torch.equal(got, getattr(manifold, name)(w.to(dtype), z.to(dtype))), name


@pytest.mark.parametrize("manifold", [*MATRIX, Euclidean(ndim=2)], ids=[*MATRIX_IDS, "euclidean-2"])
def test_the_dual_helpers_refuse_what_is_no_matrix_of_the_manifold(manifold):
    # an integer tensor gave an integer 'deviation' (or torch's error), a wide matrix an (m, m)
    # deviation of the wrong constraint, a vector torch's RuntimeError / IndexError
    w = manifold.random(6, 4, dtype=F64)
    helpers = [("constraint_residual", (w.long(),), "'w' must be a real floating-point tensor"),
               ("tangent_residual", (w, w.long()), "'a' must be a real floating-point tensor")]
    if not isinstance(manifold, Euclidean):
        helpers += [(name, (w.mT,), "needs (..., m, n) with m >= n >= 1, got m=4, n=6")
                    for name in ("constraint_deviation", "constraint_residual")]
        helpers += [("constraint_deviation", (w[:, 0],), "needs a matrix (..., m, n) with m >= n, got shape (6,)"),
                    ("normal_multiplier", (w, w.int()), "'z' must be a real floating-point tensor")]
    for name, args, message in helpers:
        with pytest.raises(ValueError, match=re.escape(message)):
            getattr(manifold, name)(*args)


# check_vector_on_tangent: x is judged as a point at its own dtype's tolerance and u's tangency at
# the looser of x's and u's; the old code took both from u's dtype
TANGENT_CHECKED = [m for m in MANIFOLDS if not isinstance(m, Euclidean)]
TANGENT_IDS = [i for m, i in zip(MANIFOLDS, IDS) if not isinstance(m, Euclidean)]


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("manifold", TANGENT_CHECKED, ids=TANGENT_IDS)
def test_the_tangent_check_of_a_low_precision_point_takes_its_rounding(manifold, low):
    # a float16 point with a float64 tangent vector: the point's rounding (~1e-3) is in x^T u, and
    # the old code judged both at float64's 1e-5 (not a point, not tangent)
    x, u, _, _ = _arguments(manifold, low, F64)
    assert manifold.check_vector_on_tangent(x, u)
    manifold.assert_check_vector_on_tangent(x, u)
    # still refused: a normal part as large as u (bfloat16's tolerance is 0.125)
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    normal = z - manifold.proju(x, z)  # (float64; x judged in its own dtype)
    assert not manifold.check_vector_on_tangent(x, u + normal * (u.norm() / normal.norm()), ok_point=True)


@pytest.mark.parametrize("manifold", TANGENT_CHECKED, ids=TANGENT_IDS)
def test_the_tangent_check_judges_the_point_in_its_own_dtype(manifold):
    # a float64 x off the manifold by 1e-3 with a float16 u: judged at float16's tolerance, the old
    # code took it for a point
    x, u, _, _ = _arguments(manifold, F64, torch.float16)
    off = x + 1e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=F64)
    ok, reason = manifold.check_vector_on_tangent(off, u, explain=True)
    assert not ok and "exceeds atol=1e-05, rtol=1e-05" in reason
    with pytest.raises(ValueError, match="not lying on tangent space"):
        manifold.assert_check_vector_on_tangent(off, u)
    assert manifold.check_vector_on_tangent(x, u)  # the point itself, u rounded to float16
