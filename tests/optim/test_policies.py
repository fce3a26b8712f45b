"""Policies, build_optimizer and the combined optimizer, on models.GPT and on a user's model."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from manifoldlib.optim import (
    CombinedOptimizer,
    assign_parameters,
    available_policies,
    build_optimizer,
    constraint_residual,
    describe_assignment,
    get_policy,
    register_policy,
)
from models import GPT, GPTConfig

BUILT_IN = ["unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv"]


def _gpt(seed=0, n_layer=2, n_embd=32):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=64, block_size=16, connection="pre-ln")
    return GPT(cfg)


class _UserBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.ModuleDict({"q": nn.Linear(d, d), "k": nn.Linear(d, d)})
        self.mlp = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))
        self.gain = nn.Parameter(torch.ones(d))


class _UserModel(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.embed = nn.Embedding(10, d)
        self.layers = nn.ModuleList([_UserBlock(d)])
        self.mixer = nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, 10)


#: _UserModel's mixer goes to hetero's fallback with a warning that other tests assert
_MIXER_FALLBACK_SEEN = pytest.mark.filterwarnings("ignore:1 hidden matrix matched no attention")


def test_built_in_policies_are_registered():
    assert set(BUILT_IN) <= set(available_policies())


@pytest.mark.parametrize("policy,attn,mlp", [
    ("unconstrained", "euclidean", "euclidean"),
    ("all-stiefel", "stiefel", "stiefel"),
    ("all-dgram", "dgram", "dgram"),
    ("hetero", "stiefel", "dgram"),
    ("hetero-inv", "dgram", "stiefel"),
])
def test_gpt_assignment(policy, attn, mlp):
    model = _gpt()
    assignment = assign_parameters(model, policy)
    for name, choice in assignment.items():
        if ".attn." in name and name.endswith("weight"):
            assert choice == attn, name
        elif ".mlp." in name and name.endswith("weight"):
            assert choice == mlp, name
        else:  # embeddings, tied head, norm gains
            assert choice is None, name
    assert sum(c is not None for c in assignment.values()) == 2 * 6


def test_user_model_naming_rule_and_head():
    with pytest.warns(UserWarning, match="mixer.weight"):  # the fallback is reported by name
        assignment = assign_parameters(_UserModel(), "hetero")
    assert assignment["layers.0.attn.q.weight"] == "stiefel"
    assert assignment["layers.0.mlp.0.weight"] == "dgram"
    assert assignment["layers.0.mlp.2.weight"] == "dgram"
    assert assignment["mixer.weight"] == "euclidean"  # another hidden matrix
    for name in ("embed.weight", "head.weight", "head.bias", "layers.0.gain", "layers.0.attn.q.bias"):
        assert assignment[name] is None


def test_classifier_argument():
    def classifier(name, module):
        return "attn" if name.startswith("mixer") else None

    with pytest.warns(UserWarning, match="layers.0.attn.q.weight"):
        assignment = assign_parameters(_UserModel(), "hetero", classifier=classifier)
    assert assignment["mixer.weight"] == "stiefel"
    assert assignment["layers.0.attn.q.weight"] == "euclidean"  # no longer recognized


def test_custom_policy_registration(clean_policies):
    @register_policy("test-attn-only")
    def attn_only(name, module, param):
        return "stiefel" if ".attn." in name and param.dim() == 2 else None

    assert get_policy("test-attn-only") is attn_only
    assignment = assign_parameters(_gpt(), "test-attn-only")
    assert {c for n, c in assignment.items() if ".mlp." in n} == {None}
    assert {c for n, c in assignment.items() if ".attn." in n} == {"stiefel"}


@pytest.mark.parametrize("policy,match", [
    ("no-such-policy", "unknown policy 'no-such-policy'; valid policies: "),
    (lambda n, m, p: "hyperbolic" if p.dim() == 2 else None, "to unknown manifold 'hyperbolic'"),
    (lambda n, m, p: "stiefel", r"parameter 'wte.weight'|shape \("),
])
def test_bad_policies(policy, match):
    with pytest.raises(ValueError, match=match):
        build_optimizer(_gpt(), policy)


def test_non_matrix_assignment_names_the_parameter():
    with pytest.raises(ValueError, match=r"'blocks.0.conn1.norm.weight' of shape \(32,\) to 'dgram'"):
        assign_parameters(_gpt(), lambda n, m, p: "dgram" if "norm" in n else None)


def test_classifier_for_a_plain_function_is_rejected():
    with pytest.raises(ValueError, match="does not take a classifier"):
        get_policy(lambda n, m, p: None, classifier=lambda n, m: None)


def test_build_optimizer_is_one_optimizer_with_tagged_groups():
    model = _gpt()
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=3e-3)
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, CombinedOptimizer)
    kinds = {(g["kind"], g.get("manifold")) for g in opt.param_groups}
    assert kinds == {("muon", "stiefel"), ("muon", "dgram"), ("adamw", None)}
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params == len(list(model.parameters()))
    for g in opt.param_groups:
        if g.get("manifold") in ("stiefel", "dgram"):
            for p in g["params"]:
                assert constraint_residual(p.detach(), g["manifold"]) <= 1e-5


def test_scheduler_reaches_inner_optimizers_and_state_round_trips():
    model = _gpt(seed=1)
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        _, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    inner = opt.optimizers["muon"].param_groups[0]["lr"]
    assert inner == pytest.approx(0.02 * 0.25)
    assert opt.optimizers["adamw"].param_groups[0]["lr"] == pytest.approx(3e-3 * 0.25)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    twin = _gpt(seed=1)
    twin.load_state_dict(model.state_dict())
    opt2 = build_optimizer(twin, "hetero", lr=0.5, adamw_lr=0.5)
    with torch.no_grad():  # undo the construction-time projection drift: same weights as model
        for p, q in zip(twin.parameters(), model.parameters()):
            p.copy_(q)
    opt2.load_state_dict(state)
    assert opt2.optimizers["muon"].param_groups[0]["lr"] == pytest.approx(0.02 * 0.25)
    for m, o in ((model, opt), (twin, opt2)):
        _, loss = m(idx, idx)
        o.zero_grad()
        loss.backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_gpt_training_short_stays_on_manifolds():
    model = _gpt(seed=2)
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=3e-3)
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 64, (4, 16), generator=g)
    losses = []
    for _ in range(20):
        _, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for group in opt.param_groups:
        if group.get("manifold") in ("stiefel", "dgram"):
            for p in group["params"]:
                assert constraint_residual(p.detach(), group["manifold"]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["hetero", "hetero-inv"])
def test_gpt_1000_steps_float32_stay_on_manifolds(policy):
    model = _gpt(seed=4, n_layer=2, n_embd=32)
    opt = build_optimizer(model, policy, lr=0.02, adamw_lr=3e-3)
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 64, (64, 17), generator=g)
    for step in range(1000):
        batch = data[(step * 4) % 64:(step * 4) % 64 + 4]
        _, loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
    for group in opt.param_groups:
        if group.get("manifold") in ("stiefel", "dgram"):
            for p in group["params"]:
                assert p.dtype == torch.float32
                assert constraint_residual(p.detach(), group["manifold"]) <= 1e-4


@_MIXER_FALLBACK_SEEN
@pytest.mark.parametrize("key", ["params", "param_names", "manifold", "kind"])
def test_manifold_options_cannot_replace_what_the_policy_decided(key):
    """{"stiefel": {"params": []}} used to drop the attention matrices from every optimizer, and
    {"stiefel": {"manifold": "dgram"}} to move them to DGram, both without a word."""
    with pytest.raises(ValueError, match=rf"manifold_options\['stiefel'\] may not set '{key}'"):
        build_optimizer(_UserModel(), "hetero", manifold_options={"stiefel": {key: "dgram"}})


@_MIXER_FALLBACK_SEEN
def test_manifold_options_must_be_dicts():
    with pytest.raises(ValueError, match=r"manifold_options\['dgram'\] must be a dict of ManifoldMuon "
                                         r"group options, got 0.1"):
        build_optimizer(_UserModel(), "hetero", manifold_options={"dgram": 0.1})


@_MIXER_FALLBACK_SEEN
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_combined_add_param_group_reaches_the_inner_optimizer(kind):
    opt = build_optimizer(_UserModel(), "hetero", lr=0.02, adamw_lr=0.1)
    g = torch.Generator().manual_seed(3)
    extra = nn.Parameter(torch.randn(6, 4, generator=g, dtype=torch.float64))
    group = {"params": [extra], "param_names": ["extra"], "kind": kind}
    if kind == "muon":
        group["manifold"] = "stiefel"
    opt.add_param_group(group)
    inner = opt.optimizers[kind]
    assert inner.param_groups[-1] is opt.param_groups[-1]
    if kind == "muon":
        assert constraint_residual(extra.detach(), "stiefel") <= 1e-14  # projected by ManifoldMuon
    before = extra.detach().clone()
    extra.grad = torch.randn(6, 4, generator=g, dtype=torch.float64)
    opt.step()
    assert not torch.equal(extra.detach(), before)
    assert extra in opt.state


@_MIXER_FALLBACK_SEEN
@pytest.mark.parametrize("group, match", [
    ({}, r"needs 'kind' set to one of muon, adamw, got None"),
    ({"kind": "sgd"}, r"needs 'kind' set to one of muon, adamw, got 'sgd'"),
    ({"kind": "muon", "manifold": "torus"}, "unknown manifold 'torus'"),
])
def test_combined_add_param_group_refuses_a_group_no_inner_optimizer_would_step(group, match):
    """A group without a known kind was appended and then never stepped."""
    opt = build_optimizer(_UserModel(), "hetero")
    count = len(opt.param_groups)
    extra = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [extra], "param_names": ["extra"], **group})
    assert len(opt.param_groups) == count
    assert sum(len(o.param_groups) for o in opt.optimizers.values()) == count


def test_numpy_rates_give_a_state_dict_that_loads_weights_only():
    """np.float64 rates (a float subclass) passed the checks and were stored as NumPy scalars in
    the AdamW and Muon groups, so torch.load(weights_only=True) refused the state dict; an
    np.float32 rate was refused as not a number."""
    import numpy as np

    model = _gpt()
    opt = build_optimizer(model, "hetero", lr=np.float64(0.02), adamw_lr=np.float32(3e-3),
                          weight_decay=np.float64(0.01), adamw_betas=(np.float64(0.9), np.float64(0.95)))
    for group in opt.param_groups:
        assert type(group["lr"]) is float and type(group["weight_decay"]) is float
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert {g["lr"] for g in loaded["param_groups"]} == {0.02, float(np.float32(3e-3))}


def test_frozen_parameters_are_left_out_and_every_other_lands_in_one_group():
    model = _gpt()
    frozen = [model.blocks[0].attn.q.weight, model.wpe.weight]
    for p in frozen:
        p.requires_grad_(False)
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=3e-3)
    grouped = [p for g in opt.param_groups for p in g["params"]]
    assert len({id(p) for p in grouped}) == len(grouped)             # nothing twice
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in grouped} == trainable                       # nothing lost, none frozen
    assert not any(p is f for p in grouped for f in frozen)


# ---- describe_assignment, verbose, charts -----------------------------------------------------


class Conv1D(nn.Module):
    """Hugging Face's layout (the layout rule reads the class name): weight ``(in, out)``."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)

    def forward(self, x):
        return x @ self.weight


