"""SEL's fan-in follows the weight's storage layout: a Hugging Face ``Conv1D`` stores ``(in, out)``.

``SEL(weight, layout="in_out")`` reads the fan-in from the first dimension, and ``apply_chart``
passes every module's layout (as ``manifoldlib.optim.weight_layout`` reads it) to a builder that
takes ``layout``, so a GPT-2 ``Conv1D`` gets the chart of the equivalent ``nn.Linear`` without
``fan_in=``; an explicit ``fan_in=`` (or a ``layout`` bound by the caller) still wins.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from manifoldlib.charts import SEL, SEL_LAYOUTS, apply_chart
from manifoldlib.charts.base import output_dim

WIDTH = 32


def _wide(seed: int = 0) -> torch.Tensor:
    """An ``(in, out) = (64, 16)`` weight stored as a Conv1D stores it."""
    return torch.randn(64, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_the_fan_in_of_an_in_out_weight_is_its_first_dimension():
    assert SEL_LAYOUTS == ("out_in", "in_out")
    stored = _wide()
    conv = SEL(stored, layout="in_out", calibration="width", gain=2.0)
    linear = SEL(stored.T.contiguous(), calibration="width", gain=2.0)  # the same map, (out, in)
    assert conv.fan_in == linear.fan_in == 64 and conv.layout == "in_out"
    assert conv.sigma0 == linear.sigma0 == pytest.approx(2.0 / math.sqrt(64), rel=1e-15)
    assert torch.equal(conv.beta, linear.beta)
    assert SEL(stored, calibration="width").fan_in == 16  # read as (out, in): the output size
    assert "layout='in_out', fan_in=64" in repr(conv)


def test_an_explicit_fan_in_wins_over_the_layout():
    chart = SEL(_wide(), layout="in_out", fan_in=10, calibration="width")
    assert chart.fan_in == 10 and chart.sigma0 == pytest.approx(1 / math.sqrt(10), rel=1e-15)


def test_an_unknown_layout_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"layout must be one of \('out_in', 'in_out'\) .*got "
                                         r"'transposed'"):
        SEL(_wide(), layout="transposed")


def _gpt2() -> nn.Module:
    """A tiny GPT-2 from a config (random init, no download); skips without transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=WIDTH, n_head=4, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _is_conv1d(name: str, module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


def _charts(model: nn.Module, names: list[str]) -> dict[str, SEL]:
    return {n: model.get_submodule(n.rsplit(".", 1)[0]).parametrizations.weight[0] for n in names}


@pytest.mark.parametrize("builder", [SEL, functools.partial(SEL, init="congruent",
                                                            calibration="width")],
                         ids=["SEL", "partial"])
def test_apply_chart_gives_each_conv1d_the_fan_in_of_its_input(builder):
    model = _gpt2()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    names = apply_chart(model, builder, include=_is_conv1d)
    assert len(names) == 8  # c_attn, c_proj, c_fc, mlp.c_proj per layer
    for name, chart in _charts(model, names).items():
        rows = shapes[name][0]  # (in, out)
        assert chart.layout == "in_out" and chart.fan_in == rows, name
    # the output size differs from the input size for c_attn (96), c_fc (128) and mlp.c_proj
    assert {chart.fan_in for chart in _charts(model, names).values()} == {WIDTH, 4 * WIDTH}


def test_a_conv1d_gets_the_chart_of_its_nn_linear_twin():
    model = _gpt2()
    conv = model.transformer.h[0].mlp.c_fc  # (in, out) = (32, 128)
    twin = nn.Linear(WIDTH, 4 * WIDTH)
    with torch.no_grad():
        twin.weight.copy_(conv.weight.T)
    build = functools.partial(SEL, init="congruent", calibration="width")
    apply_chart(model, build, include=lambda n, m: m is conv)
    apply_chart(twin, build)
    ours, theirs = conv.parametrizations.weight[0], twin.parametrizations.weight[0]
    assert ours.fan_in == theirs.fan_in == WIDTH
    assert torch.equal(ours.beta, theirs.beta) and ours.sigma0 == theirs.sigma0
    assert output_dim(conv) == 1 and output_dim(twin) == 0  # also once parametrized


def test_the_callers_own_fan_in_or_layout_is_left_alone():
    model = _gpt2()
    names = apply_chart(model, functools.partial(SEL, fan_in=7, calibration="width"),
                        include=_is_conv1d)
    assert {c.fan_in for c in _charts(model, names).values()} == {7}
    model = _gpt2()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    names = apply_chart(model, functools.partial(SEL, layout="out_in"), include=_is_conv1d)
    for name, chart in _charts(model, names).items():
        assert chart.layout == "out_in" and chart.fan_in == shapes[name][1]


def test_a_builder_that_takes_layout_receives_it_and_one_that_does_not_is_called_as_before():
    seen = []

    def takes(weight, layout):
        seen.append(layout)
        return SEL(weight, layout=layout)

    model = _gpt2()
    apply_chart(model, takes, include=_is_conv1d)
    assert seen == ["in_out"] * 8
    linear = nn.Sequential(nn.Linear(4, 3))
    apply_chart(linear, takes)
    assert seen[-1] == "out_in"
    plain = nn.Sequential(nn.Linear(4, 3))
    assert apply_chart(plain, lambda w: SEL(w)) == ["0.weight"]  # chart(weight), no keyword
