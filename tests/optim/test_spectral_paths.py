"""The two spectral paths of the reduced dual: one eigh per evaluation, or Gram-form products only.

The products path (``spectral="products"``, what ``"auto"`` picks on CUDA and on the CPU below
:data:`~manifoldlib.optim.execution.EIGH_MIN_COLUMNS` columns) must reach the independent
optimum of ``test_steepest.py`` (tested with the other plain-dual updates in
``test_dual_updates.py``), follow the eigh path's Barzilai–Borwein iterates, never factorize a
matrix in its plain iterations (observed at the dispatcher, ``tests/dispatch_ops.py``), hand a
stalled solve to the (eigh) smoothed dual when it may stop early, and be reachable from
:class:`ManifoldMuon`.
"""

from __future__ import annotations

import pytest
import torch
from dispatch_ops import ProductRecorder  # tests/dispatch_ops.py (tests/ is on sys.path)
from test_steepest import _instance

from manifoldlib.optim import ManifoldMuon, steepest_direction, tangent_residual
from manifoldlib.optim.execution import EIGH_MIN_COLUMNS, SPECTRAL_PATHS, Execution


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("shape", [(40, 10), (10, 40)])
def test_products_path_takes_the_bb_iterates_of_the_eigh_path(manifold, shape):
    # same map R = psi(S) in exact arithmetic, same BB rule: the same iterates, to rounding
    w, g = _instance(max(shape), min(shape), manifold, seed=5)
    if shape[0] < shape[1]:
        w, g = w.mT.contiguous(), g.mT.contiguous()
    kw = {"tol": 1e-7, "max_iter": 200, "msign_method": "jordan5", "smoothing": None, "return_info": True}
    a_eigh, eigh = steepest_direction(w, g, manifold, spectral="eigh", update="bb", **kw)
    a_prod, prod = steepest_direction(w, g, manifold, spectral="products", **kw)
    assert eigh.stages == prod.stages == ("bb",)
    assert prod.iterations == eigh.iterations and prod.converged
    assert torch.allclose(torch.tensor(prod.history), torch.tensor(eigh.history), rtol=1e-8, atol=1e-12)
    assert a_prod.shape == shape
    assert float((a_prod - a_eigh).norm() / a_eigh.norm()) <= 1e-10


def _dominant(manifold):
    w, g = _instance(512, 128, "dgram" if manifold == "dgram" else "stiefel", seed=2, dtype=torch.float32)
    if manifold == "oblique":
        w = w / w.norm(dim=0)
    return w, g + 4.0 * torch.randn(512, 1, generator=torch.Generator().manual_seed(0))  # a dominant direction


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("sync_free", [False, True])
def test_products_path_factorizes_nothing(manifold, sync_free):
    # Oblique's point is W = QF with F triangular: its one QR is the setup, not an iteration
    w, g = _dominant(manifold)
    with ProductRecorder() as recorder:
        a, info = steepest_direction(w, g, manifold, tol=1e-3, max_iter=60, msign_method="jordan5", patience=None,
                                     spectral="products", sync_free=sync_free, return_info=True)
    assert recorder.factorizations() == (["qr"] if manifold == "oblique" else [])
    assert "mm" in recorder.names or "bmm" in recorder.names  # the recorder saw the products
    assert info.converged and info.iterations > 0 and info.stages == ("bb",)
    assert float(tangent_residual(w, a, manifold)) <= 1e-3  # checked independently, in float32


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_a_manifold_muon_step_on_the_products_path_factorizes_nothing(manifold):
    w, g = _dominant(manifold)
    p = torch.nn.Parameter(w.clone())
    opt = ManifoldMuon([p], manifold=manifold, lr=0.02, dual={"spectral": "products"})
    for _ in range(2):  # the second step has a warm start and a momentum buffer
        p.grad = g.clone()
        with ProductRecorder() as recorder:
            opt.step()
        assert recorder.factorizations() == []
    assert int(opt.state[p]["dual_iterations"]) > 0


