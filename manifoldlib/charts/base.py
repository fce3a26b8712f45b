r"""Charts: curved maps from raw coordinates to an effective weight, installed with ``parametrize``.

A :class:`Chart` is an :class:`torch.nn.Module` with ``forward(raw) -> weight`` and
``right_inverse(weight) -> raw``. :func:`apply_chart` installs one per selected tensor with
:func:`torch.nn.utils.parametrize.register_parametrization`; registration runs ``right_inverse`` on
the current (e.g. pretrained) weight, so converting a pretrained model *is* :func:`apply_chart`.
:func:`merge_charts` stores the effective weights back into plain tensors (zero inference cost).

Raw chart coordinates are Euclidean coordinates of a curved map, not points of a matrix manifold:
a manifold-constrained optimizer (Stiefel, DGram, sphere) on them has no meaning.
:func:`assert_chart_compatible` states that rule as a check and :func:`apply_chart` enforces it.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = [
    "Chart",
    "apply_chart",
    "assert_chart_compatible",
    "chart_parameter_names",
    "merge_charts",
    "output_dim",
]

_COMPATIBLE_KINDS = (None, "euclidean", "adamw")


class Chart(nn.Module):
    r"""Base class of a parameter chart :math:`\phi: \text{raw} \mapsto W`.

    Subclasses implement :meth:`forward` and :meth:`right_inverse`. When :attr:`exact_inverse` is
    True the chart guarantees ``forward(right_inverse(W)) == W`` (to rounding) for every admissible
    ``W``; a chart with a deliberately mismatched initialization sets it False and documents what
    ``forward(right_inverse(W))`` realizes instead.
    """

    exact_inverse: bool = True

    def forward(self, raw: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


def assert_chart_compatible(param_or_kind: Any, name: str = "parameter") -> None:
    """Raise if a charted parameter would be handed to a manifold-constrained optimizer.

    Raw chart coordinates live in flat space. They may be trained by AdamW, SGD, or
    ``ManifoldMuon`` with ``manifold="euclidean"``; a Stiefel/DGram/sphere constraint on them is
    meaningless (the *effective* weight would not be on that manifold either).

    Args:
        param_or_kind: a tensor (rejected if it is a ``geoopt.ManifoldParameter`` on a
            non-Euclidean manifold) or an optimizer assignment: ``None``/``"adamw"``/``"euclidean"``
            are accepted, any other manifold name is rejected.
        name: the parameter's name, used in the error message.

    Raises:
        ValueError: naming the parameter and the offending manifold.
    """
    if isinstance(param_or_kind, torch.Tensor):
        manifold = getattr(param_or_kind, "manifold", None)
        if manifold is None:
            return
        kind = getattr(manifold, "name", type(manifold).__name__)
        if str(kind).lower() == "euclidean":
            return
    else:
        kind = param_or_kind
        if kind is None or (isinstance(kind, str) and kind.lower() in _COMPATIBLE_KINDS[1:]):
            return
    raise ValueError(
        f"{name}: manifold={kind!r} cannot be combined with a chart. Raw chart (e.g. SEL) "
        f"coordinates "
        f"are not points of a matrix manifold, so a constrained optimizer on them has no meaning; "
        f"expected one of None, 'adamw', 'euclidean' (route charted parameters to AdamW)"
    )


def output_dim(module: nn.Module) -> int:
    """The output dimension of ``module``'s weight: 1 for a Hugging Face ``Conv1D`` (it stores
    ``(in, out)`` and computes ``x @ W``) and its subclasses (the ``ParametrizedConv1D`` that
    ``parametrize`` makes of one), 0 for every torch layer (``(out, in)``)."""
    return 1 if any(cls.__name__ == "Conv1D" for cls in type(module).__mro__) else 0


def _layout(module: nn.Module) -> str:
    """``"in_out"`` for a module whose weight is stored ``(in, out)`` (:func:`output_dim` 1),
    else ``"out_in"``: the names :func:`manifoldlib.optim.weight_layout` gives them."""
    return "in_out" if output_dim(module) == 1 else "out_in"


def _takes_layout(chart: Callable[..., Chart]) -> bool:
    """Whether :func:`apply_chart` passes ``layout=`` to the builder ``chart``: it names that
    keyword (as :class:`~manifoldlib.charts.SEL` does) and the caller has not bound it."""
    if isinstance(chart, functools.partial) and "layout" in chart.keywords:
        return False
    try:
        parameter = inspect.signature(chart).parameters.get("layout")
    except (TypeError, ValueError):  # a callable without a signature
        return False
    return parameter is not None and parameter.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _qualified(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf


def _has_chart(module: nn.Module, tensor_name: str) -> bool:
    if not parametrize.is_parametrized(module, tensor_name):
        return False
    return any(isinstance(p, Chart) for p in module.parametrizations[tensor_name])


def _own_parametrized_class(module: nn.Module) -> None:
    """Give a parametrized module a private copy of its generated ``Parametrized<Cls>`` class.

    ``parametrize`` stores each tensor's property on a class generated per module, but
    :func:`copy.deepcopy` keeps the class object, so a copy and its original share it; removing
    (or adding) a parametrization on one would then delete (or add) the property on both.
    """
    if not parametrize.is_parametrized(module):
        return
    cls = type(module)
    namespace = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    module.__class__ = type(cls.__name__, cls.__bases__, namespace)


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def apply_chart(
    model: nn.Module,
    chart: Callable[..., Chart],
    include: Callable[[str, nn.Module], bool] | None = None,
    tensor_name: str = "weight",
) -> list[str]:
    """Install a chart on every selected tensor; ``right_inverse`` converts the current values.

    Build the optimizer *after* this call. The charted tensor's parameter object now holds the
    chart's raw coordinates (:mod:`torch.nn.utils.parametrize` keeps it as ``original``) and the
    chart's own parameters (SEL's scales) are new: an optimizer made before would go on stepping
    the raw coordinates with moments gathered on the weights, and never see the scales. Nothing
    can detect such an optimizer here.

    Args:
        model: the model, modified in place.
        chart: builder called as ``chart(weight)`` with the tensor's current value (detached),
            returning a :class:`Chart`; pass options with :func:`functools.partial`. A builder
            that takes a ``layout`` keyword (:class:`~manifoldlib.charts.SEL` does) is called as
            ``chart(weight, layout=...)`` with the module's storage layout: ``"in_out"`` for a
            Hugging Face ``Conv1D`` (:func:`output_dim`), ``"out_in"`` for every torch layer, as
            :func:`manifoldlib.optim.weight_layout` reads it; a ``layout`` bound with
            :func:`functools.partial` is the caller's and is left alone.
        include: ``include(name, module) -> bool`` selects modules (default: every
            :class:`torch.nn.Linear`). Selected modules without a ``tensor_name`` parameter (e.g.
            ``bias=False``) are skipped. A frozen tensor (``requires_grad=False``) stays frozen:
            its chart's own parameters (SEL's scales) are created with ``requires_grad=False``
            too, so training the rest of the model leaves its effective weight unchanged.
        tensor_name: the parameter to chart on each selected module.

    Returns:
        Qualified names of the charted tensors, e.g. ``["blocks.0.attn.q.weight", ...]``; its
        length is the number of charted tensors. When it is empty a :class:`UserWarning` says so
        and names the module types that do hold a matrix ``tensor_name`` (a Hugging Face GPT-2's
        layers are ``Conv1D``, not :class:`torch.nn.Linear`, so an ``isinstance(m, nn.Linear)``
        filter selects none of them).

    Raises:
        ValueError: if a selected tensor is a manifold-constrained parameter, is tied to (shared
            with) another module, already carries a chart or another parametrization (blocks of
            :func:`~manifoldlib.charts.split_blocks`), or the builder does not return a Chart,
            or a chart cannot take the tensor's values (the message names the tensor). Either
            every selected tensor is charted or, after any error, none is: the tensors charted
            before it are restored, parameter objects and values (a copy of each charted
            tensor's values is held until the call returns).
    """
    _check_model(model)
    if not callable(chart):
        raise ValueError(f"chart must be a callable chart(weight) -> Chart, got {chart!r}")
    if include is None:
        include = lambda name, module: isinstance(module, nn.Linear)
    holders: dict[int, list[tuple[str, nn.Module]]] = {}  # a module used twice is no tie
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((_qualified(mname, pname), module))
    targets = []
    for mname, module in model.named_modules():
        if not include(mname, module):
            continue
        qname = _qualified(mname, tensor_name)
        if _has_chart(module, tensor_name):
            raise ValueError(
                f"{qname} already carries a chart; merge_charts(model) before charting again"
            )
        if parametrize.is_parametrized(module, tensor_name):  # e.g. split into blocks
            kinds = ", ".join(type(p).__name__ for p in module.parametrizations[tensor_name])
            raise ValueError(
                f"{qname} is already parametrized ({kinds}); merge it first (merge_blocks(model) "
                f"after split_blocks) or exclude it with include=..."
            )
        param = module._parameters.get(tensor_name)
        if param is None:
            continue
        assert_chart_compatible(param, qname)
        shared = sorted({name for name, holder in holders[id(param)] if holder is not module})
        if shared:
            raise ValueError(
                f"{qname} is tied to {shared}; a chart would overwrite the shared tensor with raw "
                f"coordinates. Untie it or exclude it with include=..."
            )
        targets.append((qname, module, param.requires_grad))
    names = []
    done: list[tuple[nn.Module, torch.Tensor, list[str]]] = []  # charted here: values, parameter order
    takes_layout = _takes_layout(chart)
    for qname, module, trainable in targets:
        weight = getattr(module, tensor_name).detach()
        try:
            built = chart(weight, layout=_layout(module)) if takes_layout else chart(weight)
            if not isinstance(built, Chart):
                raise ValueError(
                    f"chart builder must return a Chart, got {type(built).__name__} for {qname}"
                )
            saved, order = weight.clone(), _owner_order(module)
            _own_parametrized_class(module)
            if not trainable:  # a frozen weight stays frozen: its chart's scales too
                built.requires_grad_(False)
            parametrize.register_parametrization(module, tensor_name, built)
            built._owner_order = tuple(order)  # merge_charts puts the tensor back in its place
        except Exception as err:
            _uncharted(done, tensor_name)
            if isinstance(err, ValueError) and qname not in str(err):
                raise ValueError(f"cannot chart {qname}: {err}") from err
            raise
        done.append((module, saved, order))
        names.append(qname)
    if not names:
        _warn_nothing_charted(model, tensor_name)
    return names


def _uncharted(done: list[tuple[nn.Module, torch.Tensor, list[str]]], tensor_name: str) -> None:
    """Undo the charts :func:`apply_chart` installed before a later tensor failed: each module is
    plain again and holds its original parameter object with its original values, in its
    original place among the module's parameters."""
    for module, saved, order in reversed(done):
        _own_parametrized_class(module)
        parametrize.remove_parametrizations(module, tensor_name, leave_parametrized=False)
        with torch.no_grad():
            getattr(module, tensor_name).copy_(saved)
        _restore_order(module, order)


def _owner_order(module: nn.Module) -> tuple[str, ...]:
    """``module``'s parameter names in their order before any parametrization of
    :func:`apply_chart` or :func:`~manifoldlib.charts.split_blocks`: the order one of them
    recorded (``_owner_order``), with parameters registered since at the end. A tensor that is
    already parametrized has left ``_parameters``: read from there alone, a weight charted after
    its bias recorded ``("weight",)`` and came back after the bias when merged."""
    present = tuple(module._parameters)
    if parametrize.is_parametrized(module):
        for plist in module.parametrizations.values():
            for p in plist:
                order = getattr(p, "_owner_order", None)
                if order:
                    return tuple(order) + tuple(k for k in present if k not in order)
    return present


def _restore_order(module: nn.Module, order) -> None:
    """Put ``module``'s parameters back in ``order`` (removing a parametrization re-registers
    the tensor last, which moves it in ``parameters()``, ``parameters_to_vector`` and the
    positional state of an optimizer built afterwards)."""
    params = module._parameters
    params.update({key: params.pop(key) for key in order if key in params})


def _warn_nothing_charted(model: nn.Module, tensor_name: str) -> None:
    holders = Counter(
        type(module).__name__
        for _, module in model.named_modules()
        if isinstance(module._parameters.get(tensor_name), torch.Tensor)
        and module._parameters[tensor_name].dim() == 2
    )
    found = ", ".join(f"{cls} ({n})" for cls, n in sorted(holders.items())) or "none"
    warnings.warn(
        f"apply_chart charted 0 tensors: include selected no module with a {tensor_name!r} "
        f"parameter. Modules holding a 2-D {tensor_name!r}: {found}; widen include=... "
        f"(name, module) -> bool to chart them.",
        UserWarning,
        stacklevel=3,
    )


def merge_charts(model: nn.Module, charts_only: bool = True) -> list[str]:
    """Replace each charted tensor by its effective value and remove the parametrization.

    Uses :func:`torch.nn.utils.parametrize.remove_parametrizations` with
    ``leave_parametrized=True``: the module becomes a plain module again whose outputs equal the
    charted module's, and the parameter object is kept (optimizers holding it stay valid). A
    tensor charted by :func:`apply_chart` returns to its place among the module's parameters, so
    ``parameters()`` lists the merged model in the uncharted model's order.

    Args:
        model: the model, modified in place.
        charts_only: merge only tensors whose parametrization list contains a :class:`Chart`;
            with False, every parametrization in the model is merged, the blocks of
            :func:`~manifoldlib.charts.split_blocks` as :func:`~manifoldlib.charts.merge_blocks`
            merges them (one parameter, trainable unless every block was frozen).

    Returns:
        Qualified names of the merged tensors.
    """
    _check_model(model)
    names = []
    for mname, module in list(model.named_modules()):
        if not parametrize.is_parametrized(module):
            continue
        for tensor_name in list(module.parametrizations.keys()):
            if charts_only and not _has_chart(module, tensor_name):
                continue
            _leave_merged(module, tensor_name)
            names.append(_qualified(mname, tensor_name))
    return names


def _leave_merged(module: nn.Module, tensor_name: str) -> None:
    """Remove ``module``'s parametrization of ``tensor_name``, leaving its current value as a
    plain :class:`torch.nn.Parameter` in the place :func:`apply_chart` or
    :func:`~manifoldlib.charts.split_blocks` found it (``_owner_order``).

    A tensor parametrized by one original keeps that parameter object (torch sets its value).
    One parametrized by several (blocks) becomes a new parameter that requires a gradient where
    any original does: torch reads that from the value it computes, so it left the merge of a
    frozen tensor, and of any tensor merged under :func:`torch.no_grad` or
    :func:`torch.inference_mode`, as a buffer, out of ``parameters()``."""
    plist = module.parametrizations[tensor_name]
    order = next((p._owner_order for p in plist
                  if getattr(p, "_owner_order", None) is not None), ())
    trainable = plist.is_tensor or any(getattr(plist, f"original{i}").requires_grad
                                       for i in range(plist.ntensors))
    _own_parametrized_class(module)  # a deep copy's original keeps its parametrization
    parametrize.remove_parametrizations(module, tensor_name, leave_parametrized=True)
    if not plist.is_tensor:
        merged = module._parameters.pop(tensor_name, None)
        merged = module._buffers.pop(tensor_name) if merged is None else merged
        merged = merged.detach()
        if merged.is_inference():  # computed under inference_mode: it could never train
            with torch.inference_mode(False):
                merged = merged.clone()
        module.register_parameter(tensor_name, nn.Parameter(merged, requires_grad=trainable))
    _restore_order(module, order)


def chart_parameter_names(model: nn.Module) -> set[str]:
    """Names of all parameters that belong to a chart: raw coordinates and the chart's own scales.

    An optimizer policy can use it to route these to AdamW (see :func:`assert_chart_compatible`).
    """
    names = set()
    for mname, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for tensor_name, plist in module.parametrizations.items():
            if not any(isinstance(p, Chart) for p in plist):
                continue
            prefix = _qualified(mname, f"parametrizations.{tensor_name}")
            names.update(_qualified(prefix, n) for n, _ in plist.named_parameters())
    return names
