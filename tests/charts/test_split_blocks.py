"""split_blocks / merge_blocks: ties, copies and failures leave no half-split model."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from manifoldlib.charts import merge_blocks, merge_charts, split_blocks


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


@pytest.mark.parametrize("sizes, bad", [((2.5, 1.5), "2.5"), ((2.0, 2.0), "2.0"), ((True, True, 2), "True"),
                                        (("2", "2"), "'2'")])
def test_split_blocks_refuse_sizes_that_are_not_integers(sizes, bad):
    """SplitBlocks((2.5, 1.5), 0) split a 4-row matrix as [2, 1] (int() truncated each size), so
    the sum check of split_blocks (4 == 2.5 + 1.5) did not catch it."""
    from manifoldlib.charts import SplitBlocks

    with pytest.raises(ValueError, match=rf"block sizes must be integers \(not bools\), got {bad}"):
        SplitBlocks(sizes, dim=0)
    model = nn.Sequential()
    model.add_module("qkv", nn.Linear(4, 4))
    with pytest.raises(ValueError, match=rf"got {bad}"):
        split_blocks(model, blocks=sizes)
    assert not parametrize.is_parametrized(model.qkv)


@pytest.mark.parametrize("dim", [1.5, True, "0"])
def test_split_blocks_refuse_a_dim_that_is_not_an_integer(dim):
    """dim=True stacked along dim 1 and dim=1.5 was stored as given."""
    from manifoldlib.charts import SplitBlocks

    with pytest.raises(ValueError, match=rf"dim must be an integer \(not a bool\), got {dim!r}"):
        SplitBlocks([2, 2], dim=dim)


@pytest.mark.parametrize("blocks", [3.0, True, "3", None])
def test_split_blocks_refuse_a_block_count_that_is_not_an_int_or_a_list(blocks):
    """blocks=3.0 raised TypeError ('float' object is not iterable); with no module selected
    any blocks value passed."""
    with pytest.raises(ValueError, match=r"blocks must be a number of equal blocks"):
        split_blocks(_Model(), blocks=blocks)
    with pytest.raises(ValueError, match=r"blocks must be a number of equal blocks"):
        split_blocks(nn.Linear(2, 2), blocks=blocks)


def test_split_blocks_accept_numpy_integers():
    import numpy as np

    from manifoldlib.charts import SplitBlocks

    assert SplitBlocks(np.array([4, 2]), dim=np.int64(0)).sizes == [4, 2]
    model = _Model()
    assert split_blocks(model, blocks=np.int64(3)) == ["a.c_attn.weight", "b.c_attn.weight"]


@pytest.mark.parametrize(
    ("merge", "context", "frozen"),
    [
        ("merge_blocks", "plain", False),
        ("merge_blocks", "plain", True),
        ("merge_blocks", "no_grad", False),
        ("merge_blocks", "inference_mode", False),
        ("merge_charts", "plain", True),
        ("merge_charts", "no_grad", False),
        ("merge_charts", "inference_mode", False),
    ],
)
def test_a_merged_matrix_is_a_parameter_in_its_place(merge, context, frozen):
    # torch's remove_parametrizations leaves a concatenation that needs no gradient as a buffer:
    # the merged model's parameters() lost the fused weight (model.requires_grad_() could not
    # unfreeze it, an optimizer built afterwards never saw it), and every merged weight came back
    # after its bias (an optimizer state saved on the unsplit model loaded positionally into the
    # wrong tensors). It reads "needs no gradient" from the value it computes, so under no_grad /
    # inference_mode merge_blocks froze a trainable c_attn, and merge_charts(charts_only=False)
    # left it (and a frozen one anywhere) a buffer
    torch.manual_seed(0)
    model = _Model().double()
    model.a.c_attn.weight.requires_grad_(not frozen)
    names = [name for name, _ in model.named_parameters()]
    x = torch.randn(2, 4, dtype=torch.float64)
    expected = model.a.c_attn(x)
    split_blocks(model)
    run = {"merge_blocks": merge_blocks,
           "merge_charts": lambda m: merge_charts(m, charts_only=False)}[merge]
    scope = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad,
             "inference_mode": torch.inference_mode}[context]
    with scope():
        assert run(model) == ["a.c_attn.weight", "b.c_attn.weight"]
    assert [name for name, _ in model.named_parameters()] == names
    weight = model.a.c_attn.weight
    assert isinstance(weight, nn.Parameter) and weight.requires_grad is not frozen
    assert not dict(model.named_buffers())
    assert torch.equal(model.a.c_attn(x), expected)
    model.requires_grad_(True)  # it trains: the gradient reaches the merged parameter
    model.a.c_attn(x).sum().backward()
    assert weight.grad is not None and torch.equal(weight.grad, x.sum(0).expand(12, 4))
