"""reject_unsupported_parameter: whole tensors pass, FSDP-flattened ones are refused.

DTensor parameters need a device mesh, so they are checked inside the 2-process job
(test_multiprocess_sharding.py). FSDP1 itself needs an accelerator; its FlatParameter and the
``_fsdp_flattened`` mark it puts on original parameters are built directly here.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._common_utils import _set_fsdp_flattened
from torch.distributed.fsdp._flat_param import FlatParameter

from manifoldlib.distributed import UnsupportedParameterError, reject_unsupported_parameter


def test_whole_parameters_pass() -> None:
    layer = torch.nn.Linear(4, 3)
    for name, param in layer.named_parameters():
        assert reject_unsupported_parameter(param, name) is None
    assert reject_unsupported_parameter(torch.zeros(2, 2)) is None


def test_fsdp_flat_parameter_is_refused() -> None:
    flat = FlatParameter(torch.zeros(12))
    with pytest.raises(
        UnsupportedParameterError,
        match=r"'_fsdp_wrapped_module._flat_param' is an FSDP FlatParameter \(shape \(12,\)\)",
    ):
        reject_unsupported_parameter(flat, "_fsdp_wrapped_module._flat_param")


def test_parameter_flattened_by_fsdp_is_refused() -> None:
    view = torch.nn.Parameter(torch.zeros(6))  # what use_orig_params=True leaves in the module
    _set_fsdp_flattened(view)
    with pytest.raises(
        UnsupportedParameterError, match=r"parameter 'attn.q.weight' was flattened by FSDP"
    ) as caught:
        reject_unsupported_parameter(view, "attn.q.weight")
    assert "DistributedDataParallel" in str(caught.value)


def test_unsupported_parameter_error_is_both_type_and_value_error() -> None:
    flat = FlatParameter(torch.zeros(3))
    for kind in (TypeError, ValueError):
        with pytest.raises(kind):
            reject_unsupported_parameter(flat)


def test_non_tensors_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="parameter 'w' must be a torch.Tensor, got list"):
        reject_unsupported_parameter([1.0, 2.0], "w")  # type: ignore[arg-type]
