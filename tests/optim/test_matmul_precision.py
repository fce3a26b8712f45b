"""The solves and retractions of Manifold Muon run with IEEE float32 products, and leave the
process's own TF32 / bfloat16 matmul setting exactly as they found it.

On the development CPU a ``"medium"`` float32 product differs from an IEEE one by a few 1e-7 only,
so these tests check the mechanism (the precision seen inside the solve, the setting after it);
the harm it prevents was measured on an H200 (see :mod:`manifoldlib.optim.matmul_precision`).
"""

from __future__ import annotations

import sys

import pytest
import torch

from manifoldlib.manifolds.stiefel import Stiefel
from manifoldlib.optim import ManifoldMuon, dual_problem, steepest_direction
from manifoldlib.optim.matmul_precision import FULL_PRECISION, _matmul_backends, ieee_float32_matmul
from manifoldlib.retractions import stiefel as stiefel_retractions


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
        *[(lambda h=h: h.fp32_precision) for h in _matmul_backends()],
    ]
    out = []
    for read in readers:
        try:
            out.append(read())
        except RuntimeError:
            out.append("raises")
    return tuple(out)


def _full_precision_now() -> bool:
    return all(h.fp32_precision in FULL_PRECISION for h in _matmul_backends())


SETUPS = {
    "legacy high": lambda: torch.set_float32_matmul_precision("high"),
    "legacy medium": lambda: torch.set_float32_matmul_precision("medium"),
    "legacy allow_tf32": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "new api tf32": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "new api onednn bf16": lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
    "untouched": lambda: None,
}


def test_torch_has_the_per_backend_precision_handles():
    assert len(_matmul_backends()) == 2  # cuBLAS and oneDNN (torch >= 2.9, the declared minimum)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_block_runs_in_ieee_and_the_setting_comes_back_unchanged(setup):
    SETUPS[setup]()
    before = _settings()
    with ieee_float32_matmul():
        assert _full_precision_now()
    assert _settings() == before


def test_the_setting_comes_back_after_an_exception():
    torch.set_float32_matmul_precision("medium")
    before = _settings()
    with pytest.raises(ZeroDivisionError), ieee_float32_matmul():
        _ = 1 / 0
    assert _settings() == before
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"


def test_steepest_direction_solves_in_ieee_float32(monkeypatch):
    seen = []
    real = dual_problem._spectral_gain

    def recording(*args, **kwargs):
        seen.append(_full_precision_now())
        return real(*args, **kwargs)

    monkeypatch.setattr(dual_problem, "_spectral_gain", recording)
    torch.set_float32_matmul_precision("medium")
    before = _settings()
    gen = torch.Generator().manual_seed(0)
    w = torch.linalg.qr(torch.randn(64, 16, generator=gen))[0]
    g = torch.randn(64, 16, generator=gen)
    steepest_direction(w, g, "stiefel", msign_method="jordan5", tol=1e-3)
    assert seen and all(seen)
    assert _settings() == before


def test_manifold_muon_steps_and_projects_in_ieee_float32(monkeypatch):
    seen = {"projection": [], "solve": [], "retraction": []}
    real_projx, real_gain, real_polar = Stiefel.projx, dual_problem._spectral_gain, stiefel_retractions.stiefel_polar

    def projx(self, x):
        seen["projection"].append(_full_precision_now())
        return real_projx(self, x)

    def gain(*args, **kwargs):
        seen["solve"].append(_full_precision_now())
        return real_gain(*args, **kwargs)

    def polar(*args, **kwargs):
        seen["retraction"].append(_full_precision_now())
        return real_polar(*args, **kwargs)

    monkeypatch.setattr(Stiefel, "projx", projx)
    monkeypatch.setattr(dual_problem, "_spectral_gain", gain)
    monkeypatch.setattr(stiefel_retractions, "stiefel_polar", polar)
    muon_module = sys.modules["manifoldlib.optim.muon_finish"]  # where the step retracts
    real_fused = muon_module.fused_retraction

    def fused(*args, **kwargs):  # a tall matrix's retraction, formed from the solved dual
        seen["retraction"].append(_full_precision_now())
        return real_fused(*args, **kwargs)

    monkeypatch.setattr(muon_module, "fused_retraction", fused)
    torch.set_float32_matmul_precision("high")
    before = _settings()
    p = torch.nn.Parameter(torch.randn(48, 12, generator=torch.Generator().manual_seed(1)))
    opt = ManifoldMuon([p], lr=0.02, manifold="stiefel")  # projects p onto the Stiefel manifold
    p.grad = torch.randn(48, 12, generator=torch.Generator().manual_seed(2))
    opt.step()
    for stage, flags in seen.items():
        assert flags and all(flags), stage
    assert _settings() == before


def test_steepest_direction_forms_its_answer_in_ieee_float32(monkeypatch):
    # the m x n product X R that makes the answer comes after the solve: it must not run in TF32
    seen = []
    real = dual_problem._DualProblem.direction

    def direction(self, state):
        seen.append(_full_precision_now())
        return real(self, state)

    monkeypatch.setattr(dual_problem._DualProblem, "direction", direction)
    torch.set_float32_matmul_precision("high")
    gen = torch.Generator().manual_seed(3)
    w = torch.linalg.qr(torch.randn(64, 16, generator=gen))[0]
    steepest_direction(w, torch.randn(64, 16, generator=gen), "stiefel", msign_method="jordan5", tol=1e-3)
    assert seen == [True]
    assert torch.get_float32_matmul_precision() == "high"
