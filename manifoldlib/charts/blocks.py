r"""Fused projections as separate blocks: q, k and v of one ``c_attn`` as three matrices.

A fused attention input projection stacks three maps, :math:`W = [W_q\ W_k\ W_v]` along its output
dimension (``(d, 3d)`` for a Hugging Face ``Conv1D``, ``(3d, d)`` for :class:`torch.nn.Linear` and
:class:`torch.nn.MultiheadAttention`'s ``in_proj_weight``). An optimizer sees it as *one* matrix, so
a Stiefel constraint makes the rows (or columns) of the whole stack orthonormal. The layer-wise
manifolds seed constrains each projection by itself, :math:`W_q^\top W_q = W_k^\top W_k =
W_v^\top W_v = I`. :func:`split_blocks` gives that choice: it installs an exact linear
parametrization

.. math::
    \phi(B_1, \dots, B_k) = \operatorname{cat}(B_1, \dots, B_k), \qquad
    \phi^{-1}(W) = \operatorname{split}(W),

so the module keeps its forward and its outputs, while its parameters become the blocks
``<module>.parametrizations.<tensor>.original0`` ... ``original{k-1}``, each a matrix that
:func:`~manifoldlib.optim.build_optimizer` assigns by the same name rules (the path still contains
``attn``). :func:`merge_blocks` stores the concatenation back into one plain tensor, e.g. before
saving a checkpoint in the original layout. Without :func:`split_blocks` the fused matrix stays one
block; both are valid choices, and the difference is the constraint set, not the model.

Some fused projections interleave the blocks head by head instead: GPT-NeoX's (and BLOOM's)
``query_key_value`` has rows ``(heads, 3, head_dim)``, so its first third is *not*
:math:`W_q`. With ``heads=h`` the output dimension is read as ``h`` equal slices, each holding its
share of every block in order; the blocks are still exactly q, k and v. Falcon's
``query_key_value`` is contiguous under multi-query attention (``blocks=[q, k, v sizes],
heads=1``), per head in the original layout (``heads=num_attention_heads``) and per key/value
group in the new decoder architecture (``blocks=[q, k, v sizes], heads=num_kv_heads``). Because
the name alone does not tell, a selected tensor whose module is named in :data:`PER_HEAD_NAMES`
needs ``heads`` given. GPTBigCode without multi-query attention lays out its ``c_attn`` per head
too (``heads=n_head``) under GPT-2's name for a contiguous one: its configuration says so, and
:func:`split_blocks` then requires ``heads``. A model of another family with such a layout is not
recognized: check the layout of a model's fused projection before splitting it.

Unlike a :class:`~manifoldlib.charts.Chart`, the blocks are the weight's own entries, so a
manifold-constrained optimizer on them is meaningful.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from .._numbers import is_integer
from .base import (  # output_dim: also read from here by optim
    _leave_merged,
    _own_parametrized_class,
    _owner_order,
    output_dim,
)

__all__ = ["FUSED_NAMES", "PER_HEAD_NAMES", "SplitBlocks", "merge_blocks", "split_blocks"]

#: Leaf module names (lower case) of fused q/k/v projections selected by default.
FUSED_NAMES = ("c_attn", "qkv", "qkv_proj", "wqkv", "query_key_value")

#: Leaf module names (lower case) whose q/k/v layout differs between model families (GPT-NeoX
#: interleaves per head, Falcon depends on its attention variant): splitting one needs ``heads``.
PER_HEAD_NAMES = ("query_key_value",)


class SplitBlocks(nn.Module):
    """Parametrization ``(B_1, ..., B_k) -> cat(B_1, ..., B_k, dim)``; ``right_inverse`` splits.

    Args:
        sizes: the block sizes along ``dim``, integers > 0.
        dim: the dimension that stacks the blocks (the output dimension of the fused map), an int.
        heads: the number of equal slices along ``dim`` that each hold ``size // heads`` entries of
            every block in turn (a per-head layout such as GPT-NeoX's); 1: contiguous blocks.
    """

    def __init__(self, sizes: Sequence[int], dim: int, heads: int = 1):
        super().__init__()
        try:
            if isinstance(sizes, (str, bytes)):
                raise TypeError
            sizes = list(sizes)
        except TypeError:
            raise ValueError(f"sizes must be a sequence of block sizes (ints), got {sizes!r}") from None
        bad = [s for s in sizes if not is_integer(s)]
        if bad:  # int(2.5) == 2 would split silently at the wrong place
            raise ValueError(f"block sizes must be integers (not bools), got {bad[0]!r} in {sizes}")
        sizes = [int(s) for s in sizes]
        if len(sizes) < 2 or min(sizes) < 1:
            raise ValueError(f"sizes must list at least two block sizes > 0, got {list(sizes)}")
        if not is_integer(dim):
            raise ValueError(f"dim must be an integer (not a bool), got {dim!r}")
        dim = int(dim)
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or any(s % heads for s in sizes):
            raise ValueError(f"heads must be an int >= 1 dividing every block size {sizes}, got {heads!r}")
        self.sizes, self.dim, self.heads = sizes, dim, heads

    def forward(self, *blocks: torch.Tensor) -> torch.Tensor:
        if self.heads == 1:
            return torch.cat(blocks, dim=self.dim)
        # each block (..., size, ...) -> (heads, size // heads, ...) along dim, interleaved per head
        per_head = [b.movedim(self.dim, 0).unflatten(0, (self.heads, -1)) for b in blocks]
        return torch.cat(per_head, dim=1).flatten(0, 1).movedim(0, self.dim)

    def right_inverse(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if weight.size(self.dim) != sum(self.sizes):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} has {weight.size(self.dim)} entries along "
                f"dim {self.dim}; the blocks {self.sizes} need {sum(self.sizes)}"
            )
        if self.heads == 1:
            return tuple(b.clone() for b in torch.split(weight, self.sizes, dim=self.dim))
        per_head = weight.movedim(self.dim, 0).unflatten(0, (self.heads, -1))  # (heads, total // heads, ...)
        parts = torch.split(per_head, [s // self.heads for s in self.sizes], dim=1)
        return tuple(b.flatten(0, 1).movedim(0, self.dim).contiguous().clone() for b in parts)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, dim={self.dim}" + (f", heads={self.heads}" if self.heads > 1 else "")


def _default_include(name: str, module: nn.Module) -> bool:
    leaf = name.rsplit(".", 1)[-1].lower()
    return leaf in FUSED_NAMES or isinstance(module, nn.MultiheadAttention)


def _grouped_query_sizes(model: nn.Module, total: int) -> list[int] | None:
    """The q, k, v sizes when ``model.config`` (a Hugging Face configuration) declares fewer
    key/value heads than query heads and ``total`` fits them; else ``None``."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and 0 < kv_heads < heads):
        return None
    head_dim, rest = divmod(total, heads + 2 * kv_heads)
    return None if rest else [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]


def _per_head_fused_heads(model: nn.Module) -> int | None:
    """The head count when ``model.config`` declares a fused q/k/v laid out head by head under a
    name that is contiguous elsewhere (GPTBigCode without multi-query attention: ``c_attn`` rows
    ``(heads, 3, head_dim)``, where GPT-2's are ``(3, heads, head_dim)``); else ``None``."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "gpt_bigcode" or getattr(config, "multi_query", True):
        return None
    heads = getattr(config, "num_attention_heads", None)
    return heads if isinstance(heads, int) and heads > 1 else None


def split_blocks(
    model: nn.Module,
    blocks: int | Sequence[int] = 3,
    include: Callable[[str, nn.Module], bool] | None = None,
    tensor_name: str = "weight",
    heads: int | None = None,
) -> list[str]:
    """Split every selected fused matrix into blocks along its output dimension, in place.

    Args:
        model: the model, modified in place (forward and outputs unchanged).
        blocks: the number of equal blocks (3: q, k, v) or the list of block sizes (grouped-query
            layouts with fewer k/v heads). Equal blocks are refused for a q/k/v projection
            (:data:`FUSED_NAMES`) of a model whose ``config`` declares fewer
            ``num_key_value_heads`` than ``num_attention_heads``.
        include: ``include(name, module) -> bool`` (default: a leaf name in :data:`FUSED_NAMES`
            or a :class:`torch.nn.MultiheadAttention`). A selected
            :class:`~torch.nn.MultiheadAttention` is split on ``in_proj_weight`` whatever
            ``tensor_name`` says.
        tensor_name: the fused parameter of the selected modules.
        heads: read the output dimension head by head (see :class:`SplitBlocks`): GPT-NeoX's
            ``query_key_value`` takes ``heads=num_attention_heads``; ``None`` (default) or 1 means
            contiguous blocks. Required for a module named in :data:`PER_HEAD_NAMES`.

    Returns:
        Qualified names of the split tensors.

    Raises:
        ValueError: a block count that does not divide the output dimension, sizes that do not
            add up to it, equal blocks for a grouped-query q/k/v, ``heads`` not dividing the block
            sizes, ``heads`` missing for a module named in :data:`PER_HEAD_NAMES` or for the fused
            projection of a model whose ``config`` declares a per-head layout, a selected
            tensor that is already parametrized, or one tied to (shared with) another module (each
            module would get blocks of its own, breaking the tie).
            Every selected tensor is checked before any is split, so after an error none is.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if is_integer(blocks):
        blocks = int(blocks)
    elif isinstance(blocks, (bool, str, bytes, float)) or not hasattr(blocks, "__iter__"):
        raise ValueError(f"blocks must be a number of equal blocks (an int >= 2) or a list of "
                         f"block sizes, got {blocks!r}")
    include = _default_include if include is None else include
    holders: dict[int, list[tuple[str, nn.Module]]] = {}  # a module used twice is no tie
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((f"{mname}.{pname}" if mname else pname, module))
    targets = []
    for mname, module in list(model.named_modules()):
        if not include(mname, module):
            continue
        tname = "in_proj_weight" if isinstance(module, nn.MultiheadAttention) else tensor_name
        qname = f"{mname}.{tname}" if mname else tname
        # a parametrized tensor (a chart, an earlier split) has left module._parameters
        if parametrize.is_parametrized(module, tname):
            raise ValueError(f"{qname} is already parametrized; merge it before splitting")
        param = module._parameters.get(tname)
        if param is None or param.dim() != 2:
            continue
        per_head = _per_head_fused_heads(model)
        if heads is None and per_head is not None and mname.rsplit(".", 1)[-1].lower() in FUSED_NAMES:
            raise ValueError(
                f"{qname}: this model's config ({type(model.config).__name__}, multi_query=False) "
                f"lays out its fused {mname.rsplit('.', 1)[-1]!r} head by head, so contiguous "
                f"blocks would not be q, k, v; pass heads={per_head}"
            )
        if heads is None and mname.rsplit(".", 1)[-1].lower() in PER_HEAD_NAMES:
            raise ValueError(
                f"{qname}: the q/k/v layout of a fused {mname.rsplit('.', 1)[-1]!r} differs between "
                f"model families; pass heads= (GPT-NeoX: heads=num_attention_heads; Falcon: heads=1 "
                f"with blocks=[q, k, v sizes] under multi-query attention) or exclude it with include=..."
            )
        shared = sorted({name for name, holder in holders[id(param)] if holder is not module})
        if shared:
            raise ValueError(
                f"{qname} is tied to {shared}; splitting would give each module blocks of its own. "
                f"Untie it or exclude it with include=..."
            )
        dim = output_dim(module)
        total = param.size(dim)
        if isinstance(blocks, int):
            grouped = _grouped_query_sizes(model, total)
            if grouped is not None and mname.rsplit(".", 1)[-1].lower() in FUSED_NAMES:
                raise ValueError(
                    f"{qname}: the model's config has fewer key/value heads than query heads, so k "
                    f"and v are smaller than q and {blocks} equal blocks would not be q, k, v; pass "
                    f"blocks={grouped}"
                )
            if blocks < 2 or total % blocks:
                raise ValueError(
                    f"blocks={blocks} must be >= 2 and divide {mname}.{tname}'s output size {total}"
                )
            sizes = [total // blocks] * blocks
        else:
            sizes = list(blocks)
        try:
            split = SplitBlocks(sizes, dim, 1 if heads is None else heads)
        except ValueError as err:
            raise ValueError(f"{qname}: {err}") from err
        if sum(split.sizes) != total:
            raise ValueError(
                f"{qname} has {total} entries along its output dimension {dim}; the blocks "
                f"{split.sizes} need {sum(split.sizes)}"
            )
        targets.append((qname, module, tname, split))
    for qname, module, tname, split in targets:
        split._owner_order = _owner_order(module)  # merge_blocks puts the tensor back in its place
        _own_parametrized_class(module)
        parametrize.register_parametrization(module, tname, split)
    return [qname for qname, *_ in targets]


def merge_blocks(model: nn.Module) -> list[str]:
    """Store every split tensor back as one plain parameter (the concatenation); return the names.

    The merged tensor is a new :class:`torch.nn.Parameter` (an optimizer holding the blocks needs
    rebuilding) in the tensor's place among its module's parameters, as :func:`split_blocks`
    found it; it requires a gradient unless every block was frozen (a frozen fused weight stays a
    frozen parameter, not a buffer), also when merged under :func:`torch.no_grad` or
    :func:`torch.inference_mode`."""
    names = []
    for mname, module in list(model.named_modules()):
        if not parametrize.is_parametrized(module):
            continue
        for tname in list(module.parametrizations.keys()):
            splits = [p for p in module.parametrizations[tname] if isinstance(p, SplitBlocks)]
            if not splits:
                continue
            _leave_merged(module, tname)
            names.append(f"{mname}.{tname}" if mname else tname)
    return names
