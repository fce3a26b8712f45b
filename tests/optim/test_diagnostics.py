"""Diagnostics: constraint residuals, spectral norms, dual statistics, max attention logit."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from manifoldlib import DGram, Stiefel
from manifoldlib.optim import (
    ManifoldMuon,
    build_optimizer,
    constraint_residual,
    max_attention_logit,
    optimizer_diagnostics,
    spectral_norm,
)
from models import GPT, GPTConfig


def test_constraint_residuals():
    g = torch.Generator().manual_seed(0)
    st = Stiefel().random(10, 4, generator=g, dtype=torch.float64)
    dg = DGram().random(10, 4, generator=g, dtype=torch.float64)
    assert constraint_residual(st, "stiefel") <= 1e-12
    assert constraint_residual(st.T, "stiefel") <= 1e-12  # wide: orthonormal rows
    assert constraint_residual(dg, "dgram") <= 1e-12
    assert constraint_residual(2.0 * st, "stiefel") == pytest.approx(3.0 * 2.0, rel=1e-12)  # ||3I||_F
    off = st.clone()
    off[:, 1] += 0.1 * off[:, 0]
    cosine = 0.1 / math.sqrt(1.01)  # of columns 0 and 1: Off(C) holds it twice, C has 4 ones
    expected = math.sqrt(2) * cosine / math.sqrt(4 + 2 * cosine**2)  # ||Off(C)||_F / ||C||_F
    assert constraint_residual(off, "dgram") == pytest.approx(expected, rel=1e-12)
    off[:, 1] *= 1e-6  # column by column scale free: a small column is not drowned by the others
    assert constraint_residual(off, "dgram") == pytest.approx(expected, rel=1e-12)
    assert constraint_residual(off, "euclidean") == 0.0
    with pytest.raises(ValueError, match="unknown manifold 'sphere'"):
        constraint_residual(st, "sphere")


def test_spectral_norm():
    d = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=torch.float64))
    assert spectral_norm(d) == pytest.approx(5.0, rel=1e-12)


def test_optimizer_diagnostics_rows():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8, connection="pre-ln"))
    opt = build_optimizer(model, "hetero", lr=0.02)
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    _, loss = model(idx, idx)
    loss.backward()
    opt.step()
    rows = optimizer_diagnostics(opt)
    assert set(rows) == {f"blocks.0.attn.{k}.weight" for k in "qkvo"} | {"blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight"}
    for name, row in rows.items():
        assert set(row) == {"manifold", "residual", "dual_iterations", "dual_residual", "retraction_residual",
                            "skipped_steps", "spectral_norm"}
        assert row["manifold"] == ("stiefel" if ".attn." in name else "dgram")
        # the sync-free retraction may leave the point off by about its own residual
        assert row["residual"] <= max(1e-5, 2 * row["retraction_residual"]), (name, row)
        # plain Python numbers read from the step's device tensors
        assert type(row["dual_iterations"]) is int and row["dual_iterations"] >= 0
        assert type(row["dual_residual"]) is float and 0.0 <= row["dual_residual"] <= 1.0
        assert type(row["retraction_residual"]) is float and 0.0 <= row["retraction_residual"] <= 1e-2
        assert row["skipped_steps"] == 0
        if row["manifold"] == "stiefel":
            assert row["spectral_norm"] == pytest.approx(1.0, abs=1e-4)
    assert set(optimizer_diagnostics(opt, spectral=False)["blocks.0.mlp.fc.weight"]) == set(row) - {"spectral_norm"}


def test_optimizer_diagnostics_of_a_plain_manifold_muon_name_groups_and_params():
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(12, 4, generator=gen)), nn.Parameter(torch.randn(6, 6, generator=gen))]
    opt = ManifoldMuon([{"params": params[:1], "manifold": "oblique"}, {"params": params[1:]}], lr=0.02)
    rows = optimizer_diagnostics(opt)  # before any step: no errors; nothing measured yet reads NaN, not 0
    assert rows["group0.param0"]["dual_iterations"] == 0 and rows["group1.param0"]["manifold"] == "euclidean"
    for row in rows.values():
        assert math.isnan(row["dual_residual"]) and math.isnan(row["retraction_residual"]), row
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    rows = optimizer_diagnostics(opt)
    assert set(rows) == {"group0.param0", "group1.param0"}
    assert rows["group0.param0"]["residual"] <= 1e-5 and rows["group0.param0"]["dual_residual"] > 0
    assert rows["group1.param0"]["residual"] == 0.0 and rows["group1.param0"]["dual_iterations"] == 0
    assert math.isnan(rows["group1.param0"]["dual_residual"])  # Euclidean: Muon's step, no dual


class _TinyAttn(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x):
        return x + 0.0 * self.q(x) + 0.0 * self.k(x)


class _TinyModel(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.embed = nn.Embedding(16, d)
        self.block = nn.ModuleDict({"attn": _TinyAttn(d, 2)})

    def forward(self, idx):
        return self.block["attn"](self.embed(idx))


def test_max_attention_logit_hooks_match_a_direct_computation():
    torch.manual_seed(0)
    model = _TinyModel()
    idx = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(2))
    got = max_attention_logit(model, idx)
    x = model.embed(idx)
    q = model.block["attn"].q(x).view(2, 5, 2, 4).transpose(1, 2)
    k = model.block["attn"].k(x).view(2, 5, 2, 4).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)).abs() / 2.0
    expected = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), 0).amax()
    assert got.shape == (1,)
    torch.testing.assert_close(got[0], expected.detach(), rtol=1e-6, atol=0)


def test_max_attention_logit_uses_the_gpt_method():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8, connection="pre-ln"))
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    got = max_attention_logit(model, idx)
    assert got.shape == (2,)
    torch.testing.assert_close(got, model.max_attention_logit(idx))
    assert bool((got > 0).all())
