"""Bad input raises ValueError naming the value and what was expected."""

from __future__ import annotations

import math
import re

import pytest
import torch

from manifoldlib import DGram, Euclidean, Oblique, Sphere, Stiefel, get_manifold
from manifoldlib.functional import (
    dgram_alternating,
    dgram_colnorm_polar,
    dgram_metric_projection,
    msign,
    newton_schulz,
    p_coefficients,
    stiefel_cayley,
    stiefel_exp,
    stiefel_polar,
    stiefel_qr,
)
from manifoldlib.retractions import PRetraction

WIDE = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
VECTOR = torch.randn(5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("cls,label", [(Stiefel, "Stiefel"), (DGram, "DGram")])
@pytest.mark.parametrize(
    "call",
    [
        lambda m, z: m.projx(z),
        lambda m, z: m.proju(z, z),
        lambda m, z: m.retr(z, z),
        lambda m, z: m.egrad2rgrad(z, z),
        lambda m, z: m.random(*z.shape),
    ],
    ids=["projx", "proju", "retr", "egrad2rgrad", "random"],
)
def test_matrix_manifolds_reject_wide_matrices(cls, label, call):
    with pytest.raises(
        ValueError, match=rf"on {label} needs \(\.\.\., m, n\) with m >= n >= 1, got m=3, n=5"
    ):
        call(cls(), WIDE)


@pytest.mark.parametrize("cls,label", [(Stiefel, "Stiefel"), (DGram, "DGram")])
@pytest.mark.parametrize(
    "call",
    [
        lambda m, z: m.projx(z),
        lambda m, z: m.proju(z, z),
        lambda m, z: m.retr(z, z),
        lambda m, z: m.random(*z.shape),
    ],
    ids=["projx", "proju", "retr", "random"],
)
def test_matrix_manifolds_reject_vectors(cls, label, call):
    with pytest.raises(ValueError, match=rf"on {label} needs a matrix .* got shape \(5,\)"):
        call(cls(), VECTOR)


def test_stiefel_expmap_rejects_wide():
    with pytest.raises(ValueError, match="m=3, n=5"):
        Stiefel().expmap(WIDE, WIDE)


def test_dgram_has_no_expmap():
    x = DGram().random(4, 2, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="no closed-form exponential map"):
        DGram().expmap(x, x)


@pytest.mark.parametrize("p", [0.0, -1.0, -math.inf, math.nan, "abc", None])
def test_p_must_be_positive(p):
    with pytest.raises(ValueError, match=r"p must be (a number )?in \(0, inf\], got"):
        PRetraction(p)
    with pytest.raises(ValueError, match=r"p must be"):
        Sphere(retraction="p", p=p)


@pytest.mark.parametrize("radius", [0.0, -2.0, math.nan, math.inf, "big", "2", True])  # "2", True: were 2.0, 1.0
def test_radius_must_be_positive_and_finite(radius):
    with pytest.raises(
        ValueError, match=rf"radius must be a (finite|positive) number.*got {radius!r}"
    ):
        Sphere(radius=radius)
    with pytest.raises(ValueError, match="radius"):
        get_manifold("sphere", radius=radius)


def test_sphere_rejects_scalars():
    with pytest.raises(ValueError, match=r"needs shape \(\.\.\., d\) with d >= 1, got \(\)"):
        Sphere().projx(torch.tensor(1.0))


def test_euclidean_ndim_must_be_non_negative_int():
    with pytest.raises(ValueError, match="ndim must be an int >= 0, got -1"):
        Euclidean(ndim=-1)
    with pytest.raises(ValueError, match="ndim must be an int >= 0, got 1.5"):
        Euclidean(ndim=1.5)
    with pytest.raises(ValueError, match="ndim must be an int >= 0, got True"):  # was taken as 1
        Euclidean(ndim=True)


def test_unknown_manifold_name_lists_valid():
    with pytest.raises(
        ValueError,
        match="unknown manifold 'poincare'; valid names: dgram, euclidean, oblique, sphere, stiefel",
    ):
        get_manifold("poincare")
    with pytest.raises(ValueError, match="cannot be applied to the instance"):
        get_manifold(Sphere(), radius=2.0)


@pytest.mark.parametrize("method", ["nope", "SVD", "newton_schulz", ""])
def test_unknown_msign_method_lists_valid(method):
    with pytest.raises(
        ValueError,
        match=rf"unknown msign method {method!r}; "
        r"valid methods: svd, newton, newton-schulz, jordan5, polar-express",
    ):
        msign(WIDE, method)


@pytest.mark.parametrize("cls", [Stiefel, DGram])
def test_unknown_polar_method_in_retraction(cls):
    with pytest.raises(ValueError, match="unknown polar method 'qr'; valid: auto, svd"):
        cls(method="qr")


def test_msign_rejects_vectors_and_negative_steps():
    with pytest.raises(ValueError, match=r"got shape \(5,\)"):
        msign(VECTOR)
    with pytest.raises(ValueError, match="steps must be None or an int >= 0, got -1"):
        msign(WIDE, "jordan5", steps=-1)
    with pytest.raises(ValueError, match="steps must be an int >= 0, got -2"):
        newton_schulz(WIDE, (1.5, -0.5, 0.0), -2)


def test_metric_projection_iterations():
    with pytest.raises(ValueError, match="iterations must be an int >= 1 \\(or None: to convergence\\), got 0"):
        dgram_metric_projection(WIDE.mT, iterations=0)


@pytest.mark.parametrize(
    "manifold,x_shape,u_shape,point_shape,method",
    [
        (m, xs, us, ps, method)
        for m, xs, us, ps in [
            (Sphere(), (3, 4), (3, 5), (4,)),
            (Stiefel(), (5, 3), (5, 2), (5, 3)),
            (DGram(), (2, 5, 3), (2, 3, 5), (5, 3)),
        ]
        for method in ("proju", "retr", "expmap")
        if not (method == "expmap" and isinstance(m, DGram))  # DGram has no expmap
    ],
)
def test_vector_must_have_the_point_shape(manifold, x_shape, u_shape, point_shape, method):
    x = manifold.random(*x_shape, dtype=torch.float64)
    u = torch.zeros(u_shape, dtype=torch.float64)
    message = (
        rf"'u' must have the point shape {re.escape(str(point_shape))} of x on {manifold.name}, "
        rf"got shape {re.escape(str(u_shape))}"
    )
    with pytest.raises(ValueError, match=message):
        getattr(manifold, method)(x, u)


@pytest.mark.parametrize(
    "kernel", [stiefel_polar, stiefel_qr, stiefel_cayley, stiefel_exp, dgram_alternating, dgram_colnorm_polar]
)
def test_matrix_retraction_kernels_check_their_shapes(kernel):
    tall = torch.linalg.qr(WIDE.mT).Q  # (5, 3)
    name = kernel.__name__
    with pytest.raises(ValueError, match=rf"{name} needs points \(\.\.\., m, n\) with m >= n, got shape \(3, 5\)"):
        kernel(WIDE, WIDE)
    with pytest.raises(ValueError, match=rf"{name} needs v with the matrix shape \(5, 3\) of x, got shape \(3, 5"):
        kernel(tall, WIDE)


def test_kernel_arguments():
    with pytest.raises(ValueError, match="p must be in \\(0, inf\\], got 0.0"):
        p_coefficients(torch.ones(1), 0.0)
    with pytest.raises(ValueError, match="p must be in \\(0, inf\\], got nan"):
        p_coefficients(torch.ones(1), math.nan)
    for bad in [(), (1.5, -0.5), ((1.5, -0.5, 0.0), (1.0,))]:
        with pytest.raises(ValueError, match="coefficients must be one \\(a, b, c\\) triple"):
            newton_schulz(WIDE, bad, 2)


@pytest.mark.parametrize("manifold", [Sphere(), Stiefel(), DGram(), Euclidean(ndim=1)],
                         ids=["sphere", "stiefel", "dgram", "euclidean"])
@pytest.mark.parametrize("size, shown", [
    ((2.5, 4), "2.5"),    # was truncated to 2
    (("4", 3), "'4'"),    # was parsed
    ((True, 3), "True"),  # was 1
    ((-1, 4), "-1"),      # was torch's RuntimeError
])
def test_random_sizes_must_be_ints(manifold, size, shown):
    with pytest.raises(ValueError, match=rf"random\(\) sizes must be ints >= 0, got {re.escape(shown)} in "):
        manifold.random(*size)


@pytest.mark.parametrize("manifold", [Sphere(), Stiefel(), DGram(), Oblique(), Euclidean(ndim=1)],
                         ids=["sphere", "stiefel", "dgram", "oblique", "euclidean"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_random_dtype_must_be_real_floating_point(manifold, dtype):
    # int64 and bool raised torch's NotImplementedError ("normal_kernel_cpu"); complex64 gave
    # complex "points" on Oblique and Euclidean, with no error
    with pytest.raises(ValueError, match=rf"random\(\) dtype must be a real floating-point dtype "
                                         rf"\(float16, bfloat16, float32, float64\), got {re.escape(repr(dtype))}"):
        manifold.random(5, 3, dtype=dtype)


def test_euclidean_random_size_has_the_point_dimensions():
    # random() with no size raised randn's TypeError; for ndim=0 it is one scalar point
    assert Euclidean().random(dtype=torch.float64).shape == ()
    assert Euclidean(ndim=2).random(4, 3).shape == (4, 3)
    with pytest.raises(ValueError, match=r"Euclidean\(ndim=2\)\.random needs a size of at least 2 "
                                         r"dimension\(s\), the point's; got \(3,\)"):
        Euclidean(ndim=2).random(3)


def test_random_accepts_a_shape_and_numpy_or_torch_ints():
    import numpy as np

    assert Stiefel().random(torch.Size([5, 3])).shape == (5, 3)
    assert Sphere().random(np.int64(2), torch.tensor(4).item()).shape == (2, 4)
    assert Sphere().random(0, 4).shape == (0, 4)


@pytest.mark.parametrize(
    "manifold",
    [Oblique(), DGram(retraction="colnorm-polar"), DGram(retraction="colnorm-polar", method="newton-schulz"),
     DGram(retraction="alternating"), DGram(retraction="alternating", method="svd"),
     DGram(retraction="alternating", method="newton-schulz")],
    ids=["oblique", "colnorm-polar", "colnorm-polar-ns", "alternating", "alternating-svd", "alternating-ns"],
)
def test_a_step_that_zeroes_a_column_is_refused_by_name(manifold):
    """u_j = -x_j makes column j of x + u zero, which column normalization cannot map: Oblique's
    retr said 'the step is too long for torch.float64' of a unit step, DGram's colnorm-polar raised
    torch's LinAlgError from its SVD, its alternating retraction msign's 'needs matrices of full
    rank', and with method "svd" or "newton-schulz" returned the column at a norm of 2.2e-308 (its
    d'_j clamped to float64's tiny), no error. Each names the zero columns of x + u."""
    x = manifold.random(2, 5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u = torch.zeros_like(x)
    u[1, :, 2] = -x[1, :, 2]  # column 2 of the second matrix
    with pytest.raises(ValueError, match=re.escape(f"{manifold.name}.retr: columns [2] of x + u (tall "
                                                   f"orientation) are zero, a step u_j = -x_j")):
        manifold.retr(x, u)
