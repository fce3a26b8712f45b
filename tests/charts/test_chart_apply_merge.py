"""apply_chart / merge_charts on models.GPT: conversion, training with AdamW, merge, state dicts."""

from __future__ import annotations

import functools
import io

import geoopt
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from manifoldlib import Stiefel
from manifoldlib.charts import (
    SEL,
    Chart,
    apply_chart,
    assert_chart_compatible,
    chart_parameter_names,
    merge_blocks,
    merge_charts,
    sel_lr_scheduler,
    sel_param_groups,
    split_blocks,
)
from models import GPT, GPTConfig

BLOCK_LINEARS = [
    f"blocks.{i}.{m}.weight"
    for i in range(2)
    for m in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc", "mlp.proj")
]


def in_blocks(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and name.startswith("blocks.")


def small_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = {
        "n_layer": 2,
        "n_embd": 32,
        "n_head": 2,
        "vocab_size": 64,
        "block_size": 16,
        "connection": "pre-ln",
    }
    return GPT(GPTConfig(**{**cfg, **overrides}))


def batch(seed: int = 0, B: int = 4, T: int = 16, V: int = 64):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (B, T + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def pretrained_like(model: nn.Module, seed: int = 1) -> None:
    """Heavy-tailed weights, as in a pretrained model (a few entries far above the init scale)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                t = torch.randn(p.shape, generator=g) / torch.randn(
                    p.shape, generator=g
                ).abs().clamp(min=0.05)
                p.copy_(0.02 * t.clamp(-40, 40))


def test_congruent_conversion_keeps_outputs_and_lists_names():
    model = small_gpt()
    pretrained_like(model)
    idx, _ = batch()
    before, _ = model(idx)
    names = apply_chart(model, functools.partial(SEL, init="congruent"), include=in_blocks)
    assert names == BLOCK_LINEARS
    after, _ = model(idx)
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-5)
    assert all(
        parametrize.is_parametrized(model.get_submodule(n.rsplit(".", 1)[0]), "weight")
        for n in names
    )


def test_mismatched_conversion_changes_only_negative_weights():
    model = small_gpt()
    W = model.blocks[0].mlp.fc.weight.detach().clone()
    apply_chart(model, SEL, include=in_blocks)
    realized = model.blocks[0].mlp.fc.weight.detach()
    assert torch.allclose(realized[W > 0], W[W > 0], rtol=1e-6, atol=0)
    assert bool((realized[W < 0].abs() < W[W < 0].abs()).all())


def test_every_linear_with_untied_head_and_tied_head_is_refused():
    names = apply_chart(small_gpt(tie_weights=False), SEL)
    assert names == BLOCK_LINEARS + ["lm_head.weight"]
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to \['wte.weight'\]"):
        apply_chart(small_gpt(), SEL)


def test_train_with_adamw_then_merge_keeps_outputs():
    model = small_gpt()
    apply_chart(model, functools.partial(SEL, rank=2), include=in_blocks)
    idx, targets = batch()
    opt = torch.optim.AdamW(sel_param_groups(model, lr=3e-3, scale_lr=1e-2, weight_decay=0.01))
    sched = sel_lr_scheduler(opt, anneal_steps=10)
    losses = []
    for _ in range(12):
        _, loss = model(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    model.eval()
    charted, _ = model(idx)
    merged_names = merge_charts(model)
    assert merged_names == BLOCK_LINEARS
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert all(
        type(m) is nn.Linear for n, m in model.named_modules() if n.endswith((".q", ".fc", ".proj"))
    )
    assert not any("parametrizations" in k for k in model.state_dict())
    merged, _ = model(idx)
    assert torch.allclose(merged, charted, rtol=0, atol=1e-6 * charted.abs().max().item())


def test_state_dict_round_trip_into_a_fresh_sel_model():
    model = small_gpt(seed=0)
    apply_chart(model, functools.partial(SEL, rank=1), include=in_blocks)
    idx, targets = batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        _, loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = small_gpt(seed=123)  # different init: the load must overwrite everything
    apply_chart(fresh, functools.partial(SEL, rank=1), include=in_blocks)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(fresh(idx)[0], model(idx)[0])
    assert any(".parametrizations.weight.0.log_m_row" in k for k in model.state_dict())


def test_charting_a_manifold_parameter_is_refused():
    model = small_gpt()
    q = model.blocks[0].attn.q
    q.weight = geoopt.ManifoldParameter(Stiefel().projx(q.weight.detach()), manifold=Stiefel())
    with pytest.raises(
        ValueError, match=r"blocks.0.attn.q.weight: manifold='stiefel' cannot be combined"
    ):
        apply_chart(model, SEL, include=in_blocks)
    assert not parametrize.is_parametrized(
        model.blocks[1].attn.q
    )  # refused before touching anything


@pytest.mark.parametrize("kind", [None, "adamw", "euclidean", "Euclidean"])
def test_assert_chart_compatible_accepts_flat_assignments(kind):
    assert_chart_compatible(kind)
    assert_chart_compatible(torch.zeros(2, 2))
    assert_chart_compatible(
        geoopt.ManifoldParameter(torch.zeros(2, 2), manifold=geoopt.Euclidean())
    )


@pytest.mark.parametrize("kind", ["stiefel", "dgram", "sphere"])
def test_assert_chart_compatible_rejects_manifolds(kind):
    with pytest.raises(ValueError, match=f"raw.q: manifold='{kind}' cannot be combined"):
        assert_chart_compatible(kind, name="raw.q")


def test_second_chart_and_non_chart_builder_are_refused():
    model = small_gpt()
    apply_chart(model, SEL, include=in_blocks)
    with pytest.raises(ValueError, match="blocks.0.attn.q.weight already carries a chart"):
        apply_chart(model, SEL, include=in_blocks)
    with pytest.raises(ValueError, match="chart builder must return a Chart, got Identity"):
        apply_chart(small_gpt(), lambda w: nn.Identity(), include=in_blocks)


class _Double(nn.Module):  # a non-chart parametrization
    def forward(self, x):
        return 2 * x

    def right_inverse(self, w):
        return w / 2


def test_merge_leaves_non_chart_parametrizations_unless_asked():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    apply_chart(model, SEL, include=lambda n, m: n == "0")
    parametrize.register_parametrization(model[1], "weight", _Double())
    assert merge_charts(model) == ["0.weight"]
    assert parametrize.is_parametrized(model[1])
    assert merge_charts(model, charts_only=False) == ["1.weight"]
    assert not parametrize.is_parametrized(model[1])


def test_chart_parameter_names_are_raw_plus_scales():
    model = small_gpt()
    apply_chart(model, SEL, include=in_blocks)
    names = chart_parameter_names(model)
    all_names = {n for n, _ in model.named_parameters()}
    assert names <= all_names
    assert {n for n in all_names if ".parametrizations." in n} == names
    assert sum(n.endswith(".original") for n in names) == len(BLOCK_LINEARS)
    assert isinstance(model.blocks[0].attn.q.parametrizations.weight[0], Chart)


def test_merging_a_deep_copy_leaves_the_original_charted():
    import copy

    model = small_gpt()
    apply_chart(model, SEL, include=in_blocks)
    idx, _ = batch()
    expected, _ = model(idx)
    twin = copy.deepcopy(model)  # shares parametrize's generated classes with `model`
    merge_charts(twin)
    assert torch.equal(model(idx)[0], expected)  # the original still has its charts
    assert parametrize.is_parametrized(model.blocks[0].attn.q, "weight")
    assert torch.allclose(twin(idx)[0], expected, rtol=0, atol=1e-6 * expected.abs().max().item())
    merge_charts(model)
    assert torch.allclose(model(idx)[0], expected, rtol=0, atol=1e-6 * expected.abs().max().item())


def test_apply_and_merge_reject_what_is_not_a_model_or_a_chart():
    with pytest.raises(ValueError, match="model must be a torch.nn.Module, got dict"):
        apply_chart({"w": torch.ones(2, 2)}, SEL)
    with pytest.raises(ValueError, match="model must be a torch.nn.Module, got int"):
        merge_charts(3)
    with pytest.raises(ValueError, match="chart must be a callable chart\\(weight\\) -> Chart, got 'SEL'"):
        apply_chart(nn.Linear(2, 2), "SEL")


def test_a_tensor_the_chart_cannot_represent_is_named_and_nothing_is_charted():
    """The first Linear was charted before the second raised, and the error did not say which
    tensor was out of range."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).double()
    with torch.no_grad():
        model[1].weight[0, 0] = 3.0  # b|w| = 3 kappa / sigma0 > max_exponent = 2
    params = list(model.parameters())
    weights = [p.detach().clone() for p in params]
    x = torch.randn(4, 16, dtype=torch.float64)
    expected = model(x)
    with pytest.raises(ValueError, match=r"cannot chart 1\.weight: weight magnitude 3 is beyond"):
        apply_chart(model, functools.partial(SEL, max_exponent=2.0))
    assert not any(parametrize.is_parametrized(m) for m in model)
    assert all(type(m) is nn.Linear for m in model)
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))  # objects and order
    for p, w in zip(params, weights):
        assert torch.equal(p.detach(), w)
    assert torch.equal(model(x), expected)
    assert apply_chart(model, SEL) == ["0.weight", "1.weight"]  # the model can be charted again


