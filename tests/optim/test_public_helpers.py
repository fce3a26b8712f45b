"""Small public helpers of manifoldlib.optim: role classification, RolePolicy, SteepestInfo, the functional core."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from manifoldlib.optim import (
    MUON_MANIFOLDS,
    ManifoldMuon,
    RolePolicy,
    SteepestInfo,
    default_classifier,
    is_hidden_matrix,
    manifold_muon,
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
    _, info = steepest_direction(w, grad, "stiefel", tol=1e-6, return_info=True)
    assert isinstance(info, SteepestInfo)
    assert info.converged == (info.residual <= 1e-6)
    assert info.converged and info.iterations >= 0


@pytest.mark.parametrize("manifold", MUON_MANIFOLDS)
def test_functional_core_equals_the_optimizer_step(manifold):
    # manifold_muon with the optimizer's group options (a plain dict) is the optimizer's step, bit
    # for bit; with only some options given, the others take the constructor's defaults
    g = torch.Generator().manual_seed(5)
    param = nn.Parameter(torch.randn(10, 4, generator=g))
    grad = torch.randn(10, 4, generator=g)
    opt = ManifoldMuon([param], lr=0.05, manifold=manifold)
    start = param.detach().clone()  # projected
    param.grad = grad.clone()
    opt.step()
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    for options in (group, {"lr": 0.05, "manifold": manifold}):
        w, state = start.clone(), {}
        manifold_muon([w], [grad.clone()], [torch.zeros_like(w)], [state], options)
        torch.testing.assert_close(w, param.detach(), rtol=0, atol=0)
        assert state.keys() == opt.state[param].keys()
    assert float((param.detach() - start).abs().max()) > 1e-3


def test_functional_core_refuses_bad_options_by_name():
    w = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"layout must be one of out_in, in_out.*'T'"):
        manifold_muon([w], [torch.ones_like(w)], [torch.zeros_like(w)], [{}], {"manifold": "dgram", "layout": "T"})
    with pytest.raises(ValueError, match="unknown manifold 'sphere'"):
        manifold_muon([w], [torch.ones_like(w)], [torch.zeros_like(w)], [{}], {"manifold": "sphere"})


@pytest.mark.parametrize("manifold", ["euclidean", "stiefel"])
def test_functional_core_updates_the_callers_momentum_buffers_in_place(manifold):
    g = torch.Generator().manual_seed(6)
    w = torch.linalg.qr(torch.randn(10, 4, generator=g)).Q
    grad = torch.randn(10, 4, generator=g)
    buf = torch.zeros_like(w)
    manifold_muon([w], [grad], [buf], [{}], {"lr": 0.05, "manifold": manifold, "momentum": 0.9})
    torch.testing.assert_close(buf, 0.1 * grad)  # B <- mu B + (1 - mu) G from B = 0


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


@pytest.mark.parametrize("keyword", ["dual_tol", "retraction_options", "project_init", "distributed",
                                     "shard_strategy", "workers", "batch", "ns_dtype", "layout", "bogus"])
def test_removed_or_moved_keywords_are_refused_by_name(keyword):
    # removed (project_init, workers, batch), renamed (retraction_options -> retraction,
    # distributed / shard_strategy -> distribution) or now group options (ns_dtype, layout)
    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        ManifoldMuon([p], manifold="stiefel", **{keyword: 1})


def test_an_unknown_dual_option_is_refused_listing_the_valid_ones():
    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(TypeError, match=r"unknown dual option\(s\) \['tolerance'\]; valid: .*tol"):
        ManifoldMuon([p], manifold="stiefel", dual={"tolerance": 1e-4})
    with pytest.raises(TypeError, match=r"unknown dual option\(s\) \['tolerance'\]"):
        ManifoldMuon([{"params": [p], "dual": {"tolerance": 1e-4}}], manifold="stiefel")


@pytest.mark.parametrize("key", ["retraction_options", "warm_start", "project_init", "manifol"])
def test_an_unknown_group_key_is_refused_by_name(key):
    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(TypeError, match=key):
        ManifoldMuon([{"params": [p], key: {"method": "svd"}}], manifold="stiefel")


@pytest.mark.parametrize(("key", "value"), [("maximize", True), ("differentiable", True), ("amsgrad", True),
                                            ("betas", (0.9, 0.95))])
def test_another_optimizers_option_that_changes_the_step_is_refused_in_a_group(key, value):
    # kept as an extra key, a group's maximize=True was ignored: the step descended on the loss
    # the user asked to ascend, bit for bit the maximize=False step, without an error
    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(TypeError, match=rf"ManifoldMuon parameter group: {key}=.* is not an option of ManifoldMuon"):
        ManifoldMuon([{"params": [p], key: value}], manifold="stiefel")
    if value is True:  # the flag's default is accepted: it asks for nothing ManifoldMuon lacks
        ManifoldMuon([{"params": [p], key: False}], manifold="stiefel")
