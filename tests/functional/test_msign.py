"""msign: every method against the SVD polar factor and scipy.linalg.polar
(docs/theory/msign.rst)."""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import scipy.linalg
import torch
from dispatch_ops import ProductRecorder  # tests/dispatch_ops.py (tests/ is on sys.path)
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib.functional import MSIGN_METHODS, POLAR_EXPRESS_COEFFICIENTS, dgram_alternating, msign, newton_schulz

EPS = torch.finfo(torch.float64).eps
CONVERGENT = ("svd", "newton", "newton-schulz")
SHAPES = [(7, 3), (3, 7), (5, 5), (4, 6, 2), (2, 3, 5, 4)]


def _gaussian(shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _with_spectrum(m: int, n: int, s: torch.Tensor, seed: int) -> torch.Tensor:
    """An (m, n) matrix with singular values ``s`` (length min(m, n)), random singular vectors."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))[0]
    return (u * s) @ v.T


def _scipy_polar(x: torch.Tensor) -> torch.Tensor:
    """Orthogonal polar factor from scipy, batched over leading dims (wide: side='left')."""
    flat = x.reshape(-1, *x.shape[-2:]).numpy()
    side = "right" if x.shape[-2] >= x.shape[-1] else "left"
    out = np.stack([scipy.linalg.polar(a, side=side)[0] for a in flat])
    return torch.from_numpy(out).reshape(x.shape)


def _rel(a, b):
    return float(torch.linalg.matrix_norm(a - b).max() / torch.linalg.matrix_norm(b).max())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("method", CONVERGENT)
def test_convergent_methods_match_scipy_polar(shape, method):
    x = _gaussian(shape, 0)
    ref = _scipy_polar(x)
    y = msign(x, method)
    assert y.shape == x.shape and y.dtype == x.dtype
    # Gaussian matrices up to 7x7: condition numbers below ~1e3 for these seeds
    assert _rel(y, ref) <= 1e-12


@pytest.mark.parametrize("method", CONVERGENT + ("polar-express",))
@pytest.mark.parametrize("cond", [1e1, 1e3])
def test_ill_conditioned_spectrum(method, cond):
    s = torch.logspace(0, -np.log10(cond), 8, dtype=torch.float64)
    x = _with_spectrum(20, 8, s, seed=1)
    steps = 10 if method == "polar-express" else None  # 8 steps reach 1e-3 only to ~1e-6
    y = msign(x, method, steps=steps)
    assert _rel(y, _scipy_polar(x)) <= 1e-13 * cond


@pytest.mark.parametrize("cond", [1e6, 1e10, 1e13])
@pytest.mark.parametrize("shape", [(64, 32), (32, 64)], ids=str)
def test_newton_is_as_accurate_as_the_svd_at_any_condition_number(cond, shape):
    """The Newton iteration's X^{-T} comes from a QR, not from X^T X: through the Gram matrix the
    polar factor was off by kappa^2 eps (0.6 at kappa = 1e10) while orthonormal to rounding."""
    m, n = max(shape), min(shape)
    s = torch.logspace(0, -np.log10(cond), n, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    u = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    x, exact = (u * s) @ v.T, u @ v.T  # msign(x) = u v^T exactly
    x, exact = (x, exact) if shape[0] >= shape[1] else (x.mT, exact.mT)
    newton, svd = msign(x, "newton"), msign(x, "svd")
    assert _rel(newton, exact) <= 2 * _rel(svd, exact) + 1e-14


def test_newton_refuses_a_rank_deficient_matrix_by_name():
    x = _gaussian((8, 4), 0)
    x[:, 1] = 0
    with pytest.raises(ValueError, match=r"method='newton'\) needs matrices of full rank 4; got a rank-deficient \(8, 4\)"):
        msign(x, "newton")


@pytest.mark.parametrize("m, n", [(6, 4), (10, 6), (5, 8)], ids=str)
def test_newton_refuses_a_numerically_rank_deficient_matrix_by_its_rank(m, n):
    # a product of rank 2 rounds to an R with no zero on its diagonal: the iteration mapped its
    # rounding-level singular values to 1 and returned an orthonormal matrix 0.69 to 0.75 off
    # msign(x, "svd") in its largest entry (float32: up to 1.08), no error
    g = torch.Generator().manual_seed(n)
    x = torch.randn(m, 2, generator=g, dtype=torch.float64) @ torch.randn(2, n, generator=g, dtype=torch.float64)
    batch = torch.stack([_gaussian((m, n), 1), x])  # one full-rank member, one rank-deficient
    for matrix in (x, x.mT, batch, x.float()):
        with pytest.raises(ValueError, match=r"full rank \d; got a rank-deficient .* \(numerical rank 2: .*method='svd'"):
            msign(matrix, "newton")


def _polar_oracle(x: torch.Tensor) -> torch.Tensor:
    """The polar factor of a tall float64 ``x``, :math:`X(X^\top X)^{-1/2}` in 80-digit mpmath."""
    with mpmath.workdps(80):
        a = mpmath.matrix(x.tolist())
        lam, v = mpmath.eigsy(a.T * a)
        q = a * (v * mpmath.diag([1 / mpmath.sqrt(value) for value in lam]) * v.T)
        return torch.tensor(q.tolist(), dtype=torch.float64)


@pytest.mark.parametrize("m, n", [(6, 4), (9, 5)], ids=str)
def test_newton_resolves_graded_full_rank_matrices(m, n):
    """Column norms from 1e-8 to 1e8 (DGram's grading): full rank with the columns scaled, so the
    rank test lets them through, and the QR-based iteration is exact to rounding, where the SVD
    maps the small columns' singular values to 0."""
    x = _gaussian((m, n), 4) * torch.logspace(-8, 8, n, dtype=torch.float64)
    exact = _polar_oracle(x)
    for matrix, expected in ((x, exact), (x.mT, exact.mT)):
        assert (msign(matrix, "newton") - expected).abs().max() <= 4 * EPS
    assert (msign(x, "svd") - exact).abs().max() > 0.1


def test_svd_maps_zero_singular_values_to_zero():
    s = torch.tensor([3.0, 1.0, 0.5, 0.0, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    u = torch.linalg.qr(torch.randn(9, 5, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))[0]
    x = (u * s) @ v.T
    expected = (u * (s > 0).double()) @ v.T
    assert _rel(msign(x, "svd"), expected) <= 1e-14
    assert torch.equal(
        msign(torch.zeros(4, 3, dtype=torch.float64), "svd"), torch.zeros(4, 3, dtype=torch.float64)
    )
    # wide orientation and a batch holding a rank-deficient member
    batch = torch.stack([x.T, _gaussian((5, 9), 3)])
    out = msign(batch, "svd")
    assert _rel(out[0], expected.T) <= 1e-14
    assert torch.linalg.svdvals(out[1]).sub(1).abs().max() <= 1e-14


def test_fixed_count_methods_map_zero_to_zero():
    z = torch.zeros(3, 6, 4, dtype=torch.float64)
    for method in ("jordan5", "polar-express"):
        assert torch.equal(msign(z, method), z)


@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (3, 32, 24)], ids=str)
def test_jordan5_singular_values_in_expected_band(shape):
    x = _gaussian(shape, 4, torch.float32)
    s = torch.linalg.svdvals(msign(x, "jordan5").double())
    assert 0.5 <= float(s.min()) and float(s.max()) <= 1.2
    # not convergent: far from the polar factor (docs/theory/msign.rst: an update direction, not
    # a retraction)
    assert float(s.max() - s.min()) > 0.3


@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (3, 32, 24)], ids=str)
def test_polar_express_accuracy(shape):
    x64 = _gaussian(shape, 5)
    assert _rel(msign(x64, "polar-express"), msign(x64, "svd")) <= 1e-13
    s32 = torch.linalg.svdvals(msign(x64.float(), "polar-express").double())
    assert (s32 - 1).abs().max() <= 1e-6  # a few float32 ulps
    sj = torch.linalg.svdvals(msign(x64.float(), "jordan5").double())
    assert (s32 - 1).abs().max() < 1e-4 * (sj - 1).abs().max()


