r"""Hidden-state connections: how a block combines its state :math:`x` with a sub-layer :math:`F`.

Every connection is a module ``conn(x, F) -> x'`` where ``F`` is the sub-layer (attention or MLP,
a callable on ``(B, T, C)``). Each class carries its formula; :func:`make_connection` builds one
by name, and :func:`make_entry` / :func:`make_exit` build what the stream needs before the first
block (ScaleNorm for the sphere connections) and before the head (a final norm, or a learnable
scale on the sphere).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from manifoldlib.nn import DyT, ScaleNorm, SphereResidual

__all__ = [
    "CONNECTIONS",
    "DAMPING_DEPTHS",
    "SPHERE_CONNECTIONS",
    "EmbeddingScale",
    "Keel",
    "PeriLN",
    "PostLN",
    "PreDyT",
    "PreLN",
    "SphereHead",
    "Spheret",
    "make_connection",
    "make_entry",
    "make_exit",
]

#: Valid ``GPTConfig.connection`` names.
CONNECTIONS = ("pre-ln", "post-ln", "peri-ln", "pre-dyt", "keel", "geonorm", "spheret")
#: What the depth ``l`` of a sphere residual's damping counts (``GPTConfig.damping_depth``).
DAMPING_DEPTHS = ("sublayer", "block")
#: Standard deviation of the reference GPT's embedding initialization (GPT-2's).
EMBEDDING_INIT_STD = 0.02
#: Connections whose hidden states live on a sphere.
SPHERE_CONNECTIONS = ("geonorm", "spheret")

SubLayer = Callable[[torch.Tensor], torch.Tensor]


def _layer_norm(config) -> nn.LayerNorm:
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class PreLN(nn.Module):
    r"""Pre-LN: :math:`x' = x + F(\mathrm{LN}(x))`."""

    def __init__(self, config, layer: int):
        super().__init__()
        self.norm = _layer_norm(config)

    def forward(self, x: torch.Tensor, sublayer: SubLayer) -> torch.Tensor:
        return x + sublayer(self.norm(x))


class PostLN(nn.Module):
    r"""Post-LN: :math:`x' = \mathrm{LN}(x + F(x))`."""

    def __init__(self, config, layer: int):
        super().__init__()
        self.norm = _layer_norm(config)

    def forward(self, x: torch.Tensor, sublayer: SubLayer) -> torch.Tensor:
        return self.norm(x + sublayer(x))


class PeriLN(nn.Module):
    r"""Peri-LN: normalize the input and the output of the sub-layer,
    :math:`x' = x + \mathrm{LN}_{out}(F(\mathrm{LN}_{in}(x)))`; the stream starts at
    :math:`\mathrm{LN}(x_{embed})` (:func:`make_entry`, ``periln_embed_norm``), and a final
    LayerNorm reads it before the head (:func:`make_exit`).

    :math:`\mathrm{LN}_{out}` runs in the stream's dtype: under autocast the sub-layer returns
    bfloat16 (float16), which CUDA's autocast normalizes in float32 and CPU's in bfloat16
    (``layer_norm`` is on CUDA's float32 list only), so the sub-layer output is cast to the
    stream's dtype first and both devices compute the same normalization."""

    def __init__(self, config, layer: int):
        super().__init__()
        self.norm_in = _layer_norm(config)
        self.norm_out = _layer_norm(config)

    def forward(self, x: torch.Tensor, sublayer: SubLayer) -> torch.Tensor:
        f = sublayer(self.norm_in(x))  # (B, T, C), bfloat16 under autocast
        return x + self.norm_out(f.to(x.dtype))


class PreDyT(nn.Module):
    r"""Pre-DyT: Pre-LN with Dynamic Tanh in place of LayerNorm,
    :math:`x' = x + F(\gamma\tanh(\alpha x) + \beta)`.

    The DyT paper's LLM recipe: :math:`\alpha_0` = ``dyt_alpha_attn`` before attention (odd
    sub-layers), ``dyt_alpha_init`` before the MLP and in the final DyT, and a learnable scalar
    after the embedding (:class:`EmbeddingScale`, see :func:`make_entry`)."""

    def __init__(self, config, layer: int):
        super().__init__()
        alpha = config.dyt_alpha_attn if layer % 2 == 1 else config.dyt_alpha_init
        self.norm = DyT(config.n_embd, alpha_init=alpha)

    def forward(self, x: torch.Tensor, sublayer: SubLayer) -> torch.Tensor:
        return x + sublayer(self.norm(x))


class Keel(nn.Module):
    r"""Keel: a Post-LN with an amplified highway,
    :math:`x' = \mathrm{LN}(\alpha x + F(\mathrm{LN}(x)))`, :math:`\alpha` = ``config.keel_alpha``,
    by default (0) the paper's number of sub-layers (``2 * n_layer``)."""

    def __init__(self, config, layer: int):
        super().__init__()
        self.alpha = float(config.keel_alpha or 2 * config.n_layer)
        self.norm_in = _layer_norm(config)
        self.norm_out = _layer_norm(config)

    def forward(self, x: torch.Tensor, sublayer: SubLayer) -> torch.Tensor:
        return self.norm_out(self.alpha * x + sublayer(self.norm_in(x)))

    def branch_ratio(self, x: torch.Tensor, sublayer: SubLayer) -> torch.Tensor:
        r"""Per token, :math:`\|F(\mathrm{LN}(x))\| / \|\alpha x\|` (``x``: ``(..., d)`` ->
        ``(...)``): the sub-layer's term against the highway's. Far above 1, the normalization
        after the sum removes the highway and the block is a Post-LN without a residual path."""
        return sublayer(self.norm_in(x)).norm(dim=-1) / (self.alpha * x.norm(dim=-1))


class Spheret(nn.Module):
    r"""SpheretNorm / GeoNorm: :math:`h' = R_h(\alpha_l\lambda_l\,P_h(F(h)))` on the sphere.

    ``retraction`` is any registered sphere retraction (``"p"`` uses ``config.p``: 1 =
    Proj-SpheretNorm, 2 = Cay-SpheretNorm, inf = GeoNorm); ``geonorm`` is this connection with the
    exponential map. ``layer`` is the 1-based sub-layer index; the :math:`l` of the damping
    :math:`\lambda_l` is that index (``damping_depth="sublayer"``, attention and MLP counted
    separately) or the 1-based block index (``"block"``). ``config.sphere_step`` picks the
    literal or the normalized step.
    """

    def __init__(self, config, layer: int):
        super().__init__()
        retraction = "exp" if config.connection == "geonorm" else config.retraction
        depth = layer if config.damping_depth == "sublayer" else (layer + 1) // 2
        self.residual = SphereResidual(
            config.n_embd, layer=depth, retraction=retraction, p=config.p,
            damping=config.damping, step=config.sphere_step, alpha_init=config.alpha_init,
            fused=config.fused,
        )
        self.residual.log_alpha.requires_grad_(config.learn_alpha)  # False: an ablation, alpha fixed

    def forward(self, h: torch.Tensor, sublayer: SubLayer) -> torch.Tensor:
        return self.residual(h, sublayer(h))


class SphereHead(nn.Module):
    r"""Reads the sphere before the LM head: :math:`s\,h` with a learnable scalar :math:`s`
    (initialized to 1). The stream has radius :math:`\sqrt d` at initialization (RMS 1 per
    coordinate, like a LayerNorm output), so the head sees the same scale as in Pre-LN; :math:`s`
    lets the logit temperature move independently of the sphere radius the blocks work on."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale.to(h.dtype)  # (..., d)


_BY_NAME = {
    "pre-ln": PreLN,
    "post-ln": PostLN,
    "peri-ln": PeriLN,
    "pre-dyt": PreDyT,
    "keel": Keel,
    "geonorm": Spheret,
    "spheret": Spheret,
}


def make_connection(config, layer: int) -> nn.Module:
    """The connection module of ``config.connection`` for 1-based sub-layer ``layer``."""
    try:
        cls = _BY_NAME[config.connection]
    except KeyError:
        raise ValueError(
            f"unknown connection {config.connection!r}; valid connections: {', '.join(CONNECTIONS)}"
        ) from None
    return cls(config, layer)


class EmbeddingScale(nn.Module):
    r""":math:`s\,x` with one learnable scalar :math:`s`: the DyT paper's scalar after the
    embedding, initialized at :math:`\sqrt d`. With ``pre-dyt``, :class:`models.GPT` also
    initializes the embeddings at std :math:`d^{-1/2}` (as LLaMA code of that lineage does), so the stream starts at unit
    RMS per token and position embedding — DyT, unlike LayerNorm, does not undo a small input
    scale — while an AdamW step on the embeddings stays small relative to them."""

    def __init__(self, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(x.dtype)  # (..., d)


def make_entry(config) -> nn.Module:
    """Applied to the embeddings: ScaleNorm onto the sphere for sphere connections,
    :class:`EmbeddingScale` for ``pre-dyt`` (``dyt_embed_scale``), a LayerNorm for ``peri-ln``
    (``periln_embed_norm``: the Peri-LN paper's initial embedding normalization), else identity."""
    if config.connection in SPHERE_CONNECTIONS:
        entry = ScaleNorm(config.n_embd, eps=config.norm_eps)
        entry.scale.requires_grad_(config.learn_radius)  # False: an ablation, radius fixed at sqrt(d)
        return entry
    if config.connection == "pre-dyt" and config.dyt_embed_scale:
        return EmbeddingScale(math.sqrt(config.n_embd))
    if config.connection == "peri-ln" and config.periln_embed_norm:
        return _layer_norm(config)
    return nn.Identity()


def make_exit(config) -> nn.Module:
    """Applied before the LM head: a final LayerNorm (pre-ln, peri-ln), DyT (pre-dyt), nothing
    (post-ln, keel: their last operation is a LayerNorm) or :class:`SphereHead`."""
    if config.connection in ("pre-ln", "peri-ln"):
        return _layer_norm(config)
    if config.connection == "pre-dyt":
        return DyT(config.n_embd, alpha_init=config.dyt_alpha_init)
    if config.connection in SPHERE_CONNECTIONS:
        return SphereHead(config.n_embd)
    return nn.Identity()