def test_a_stalled_products_solve_continues_on_the_smoothed_dual():
    # a low-rank gradient on a tall DGram matrix: the plain dual needs more than 6 BB steps
    w, g = _instance(64, 16, "dgram", seed=0, lowrank=True)
    kw = {"tol": 1e-5, "max_iter": 6, "msign_method": "jordan5", "return_info": True, "gap_tol": None}
    _, plain = steepest_direction(w, g, "dgram", spectral="products", smoothing=None, **kw)
    a, auto = steepest_direction(w, g, "dgram", spectral="products", **kw)
    assert not plain.converged and plain.stages == ("bb",)
    assert auto.converged and auto.stages == ("bb", "smoothed")
    assert auto.iterations > kw["max_iter"]  # the Newton steps came after
    assert float(tangent_residual(w, a, "dgram")) <= 1e-5


def test_a_sync_free_products_solve_does_not_continue_on_the_smoothed_dual():
    # the same instance without host reads: a fixed iteration count, the best plain iterate
    w, g = _instance(64, 16, "dgram", seed=0, lowrank=True)
    kw = {"tol": 1e-5, "max_iter": 6, "msign_method": "jordan5", "return_info": True, "gap_tol": None}
    a, info = steepest_direction(w, g, "dgram", spectral="products", sync_free=True, **kw)
    _, early = steepest_direction(w, g, "dgram", spectral="products", smoothing=None, **kw)
    assert info.stages == ("bb",) and info.iterations == kw["max_iter"] and not info.converged
    assert torch.allclose(torch.tensor(info.history), torch.tensor(early.history), rtol=1e-9, atol=0)
    assert info.residual == pytest.approx(min(info.history), rel=1e-9)
    assert info.residual == pytest.approx(float(tangent_residual(w, a, "dgram")), rel=1e-6)


def test_products_path_converges_on_a_mostly_normal_gradient():
    # G = W S + 1e-3 tangent noise, e.g. a gradient dominated by an L2 term on Stiefel
    w, _ = _instance(40, 10, "stiefel", seed=21)
    gen = torch.Generator().manual_seed(21)
    sym = torch.randn(10, 10, generator=gen, dtype=torch.float64)
    tangent = torch.randn(40, 10, generator=gen, dtype=torch.float64)
    tangent = tangent - w @ (0.5 * (w.mT @ tangent + tangent.mT @ w))
    normal = w @ (sym + sym.mT)
    g = normal + 1e-3 * normal.norm() * tangent / tangent.norm()
    kw = {"msign_method": "polar-express", "tol": 1e-3, "max_iter": 30, "smoothing": None, "return_info": True}
    _, eigh = steepest_direction(w, g, "stiefel", spectral="eigh", **kw)
    assert eigh.converged  # the scale-invariant Anderson steps
    _, products = steepest_direction(w, g, "stiefel", spectral="products", **kw)
    assert products.converged, products.residual


def test_auto_takes_products_on_cuda_and_narrow_cpu_matrices_and_the_eigh_elsewhere():
    def resolved(spectral, device, columns=None):
        return Execution.resolve(device, spectral=spectral, bfloat16_native=False, columns=columns).spectral

    assert EIGH_MIN_COLUMNS == 256
    assert resolved("auto", torch.device("cpu")) == "eigh"
    assert resolved("auto", torch.device("cpu"), EIGH_MIN_COLUMNS - 1) == "products"
    assert resolved("auto", torch.device("cpu"), EIGH_MIN_COLUMNS) == "eigh"
    assert resolved("auto", torch.device("cuda", 0)) == "products"
    assert resolved("auto", torch.device("cuda", 0), EIGH_MIN_COLUMNS) == "products"
    for path in ("eigh", "products"):
        assert resolved(path, torch.device("cpu")) == path
        assert resolved(path, torch.device("cpu"), 8) == path
    assert SPECTRAL_PATHS == ("auto", "eigh", "products")
    assert Execution.resolve("cpu", spectral="products", bfloat16_native=False).sync_free
    assert not Execution.resolve("cpu", spectral="eigh", bfloat16_native=False).sync_free
    assert not Execution.resolve("cpu", spectral="products", bfloat16_native=False, sync_free=False).sync_free


