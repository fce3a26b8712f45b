"""The built-in classifier on the naming schemes of real clients, without transformers installed.

nanoGPT's ``GPT`` (``transformer.h.0.attn.c_attn`` as ``nn.Linear``), LLaMA/Mistral names,
``nn.TransformerEncoderLayer`` (``self_attn.in_proj_weight``, ``linear1``/``linear2``), and the
warning that names every hidden matrix sent to the fallback.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from manifoldlib.charts import SEL, apply_chart, merge_charts, split_blocks
from manifoldlib.optim import (
    assign_parameters,
    build_optimizer,
    constraint_residual,
    default_classifier,
)
from manifoldlib.optim.policies import (
    ATTN_NAMES,
    MLP_NAMES,
    ROUTER_NAMES,
    get_policy,
    unclassified_matrices,
    warn_unclassified,
)


class NanoAttention(nn.Module):
    def __init__(self, d, n_head=2):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)   # fused q, k, v: (3d, d)
        self.c_proj = nn.Linear(d, d)
        self.n_head = n_head

    def forward(self, x):  # (B, T, d)
        q, k, v = self.c_attn(x).split(x.size(-1), dim=-1)
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, d))


class NanoMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(nn.functional.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), NanoAttention(d), nn.LayerNorm(d), NanoMLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's module tree: transformer.{wte, wpe, h, ln_f} and a tied lm_head."""

    def __init__(self, vocab=32, d=16, n_layer=2, block=8):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
            h=nn.ModuleList([NanoBlock(d) for _ in range(n_layer)]), ln_f=nn.LayerNorm(d),
        ))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):  # (B, T)
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def _loss(model, idx):
    logits = model(idx)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))


@pytest.mark.parametrize("name,role", [
    ("model.layers.0.self_attn.q_proj.weight", "attn"),
    ("model.layers.0.self_attn.o_proj.weight", "attn"),
    ("model.layers.0.mlp.gate_proj.weight", "mlp"),
    ("model.layers.0.mlp.down_proj.weight", "mlp"),
    ("transformer.h.0.attn.c_proj.weight", "attn"),    # c_proj is attention inside attn ...
    ("transformer.h.0.mlp.c_proj.weight", "mlp"),      # ... and MLP inside mlp
    ("layers.0.linear1.weight", "mlp"),
    ("encoder.layer.0.attention.self.query.weight", "attn"),
    ("decoder.layers.0.fc1.weight", "mlp"),
    ("backbone.layers.0.mixer.out_proj.weight", None),  # a generic name outside a known block
    ("blocks.0.attnx.q.weight", None),
    ("model.layers.0.mlp.gate.weight", "other"),       # a mixture-of-experts router, not the MLP
    ("model.layers.0.mlp.shared_expert_gate.weight", "other"),
    ("model.layers.0.feed_forward.router.weight", "other"),
])
def test_default_classifier_on_client_names(name, role):
    assert default_classifier(name, nn.Linear(2, 2)) == role


def test_name_sets_are_disjoint_and_lower_case():
    assert not ATTN_NAMES & MLP_NAMES and not (ATTN_NAMES | MLP_NAMES) & ROUTER_NAMES
    assert all(n == n.lower() for n in ATTN_NAMES | MLP_NAMES | ROUTER_NAMES)


class _MoEBlock(nn.Module):
    """A mixture-of-experts MLP with 2-D experts and a router named ``gate`` (Mixtral's scheme)."""

    def __init__(self, d=8, experts=4):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)  # router: (experts, d)
        self.experts = nn.ModuleList([NanoMLP(d) for _ in range(experts)])


def test_a_router_takes_the_fallback_without_a_warning_and_a_classifier_may_say_other():
    model = nn.ModuleDict({"mlp": _MoEBlock()})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "other" is recognized: nothing to warn about
        assignment = assign_parameters(model, "hetero")
    assert assignment["mlp.gate.weight"] == "euclidean"  # hetero's other, not the MLP's DGram
    assert assignment["mlp.experts.0.c_fc.weight"] == "dgram"
    assert assign_parameters(model, "all-stiefel")["mlp.gate.weight"] == "stiefel"
    assignment = assign_parameters(model, "hetero", classifier=lambda name, module: "other")
    assert set(assignment.values()) == {"euclidean", None}
    with pytest.raises(ValueError, match=r"'router'.*'other'"):
        assign_parameters(model, "hetero", classifier=lambda name, module: "router")


def test_multihead_attention_is_attention_by_type():
    mha = nn.MultiheadAttention(8, 2)
    assert default_classifier("anything.in_proj_weight", mha) == "attn"


