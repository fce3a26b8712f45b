"""Product-only inverse square roots of nearly diagonal Gram matrices (functional.gram_rsqrt)."""

from __future__ import annotations

import math
import sys

import mpmath
import numpy as np
import pytest
import torch
from dispatch_ops import ProductRecorder  # tests/dispatch_ops.py (tests/ is on sys.path)

from manifoldlib.functional import msign
from manifoldlib.functional.gram_rsqrt import (
    CHORD_TOL_EPS,
    alternating_gram_factor,
    chord_rsqrt,
    near_diagonal_rsqrt,
    near_scalar_rsqrt,
    products_only_rsqrt,
)
from manifoldlib.manifolds import DGram

F64_EPS = torch.finfo(torch.float64).eps
F32_EPS = torch.finfo(torch.float32).eps


def _symmetric_off_diagonal(n: int, rho: float, seed: int, batch: tuple[int, ...] = ()) -> torch.Tensor:
    """A symmetric ``(..., n, n)`` matrix with zero diagonal and 1-norm exactly ``rho``."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(*batch, n, n, generator=g, dtype=torch.float64)
    e = 0.5 * (e + e.mT)
    e = e - torch.diag_embed(torch.diagonal(e, dim1=-2, dim2=-1))
    return e * (rho / e.abs().sum(-2).amax(-1, keepdim=True).unsqueeze(-1))


def _rsqrt_reference(t: torch.Tensor) -> torch.Tensor:
    lam, vec = torch.linalg.eigh(t.double())
    return (vec * lam.rsqrt().unsqueeze(-2)) @ vec.mT


def _spectral(x: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(x, 2).max())


def _near_scalar_case(kind: str, n: int, rho: float, seed: int) -> torch.Tensor:
    """``2.5 (I + E)`` rounded to float32 (so that float32 and float64 see the same values), with
    ``E`` symmetric of 1-norm ``rho``: ``"minus-ones"``, ``rho/(n-1) (I - J)`` (an eigenvalue at
    ``-rho``, where every Taylor term has one sign, and off-diagonal entries of one sign, whose
    products' roundings add up); ``"plus-ones"``, its negative; ``"diagonal"``, ``+-rho`` (and a 0
    for odd ``n``); and ``"random"``."""
    eye = torch.eye(n, dtype=torch.float64)
    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        diagonal = 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
        e = _symmetric_off_diagonal(n, 1.0, seed) + torch.diag(diagonal)
    elif kind == "diagonal":
        signs = [(-1.0) ** i for i in range(n - n % 2)] + [0.0] * (n % 2)  # trace 0: s is the mean
        e = torch.diag(torch.tensor(signs, dtype=torch.float64))
    else:
        e = (eye - torch.ones(n, n, dtype=torch.float64)) * (1.0 if kind == "minus-ones" else -1.0)
    e = e * (rho / e.abs().sum(-2).amax())
    return (2.5 * (eye + e)).float()


def _rsqrt_oracle(t: torch.Tensor) -> np.ndarray:
    r""":math:`T^{-1/2}` of the exact values of a float ``(n, n)`` ``t``, as ``np.longdouble``: in
    closed form from 60-digit mpmath scalars where ``t`` is diagonal or has one diagonal and one
    off-diagonal value (``T = (a - b)I + bJ``), else by the coupled Newton–Schulz iteration
    :math:`Y \leftarrow Y(3I - ZY)/2`, :math:`Z \leftarrow (3I - ZY)Z/2` (``Z`` tends to
    :math:`A^{-1/2}`, :math:`A = T/s`, quadratically for :math:`\|I - A\| < 1`) in 60-digit mpmath
    for ``n <= 4`` and in extended precision (``np.longdouble``) above, which agrees with mpmath
    (:func:`test_the_extended_precision_oracle_agrees_with_mpmath`)."""
    x = t.double().numpy()
    n = x.shape[0]
    with mpmath.workdps(60):
        diag, off = np.diag(x), x[~np.eye(n, dtype=bool)]
        if np.all(off == 0):
            roots = [1 / mpmath.sqrt(mpmath.mpf(float(v))) for v in diag]
            return np.diag([np.longdouble(str(root)) for root in roots])
        if np.all(diag == diag[0]) and np.all(off == off[0]):
            a, b = mpmath.mpf(float(diag[0])), mpmath.mpf(float(off[0]))
            inner, ones = 1 / mpmath.sqrt(a - b), 1 / mpmath.sqrt(a - b + n * b)
            on, across = inner + (ones - inner) / n, (ones - inner) / n
            on, across = np.longdouble(str(on)), np.longdouble(str(across))
            return np.where(np.eye(n, dtype=bool), on, across)
        if n <= 4:
            a = mpmath.matrix(x.tolist())
            s = sum(a[i, i] for i in range(n)) / n
            z = _coupled_newton_schulz(a / s, mpmath.eye(n), lambda r: mpmath.mnorm(r, 1), 1e-55)
            z = z / mpmath.sqrt(s)
            return np.array([[np.longdouble(str(z[i, j])) for j in range(n)] for i in range(n)])
    a = x.astype(np.longdouble)
    s = np.trace(a) / n
    eye = np.eye(n, dtype=np.longdouble)
    z = _coupled_newton_schulz(a / s, eye, lambda r: float(np.abs(r).sum(0).max()), 1e-17)
    return z / np.sqrt(s)


def _coupled_newton_schulz(a, eye, norm, tol):
    mp = isinstance(a, mpmath.matrix)
    y, z, zy, previous = a, eye, a, math.inf
    for _ in range(30):
        step = (3 * eye - zy) / 2
        y, z = (y * step, step * z) if mp else (y @ step, step @ z)
        zy = z * y if mp else z @ y
        residual = float(norm(eye - zy))
        if residual <= tol or (residual < 1e-12 and residual > 0.25 * previous):  # or at the floor
            return z
        previous = residual
    raise AssertionError(f"the oracle did not converge (residual {residual:.2e})")


def _relative_error(y: torch.Tensor, oracle: np.ndarray) -> float:
    difference = y.double().numpy().astype(np.longdouble) - oracle
    difference = torch.from_numpy(difference.astype(np.float64))
    return _spectral(difference) / _spectral(torch.from_numpy(oracle.astype(np.float64)))


def test_the_extended_precision_oracle_agrees_with_mpmath():
    if np.finfo(np.longdouble).eps > 1e-18:
        pytest.skip("np.longdouble is not an extended type here")
    t = _near_scalar_case("random", 12, 0.3, seed=20)
    reference = _rsqrt_oracle(t)
    x = t.double().numpy()
    with mpmath.workdps(60):
        a = mpmath.matrix(x.tolist())
        lam, vec = mpmath.eigsy(a)
        exact = vec * mpmath.diag([1 / mpmath.sqrt(v) for v in lam]) * vec.T
        worst = max(abs(exact[i, j] - mpmath.mpf(str(reference[i, j])))
                    for i in range(12) for j in range(12))
    assert float(worst) <= 1e-18  # float64's eps is 2.2e-16: the oracle is 200 times finer


NEAR_SCALAR_NS = (2, 3, 16, 64, 256)
NEAR_SCALAR_RHOS = (1e-8, 1e-5, 3e-4, 3e-3, 0.05, 0.45)


@pytest.mark.parametrize("rho", NEAR_SCALAR_RHOS, ids=str)
@pytest.mark.parametrize("n", NEAR_SCALAR_NS)
@pytest.mark.parametrize("kind", ["minus-ones", "plus-ones", "diagonal", "random"])
def test_near_scalar_error_is_within_its_bound(kind, n, rho):
    # the bound used to take eps (1 + rho)/(1 - rho) for the rounding: the computed error exceeded
    # it by up to 1.5 times (float32 and float64; the rsqrt, the rounding of E and the Horner steps
    # each add a few u), and the products' rounding grows with n. Checked against a 60-digit oracle
    # (extended precision for the random matrices above n = 4) on the exact values of the input
    if kind == "random" and n > 4 and np.finfo(np.longdouble).eps > 1e-18:
        pytest.skip("np.longdouble is not an extended type here")
    t = _near_scalar_case(kind, n, rho, seed=n)
    oracle = None
    for dtype in (torch.float32, torch.float64):
        eps = torch.finfo(dtype).eps
        found = near_scalar_rsqrt(t.to(dtype))
        # five terms reach eps while |c_5| rho^5 / (1 - rho) <= eps: rho up to 0.054 in float32, 1e-3 in float64
        assert (found is None) == (rho > (0.05 if dtype == torch.float32 else 1e-3)), dtype
        if found is None:
            continue
        y, bound = found
        assert y.dtype == dtype
        oracle = _rsqrt_oracle(t) if oracle is None else oracle
        error = _relative_error(y, oracle)
        assert error <= bound, (dtype, error, bound, error / bound)
        assert bound <= 3.5 * eps + n * eps * rho**2  # a useful one: a few eps, n only with rho^2


@pytest.mark.parametrize("eta", [0.02, 0.05])
def test_a_float32_step_at_768_columns_keeps_the_one_pass_fast_path(monkeypatch, eta):
    # the bound's readers (msign's gram-eigh, the fused Manifold Muon retraction) keep one pass only
    # under GRAM_EIGH_ONE_PASS (1e-6). Here rho is 2.5e-3 and 1.6e-2: an honest bound for Horner
    # with the identity inside the products (gamma_n rho per product) crosses 1e-6 at rho ~ 0.015
    # for 768 columns and would have turned the fast path off at eta = 0.05
    from manifoldlib.functional.msign import GRAM_EIGH_ONE_PASS

    g = torch.Generator().manual_seed(9)
    q = torch.linalg.qr(torch.randn(768, 768, generator=g, dtype=torch.float64))[0]
    z = torch.randn(768, 768, generator=g, dtype=torch.float64)
    a = z - q @ (0.5 * (q.mT @ z + z.mT @ q))
    y = (q - eta * a / torch.linalg.matrix_norm(a, 2)).float()
    module = sys.modules["manifoldlib.functional.gram_rsqrt"]
    kernel, bounds = module.near_scalar_rsqrt, []

    def recorded(t):
        found = kernel(t)
        bounds.append(None if found is None else found[1])
        return found

    monkeypatch.setattr(module, "near_scalar_rsqrt", recorded)
    with ProductRecorder() as recorder:
        msign(y, "gram-eigh")
    assert recorder.factorizations() == []
    assert len(bounds) == 1 and bounds[0] <= GRAM_EIGH_ONE_PASS  # one pass, no second


def test_near_scalar_series_declines_what_five_terms_cannot_reach():
    t = torch.eye(30, dtype=torch.float64) + _symmetric_off_diagonal(30, 0.05, seed=2)
    assert near_scalar_rsqrt(t) is None  # 0.246 * 0.05^5 > eps(float64)
    assert near_scalar_rsqrt(t.float()) is not None  # ... but not float32's
    assert near_scalar_rsqrt(-torch.eye(3, dtype=torch.float64)) is None
    assert near_scalar_rsqrt(torch.full((3, 3), float("nan"), dtype=torch.float64)) is None


def _graded(n: int, low: float, rho: float, seed: int, dtype=torch.float64, batch=()) -> torch.Tensor:
    """``D (I + E) D`` with ``D`` log-spaced over ``[low, 1]``."""
    d = torch.logspace(0, torch.log10(torch.tensor(low)).item(), n, dtype=torch.float64)
    e = _symmetric_off_diagonal(n, rho, seed, batch)
    t = d.unsqueeze(-1) * (torch.eye(n, dtype=torch.float64) + e) * d.unsqueeze(-2)
    return t.to(dtype), d


@pytest.mark.parametrize(("dtype", "rho"), [(torch.float64, 1e-4), (torch.float32, 3e-3), (torch.float32, 3e-2)], ids=str)
@pytest.mark.parametrize("low", [1.0, 1e-2, 1e-6])
def test_near_diagonal_chord_resolves_graded_gram_matrices(dtype, rho, low):
    eps = torch.finfo(dtype).eps
    t, d = _graded(48, low, rho, seed=3, dtype=dtype)
    found = near_diagonal_rsqrt(t)
    assert found is not None
    y, residual = found
    assert y.dtype == dtype
    torch.testing.assert_close(y, y.mT, rtol=0, atol=0)
    # the reported residual is I - Y T Y, checked independently in float64 ...
    t64, y64 = t.double(), y.double()
    true_residual = float((torch.eye(48, dtype=torch.float64) - y64 @ t64 @ y64).abs().sum(-2).max())
    assert residual <= CHORD_TOL_EPS * eps
    assert true_residual <= 4 * CHORD_TOL_EPS * eps
    # ... and Y is T^{-1/2} in the relative sense the grading needs: D Y D against its reference
    ref = _rsqrt_reference(t64)
    outer = d.unsqueeze(-1) * d.unsqueeze(-2)
    assert _spectral(outer * y64 - outer * ref) <= 50 * eps


def test_near_diagonal_chord_is_batched_and_declines_far_from_diagonal():
    t, _ = _graded(20, 1e-3, 1e-4, seed=4, batch=(3,))
    y, _ = near_diagonal_rsqrt(t)
    for k in range(3):
        torch.testing.assert_close(y[k], near_diagonal_rsqrt(t[k])[0], rtol=1e-12, atol=0)
    far, _ = _graded(20, 1e-3, 0.2, seed=5)
    assert near_diagonal_rsqrt(far) is None  # rho above CHORD_START_LIMIT
    zero = torch.eye(4, dtype=torch.float64)
    zero[2, 2] = 0.0
    assert near_diagonal_rsqrt(zero) is None


def _dgram_step(m: int, n: int, low: float, eta: float, seed: int):
    """``Y diag(|y_j|)`` for the alternating retraction of a tangent step on a DGram point."""
    from manifoldlib.functional.dgram import dgram_project_tangent

    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))[0]
    w = q * torch.logspace(0, torch.log10(torch.tensor(low)).item(), n, dtype=torch.float64)
    a = dgram_project_tangent(w, torch.randn(m, n, generator=g, dtype=torch.float64))
    y = w - eta * a / torch.linalg.matrix_norm(a, 2)
    return y * y.norm(dim=-2, keepdim=True)


def test_gram_eigh_takes_no_eigh_for_a_small_graded_step_and_keeps_every_column():
    # column norms 1e-4 .. 1: the Gram matrix of Y diag(|y_j|) spans 1e-16 in float32, where an eigh
    # cannot see the small columns (it fell back to a float64 SVD); the chord kernel works relatively.
    # "Small" is relative to the smallest column: a step of 1e-6 moves it by 1 %
    z = _dgram_step(200, 40, 1e-4, 1e-6, seed=6)
    with ProductRecorder() as recorder:
        out = msign(z.float(), "gram-eigh")
    assert recorder.factorizations() == []
    ref = torch.linalg.svd(z.float().double(), full_matrices=False)
    ref = ref.U @ ref.Vh
    assert float((out.double() - ref).norm() / ref.norm()) <= 1e-6
    eye = torch.eye(40, dtype=torch.float64)
    assert float((out.double().mT @ out.double() - eye).norm()) <= 1e-5


def test_gram_eigh_small_stiefel_step_is_more_orthonormal_than_the_eigh_path(monkeypatch):
    # the polar retraction of a tangent step: the series kernel, one product, and about ten times
    # closer to orthonormal in float32 than the eigh path (whose eigenvectors carry the rounding)
    g = torch.Generator().manual_seed(7)
    q = torch.linalg.qr(torch.randn(512, 128, generator=g, dtype=torch.float64))[0]
    z = torch.randn(512, 128, generator=g, dtype=torch.float64)
    a = z - q @ (0.5 * (q.mT @ z + z.mT @ q))
    y = (q - 0.02 * a / torch.linalg.matrix_norm(a, 2)).float()
    eye = torch.eye(128, dtype=torch.float64)

    def defect(x):
        return float((x.double().mT @ x.double() - eye).norm())

    fast = msign(y, "gram-eigh")
    module = sys.modules["manifoldlib.functional.gram_rsqrt"]  # the kernels products_only_rsqrt runs
    monkeypatch.setattr(module, "near_scalar_rsqrt", lambda t: None)
    monkeypatch.setattr(module, "near_diagonal_rsqrt", lambda t: None)
    slow = msign(y, "gram-eigh")
    ref = msign(y.double(), "svd")
    assert float((fast.double() - ref).norm() / ref.norm()) <= 1e-6
    assert defect(fast) < 0.5 * defect(slow)


@pytest.mark.parametrize("kind", ["stiefel", "dgram"])
def test_kernels_are_differentiable_like_the_polar_factor(monkeypatch, kind):
    # under autograd the product-only kernels still give the value, and msign attaches the polar
    # factor's derivative (checked against autograd through the float64 SVD)
    import warnings

    module = sys.modules["manifoldlib.functional.gram_rsqrt"]  # the kernels products_only_rsqrt runs
    used = []

    def spied(name):
        kernel = getattr(module, name)

        def run(t):
            found = kernel(t)
            if found is not None:
                used.append(name)
            return found

        return run

    for name in ("near_scalar_rsqrt", "near_diagonal_rsqrt"):
        monkeypatch.setattr(module, name, spied(name))
    g = torch.Generator().manual_seed(8)
    q = torch.linalg.qr(torch.randn(30, 8, generator=g, dtype=torch.float64))[0]
    if kind == "dgram":
        q = q * torch.logspace(0, -1, 8, dtype=torch.float64)
    step = 1e-7 * torch.randn(30, 8, generator=g, dtype=torch.float64)
    x = (q + step).requires_grad_(True)
    weights = torch.randn(30, 8, generator=g, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "tensor with requires_grad to a scalar" warnings
        (msign(x, "gram-eigh") * weights).sum().backward()
    assert used == ["near_scalar_rsqrt" if kind == "stiefel" else "near_diagonal_rsqrt"]
    fast = x.grad.clone()
    x.grad = None
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    ((u @ vh) * weights).sum().backward()
    assert float((fast - x.grad).norm() / x.grad.norm()) <= 1e-8


@pytest.mark.parametrize(("dtype", "exponent"), [
    (torch.float64, -500), (torch.float64, -200), (torch.float64, 200), (torch.float64, 500),
    (torch.float32, -60), (torch.float32, -30), (torch.float32, 30), (torch.float32, 60),
])
@pytest.mark.parametrize("kernel", ["chord", "products-only"])
def test_alternating_gram_factor_is_scale_free_over_the_whole_range(dtype, exponent, kernel):
    # Phi(sT) = Phi(T), but cTc is T's scale squared: points of 2^+-500 (float64) and 2^+-60
    # (float32) gave Phi = 0 (residual 1) or a non-finite Phi, and products_only_rsqrt declined
    def rsqrt(t):
        if kernel == "chord":
            return chord_rsqrt(t)[0]
        found = products_only_rsqrt(t)
        return None if found is None else found[0]

    g = torch.Generator().manual_seed(9)
    manifold = DGram()
    w = manifold.random(9, 4, generator=g, dtype=torch.float64)  # (9, 4)
    y = w + 1e-3 * manifold.proju(w, torch.randn(9, 4, generator=g, dtype=torch.float64))
    y = y.to(dtype)
    phi = alternating_gram_factor(y.mT @ y, rsqrt)  # (4, 4) at unit scale
    scaled = y * 2.0**exponent  # exact
    phi_scaled = alternating_gram_factor(scaled.mT @ scaled, rsqrt)
    assert phi_scaled is not None
    eps = torch.finfo(dtype).eps
    assert torch.allclose(phi_scaled, phi, rtol=0.0, atol=8 * eps * float(phi.abs().max()))
    ok, reason = manifold.check_point_on_manifold(scaled @ phi_scaled, explain=True)
    assert ok, reason