def _table_rows(table: str) -> dict[str, list[str]]:
    lines = table.splitlines()
    assert lines[0].split() == ["parameter", "shape", "layout", "optimizer", "why"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    rows = {}
    for line in lines[2:-1]:
        name, *cells = line.split(maxsplit=4)
        rows[name] = cells
    return rows


def test_describe_assignment_names_every_parameter_its_shape_layout_optimizer_and_why():
    model = _gpt(n_layer=1, n_embd=16)
    table = describe_assignment(model, "hetero")
    rows = _table_rows(table)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(rows) == trainable  # every parameter once (the tied head is the embedding)
    assert rows["blocks.0.attn.q.weight"] == ["16x16", "out_in", "stiefel", "attention"]
    assert rows["blocks.0.mlp.fc.weight"] == ["64x16", "out_in", "dgram", "MLP"]
    assert rows["wte.weight"] == ["64x16", "out_in", "AdamW", "embedding"]
    assert rows["norm_f.weight"] == ["16", "-", "AdamW", "not a matrix"]
    assert table.splitlines()[-1] == "(AdamW: 5, stiefel: 4, dgram: 2)"
    assignment = assign_parameters(model, "hetero")  # the table says what the optimizer does
    assert {n: (c or "AdamW") for n, c in assignment.items()} == {n: r[2] for n, r in rows.items()}


@_MIXER_FALLBACK_SEEN
def test_describe_assignment_reads_layouts_heads_and_fallbacks():
    model = _UserModel()
    model.layers[0].attn["q"] = Conv1D(8, 8)
    rows = _table_rows(describe_assignment(model, "hetero"))
    assert rows["layers.0.attn.q.weight"] == ["8x8", "in_out", "stiefel", "attention"]
    assert rows["head.weight"] == ["10x8", "out_in", "AdamW", "output head"]
    assert rows["mixer.weight"] == ["8x8", "out_in", "euclidean", "unrecognized: fallback"]
    assert rows["head.bias"] == ["10", "-", "AdamW", "not a matrix"]
    custom = _table_rows(describe_assignment(model, lambda n, m, p: "oblique" if n == "mixer.weight" else None))
    assert custom["mixer.weight"][2:] == ["oblique", "policy <lambda>"]


def test_build_optimizer_verbose_prints_the_table(capsys):
    model = _gpt(n_layer=1, n_embd=16)
    build_optimizer(model, "hetero", verbose=True)
    assert capsys.readouterr().out.strip() == describe_assignment(model, "hetero").strip()
    build_optimizer(model, "hetero")
    assert capsys.readouterr().out == ""


def test_build_optimizer_warns_that_sel_charted_matrices_go_to_adamw():
    from manifoldlib.charts import SEL, apply_chart

    model = _gpt(n_layer=1, n_embd=16)
    charted = apply_chart(model, SEL, include=lambda name, module: ".attn." in f"{name}.")
    assert len(charted) == 4
    with pytest.warns(UserWarning, match=r"^4 charted matrices \(e.g. 'blocks.0.attn.k'\) go to AdamW.*merge the charts"):
        opt = build_optimizer(model, "hetero")
    kinds = {n: g["kind"] for g in opt.param_groups for n in g["param_names"]}
    assert kinds["blocks.0.attn.q.parametrizations.weight.original"] == "adamw"
    assert kinds["blocks.0.mlp.fc.weight"] == "muon"  # the uncharted matrices keep their manifold
    rows = _table_rows(describe_assignment(model, "hetero"))
    assert rows["blocks.0.attn.q.parametrizations.weight.original"][2:] == ["AdamW", "chart coordinates (Euclidean)"]


class _Scale2(nn.Module):
    """A user's own parametrization: the model uses 2 * original."""

    def forward(self, x):
        return 2 * x


def test_foreign_parametrizations_go_to_adamw_with_a_warning_naming_their_raw_tensors():
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import orthogonal, weight_norm

    from manifoldlib.charts import split_blocks

    torch.manual_seed(0)
    model = _gpt(n_layer=1, n_embd=16)
    block = model.blocks[0]
    orthogonal(block.attn.q)
    weight_norm(block.mlp.fc)  # original0 is g, (64, 1): a 2-D tensor that is no matrix of the map
    parametrize.register_parametrization(block.attn.k, "weight", _Scale2())
    raw = ["blocks.0.attn.q.parametrizations.weight.original", "blocks.0.mlp.fc.parametrizations.weight.original0",
           "blocks.0.mlp.fc.parametrizations.weight.original1", "blocks.0.attn.k.parametrizations.weight.original"]
    with pytest.warns(UserWarning, match=r"^4 parametrized matrices go to AdamW: .*weight\.original \(_Orthogonal\)"
                      r".*original \(_Scale2\).*original0 \(_WeightNorm\).*original1 \(_WeightNorm\)\. .*remove_parametrizations"):
        opt = build_optimizer(model, "hetero")
    kinds = {n: g["kind"] for g in opt.param_groups for n in g["param_names"]}
    assert all(kinds[n] == "adamw" for n in raw)
    assert kinds["blocks.0.attn.v.weight"] == kinds["blocks.0.mlp.proj.weight"] == "muon"  # the plain ones keep theirs
    with pytest.warns(UserWarning, match="parametrized matrices go to AdamW"):
        rows = _table_rows(describe_assignment(model, "hetero"))
    assert rows[raw[0]][2:] == ["AdamW", "parametrization tensor (Euclidean)"]
    # a custom policy that puts a raw tensor on a manifold is told the constraint misses the weight
    with pytest.warns(UserWarning, match=r"put 1 raw parametrization tensors on a manifold: "
                      r"blocks\.0\.attn\.k\.parametrizations\.weight\.original \(_Scale2\)"):
        assign_parameters(model, lambda n, m, p: "stiefel" if n == raw[3] else None)
    # the library's own split blocks are the fused weight's entries: constrained, no warning
    fused = nn.Module()
    fused.attn = nn.Module()
    fused.attn.c_attn = nn.Linear(8, 24)
    assert split_blocks(fused) == ["attn.c_attn.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assignment = assign_parameters(fused, "hetero")
    assert [assignment[f"attn.c_attn.parametrizations.weight.original{i}"] for i in range(3)] == ["stiefel"] * 3


def test_a_weight_tied_between_blocks_the_policy_tells_apart_is_refused_naming_both():
    # one Linear's weight tied into an attention and an MLP block: under hetero its first name
    # (attention) made it Stiefel and the MLP's DGram was dropped without a word
    model = nn.Module()
    model.attn = nn.Module()
    model.mlp = nn.Module()
    model.attn.q = nn.Linear(8, 8, bias=False)
    model.mlp.fc = nn.Linear(8, 8, bias=False)
    model.mlp.fc.weight = model.attn.q.weight
    with pytest.raises(ValueError, match=r"shared as 'attn\.q\.weight' and 'mlp\.fc\.weight' two optimizers: "
                                         r"'stiefel' under the first name and 'dgram' under the second"):
        assign_parameters(model, "hetero")
    assert assign_parameters(model, "all-stiefel") == {"attn.q.weight": "stiefel"}  # one answer: fine
    # the same module under two names is one parameter with two names too
    shared = nn.Module()
    shared.attn, shared.mlp = nn.Module(), nn.Module()
    shared.attn.proj = shared.mlp.proj = nn.Linear(8, 8, bias=False)
    with pytest.raises(ValueError, match="'attn.proj.weight' and 'mlp.proj.weight'"):
        assign_parameters(shared, "hetero")


@pytest.mark.parametrize("policy", ["unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv"])
def test_a_tied_embedding_and_head_stay_one_adamw_parameter(policy):
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    assert model.lm_head.weight is model.wte.weight  # the tie the check reads both names of
    assignment = assign_parameters(model, policy)  # both names AdamW: no refusal
    assert set(assignment) == {name for name, _ in model.named_parameters()}
    assert assignment["wte.weight"] is None and "lm_head.weight" not in assignment
