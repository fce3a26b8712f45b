"""The public code's Manifold Muon (models.reference_muon): its DGram "retraction" against a
reference written here from its description, its inexact dual against the library's exact one,
and its Euclidean step by hand."""

from __future__ import annotations

import pytest
import torch

from manifoldlib.functional import msign
from manifoldlib.optim import steepest_direction
from models.reference_muon import ReferenceManifoldMuon, reference_dual, sorted_scale_polar


def _described(y: torch.Tensor) -> torch.Tensor:
    """The description, through an eigendecomposition instead of an SVD: Y^T Y = V S^2 V^T,
    the polar factor Y V S^-1 V^T, its column j scaled by the j-th largest singular value."""
    s2, v = torch.linalg.eigh(y.mT @ y)  # ascending
    s = s2.clamp_min(0).sqrt()
    polar = y @ v @ torch.diag(1 / s) @ v.mT
    return polar * s.flip(-1).unsqueeze(-2)


def test_the_dgram_map_is_the_polar_factor_with_sorted_singular_values():
    y = torch.randn(40, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sorted_scale_polar(y), _described(y), rtol=1e-10, atol=1e-12)


def test_the_dgram_map_sorts_a_points_column_norms_so_it_is_no_retraction():
    q = torch.linalg.qr(torch.randn(30, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))[0]
    unsorted = q * torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)
    moved = sorted_scale_polar(unsorted)
    torch.testing.assert_close(moved.norm(dim=0), torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64))
    assert (moved - unsorted).norm() > 1.0  # R(W) != W
    ordered = q * torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(sorted_scale_polar(ordered), ordered, rtol=1e-10, atol=1e-12)


def test_the_inexact_dual_approaches_the_exact_steepest_direction_with_more_steps():
    gen = torch.Generator().manual_seed(2)
    w = torch.linalg.qr(torch.randn(64, 16, dtype=torch.float64, generator=gen))[0]
    g = torch.randn(64, 16, dtype=torch.float64, generator=gen)
    exact = (g * steepest_direction(w, g, "stiefel")).sum()
    violation = {}
    for steps in (20, 400):
        a, ran = reference_dual(w, g, "stiefel", steps, 0.1, 0.0)
        assert ran == steps
        torch.testing.assert_close(a.mT @ a, torch.eye(16, dtype=torch.float64), atol=1e-6, rtol=0)  # msign
        violation[steps] = float((w.mT @ a + a.mT @ w).norm())
        if steps == 400:
            assert float((g * a).sum()) == pytest.approx(float(exact), rel=1e-4)
    assert violation[400] < violation[20] / 10  # 20 steps (the paper's runs) are far from tangent


def test_a_euclidean_step_is_sum_form_nesterov_and_polar_express():
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(12, 8, generator=gen)
    grads = [torch.randn(12, 8, generator=gen) for _ in range(2)]
    p = torch.nn.Parameter(w0.clone())
    opt = ReferenceManifoldMuon([p], lr=0.05, momentum=0.9, weight_decay=0.1)
    w, buf = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        p.grad = g
        opt.step()
        buf = 0.9 * buf + g
        w = w * (1 - 0.05 * 0.1) - 0.05 * msign(g + 0.9 * buf, "polar-express")
    torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
def test_a_manifold_step_keeps_wide_and_tall_matrices_on_their_manifold(manifold):
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(24, 8, generator=gen)), torch.nn.Parameter(torch.randn(8, 24, generator=gen))]
    opt = ReferenceManifoldMuon([{"params": params, "manifold": manifold}], lr=0.02)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    for p in params:
        tall = p.detach() if p.size(0) > p.size(1) else p.detach().mT
        gram = tall.mT @ tall
        off = gram - torch.diag(torch.diag(gram))
        if manifold != "oblique":  # Oblique constrains the column norms only
            assert off.abs().max() < 1e-4 * gram.diag().max()
        if manifold != "dgram":
            torch.testing.assert_close(gram.diag(), torch.ones(8), atol=1e-4, rtol=0)
    assert all(1 <= opt.state[p]["dual_steps"] <= 20 for p in params)


def test_bad_input_is_refused_naming_it():
    with pytest.raises(ValueError, match="unknown manifold 'sphere'"):
        ReferenceManifoldMuon([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "manifold": "sphere"}])
    with pytest.raises(ValueError, match=r"2-D matrices, got shape \(4,\)"):
        ReferenceManifoldMuon([torch.nn.Parameter(torch.randn(4))])
    with pytest.raises(ValueError, match="dual_steps must be an int >= 1, got 0"):
        ReferenceManifoldMuon([torch.nn.Parameter(torch.randn(4, 4))], dual_steps=0)


def test_the_trainer_runs_the_reference_recipe_and_resumes_it_exactly(tmp_path):
    from models.config import ConfigError, build_config
    from models.train import build_model, build_train_optimizer, main, read_metrics

    cfg = build_config("smoke", overrides={"optimizer": "manifold-muon", "policy": "hetero", "muon_recipe": "reference"})
    model = build_model(cfg, vocab_size=256)
    opt, _ = build_train_optimizer(model, cfg)
    muon = opt.optimizers["muon"]
    assert isinstance(muon, ReferenceManifoldMuon)
    assert {g["manifold"] for g in muon.param_groups} == {"stiefel", "dgram"}  # hetero: attention, MLP
    assert all(g["weight_decay"] == 0.0 for g in muon.param_groups)  # constrained: no decay, as the code
    with pytest.raises(ConfigError, match="muon_recipe='reference' runs in one process"):
        build_train_optimizer(model, cfg, world_size=2)
    common = ["--preset", "smoke", "--progress", "off", "--steps", "8", "--eval_interval", "4", "--log_interval", "2",
              "--optimizer", "manifold-muon", "--policy", "hetero", "--muon_recipe", "reference", "--lr", "0.02"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--stop_at", "4", "--out", str(tmp_path / "b")]) == 0
    assert main(["--resume", "--out", str(tmp_path / "b")]) == 0
    a, b = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
