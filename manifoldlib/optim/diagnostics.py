r"""Numbers worth logging while training with Manifold Muon.

- :func:`constraint_residual`: how far a matrix is from its manifold, Stiefel
  :math:`\|W^\top W - I\|_F`, DGram :math:`\|\operatorname{Off}(C)\|_F / \|C\|_F` of the column
  cosines :math:`C = D^{-1}W^\top W D^{-1}`, :math:`D = \operatorname{diag}(\|w_j\|)` (each pair
  of columns at its own scale; NaN for a zero column), Oblique :math:`\|\operatorname{diag}(W^\top W) - 1\|` (tall
  orientation; the manifolds' own checks);
- :func:`spectral_norm`: :math:`\|W\|_2`;
- :func:`optimizer_diagnostics`: both per Muon matrix, plus the dual iterations and residual of
  the last step (recorded in the optimizer state);
- :func:`max_attention_logit`: :math:`\max |q\cdot k|/\sqrt{d_h}` per attention layer, from
  ``model.max_attention_logit`` where the model has it (``models.GPT``), else from forward hooks
  on every ``attn.q`` / ``attn.k`` pair.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..distributed import is_row_sharded
from .options import check_layout, tall
from .steepest import matrix_manifold

__all__ = ["constraint_residual", "max_attention_logit", "optimizer_diagnostics", "spectral_norm"]


@torch.no_grad()
def constraint_residual(w: torch.Tensor, manifold, layout: str = "out_in") -> float:
    r"""Distance of ``w`` (``(m, n)``, either orientation) from ``manifold`` (a name or a manifold
    object): the manifold's own :meth:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold.constraint_residual`
    in float64, on the map's matrix in its tall orientation (``layout``: how ``w`` is stored,
    :mod:`~manifoldlib.optim.options`); 0 for Euclidean. For DGram it is
    :math:`\|\operatorname{Off}(C)\|_F / \|C\|_F` of the column cosines
    :math:`C_{ij} = w_i^\top w_j / (\|w_i\|\|w_j\|)`: a small column far from orthogonal to a
    large one counts in full. It was :math:`\|\operatorname{Off}(W^\top W)\|_F / \|W^\top W\|_F`,
    in which such a column vanished; the two agree where the columns have equal norms.

    Raises:
        ValueError: unknown manifold or layout, or a non-matrix ``w``.
    """
    geometry = matrix_manifold(manifold)
    if w.dim() != 2:
        raise ValueError(f"constraint_residual needs a matrix, got shape {tuple(w.shape)}")
    return float(geometry.constraint_residual(tall(w, check_layout(layout)).to(torch.float64)))


@torch.no_grad()
def spectral_norm(w: torch.Tensor) -> float:
    """Largest singular value of a matrix."""
    if w.dim() != 2:
        raise ValueError(f"spectral_norm needs a matrix, got shape {tuple(w.shape)}")
    return float(torch.linalg.matrix_norm(w.to(torch.float64), ord=2))


def optimizer_diagnostics(optimizer: torch.optim.Optimizer, *, spectral: bool = True) -> dict[str, dict]:
    """Per Muon matrix: ``manifold``, ``residual`` (of the point), ``spectral_norm``, and what the
    last step did: ``dual_iterations``, ``dual_residual`` (the tangent residual of the direction it
    took), ``retraction_residual`` (of a sync-free retraction) and ``skipped_steps`` (steps the
    matrix kept its value: a non-finite gradient, or a retraction that did not converge).

    A residual that was not measured is NaN, not 0 (which would read as exact): both residuals
    before the first step, on a Euclidean matrix (no dual, no retraction) and after a step skipped
    for a non-finite gradient (no direction was solved; its ``dual_iterations`` is 0), and the
    retraction residual where the manifold's own retraction ran (the early-stopping path: it
    checks its own accuracy). Leave NaNs out of an average (``torch.nanmean``).

    Works on a :class:`~manifoldlib.optim.ManifoldMuon` or the combined optimizer of
    :func:`~manifoldlib.optim.build_optimizer` (keys are the parameter names recorded there, or
    ``"group{i}.param{j}"``). Reads the step's device values back (one host synchronization per
    call): call it at logging time. ``spectral=False`` skips the SVD-based spectral norm. With
    FSDP2's row-sharded parameters each matrix is gathered whole (a collective: every rank calls it).
    """
    out: dict[str, dict] = {}
    for gi, group in enumerate(optimizer.param_groups):
        if "manifold" not in group:
            continue
        names = group.get("param_names") or [f"group{gi}.param{j}" for j in range(len(group["params"]))]
        for name, p in zip(names, group["params"]):
            state = optimizer.state.get(p, {})
            w = p.detach().full_tensor() if is_row_sharded(p) else p.detach()
            row = {
                "manifold": group["manifold"],
                "residual": constraint_residual(w, group["manifold"], group.get("layout", "out_in"))
                if p.numel() else 0.0,
                "dual_iterations": int(state.get("dual_iterations", 0)),
                "dual_residual": float(state.get("dual_residual", math.nan)),
                "retraction_residual": float(state.get("retraction_residual", math.nan)),
                "skipped_steps": int(state.get("skipped_steps", 0)),
            }
            if spectral:
                row["spectral_norm"] = spectral_norm(w) if p.numel() else 0.0
            out[name] = row
    return out


@torch.no_grad()
def max_attention_logit(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    r"""Per attention layer, :math:`\max |q\cdot k|/\sqrt{d_h}` over batch, heads and causal pairs.

    Uses ``model.max_attention_logit(idx)`` when the model provides it (``models.GPT`` does).
    Otherwise hooks every module named ``...attn`` that has ``q`` and ``k`` children, runs one
    forward in eval mode, and splits heads by the module's ``n_head`` attribute (1 if absent).

    Returns:
        ``(n_attention_layers,)`` tensor.
    """
    if hasattr(model, "max_attention_logit") and callable(model.max_attention_logit):
        return model.max_attention_logit(idx)
    attn_modules = [
        m for name, m in model.named_modules()
        if name.split(".")[-1] == "attn" and hasattr(m, "q") and hasattr(m, "k")
    ]
    if not attn_modules:
        raise ValueError("the model has no 'attn' module with 'q' and 'k' children")
    captured: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    for i, attn in enumerate(attn_modules):
        captured[i] = {}
        for key in ("q", "k"):
            def hook(_module, _inputs, output, i=i, key=key):
                captured[i][key] = output.detach()
            handles.append(getattr(attn, key).register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        model(idx)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    maxima = []
    for i, attn in enumerate(attn_modules):
        q, k = captured[i]["q"], captured[i]["k"]  # (B, T, C)
        n_head = int(getattr(attn, "n_head", 1))
        b, t, c = q.shape
        hd = c // n_head
        qh = q.view(b, t, n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        kh = k.view(b, t, n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        scores = (qh @ kh.transpose(-2, -1)).abs() / math.sqrt(hd)  # (B, nh, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        maxima.append(scores.masked_fill(~causal, 0.0).amax())
    return torch.stack(maxima)
