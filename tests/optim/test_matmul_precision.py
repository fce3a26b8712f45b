"""The solves and retractions of Manifold Muon run with IEEE float32 products, and leave the
process's own TF32 / bfloat16 matmul setting exactly as they found it.

On the development CPU a ``"medium"`` float32 product differs from an IEEE one by a few 1e-7 only,
so these tests check the mechanism (the precision seen inside the solve, the setting after it);
the harm it prevents was measured on an H200 (see :mod:`manifoldlib.optim.execution`).
"""

from __future__ import annotations

import pytest
import torch
from dispatch_ops import (  # tests/dispatch_ops.py (tests/ is on sys.path)
    ProductRecorder,
    full_precision_now,
)

from manifoldlib.optim import ManifoldMuon, steepest_direction
from manifoldlib.optim.execution import ieee_float32_matmul

#: torch's per-backend float32 matmul precision handles (cuBLAS, oneDNN; torch >= 2.9)
BACKENDS = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)


@pytest.fixture(autouse=True)
def _restore_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def _settings() -> tuple:
    """Every way a program can read the setting; a getter that raises reads as 'raises'."""
    readers = [
        torch.get_float32_matmul_precision,
        lambda: torch.backends.cuda.matmul.allow_tf32,
        *[(lambda h=h: h.fp32_precision) for h in BACKENDS],
    ]
    out = []
    for read in readers:
        try:
            out.append(read())
        except RuntimeError:
            out.append("raises")
    return tuple(out)


SETUPS = {
    "legacy high": lambda: torch.set_float32_matmul_precision("high"),
    "legacy medium": lambda: torch.set_float32_matmul_precision("medium"),
    "legacy allow_tf32": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "new api tf32": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "new api onednn bf16": lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
    "untouched": lambda: None,
}


def test_torch_has_the_per_backend_precision_handles():
    assert all(hasattr(h, "fp32_precision") for h in BACKENDS)  # torch >= 2.9, the declared minimum


@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_block_runs_in_ieee_and_the_setting_comes_back_unchanged(setup):
    SETUPS[setup]()
    before = _settings()
    with ieee_float32_matmul():
        assert full_precision_now()
    assert _settings() == before


def test_the_setting_comes_back_after_an_exception():
    torch.set_float32_matmul_precision("medium")
    before = _settings()
    with pytest.raises(ZeroDivisionError), ieee_float32_matmul():
        _ = 1 / 0
    assert _settings() == before
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"


def test_the_recorder_sees_a_product_outside_the_solves():
    # the check below could fail: a float32 product under "high" is recorded as not IEEE
    torch.set_float32_matmul_precision("high")
    with ProductRecorder() as rec:
        _ = torch.randn(4, 4) @ torch.randn(4, 4)
        with ieee_float32_matmul():
            _ = torch.randn(4, 4) @ torch.randn(4, 4)
    assert rec.seen == [("mm", False), ("mm", True)]


@pytest.mark.parametrize("spectral", ["eigh", "products"])
def test_steepest_direction_solves_and_forms_its_answer_in_ieee_float32(spectral):
    torch.set_float32_matmul_precision("medium")
    before = _settings()
    gen = torch.Generator().manual_seed(0)
    w = torch.linalg.qr(torch.randn(64, 16, generator=gen))[0]
    g = torch.randn(64, 16, generator=gen)
    with ProductRecorder() as rec:  # gap_tol=None: a float32 solve (a certified one runs in float64)
        steepest_direction(w, g, "stiefel", msign_method="jordan5", tol=1e-3, spectral=spectral, gap_tol=None)
    products = rec.names
    assert products.count("mm") + products.count("bmm") >= 5, products
    assert ("_linalg_eigh" in products) == (spectral == "eigh"), products
    assert all(ieee for _, ieee in rec.seen), rec.seen  # the setup, the solve and the m x n answer X R
    assert _settings() == before


@pytest.mark.parametrize("shape", [(48, 12), (24, 20)])  # tall (fused retraction) and near-square (polar)
def test_manifold_muon_steps_and_projects_in_ieee_float32(shape):
    torch.set_float32_matmul_precision("high")
    before = _settings()
    p = torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(1)))
    with ProductRecorder() as rec:
        opt = ManifoldMuon([p], lr=0.02, manifold="stiefel")  # projects p onto the Stiefel manifold
    assert rec.seen and all(ieee for _, ieee in rec.seen), rec.seen
    p.grad = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    before_step = p.detach().clone()
    with ProductRecorder() as rec:
        opt.step()
    assert len(rec.seen) >= 10 and all(ieee for _, ieee in rec.seen), rec.seen
    assert not torch.equal(p.detach(), before_step)  # it stepped (and retracted: below)
    gram = p.detach().mT @ p.detach()
    assert float((gram - torch.eye(shape[1])).abs().max()) <= 1e-5
    assert _settings() == before


def _two_matrix_steps(manifold, spectral, setup):
    """Two (96, 32) matrices (one bank) stepped twice under the caller's ``setup``."""
    g = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(96, 32, generator=g)) for _ in range(2)]
    opt = ManifoldMuon(params, manifold=manifold, lr=0.05, dual={"spectral": spectral})
    SETUPS[setup]()
    before = _settings()
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    assert _settings() == before  # left as it was
    assert torch.is_grad_enabled()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("spectral", ["eigh", "products"])
@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("setup", ["new api onednn bf16", "legacy medium"])
def test_a_reduced_precision_setting_of_the_caller_does_not_reach_the_step(manifold, spectral, setup):
    # the step under a bfloat16 / TF32 matmul setting is the IEEE step, bit for bit
    reduced = _two_matrix_steps(manifold, spectral, setup)
    torch.set_float32_matmul_precision("highest")
    for h in BACKENDS:
        h.fp32_precision = "ieee"
    ieee = _two_matrix_steps(manifold, spectral, "untouched")
    assert all(torch.equal(a, b) for a, b in zip(reduced, ieee))