def test_a_module_used_twice_is_charted_once():
    """The same Linear at two places of a Sequential holds one weight, which one chart carries;
    it was refused as 'tied to' itself under its other name."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 6).double()
    model = nn.Sequential(layer, nn.Tanh(), layer)
    x = torch.randn(3, 6, dtype=torch.float64)
    expected = model(x)
    assert apply_chart(model, functools.partial(SEL, init="congruent")) == ["0.weight"]
    torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-14)
    assert merge_charts(model) == ["0.weight"] and model[2] is layer


def test_merge_puts_each_weight_back_in_its_place_among_the_parameters():
    """Removing a parametrization re-registers the tensor last: a merged Linear listed
    ``bias, weight``, so ``parameters_to_vector`` and a positional optimizer state no longer
    lined up with the uncharted model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4, bias=False),
                          nn.Linear(4, 3)).double()
    plain = [name for name, _ in model.named_parameters()]
    assert plain == ["0.weight", "0.bias", "2.weight", "3.weight", "3.bias"]
    plain_vector = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    apply_chart(model, functools.partial(SEL, init="congruent"))
    assert merge_charts(model) == ["0.weight", "2.weight", "3.weight"]
    assert [name for name, _ in model.named_parameters()] == plain
    # a congruent chart reproduces the weights: the same vector, entry by entry
    merged_vector = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    torch.testing.assert_close(merged_vector, plain_vector, rtol=0, atol=1e-13)