@pytest.mark.parametrize("m,n,path,update", [(24, 6, "products", "bb"), (768, EIGH_MIN_COLUMNS, "eigh", "anderson")])
def test_steepest_direction_auto_equals_the_path_it_resolves_to(m, n, path, update):
    w, g = _instance(m, n, "stiefel", seed=3, dtype=torch.float32)
    kw = {"tol": 1e-3, "max_iter": 300, "msign_method": "jordan5", "return_info": True}
    a_auto, auto = steepest_direction(w, g, "stiefel", **kw)
    a_path, explicit = steepest_direction(w, g, "stiefel", spectral=path, **kw)
    assert auto.stages == explicit.stages == (update,)
    assert auto.history == explicit.history and auto.iterations > 0
    assert torch.equal(a_auto, a_path)


def test_bad_spectral_options_are_refused():
    w, g = _instance(12, 4, "stiefel", seed=0)
    with pytest.raises(ValueError, match="dual spectral must be one of auto, eigh, products, got 'cholesky'"):
        steepest_direction(w, g, msign_method="jordan5", spectral="cholesky")
    with pytest.raises(ValueError, match=r"update='anderson' needs the eigenbasis .* got spectral='products'"):
        steepest_direction(w, g, msign_method="jordan5", spectral="products", update="anderson")
    p = torch.nn.Parameter(w.clone())
    with pytest.raises(ValueError, match="dual spectral must be one of auto, eigh, products, got 'qr'"):
        ManifoldMuon([p], manifold="stiefel", dual={"spectral": "qr"})
    with pytest.raises(ValueError, match="got spectral='products'"):
        ManifoldMuon([p], manifold="stiefel", dual={"spectral": "products", "update": "anderson"})
    with pytest.raises(ValueError, match="dual sync_free must be None, True or False, got 'yes'"):
        ManifoldMuon([p], manifold="stiefel", dual={"sync_free": "yes"})
    with pytest.raises(ValueError, match="Execution.spectral must be 'eigh' or 'products', got 'auto'"):
        Execution(spectral="auto")
    with pytest.raises(ValueError, match="spectral must be one of auto, eigh, products, got 'qr'"):
        Execution.resolve("cpu", spectral="qr")
    with pytest.raises(ValueError, match="ns_dtype must be one of auto, bfloat16, float32, got 'fp8'"):
        Execution.resolve("cpu", ns_dtype="fp8")


def _trajectory(manifold: str, **options) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter(torch.randn(48, 12, generator=gen, dtype=torch.float64))
    target = torch.randn(48, 12, generator=gen, dtype=torch.float64)
    opt = ManifoldMuon([p], lr=0.05, manifold=manifold, dual={"tol": 1e-6, "max_iter": 200, **options})
    iterations = []
    for _ in range(5):
        p.grad = p.detach() - target
        opt.step()
        iterations.append(int(opt.state[p]["dual_iterations"]))
    return p.detach().clone(), iterations


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_manifold_muon_on_the_products_path_takes_the_bb_steps(manifold):
    # sync-free (a fixed 200 iterations, converged matrices masked), early-stopping products and
    # eigh BB steps: the same iterates, so the same iteration counts and the same trajectory
    w_sync, it_sync = _trajectory(manifold, spectral="products")
    w_prod, it_prod = _trajectory(manifold, spectral="products", sync_free=False)
    w_eigh, it_eigh = _trajectory(manifold, spectral="eigh", update="bb")
    assert it_sync == it_prod == it_eigh and sum(it_prod) > 0
    assert max(it_sync) < 200  # the masks stopped counting once a step converged
    assert torch.allclose(w_sync, w_prod, rtol=0, atol=1e-12)
    assert torch.allclose(w_prod, w_eigh, rtol=0, atol=1e-9)
