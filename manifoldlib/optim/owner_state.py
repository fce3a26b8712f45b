"""The warm-start state of each matrix: shared for a checkpoint, and loaded in its own dtype.

In sharded mode only a matrix's owner rank keeps its ``"dual_correction"``, ``"dual_iterations"``
and ``"dual_residual"``; :func:`share_owner_state` (what
:meth:`~manifoldlib.optim.ManifoldMuon.consolidate_state_dict` runs) gives every rank a copy.

``"dual_correction"`` lives in the dual solve's work dtype (float32 for a 16-bit parameter,
float64 for a float32 solve smoothed in float64 on CUDA), not the parameter's, while
:meth:`torch.optim.Optimizer.load_state_dict` casts every floating-point state tensor to its
parameter's dtype: :func:`restore_dual_corrections` puts the saved tensors back after it, so a
resumed run takes the steps of an uninterrupted one.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import Tensor

from ..distributed import sharded_apply
from .muon_groups import group_manifold

__all__ = ["restore_dual_corrections", "share_owner_state"]


@torch.no_grad()
def share_owner_state(optimizer) -> None:
    """Copy every matrix's owner-only state to every rank of ``optimizer.process_group`` (a collective)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owners = optimizer.owners()
    ranks = [owners[id(p)] for p in params]
    corrections = []  # (k, k) per matrix, k = min(m, n), in the dual solve's dtype
    for p in params:
        k = min(p.shape)
        dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
        corrections.append(torch.zeros(k, k, dtype=dtype, device=p.device))
    # [has state, has correction, iterations, residual] per matrix
    scalars = [torch.zeros(4, dtype=torch.float64, device=p.device) for p in params]

    def owned_correction(i: int, template: Tensor) -> Tensor:
        value = optimizer.state.get(params[i], {}).get("dual_correction")
        return template if value is None else value.to(template.dtype)

    def owned_scalars(i: int, template: Tensor) -> Tensor:
        state = optimizer.state.get(params[i], {})
        if "dual_iterations" not in state:
            return template
        return torch.tensor(
            [
                1.0,
                float(state.get("dual_correction") is not None),
                float(state["dual_iterations"]),
                float(state["dual_residual"]),
            ],
            dtype=torch.float64,
            device=template.device,
        )

    shared_corrections = sharded_apply(
        corrections, owned_correction, process_group=optimizer.process_group, owners=ranks
    )
    shared_scalars = sharded_apply(
        scalars, owned_scalars, process_group=optimizer.process_group, owners=ranks
    )
    euclidean = {
        id(p) for group in optimizer.param_groups if group_manifold(group).flat
        for p in group["params"]
    }
    for p, correction, values in zip(params, shared_corrections, shared_scalars):
        has_state, has_correction, iterations, residual = values.tolist()
        if not has_state:
            continue
        state = optimizer.state[p]
        state["dual_iterations"] = int(iterations)
        state["dual_residual"] = residual
        if id(p) not in euclidean:  # a dual solve writes the correction, possibly None
            state["dual_correction"] = correction.clone() if has_correction else None


def restore_dual_corrections(optimizer, state_dict: dict[str, Any]) -> None:
    """After ``optimizer.load_state_dict(state_dict)``: each parameter's ``"dual_correction"`` as saved
    (its dtype, on the parameter's device), not cast to the parameter's dtype.

    Parameters are matched to the saved ids as :meth:`torch.optim.Optimizer.load_state_dict` matches
    them (group by group, in order); state without a correction is left as loaded.
    """
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    for saved_id, p in zip(saved_ids, params):
        correction = state_dict["state"].get(saved_id, {}).get("dual_correction")
        if isinstance(correction, Tensor) and p in optimizer.state:
            optimizer.state[p]["dual_correction"] = correction.to(device=p.device, copy=True)
