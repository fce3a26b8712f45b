"""split_blocks / merge_blocks: ties, copies and failures leave no half-split model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from manifoldlib.charts import merge_blocks, split_blocks


class _Attention(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _Attention()
        self.b = _Attention()


def test_merging_a_deep_copy_leaves_the_original_split():
    """A deep copy shares parametrize's generated class; merging the copy deleted the original's
    weight property (AttributeError: 'ParametrizedLinear' object has no attribute 'weight')."""
    torch.manual_seed(0)
    model = _Model().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    expected = model.a.c_attn(x)
    split_blocks(model)
    twin = copy.deepcopy(model)
    assert merge_blocks(twin) == ["a.c_attn.weight", "b.c_attn.weight"]
    assert type(twin.a.c_attn) is nn.Linear
    assert parametrize.is_parametrized(model.a.c_attn, "weight")
    assert torch.equal(model.a.c_attn(x), expected)
    assert torch.equal(twin.a.c_attn(x), expected)


def test_a_tied_fused_matrix_is_refused():
    """Splitting gave each module its own blocks: the tie was silently broken."""
    model = _Model()
    model.b.c_attn.weight = model.a.c_attn.weight
    with pytest.raises(ValueError, match=r"a\.c_attn\.weight is tied to \['b\.c_attn\.weight'\]"):
        split_blocks(model)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())


def test_a_matrix_that_cannot_be_split_leaves_every_matrix_whole():
    model = nn.Sequential()
    model.add_module("c_attn", nn.Linear(4, 12))
    model.add_module("qkv_proj", nn.Linear(4, 10))
    with pytest.raises(ValueError, match=r"blocks=3 must be >= 2 and divide qkv_proj\.weight's output size 10"):
        split_blocks(model, include=lambda name, module: isinstance(module, nn.Linear))
    assert not any(parametrize.is_parametrized(m) for m in model)
    with pytest.raises(ValueError, match=r"a\.c_attn\.weight has 12 entries along its output dimension 0; "
                                         r"the blocks \[4, 4, 5\] need 13"):
        split_blocks(_Model(), blocks=[4, 4, 5])


def test_a_module_used_twice_is_split_once():
    """The same module at two places holds one tensor: no tie to break."""
    layer = _Attention()
    model = nn.ModuleDict({"first": layer, "second": layer})
    assert split_blocks(model) == ["first.c_attn.weight"]
    assert model["second"].c_attn is layer.c_attn
