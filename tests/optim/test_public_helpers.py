"""Small public helpers of manifoldlib.optim: role classification, RolePolicy, SteepestInfo, the functional core."""

from __future__ import annotations

import torch
from core_step import core_step  # pytest puts this folder on sys.path
from torch import nn

from manifoldlib.manifolds import Stiefel
from manifoldlib.optim import (
    MUON_MANIFOLDS,
    ManifoldMuon,
    RolePolicy,
    SteepestInfo,
    default_classifier,
    is_hidden_matrix,
    steepest_direction,
)


def test_muon_manifolds_are_exactly_the_accepted_group_manifolds():
    assert set(MUON_MANIFOLDS) == {"euclidean", "stiefel", "dgram", "oblique"}
    for name in MUON_MANIFOLDS:
        ManifoldMuon([nn.Parameter(torch.randn(6, 4))], manifold=name)


def test_default_classifier_reads_path_components_not_substrings():
    lin = nn.Linear(4, 4)
    assert default_classifier("blocks.0.attn.q", lin) == "attn"
    assert default_classifier("blocks.0.mlp.fc", lin) == "mlp"
    assert default_classifier("blocks.0.attnx.q", lin) is None   # a component, not a substring
    assert default_classifier("head", lin) is None


def test_is_hidden_matrix_excludes_embeddings_heads_and_vectors():
    emb, lin = nn.Embedding(10, 4), nn.Linear(4, 4)
    assert is_hidden_matrix("blocks.0.attn.q.weight", lin, lin.weight)
    assert not is_hidden_matrix("blocks.0.attn.q.bias", lin, lin.bias)
    assert not is_hidden_matrix("wte.weight", emb, emb.weight)
    assert not is_hidden_matrix("lm_head.weight", lin, lin.weight)


def test_role_policy_assigns_by_role_and_takes_a_classifier():
    lin = nn.Linear(4, 4)
    policy = RolePolicy(attn="stiefel", mlp="dgram", other=None)
    assert policy("blocks.0.attn.q.weight", lin, lin.weight) == "stiefel"
    assert policy("blocks.0.mlp.fc.weight", lin, lin.weight) == "dgram"
    assert policy("blocks.0.gate.weight", lin, lin.weight) is None
    custom = policy.with_classifier(lambda name, module: "attn" if "gate" in name else None)
    assert custom("blocks.0.gate.weight", lin, lin.weight) == "stiefel"


def test_steepest_info_reports_the_solve():
    g = torch.Generator().manual_seed(3)
    w = torch.linalg.qr(torch.randn(12, 4, generator=g, dtype=torch.float64)).Q
    grad = torch.randn(12, 4, generator=g, dtype=torch.float64)
    a, info = steepest_direction(w, grad, "stiefel", tol=1e-6, return_info=True)
    assert isinstance(info, SteepestInfo)
    assert info.converged == (info.residual <= 1e-6)
    assert info.converged and info.iterations >= 0


def test_functional_core_equals_the_optimizer_step():
    g = torch.Generator().manual_seed(5)
    w0 = torch.linalg.qr(torch.randn(10, 4, generator=g)).Q
    grad = torch.randn(10, 4, generator=g)
    param = nn.Parameter(w0.clone())
    opt = ManifoldMuon([param], lr=0.05, manifold="stiefel", project_init=False)
    param.grad = grad.clone()
    opt.step()
    group = opt.param_groups[0]

    # the group keeps its default retraction (ManifoldMuon fuses it then)
    w = core_step(w0, grad, group, Stiefel(retraction="polar", method="gram-eigh"), fuse_retraction=True)
    torch.testing.assert_close(w, param.detach(), rtol=0, atol=0)
    assert float((w - w0).abs().max()) > 0


def test_dual_options_round_trip_through_a_weights_only_load(tmp_path):
    p = nn.Parameter(torch.linalg.qr(torch.randn(12, 4, generator=torch.Generator().manual_seed(1))).Q)
    opt = ManifoldMuon([{"params": [p], "dual": {"tol": 1e-5}}], manifold="stiefel", dual={"max_iter": 40})
    assert opt.param_groups[0]["dual"]["tol"] == 1e-5 and opt.param_groups[0]["dual"]["max_iter"] == 40
    p.grad = torch.randn(12, 4, generator=torch.Generator().manual_seed(2))
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    fresh = ManifoldMuon([p], manifold="stiefel")
    fresh.load_state_dict(loaded)
    assert fresh.param_groups[0]["dual"] == opt.param_groups[0]["dual"]


def test_replaced_keywords_name_their_dual_field():
    import pytest

    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(TypeError, match=r"dual_tol=\.\.\. -> dual=\{'tol': \.\.\.\}"):
        ManifoldMuon([p], manifold="stiefel", dual_tol=1e-4)
    with pytest.raises(TypeError, match="ManifoldMuon parameter group: warm_start"):
        ManifoldMuon([{"params": [p], "warm_start": False}], manifold="stiefel")
    with pytest.raises(TypeError, match="unknown dual option"):
        ManifoldMuon([p], manifold="stiefel", dual={"tolerance": 1e-4})
    with pytest.raises(TypeError, match="unexpected keyword"):
        ManifoldMuon([p], manifold="stiefel", bogus=1)
