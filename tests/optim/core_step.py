"""One step of the functional core from a fresh state, with a ManifoldMuon group's options: what
``ManifoldMuon.step`` runs for one matrix (shared by the tests that compare the two)."""

from __future__ import annotations

import torch

from manifoldlib.optim import manifold_muon


def core_step(start, grad, group, manifold, *, fuse_retraction, execution=None):
    """The new value of ``start`` after one ``manifold_muon`` step on ``grad`` (zero momentum buffer)."""
    w = start.clone()
    manifold_muon(
        [w], [grad.clone()], [torch.zeros_like(w)], [{}],
        lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
        nesterov=group["nesterov"], ns_coefficients=tuple(group["ns_coefficients"]),
        ns_steps=group["ns_steps"], eps=group["eps"], adjust_lr_fn=group["adjust_lr_fn"],
        manifold=manifold, dual=group["dual"], fuse_retraction=fuse_retraction, execution=execution,
    )
    return w
