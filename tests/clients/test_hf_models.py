"""Policies and charts on Hugging Face models built from tiny configs (random init, no download).

GPT-2 (``Conv1D`` layers, fused ``c_attn``), LLaMA and Mistral (``self_attn.q_proj`` ...
``o_proj``, ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``): ``hetero`` puts every attention
matrix on Stiefel and every MLP matrix on DGram without a fallback warning; a few training steps
keep the constraints; SEL on the MLP trains and merges back into plain layers with the same outputs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from manifoldlib.charts import SEL, apply_chart, merge_blocks, merge_charts, sel_param_groups, split_blocks  # noqa: E402
from manifoldlib.optim import assign_parameters, build_optimizer, constraint_residual  # noqa: E402

VOCAB, WIDTH = 64, 32


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _mistral():
    cfg = transformers.MistralConfig(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0, sliding_window=None)
    return transformers.MistralForCausalLM(cfg)


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral}
ATTN = {"gpt2": ("attn.c_attn", "attn.c_proj"),
        "llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")}
MLP = {"gpt2": ("mlp.c_fc", "mlp.c_proj"), "llama": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
ATTN["mistral"], MLP["mistral"] = ATTN["llama"], MLP["llama"]
PREFIX = {"gpt2": "transformer.h.{}.", "llama": "model.layers.{}.", "mistral": "model.layers.{}."}


def _model(family, seed=0):
    torch.manual_seed(seed)
    return BUILDERS[family]().eval()  # eval: no dropout, so outputs compare exactly


def _batch(seed=1):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def _train(model, opt, idx, steps=3):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(idx, labels=idx).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_hetero_classifies_every_block_matrix(family):
    model = _model(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no matrix goes to the fallback
        assignment = assign_parameters(model, "hetero")
    for layer in range(2):
        prefix = PREFIX[family].format(layer)
        for leaf in ATTN[family]:
            assert assignment[prefix + leaf + ".weight"] == "stiefel", leaf
        for leaf in MLP[family]:
            assert assignment[prefix + leaf + ".weight"] == "dgram", leaf
    muon = [n for n, c in assignment.items() if c is not None]
    assert len(muon) == 2 * (len(ATTN[family]) + len(MLP[family]))  # embeddings, head, norms: AdamW


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_hetero_trains_a_few_steps_on_the_manifolds(family):
    model = _model(family)
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=3e-3)
    losses = _train(model, opt, _batch())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    for group in opt.param_groups:
        if group.get("manifold") in ("stiefel", "dgram"):
            for p in group["params"]:
                assert constraint_residual(p.detach(), group["manifold"]) <= 1e-4


def _off_diagonal(m: torch.Tensor) -> float:
    return float((m - torch.diag(torch.diag(m))).norm())


def test_a_square_dgram_matrix_is_constrained_as_the_map_it_stores_in_conv1d_and_linear_alike():
    # Off(W^T W) = 0 on the map y = W x: the stored columns of an (out, in) nn.Linear o_proj, the
    # stored rows of GPT-2's (in, out) Conv1D c_proj (docs/tutorials/hf_model.rst)
    for family, leaf in (("gpt2", "attn.c_proj"), ("llama", "self_attn.o_proj")):
        model = _model(family)
        opt = build_optimizer(model, "all-dgram", lr=0.02, adamw_lr=3e-3)
        assert {g["layout"] for g in opt.param_groups if g["kind"] == "muon"} == {
            "in_out" if family == "gpt2" else "out_in"}
        _train(model, opt, _batch())
        stored = model.get_parameter(PREFIX[family].format(0) + leaf + ".weight").detach().double()
        assert stored.shape == (WIDTH, WIDTH)
        w = stored.T if family == "gpt2" else stored  # the map's (out, in) matrix
        assert _off_diagonal(w.T @ w) < 1e-4 * float(w.norm()) ** 2
        assert _off_diagonal(w @ w.T) > 1e-2 * float(w.norm()) ** 2  # not both


def test_split_gpt2_blocks_keep_the_conv1d_layout():
    model = _model("gpt2")
    split_blocks(model)
    opt = build_optimizer(model, "all-dgram", lr=0.02, adamw_lr=3e-3)
    layouts = {n: g["layout"] for g in opt.param_groups if g["kind"] == "muon" for n in g["param_names"]}
    blocks = [n for n in layouts if "c_attn.parametrizations.weight.original" in n]
    assert len(blocks) == 6 and {layouts[n] for n in blocks} == {"in_out"}  # (in, out) blocks of a Conv1D
    _train(model, opt, _batch())
    for name in blocks:
        block = model.get_parameter(name).detach().double()
        assert block.shape == (WIDTH, WIDTH)
        assert constraint_residual(block, "dgram", "in_out") < 1e-4
        assert _off_diagonal(block @ block.T) < 1e-4 * float(block.norm()) ** 2  # the map's columns


def test_gpt2_fused_c_attn_is_one_block_or_three():
    model = _model("gpt2")
    fused = model.transformer.h[0].attn.c_attn.weight
    assert tuple(fused.shape) == (WIDTH, 3 * WIDTH)  # Conv1D stores (in, out)
    assert assign_parameters(model, "hetero")["transformer.h.0.attn.c_attn.weight"] == "stiefel"
    idx = _batch()
    with torch.no_grad():
        before = model(idx).logits
    assert split_blocks(model) == [f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)]
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, before, rtol=0, atol=0)
    assignment = assign_parameters(model, "hetero")
    blocks = [n for n in assignment if "c_attn.parametrizations.weight.original" in n]
    assert len(blocks) == 6 and {assignment[n] for n in blocks} == {"stiefel"}
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=3e-3)
    _train(model, opt, idx)
    for group in opt.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            if name in blocks:  # q, k and v each orthonormal by itself, (WIDTH, WIDTH)
                assert tuple(p.shape) == (WIDTH, WIDTH)
                assert constraint_residual(p.detach(), "stiefel") <= 1e-4
    with torch.no_grad():
        trained = model(idx).logits
    assert len(merge_blocks(model)) == 2
    assert tuple(model.transformer.h[0].attn.c_attn.weight.shape) == (WIDTH, 3 * WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, trained, rtol=0, atol=0)


def test_apply_chart_with_a_linear_filter_on_gpt2_warns_and_charts_nothing():
    model = _model("gpt2")
    with pytest.warns(UserWarning, match=r"charted 0 tensors.*Conv1D \(8\)"):
        assert apply_chart(model, SEL, include=lambda n, m: isinstance(m, torch.nn.Linear) and ".h." in n) == []


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sel_on_the_mlp_trains_beside_hetero_and_merges(family):
    model = _model(family)
    is_mlp = lambda n, m: ".mlp." in f"{n}." and hasattr(m, "weight") and m.weight.dim() == 2  # noqa: E731
    fan_in = (lambda w: w.shape[0]) if family == "gpt2" else (lambda w: w.shape[1])  # Conv1D: (in, out)
    charted = apply_chart(model, lambda w: SEL(w, init="congruent", fan_in=fan_in(w)), include=is_mlp)
    assert len(charted) == 2 * len(MLP[family])
    idx = _batch()
    assignment = assign_parameters(model, "hetero")
    assert {assignment[n] for n in assignment if ".mlp." in n} == {None}  # chart coordinates: AdamW
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=1e-3)
    losses = _train(model, opt, idx)
    assert losses[-1] < losses[0]
    with torch.no_grad():
        trained = model(idx).logits
    assert sorted(merge_charts(model)) == sorted(charted)
    assert not any("parametrizations" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, trained, rtol=1e-5, atol=1e-5)


def test_sel_everywhere_with_adamw_and_sel_groups_then_merge():
    model = _model("llama")
    charted = apply_chart(model, lambda w: SEL(w, init="congruent"),
                          include=lambda n, m: isinstance(m, torch.nn.Linear) and ".layers." in n)
    assert len(charted) == 2 * 7
    opt = torch.optim.AdamW(sel_param_groups(model, lr=1e-3, scale_lr=1e-2))
    idx = _batch()
    losses = _train(model, opt, idx)
    assert losses[-1] < losses[0]
    with torch.no_grad():
        trained = model(idx).logits
    merge_charts(model)
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, trained, rtol=1e-5, atol=1e-5)
