r"""SphereResidual: a residual connection that stays on the hidden-state sphere.

.. math::
    h_l = R_{h_{l-1}}\big(\alpha_l\,\lambda_l\,\hat F_l\big), \qquad
    \hat F_l = \begin{cases}
        P_{h}(F_l(h)) & \text{step="literal" (the seed's update)} \\
        r\,P_{h}(F_l(h)) / \|P_{h}(F_l(h))\| & \text{step="normalized"}
    \end{cases}

:math:`R` is any registered sphere retraction (gnomonic = Proj-SpheretNorm, Cayley =
Cay-SpheretNorm, the p-family, the exponential map = GeoNorm, or a user's own
:class:`~manifoldlib.retractions.AngleRetraction`), :math:`P_h` the tangent projection,
:math:`r = \|h\|`, :math:`\alpha_l > 0` a learnable scalar and :math:`\lambda_l` a fixed depth
damping. The rotation angle is :math:`\theta = \theta_R(\beta)` with the normalized step

.. math::
    \beta = \alpha_l\lambda_l\,\|P_h F\|/r \ \text{(literal)}, \qquad
    \beta = \alpha_l\lambda_l \ \text{(normalized)}.

In the literal form the angle carries the scale of the sub-layer output, hence of its weights'
initialization and of the width; in the normalized form (normalizing the update before it enters
the stream, as nGPT also does, though with a per-token angle) :math:`\alpha_l\lambda_l` alone
sets it and the sub-layer only chooses the direction.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..retractions.base import Retraction, resolve_retraction
from ._fused import sphere_residual, sphere_residual_reference

__all__ = ["DAMPINGS", "STEP_FORMS", "SphereResidual", "damping_factor", "rotation_angle"]

#: Depth-damping schedules :math:`\lambda_l` by name.
DAMPINGS = ("sqrt", "linear", "none")
#: Step forms of :class:`SphereResidual`: what the retraction is fed.
STEP_FORMS = ("normalized", "literal")
#: Default :math:`\alpha_0` per step form: the normalized step's angle is :math:`\alpha\lambda`
#: itself (0.5 rad of step at the first sub-layer); the literal step multiplies the sub-layer's
#: own scale, so it starts at 1 (the seed's plain residual scale).
DEFAULT_ALPHA = {"normalized": 0.5, "literal": 1.0}


@torch.no_grad()
def rotation_angle(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    r"""The angle from ``h`` to ``out`` (same radius) row by row, ``(..., 1)`` radians in
    :math:`[0, \pi]`: :math:`\operatorname{atan2}(\|P_h\,\mathrm{out}\|, \langle h, \mathrm{out}\rangle / r)`
    (0 for a zero row of both, which :class:`SphereResidual` keeps)."""
    r = torch.linalg.vector_norm(h, dim=-1, keepdim=True)  # (..., 1)
    r = torch.where(r > 0, r, 1.0)  # a zero row: along and across are 0, atan2(0, 0) = 0
    along = (h * out).sum(-1, keepdim=True) / r  # (..., 1)
    across = torch.linalg.vector_norm(out - along * h / r, dim=-1, keepdim=True)
    return torch.atan2(across, along)


def damping_factor(damping: str, layer: int) -> float:
    r"""The damping :math:`\lambda_l` of layer ``layer`` (1-based).

    ``"sqrt"``: :math:`1/\sqrt l` (the SpheretNorm default), ``"linear"``: :math:`1/l`,
    ``"none"``: 1.
    """
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 1:
        raise ValueError(f"layer must be an integer >= 1 (1-based depth), got {layer!r}")
    if damping == "sqrt":
        return 1.0 / math.sqrt(layer)
    if damping == "linear":
        return 1.0 / layer
    if damping == "none":
        return 1.0
    raise ValueError(f"unknown damping {damping!r}; valid dampings: {', '.join(DAMPINGS)}")


class SphereResidual(nn.Module):
    r"""Residual update on the sphere: :math:`h \mapsto R_h(\alpha\lambda\,\hat F)`.

    The radius is **read from** :math:`\|h\|` row by row, so the layer works on whatever sphere
    the network put its hidden states on (in :class:`models.GPT`, the one set by the
    :class:`~manifoldlib.nn.ScaleNorm` after the embedding) and keeps it: every retraction of
    the family preserves the norm exactly in exact arithmetic.

    :math:`\alpha` is one learnable **scalar per layer**, as in the SpheretNorm paper, and
    positive by construction: the parameter is :math:`\rho = \log\alpha` (:attr:`log_alpha`), so
    an optimizer step on it is a *relative* change of the step length and no step can flip the
    update's direction. It scales the step length only, so the update stays a rotation in
    :math:`\operatorname{span}(h, F)` in the direction of the sub-layer's own :math:`P_h F`.

    ``step`` chooses what the retraction is fed (module docstring): ``"normalized"`` (default)
    rotates by :math:`\theta_R(\alpha\lambda)` whatever the scale of :math:`F`; ``"literal"`` is
    the seed's :math:`\alpha\lambda P_h F`, whose angle is proportional to
    :math:`\|P_h F\|/r` (small at a GPT-2 initialization, growing with the width).

    Args:
        dim: feature size :math:`d`.
        layer: 1-based depth :math:`l` of this update, used by the damping.
        retraction: sphere retraction name or instance (``"p"``, ``"gnomonic"``, ``"cayley"``,
            ``"exp"``, a user's registered name...). A class that overrides ``retract`` is run
            through that ``retract`` (the reference path, whatever ``fused`` says), unless the
            override only forwards to ``super().retract`` (:func:`~manifoldlib.nn.sphere_residual`).
        p: the ``p`` of the p-family, used only when ``retraction == "p"``; ``p = inf`` is the
            exponential map.
        damping: ``"sqrt"`` (:math:`1/\sqrt l`), ``"linear"`` (:math:`1/l`) or ``"none"``.
        step: ``"normalized"`` or ``"literal"``.
        alpha_init: initial :math:`\alpha > 0` (default: 0.5 normalized, 1 literal).
        eps: relative floor of the normalized step (see
            :func:`~manifoldlib.functional.sphere_unit_tangent`); a call refuses one whose square
            is not a normal number of the dtype the rows are computed in (below about
            :math:`1.1\cdot 10^{-19}` for float32, bfloat16 and float16, :math:`1.5\cdot 10^{-154}`
            for float64), where a zero update would come out NaN.
        fused: use the analytic-backward function (``True``) or the plain-autograd reference
            (``False``; e.g. for a second derivative, which the fused path does not have). On
            contiguous float32/float64 CPU tensors (bf16 runs in float32) the fused path does its
            full-tensor passes in small C++ kernels, compiled on first use into torch's extension
            cache (``TORCH_EXTENSIONS_DIR``), under ``torch.compile`` too (opaque operators in its
            graph, for the built-in retractions); ``MANIFOLDLIB_CPU_KERNELS=0`` switches them off,
            and if they cannot be built it warns once and uses ATen, as on every other device.
            The normalized step's per-row factor is plain autograd in both cases. Nonzero rows
            of tiny norm (float32 below :math:`2^{-32}`, float64 below :math:`2^{-300}`) are
            exact where the C++ kernels run them and with ``fused=False``, and come out NaN on the ATen path (which
            includes a user's retraction in the normalized step;
            :func:`~manifoldlib.nn.sphere_residual`); a zero row is kept on every path (below).
            A nonzero row whose update overflows the dtype (:math:`\|P_h F\|^2` or the literal
            step's :math:`\beta^2` beyond its largest number: a diverged sub-layer) comes out NaN on
            every path.

    **A zero row of** :math:`h` (outside the contract: its sphere has radius 0) **is kept**, on
    every path (C++ kernels, ATen, ``fused=False``, ``torch.compile``), with finite gradients, whatever
    the scale of :math:`F` (no square of :math:`F` enters the row). The
    sphere of radius 0 is the single point 0 and its tangent space is :math:`\{0\}`, so

    .. math::
        P_0 F = 0 \ \text{for every } F, \qquad h' = R_0(0) = 0 = h, \qquad
        \frac{\partial h'}{\partial h} = I, \quad \frac{\partial h'}{\partial F} = 0, \quad
        \frac{\partial h'}{\partial \alpha} = 0:

    the zero update, whose map is the identity, as for a row where :math:`P_h F = 0`. It is the
    limit of the norm the layer keeps, :math:`\|h'\| = \|h\| \to 0`; the map is not
    differentiable there (as :math:`h \to 0` along a direction :math:`e`, the literal step's
    angle tends to :math:`\theta_R(\infty)` and the normalized step's stays
    :math:`\theta_R(\alpha\lambda)`, so :math:`h'/\|h\|` depends on :math:`e`), and these are
    the gradients of the kept row. A non-finite entry of :math:`F` in such a row makes it NaN, as
    it does any row: its values and gradients, and with them the gradient in :math:`\alpha`.

    Shapes: ``h`` and ``f`` are ``(..., d)``; the output is ``(..., d)`` in ``h``'s dtype.
    """

    def __init__(
        self,
        dim: int,
        layer: int = 1,
        retraction: str | Retraction = "p",
        p: float = 1.0,
        damping: str = "sqrt",
        step: str = "normalized",
        alpha_init: float | None = None,
        eps: float = 1e-6,
        fused: bool = True,
    ):
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
        if step not in STEP_FORMS:
            raise ValueError(f"unknown step {step!r}; valid step forms: {', '.join(STEP_FORMS)}")
        self.damping = damping
        self.layer = layer
        self.damping_factor = damping_factor(damping, layer)  # validates layer and damping
        alpha_init = DEFAULT_ALPHA[step] if alpha_init is None else alpha_init
        if not (isinstance(alpha_init, (int, float)) and not isinstance(alpha_init, bool)
                and math.isfinite(alpha_init) and alpha_init > 0):
            raise ValueError(f"alpha_init must be a finite number > 0, got {alpha_init!r}")
        if not (isinstance(eps, (int, float)) and 0 < eps < 1):
            raise ValueError(f"eps must be in (0, 1), got {eps!r}")
        if fused is not True and fused is not False:  # bool() took any object: "False" ran fused
            raise ValueError(f"fused must be True or False, got {fused!r}")
        options = {"p": p} if retraction == "p" else {}
        self.retraction = resolve_retraction("sphere", retraction, **options)
        self.dim = dim
        self.step = step
        self.eps = float(eps)
        self.fused = fused
        self.log_alpha = nn.Parameter(torch.tensor(math.log(alpha_init)))

    @property
    def alpha(self) -> torch.Tensor:
        r""":math:`\alpha = e^\rho > 0`, a 0-dim tensor (differentiable in :attr:`log_alpha`)."""
        return self.log_alpha.exp()

    def step_size(self) -> torch.Tensor:
        r""":math:`\alpha_l \lambda_l`, a 0-dim tensor."""
        return self.alpha * self.damping_factor

    @torch.no_grad()
    def angle(self, h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        r"""The angle of every row's rotation, ``(..., 1)`` radians in :math:`[0, \pi]` (diagnostics;
        an exponential-map step past :math:`\pi` reads back as its wrapped angle).

        Read from the output :math:`h'` itself, :math:`\theta = \operatorname{atan2}(\|P_h h'\|,
        \langle h, h'\rangle / r)`, so it holds for any retraction, a user's own included.
        """
        return rotation_angle(h, self(h, f))

    def forward(self, h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.dim:
            raise ValueError(f"SphereResidual expects h of shape (..., {self.dim}), got {tuple(h.shape)}")
        f = f.to(h.dtype)  # under autocast the sub-layer may return bf16; the stream keeps h's dtype
        if h.shape != f.shape:
            raise ValueError(f"h and f must have the same shape (..., d), got {tuple(h.shape)} and {tuple(f.shape)}")
        scale = self.step_size().to(h.dtype)
        eps = None if self.step == "literal" else self.eps  # normalized: folded into the passes
        if self.fused:
            return sphere_residual(h, f, scale, self.retraction, normalize_eps=eps)
        return sphere_residual_reference(h, f, scale, self.retraction, normalize_eps=eps)

    def extra_repr(self) -> str:
        return (f"{self.dim}, layer={self.layer}, retraction={self.retraction!r}, "
                f"damping={self.damping!r}, step={self.step!r}, fused={self.fused}")
