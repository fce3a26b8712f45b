"""Product-only inverse square roots of nearly diagonal Gram matrices (functional.gram_rsqrt)."""

from __future__ import annotations

import sys

import pytest
import torch

from dispatch_ops import ProductRecorder  # tests/dispatch_ops.py (tests/ is on sys.path)

from manifoldlib.functional import msign
from manifoldlib.functional.gram_rsqrt import (
    CHORD_TOL_EPS,
    RSQRT_TAYLOR,
    near_diagonal_rsqrt,
    near_scalar_rsqrt,
)

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


@pytest.mark.parametrize(
    ("dtype", "rho"),
    [(torch.float64, 1e-5), (torch.float64, 3e-4), (torch.float32, 1e-3), (torch.float32, 3e-3), (torch.float32, 2e-2)],
    ids=str,
)
def test_near_scalar_series_is_within_its_truncation_bound(dtype, rho):
    eps = torch.finfo(dtype).eps
    t = (2.5 * (torch.eye(40, dtype=torch.float64) + _symmetric_off_diagonal(40, rho, seed=1))).to(dtype)
    y, bound = near_scalar_rsqrt(t)
    assert y.dtype == dtype
    ref = _rsqrt_reference(t)  # of the rounded input
    error = _spectral(y.double() - ref) / _spectral(ref)
    assert error <= bound + 20 * eps
    # the bound is the one the docstring states: the first dropped term of the fewest that reach eps
    terms = next(k for k in range(2, len(RSQRT_TAYLOR)) if abs(RSQRT_TAYLOR[k]) * rho**k / (1 - rho) <= eps)
    expected = max(abs(RSQRT_TAYLOR[terms]) * rho**terms / (1 - rho), eps * (1 + rho) / (1 - rho))
    assert bound == pytest.approx(expected, rel=1e-3)  # (rho is measured on the rounded input)


def test_near_scalar_series_declines_what_six_terms_cannot_reach():
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
