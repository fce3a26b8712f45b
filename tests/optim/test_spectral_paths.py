"""The two spectral paths of the reduced dual: one eigh per evaluation, or Gram-form products only.

The products path (``spectral="products"``, what ``"auto"`` picks on CUDA) must reach the
independent optimum of ``test_steepest.py`` (tested with the other plain-dual updates in
``test_dual_updates.py``), follow the eigh path's Barzilai–Borwein iterates,
never factorize a matrix in its plain iterations, hand a stalled solve to the (eigh) smoothed
dual, and be reachable from :class:`ManifoldMuon`.
"""

from __future__ import annotations

import pytest
import torch
from test_steepest import _instance

from manifoldlib.optim import ExecutionPolicy, ManifoldMuon, steepest_direction, tangent_residual
from manifoldlib.optim.execution import SPECTRAL_PATHS


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("shape", [(40, 10), (10, 40)])
def test_products_path_takes_the_bb_iterates_of_the_eigh_path(manifold, shape):
    # same map R = psi(S) in exact arithmetic, same BB rule: the same iterates, to rounding
    w, g = _instance(max(shape), min(shape), manifold, seed=5)
    if shape[0] < shape[1]:
        w, g = w.mT.contiguous(), g.mT.contiguous()
    kw = {"tol": 1e-7, "max_iter": 200, "msign_method": "jordan5", "smoothing": None, "return_info": True}
    a_eigh, eigh = steepest_direction(w, g, manifold, spectral="eigh", dual_update="bb", **kw)
    a_prod, prod = steepest_direction(w, g, manifold, spectral="products", **kw)
    assert prod.iterations == eigh.iterations and prod.converged
    assert torch.allclose(torch.tensor(prod.history), torch.tensor(eigh.history), rtol=1e-8, atol=1e-12)
    assert a_prod.shape == shape
    assert float((a_prod - a_eigh).norm() / a_eigh.norm()) <= 1e-10


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_products_path_factorizes_nothing(monkeypatch, manifold):
    def refuse(*args, **kwargs):
        raise AssertionError("a matrix factorization ran on the products path")

    w, g = _instance(512, 128, manifold, seed=2, dtype=torch.float32)
    g = g + 4.0 * torch.randn(512, 1, generator=torch.Generator().manual_seed(0))  # a dominant direction
    for name in ("eigh", "svd", "eigvalsh", "qr", "cholesky"):
        monkeypatch.setattr(torch.linalg, name, refuse)
    a, info = steepest_direction(w, g, manifold, tol=1e-3, max_iter=60, msign_method="jordan5",
                                 spectral="products", return_info=True)
    assert info.converged and info.iterations > 0 and info.stages == ("bb",)
    monkeypatch.undo()
    assert float(tangent_residual(w, a, manifold)) <= 1e-3  # checked independently, in float32


def test_a_stalled_products_solve_continues_on_the_smoothed_dual():
    # a low-rank gradient on a tall DGram matrix: the plain dual needs more than 6 BB steps
    w, g = _instance(64, 16, "dgram", seed=0, lowrank=True)
    kw = {"tol": 1e-5, "max_iter": 6, "msign_method": "jordan5", "return_info": True, "gap_tol": None}
    _, plain = steepest_direction(w, g, "dgram", spectral="products", smoothing=None, **kw)
    a, auto = steepest_direction(w, g, "dgram", spectral="products", **kw)
    assert not plain.converged
    assert auto.converged and len(auto.history) > kw["max_iter"] + 1  # the Newton steps came after
    assert float(tangent_residual(w, a, "dgram")) <= 1e-5


def test_auto_takes_products_on_cuda_and_the_eigh_elsewhere():
    def resolved(spectral, device):
        return ExecutionPolicy.resolve(device, spectral=spectral, bfloat16_native=False).spectral

    assert resolved("auto", torch.device("cpu")) == "eigh"
    assert resolved("auto", torch.device("cuda", 0)) == "products"
    for path in ("eigh", "products"):
        assert resolved(path, torch.device("cpu")) == path
    assert SPECTRAL_PATHS == ("auto", "eigh", "products")
    w, g = _instance(24, 6, "stiefel", seed=3)
    kw = {"tol": 1e-6, "max_iter": 300, "msign_method": "jordan5", "return_info": True}
    _, auto = steepest_direction(w, g, "stiefel", **kw)
    _, eigh = steepest_direction(w, g, "stiefel", spectral="eigh", dual_update="anderson", **kw)
    assert auto.history == eigh.history


def test_bad_spectral_options_are_refused():
    w, g = _instance(12, 4, "stiefel", seed=0)
    with pytest.raises(ValueError, match="unknown spectral 'cholesky'; valid: auto, eigh, products"):
        steepest_direction(w, g, msign_method="jordan5", spectral="cholesky")
    with pytest.raises(ValueError, match="dual_update='anderson' needs the eigenbasis .* resolved to 'products' on cpu"):
        steepest_direction(w, g, msign_method="jordan5", spectral="products", dual_update="anderson")
    p = torch.nn.Parameter(w.clone())
    with pytest.raises(ValueError, match="dual spectral must be one of auto, eigh, products, got 'qr'"):
        ManifoldMuon([p], manifold="stiefel", dual={"spectral": "qr"})
    with pytest.raises(ValueError, match="got spectral='products'"):
        ManifoldMuon([p], manifold="stiefel", dual={"spectral": "products", "update": "anderson"})
    with pytest.raises(ValueError, match="spectral='eigh' disagrees with the execution policy's 'products'"):
        steepest_direction(w, g, msign_method="jordan5", spectral="eigh",
                           execution=ExecutionPolicy(spectral="products"))
    with pytest.raises(ValueError, match="ExecutionPolicy.spectral must be 'eigh' or 'products', got 'auto'"):
        ExecutionPolicy(spectral="auto")
    with pytest.raises(ValueError, match="ns_dtype must be one of bfloat16, float32, auto, got 'fp8'"):
        ExecutionPolicy.resolve("cpu", ns_dtype="fp8")
    with pytest.raises(ValueError, match="workers must be 'auto' or an int >= 1, got 0"):
        ExecutionPolicy.resolve("cpu", workers=0)


def _trajectory(manifold: str, **options) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter(torch.randn(48, 12, generator=gen, dtype=torch.float64))
    target = torch.randn(48, 12, generator=gen, dtype=torch.float64)
    opt = ManifoldMuon([p], lr=0.05, manifold=manifold, dual={"tol": 1e-6, "max_iter": 200, **options})
    iterations = []
    for _ in range(5):
        p.grad = p.detach() - target
        opt.step()
        iterations.append(opt.state[p]["dual_iterations"])
    return p.detach().clone(), iterations


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_manifold_muon_on_the_products_path_takes_the_bb_steps(manifold):
    w_prod, it_prod = _trajectory(manifold, spectral="products")
    w_eigh, it_eigh = _trajectory(manifold, spectral="eigh", update="bb")
    assert it_prod == it_eigh and sum(it_prod) > 0
    assert torch.allclose(w_prod, w_eigh, rtol=0, atol=1e-9)
