r"""Module-wise Manifold Muon as the layer-wise-manifolds paper's public code runs it.

The library's :class:`~manifoldlib.optim.ManifoldMuon` solves each step's dual to a tolerance and
retracts with a retraction (:math:`R_W(0) = W`). The paper's public training code does less, and
its results were produced with that; to test the paper's claims as it ran them, this optimizer
reproduces its step (written here from its description, in this project's style):

**Momentum** in the sum form, Nesterov: :math:`B \leftarrow \mu B + G`, :math:`U = G + \mu B`
(float32).

**Euclidean** matrices: :math:`W \leftarrow (1 - \eta\lambda)W - \eta\,\mathrm{msign}(U)` (Polar
Express), no shape factor on :math:`\eta`.

**A manifold** with Gram projector :math:`P` (Stiefel :math:`P = \mathrm{Id}`, DGram
:math:`P = \mathrm{Off}`, Oblique :math:`P = \mathrm{Diag}`), in the tall orientation: an *inexact*
dual ascent of ``dual_steps`` steps (20 in the paper's runs) with a linearly decaying step,

.. math::

    \Lambda_0 = -\tfrac14 P(W^\top U + U^\top W),\qquad
    A_t = \mathrm{msign}\big(U + 2W P(\mathrm{sym}\,\Lambda_t)\big),\qquad
    \Lambda_{t+1} = \Lambda_t - \alpha\,(1 - t/T)\,P(W^\top A_t + A_t^\top W),

stopped early when the RMS of :math:`P(W^\top A_t + A_t^\top W)` is below ``dual_tol``; then
:math:`W \leftarrow \mathcal{R}(W - \eta A)` with no weight decay, where :math:`\mathcal{R}` is
the code's "retraction":

- Stiefel: :math:`\mathrm{msign}` (the polar factor, a retraction);
- Oblique: columns normalized (a retraction);
- DGram: with :math:`Y = U_Y \Sigma V_Y^\top` (singular values in *descending* order),
  :math:`\mathcal{R}(Y) = U_Y V_Y^\top \operatorname{diag}(\sigma_1, \dots, \sigma_n)`: column
  :math:`j` of the polar factor gets the :math:`j`-th largest singular value. This is not a
  retraction: for :math:`W` on DGram, :math:`\mathcal{R}(W)` has :math:`W`'s column norms sorted
  into descending column order, so unless they already were, every step moves the scales between
  columns (:func:`sorted_scale_polar`).

Nothing is checked on the device beyond what the code checks; a non-finite gradient propagates.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from manifoldlib.functional import msign

__all__ = ["ReferenceManifoldMuon", "reference_dual", "sorted_scale_polar"]

MANIFOLDS = ("euclidean", "stiefel", "dgram", "oblique")


def _project(m: Tensor, manifold: str) -> Tensor:
    """The Gram projector :math:`P` of ``manifold`` on ``(..., n, n)``."""
    if manifold == "stiefel":
        return m
    eye = torch.eye(m.size(-1), dtype=m.dtype, device=m.device)
    return m * (1 - eye) if manifold == "dgram" else m * eye


def sorted_scale_polar(y: Tensor) -> Tensor:
    r""":math:`U_Y V_Y^\top\operatorname{diag}(\sigma)` of a tall ``(..., m, n)`` ``y``, singular values
    descending: the DGram "retraction" of the public code (column :math:`j` gets the
    :math:`j`-th largest singular value)."""
    u, s, vh = torch.linalg.svd(y, full_matrices=False)
    return (u @ vh) * s.unsqueeze(-2)


def _retract(y: Tensor, manifold: str) -> Tensor:
    if manifold == "stiefel":
        return msign(y, "polar-express")
    if manifold == "dgram":
        return sorted_scale_polar(y)
    return y / y.norm(dim=-2, keepdim=True).clamp(min=1e-8)


def reference_dual(w: Tensor, u: Tensor, manifold: str, steps: int, alpha: float, tol: float) -> tuple[Tensor, int]:
    """The public code's dual ascent on a tall ``w`` ``(m, n)`` and update ``u``: ``(A, steps run)``."""
    lam = -0.25 * _project(w.mT @ u + u.mT @ w, manifold)
    a = u
    for step in range(steps):
        a = msign(u + 2 * w @ _project(0.5 * (lam + lam.mT), manifold), "polar-express")
        h = _project(w.mT @ a + a.mT @ w, manifold)
        if float(h.norm()) / math.sqrt(h.numel()) < tol:
            return a, step + 1
        lam = lam - alpha * (1 - step / steps) * h
    return a, steps


class ReferenceManifoldMuon(torch.optim.Optimizer):
    """The public code's Muon per parameter group (``"manifold"`` one of :data:`MANIFOLDS`).

    Args:
        params: 2-D matrices, or groups with a ``"manifold"`` key.
        lr: :math:`\\eta` (the public code's 0.02).
        momentum: :math:`\\mu` (0.95).
        weight_decay: :math:`\\lambda`, applied to Euclidean matrices only.
        dual_steps: dual ascent steps (20).
        dual_alpha: the dual step size (0.1).
        dual_tol: RMS tangent violation that stops the dual early (1e-6).
        manifold: the default manifold of groups that name none.

    Parameters are moved onto their manifold (by the same "retraction") when the optimizer is made,
    as the public code does before training.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0, *,
                 dual_steps: int = 20, dual_alpha: float = 0.1, dual_tol: float = 1e-6,
                 manifold: str = "euclidean") -> None:
        if not (isinstance(dual_steps, int) and dual_steps >= 1):
            raise ValueError(f"dual_steps must be an int >= 1, got {dual_steps!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "dual_steps": dual_steps,
                    "dual_alpha": float(dual_alpha), "dual_tol": float(dual_tol), "manifold": manifold,
                    "layout": "out_in"}  # torch.nn.Linear's storage; the tall orientation is taken by shape
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["manifold"] not in MANIFOLDS:
            self.param_groups.pop()
            raise ValueError(f"unknown manifold {group['manifold']!r}; valid: {', '.join(MANIFOLDS)}")
        for p in group["params"]:
            if p.dim() != 2:
                self.param_groups.pop()
                raise ValueError(f"ReferenceManifoldMuon takes 2-D matrices, got shape {tuple(p.shape)}")
        if group["manifold"] != "euclidean":
            with torch.no_grad():
                for p in group["params"]:
                    w = p.float()
                    tall = w.mT if w.size(0) < w.size(1) else w
                    done = _retract(tall, group["manifold"])
                    p.copy_((done.mT if w.size(0) < w.size(1) else done).to(p.dtype))

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group; ``closure`` re-evaluates the loss (optional)."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        """One step of a group's matrices (see the module docstring)."""
        lr, mu, manifold = group["lr"], group["momentum"], group["manifold"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad.float()
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(g)
            u = g + mu * buf
            if manifold == "euclidean":
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                p.add_(msign(u, "polar-express").to(p.dtype), alpha=-lr)
                continue
            w = p.float()
            flip = w.size(0) < w.size(1)
            w, u = (w.mT, u.mT) if flip else (w, u)
            a, state["dual_steps"] = reference_dual(w, u, manifold, group["dual_steps"], group["dual_alpha"],
                                                    group["dual_tol"])
            new = _retract(w - lr * a, manifold)
            p.copy_((new.mT if flip else new).to(p.dtype))