def test_nanogpt_hetero_assignment_trains_and_keeps_constraints():
    torch.manual_seed(0)
    model = NanoGPT()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every hidden matrix is classified: no fallback warning
        assignment = assign_parameters(model, "hetero")
    for layer in range(2):
        p = f"transformer.h.{layer}."
        assert assignment[p + "attn.c_attn.weight"] == assignment[p + "attn.c_proj.weight"] == "stiefel"
        assert assignment[p + "mlp.c_fc.weight"] == assignment[p + "mlp.c_proj.weight"] == "dgram"
    assert assignment["transformer.wte.weight"] is None  # the tied embedding/head, once, to AdamW
    assert "lm_head.weight" not in assignment
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=3e-3)
    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    first = _loss(model, idx).item()
    for _ in range(5):
        opt.zero_grad()
        _loss(model, idx).backward()
        opt.step()
    assert _loss(model, idx).item() < first
    for g in opt.param_groups:
        if g.get("manifold") in ("stiefel", "dgram"):
            for p in g["params"]:
                assert constraint_residual(p.detach(), g["manifold"]) <= 1e-4


def test_transformer_encoder_layer_assignment():
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    assignment = assign_parameters(layer, "hetero")
    assert assignment["self_attn.in_proj_weight"] == assignment["self_attn.out_proj.weight"] == "stiefel"
    assert assignment["linear1.weight"] == assignment["linear2.weight"] == "dgram"
    assert {assignment[n] for n in assignment if n.endswith("bias") or "norm" in n} == {None}


def test_split_blocks_on_the_encoder_layer_gives_three_stiefel_blocks_and_same_outputs():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)
    x = torch.randn(2, 5, 16)
    before = layer(x)
    assert split_blocks(layer) == ["self_attn.in_proj_weight"]
    torch.testing.assert_close(layer(x), before, rtol=0, atol=0)
    assignment = assign_parameters(layer, "hetero")
    blocks = [n for n in assignment if ".in_proj_weight.original" in n]
    assert len(blocks) == 3 and {assignment[n] for n in blocks} == {"stiefel"}


def test_unclassified_hidden_matrices_are_named_in_one_warning():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"2 hidden matrices .* fallback 'euclidean'.*: 0\.weight, 2\.weight"):
        assignment = assign_parameters(model, "hetero")
    assert assignment["0.weight"] == assignment["2.weight"] == "euclidean"


def test_no_warning_where_the_classification_changes_nothing():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    named = [(n, model[int(n[0])], p) for n, p in model.named_parameters()]
    assert unclassified_matrices(get_policy("unconstrained"), named) == []
    assert unclassified_matrices(get_policy("hetero"), named) == ["0.weight", "1.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_unclassified(get_policy("all-stiefel"), named) == []
        assign_parameters(model, "unconstrained")


def test_charted_matrices_go_to_adamw_and_merge_back():
    torch.manual_seed(0)
    model = NanoGPT()
    charted = apply_chart(model, lambda w: SEL(w, init="congruent"),
                          include=lambda n, m: isinstance(m, nn.Linear) and ".mlp." in n)
    assert len(charted) == 4
    assignment = assign_parameters(model, "hetero")
    sel_params = [n for n in assignment if ".mlp." in n]
    assert sel_params and {assignment[n] for n in sel_params} == {None}  # raw coordinates and scales
    assert assignment["transformer.h.0.attn.c_attn.weight"] == "stiefel"
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=1e-3)
    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        opt.zero_grad()
        _loss(model, idx).backward()
        opt.step()
    with torch.no_grad():
        trained = model(idx)
    assert len(merge_charts(model)) == 4
    assert all(type(m.c_fc) is nn.Linear for m in (b.mlp for b in model.transformer.h))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), trained, rtol=1e-5, atol=1e-5)


def test_apply_chart_warns_when_it_charts_nothing():
    model = NanoGPT()
    with pytest.warns(UserWarning, match=r"charted 0 tensors.*Linear \(9\)"):
        names = apply_chart(model, SEL, include=lambda n, m: isinstance(m, nn.Conv1d))
    assert names == []


def test_split_blocks_parametrization_and_its_errors():
    from manifoldlib.charts import FUSED_NAMES, SplitBlocks

    assert "c_attn" in FUSED_NAMES and "qkv" in FUSED_NAMES
    split = SplitBlocks([2, 1, 1], dim=0)
    w = torch.arange(8.0).view(4, 2)
    q, k, v = split.right_inverse(w)
    assert q.shape == (2, 2) and torch.equal(split(q, k, v), w)
    with pytest.raises(ValueError, match=r"at least two block sizes > 0, got \[4\]"):
        SplitBlocks([4], dim=0)
    with pytest.raises(ValueError, match="the blocks \\[2, 1, 1\\] need 4"):
        split.right_inverse(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="blocks=5 must be >= 2 and divide"):
        split_blocks(NanoGPT(), blocks=5)