def test_polar_express_schedule_matches_math_md():
    assert len(POLAR_EXPRESS_COEFFICIENTS) == 8
    a, b, c = POLAR_EXPRESS_COEFFICIENTS[0]
    assert a == pytest.approx(8.28721201814563 / 1.01, rel=1e-15)
    assert b == pytest.approx(-23.595886519098837 / 1.01**3, rel=1e-15)
    assert c == pytest.approx(17.300387312530933 / 1.01**5, rel=1e-15)
    assert POLAR_EXPRESS_COEFFICIENTS[-1] == (1.875, -1.25, 0.375)
    # past the schedule the last triple repeats: 20 steps = 8 steps + 12 convergent quintic steps
    x = _gaussian((12, 5), 6)
    manual = newton_schulz(
        x, POLAR_EXPRESS_COEFFICIENTS + ((1.875, -1.25, 0.375),) * 12, 20, normalize_scale=1.01
    )
    assert torch.allclose(msign(x, "polar-express", steps=20), manual, rtol=0, atol=0)


@pytest.mark.parametrize("method", MSIGN_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_and_shape_follow_input(method, dtype):
    x = _gaussian((2, 6, 4), 7).to(dtype)
    y = msign(x, method)
    assert y.dtype == dtype and y.shape == x.shape and torch.isfinite(y).all()


@pytest.mark.parametrize("method", CONVERGENT)
def test_float32_accuracy(method):
    x = _gaussian((3, 12, 5), 8)
    y = msign(x.float(), method).double()
    assert _rel(y, msign(x, "svd")) <= 32 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("method", MSIGN_METHODS)
@given(
    seed=st.integers(0, 2**31 - 1), c=st.floats(1e-3, 1e3), m=st.integers(1, 6), n=st.integers(1, 6)
)
def test_symmetries(method, seed, c, m, n):
    x = _gaussian((m, n), seed)
    y = msign(x, method)
    exact = method in CONVERGENT
    tol = 1e-12 if exact else 1e-6
    # msign(X^T) = msign(X)^T, msign(-X) = -msign(X), msign(cX) = msign(X) for c > 0
    assert torch.allclose(msign(x.T, method), y.T, rtol=0, atol=tol)
    assert torch.allclose(msign(-x, method), -y, rtol=0, atol=tol)
    if exact:
        assert torch.allclose(msign(c * x, method), y, rtol=0, atol=tol)


@pytest.mark.parametrize("method", CONVERGENT)
def test_orthogonal_input_is_fixed(method):
    q = torch.linalg.qr(_gaussian((3, 9, 4), 9))[0]
    assert _rel(msign(q, method), q) <= 1e-14


def test_newton_gradient_matches_svd_gradient_at_generic_point():
    x = _gaussian((7, 4), 10)
    w = _gaussian((7, 4), 11)
    grads = []
    for method in ("svd", "newton"):
        xi = x.clone().requires_grad_(True)
        (msign(xi, method) * w).sum().backward()
        grads.append(xi.grad)
    assert _rel(grads[1], grads[0]) <= 1e-10


def test_newton_gradient_finite_at_orthogonal_point():
    # at an orthogonal X all singular values are 1 and SVD backward divides by 0
    q = torch.linalg.qr(_gaussian((6, 3), 12))[0].requires_grad_(True)
    (msign(q, "newton") * _gaussian((6, 3), 13)).sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("shape", [(7, 4), (4, 7), (5, 5), (2, 6, 3)], ids=str)
@pytest.mark.parametrize("spectrum", ["orthonormal", "repeated", "generic"])
def test_svd_gradient_is_finite_and_right_at_repeated_singular_values(shape, spectrum):
    # autograd through torch.linalg.svd divides by sigma_i^2 - sigma_j^2: at an orthonormal input
    # (a polar retraction's zero step) the gradient was NaN, at singular values (1, 1, 3, 3[, 2]) it
    # was finite and 6 to 19 % wrong; the polar factor's own derivative has (sigma_i + sigma_j)
    # denominators
    *batch, m, n = shape
    k = min(m, n)
    s = {"orthonormal": [1.0] * k, "repeated": [1.0, 1.0, 3.0, 3.0, 2.0][:k],
         "generic": [0.5, 1.0, 1.7, 2.9, 4.0][:k]}[spectrum]
    spectrum = torch.tensor(s, dtype=torch.float64)
    seeds = range(batch[0] if batch else 1)
    x = torch.stack([_with_spectrum(m, n, spectrum, seed) for seed in seeds]).reshape(shape)
    x = x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: msign(t, "svd"), (x,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_svd_gradient_at_a_rank_deficient_input_is_finite_and_right_along_rank_preserving_steps():
    # a zero singular value maps to 0 (msign jumps there); along steps that keep the rank the
    # derivative exists, and the backward gives it
    x = _with_spectrum(6, 4, torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=torch.float64), 21)
    a, b, w = _gaussian((6, 6), 22), _gaussian((4, 4), 23), _gaussian((6, 4), 24)
    xi = x.clone().requires_grad_(True)
    (msign(xi, "svd") * w).sum().backward()
    assert torch.isfinite(xi.grad).all()
    h = 1e-6  # (I + hA) X (I + hB) keeps the rank
    plus, minus = [(torch.eye(6, dtype=x.dtype) + t * a) @ x @ (torch.eye(4, dtype=x.dtype) + t * b)
                   for t in (h, -h)]
    slope = float(((msign(plus, "svd") - msign(minus, "svd")) * w).sum() / (2 * h))
    assert slope == pytest.approx(float((xi.grad * (a @ x + x @ b)).sum()), rel=1e-8)


def test_gram_eigh_gradient_is_right_where_gram_eigenvalues_repeat():
    # the eigh path (and its refinement for graded inputs) differentiated through torch.linalg.eigh,
    # which divides by lambda_i - lambda_j: at singular values (1, 1, 2, 2, ...) the gradient was
    # 19 % off, on a graded input with repeated Gram eigenvalues 1.5e-4 (NaN for other weights);
    # msign now attaches the polar factor's own derivative
    weights = _gaussian((12, 8), 30)
    block = torch.tensor([[1.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    graded = torch.linalg.cholesky(torch.block_diag(block, block, 1e-6 * block, 1e-6 * block)).mT
    q = torch.linalg.qr(_gaussian((12, 8), 31))[0]
    repeated = torch.tensor([1.0, 1.0, 2.0, 2.0] * 2, dtype=torch.float64)
    for x in (_with_spectrum(12, 8, repeated, 32), q @ graded):
        grads = []
        for method in ("gram-eigh", "newton"):
            xi = x.clone().requires_grad_(True)
            (msign(xi, method) * weights).sum().backward()
            grads.append(xi.grad)
        assert torch.isfinite(grads[0]).all()
        assert _rel(grads[0], grads[1]) <= 1e-12


@pytest.mark.parametrize("method", ["newton", "newton-schulz"])
def test_iterations_differentiate_without_warnings(method):
    # the convergence test converts a tensor to a Python float; it must not touch the graph
    import warnings

    x = _gaussian((6, 3), 14).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (msign(x, method) * _gaussian((6, 3), 15)).sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    (msign(ref, "svd") * _gaussian((6, 3), 15)).sum().backward()
    assert _rel(x.grad, ref.grad) <= 1e-10


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gram_eigh_matches_scipy_polar_on_well_conditioned_input(shape):
    k = min(shape[-2:])
    s = torch.linspace(1.0, 0.2, k, dtype=torch.float64)  # condition number 5
    x = torch.stack([_with_spectrum(*shape[-2:], s, seed) for seed in range(int(np.prod(shape[:-2])))])
    x = x.reshape(shape)
    assert _rel(msign(x, "gram-eigh"), _scipy_polar(x)) <= 1e-13


@pytest.mark.parametrize("cond", [1e2, 1e4])
def test_gram_eigh_error_stays_within_the_squared_condition_bound(cond):
    s = torch.logspace(0, -np.log10(cond), 6, dtype=torch.float64)
    x = _with_spectrum(15, 6, s, seed=3)
    error = _rel(msign(x, "gram-eigh"), _scipy_polar(x))
    assert error <= 10 * cond**2 * EPS  # the documented bound ...
    assert _rel(msign(x, "svd"), _scipy_polar(x)) <= 1e-12  # ... which the SVD does not need


def test_gram_eigh_maps_zero_singular_values_to_zero():
    x = _with_spectrum(9, 4, torch.tensor([1.0, 0.5, 0.25, 0.0], dtype=torch.float64), seed=4)
    y = msign(x, "gram-eigh")
    torch.testing.assert_close(torch.linalg.svdvals(y), torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert _rel(y, msign(x, "svd")) <= 1e-12


def test_gram_eigh_float32_retraction_of_a_small_step_is_orthonormal():
    # the use it is made for: the polar retraction of W - eta A with ||A||_2 = 1, eta = 0.02
    q = torch.linalg.qr(_gaussian((256, 64), 16))[0]
    a = msign(_gaussian((256, 64), 17), "svd")
    y = (q - 0.02 * a).float()
    r = msign(y, "gram-eigh")
    assert r.dtype == torch.float32
    eye = torch.eye(64, dtype=torch.float64)

    def off_orthonormal(z: torch.Tensor) -> float:
        return float(torch.linalg.matrix_norm(z.double().T @ z.double() - eye))

    # as orthonormal as float32 allows: within 2x of the float32 SVD's own answer (~1e-5 here)
    assert off_orthonormal(r) <= 2 * off_orthonormal(msign(y, "svd"))
    assert _rel(r.double(), msign(y.double(), "svd")) <= 1e-6


def _off_orthonormal(z: torch.Tensor) -> float:
    z = z.double()
    k = z.size(-1)
    return float(torch.linalg.matrix_norm(z.mT @ z - torch.eye(k, dtype=torch.float64)).max())


@pytest.mark.parametrize(
    ("cond", "passes", "svd_calls"),
    [(1.5, 1, 0), (10.0, 2, 0), (1e3, 1, 1)],  # kappa^2 eps (float32): 2.7e-7, 1.2e-5, 0.12
)
def test_gram_eigh_float32_picks_its_pass_count_from_the_condition_number(cond, passes, svd_calls):
    s = torch.logspace(0, -np.log10(cond), 48, dtype=torch.float64)
    x64 = _with_spectrum(160, 48, s, seed=5)
    x = x64.float()
    with ProductRecorder() as recorder:
        y = msign(x, "gram-eigh")
    # the first pass is one eigh of the Gram matrix; a second pass, on a result already close to
    # orthonormal, takes the product-only kernels (no factorization); the SVD replaces both
    assert recorder.factorizations() == ["eigh"] + ["svd"] * svd_calls
    lam, vec = torch.linalg.eigh(x.mT @ x)
    single = x @ ((vec * lam.rsqrt().unsqueeze(-2)) @ vec.mT)  # one pass, written out
    if passes == 1 and not svd_calls:
        assert torch.equal(y, single)
    else:  # refined: measured 15x (second pass) and 3e6x (SVD) closer to orthonormal
        assert _off_orthonormal(y) <= 0.2 * _off_orthonormal(single)
    ref = _scipy_polar(x64)
    # as orthonormal as the float32 SVD's own answer whatever the conditioning ...
    assert _off_orthonormal(y) <= 2 * _off_orthonormal(msign(x64.float(), "svd"))
    # ... and the polar factor of the float32 input within the documented kappa^2 eps
    assert _rel(y.double(), ref) <= max(1e-5, 10 * cond**2 * torch.finfo(torch.float32).eps)


def test_gram_eigh_second_pass_restores_orthonormality_a_single_pass_loses():
    from manifoldlib.functional.msign import _gram_eigh_pass

    s = torch.logspace(0, -1.2, 48, dtype=torch.float64)  # kappa 16: kappa^2 eps = 3e-5
    x = _with_spectrum(160, 48, s, seed=6).float()
    single, error = _gram_eigh_pass(x)
    assert 1e-6 < error <= 1e-4  # the refining branch
    floor = _off_orthonormal(msign(x, "svd"))  # float32 rounding, about 8e-6 here
    assert _off_orthonormal(single) > 3 * floor
    assert _off_orthonormal(msign(x, "gram-eigh")) <= 2 * floor


def test_gram_eigh_hands_unresolvable_singular_values_to_the_svd():
    # a float32 Gram matrix cannot tell a singular value below sqrt(n eps) sigma_max from zero:
    # a full-rank input must not lose that direction (a retraction would zero a column) ...
    s = torch.tensor([1.0, 0.9, 0.8, 0.7, 1e-3, 1e-4], dtype=torch.float64)
    x = _with_spectrum(30, 6, s, seed=7).float()
    with ProductRecorder() as recorder:
        y = msign(x, "gram-eigh")
    assert recorder.factorizations().count("svd") == 1
    torch.testing.assert_close(torch.linalg.svdvals(y.double()), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-5)
    # (an exactly rank-deficient input still maps its zero singular values to 0: the float64 test
    # test_gram_eigh_maps_zero_singular_values_to_zero)


@pytest.mark.parametrize("method", MSIGN_METHODS)
@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 0), (2, 0, 4), (0, 3, 2)], ids=str)
def test_an_empty_matrix_or_batch_is_its_own_polar_factor(method, shape):
    x = torch.empty(shape, dtype=torch.float64)
    out = msign(x, method)
    assert out.shape == x.shape and out.dtype == x.dtype


def test_newton_schulz_maps_a_rank_deficient_input_as_the_svd():
    # a product of rank 2 (a low-rank gradient): its two rounding-level singular values (~1e-16)
    # did not reach 1 in the 60 steps of the cap, and the last iterate came back with singular
    # values 0.81 and 0.61, neither msign's 0 nor 1
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 2, generator=g, dtype=torch.float64) @ torch.randn(3, 2, 4, generator=g, dtype=torch.float64)
    for matrix in (x, x.mT):
        expected = msign(matrix, "svd")
        assert torch.linalg.svdvals(expected)[..., 2:].max() <= 1e-14  # msign maps them to 0
        assert _rel(msign(matrix, "newton-schulz"), expected) <= 1e-12


@pytest.mark.parametrize("case", ["float32 rank 2", "float64 below the rank threshold"])
def test_newton_schulz_does_not_carry_numerically_zero_singular_values_to_one(case):
    # both reached 1 within the cap along directions the rounding chose: an orthonormal result
    # 0.82 off the float64 SVD's factor (float32 products of rank 2), 0.49 off msign's 0
    # and 0.014 off U V^T (a float64 singular value of 1e-15, under max(m, n) eps = 2e-15), no error
    g = torch.Generator().manual_seed(1)
    if case == "float32 rank 2":
        x = torch.randn(3, 9, 2, generator=g) @ torch.randn(3, 2, 5, generator=g)
        tol = 1e-6
    else:
        x, tol = _with_spectrum(9, 4, torch.tensor([1.0, 0.7, 0.3, 1e-15], dtype=torch.float64), seed=0), 1e-14
    for matrix in (x, x.mT):
        expected = msign(matrix.double(), "svd")
        assert (msign(matrix, "newton-schulz").double() - expected).abs().max() <= tol


@pytest.mark.parametrize("steps", [0, 3])
def test_newton_stopped_by_its_cap_returns_the_svd_factor(steps):
    # the last iterate came back: x itself at steps=0 (2e3 off msign(x, "svd")), 0.28 off after 3
    x = _gaussian((9, 4), 0) * torch.tensor([1e-3, 1.0, 10.0, 1e3], dtype=torch.float64)
    for matrix in (x, x.mT):
        assert _rel(msign(matrix, "newton", steps=steps), msign(matrix, "svd")) <= 1e-14


def test_newton_resolves_float32_columns_whose_norms_span_more_than_its_range_squared():
    # ||Y^{-T}||_F squared entries of about 1e20 relative and overflowed float32: NaN, then
    # ValueError 'needs matrices of full rank 5; got a rank-deficient (10, 5) input', also from the
    # DGram alternating retraction (its default polar factor) of float32 column norms 1e-5 .. 1e5
    x = (_gaussian((10, 5), 5) * torch.logspace(-10, 10, 5, dtype=torch.float64)).float()
    expected = _polar_oracle(x.double())
    for matrix, exact in ((x, expected), (x.mT, expected.mT)):
        assert (msign(matrix, "newton").double() - exact).abs().max() <= 1e-6
    q = torch.linalg.qr(_gaussian((10, 5), 6))[0]
    w = (q * torch.logspace(-5, 5, 5, dtype=torch.float64)).float()
    r = dgram_alternating(w, torch.zeros_like(w))  # R_W(0) = W
    assert ((r - w).norm(dim=0) / w.norm(dim=0)).max() <= 1e-6