@pytest.mark.parametrize("steps", ["bias, weight", "bias, split, merge_charts, merge_blocks"])
def test_a_tensor_parametrized_after_another_of_its_module_is_merged_in_its_place(steps):
    """The place a tensor returns to was read from the module's parameters when it was charted
    (or split), where a tensor parametrized before it no longer is: a weight charted after its
    bias recorded ("weight",), so the merged model listed bias before weight, and a fused c_attn
    split after its bias was charted came back after it when the chart was merged first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Linear(12, 3)).double()
    plain = [name for name, _ in model.named_parameters()]
    x = torch.randn(2, 6, dtype=torch.float64)
    expected = model(x)
    congruent = functools.partial(SEL, init="congruent")
    apply_chart(model, congruent, tensor_name="bias")
    if steps == "bias, weight":
        apply_chart(model, congruent)
        merge_charts(model)
    else:
        split_blocks(model, include=lambda name, module: name == "0")
        merge_charts(model)
        merge_blocks(model)
    assert [name for name, _ in model.named_parameters()] == plain
    torch.testing.assert_close(model(x), expected, rtol=1e-13, atol=1e-13)


def test_a_frozen_weight_stays_frozen_when_charted():
    # the chart's scales were created trainable whatever the weight: charting every Linear of a
    # model whose first block is frozen let AdamW move that block's effective weights through
    # the scales (the raw coordinates stayed, the function did not)
    model = small_gpt(seed=0)
    frozen = model.blocks[0].attn.q
    frozen.weight.requires_grad_(False)
    apply_chart(model, SEL, include=in_blocks)
    chart = frozen.parametrizations.weight[0]
    assert not any(p.requires_grad for p in chart.parameters())
    assert not frozen.parametrizations.weight.original.requires_grad
    trained = model.blocks[0].attn.k.parametrizations.weight[0]
    assert all(p.requires_grad for p in trained.parameters())
    before, other = frozen.weight.detach().clone(), model.blocks[0].attn.k.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    idx, targets = batch()
    for _ in range(3):
        _, loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.equal(frozen.weight, before)
    assert not torch.equal(model.blocks[0].attn.k.weight, other)
