r"""A reference GPT in the spirit of nanoGPT, with every hidden-state connection of the study.

``GPT(GPTConfig(...))`` is a decoder-only transformer: token + position embeddings, ``n_layer``
blocks of causal self-attention and a GELU MLP, an LM head tied to the token embedding. What
changes between runs is the *connection* (``GPTConfig.connection``), i.e. how each block
combines its hidden state with a sub-layer output (see :mod:`models.connections`):

=========  ===================================================================
pre-ln     :math:`x + F(\mathrm{LN}(x))`
post-ln    :math:`\mathrm{LN}(x + F(x))`
peri-ln    :math:`x + \mathrm{LN}(F(\mathrm{LN}(x)))`
pre-dyt    :math:`x + F(\mathrm{DyT}(x))`
keel       :math:`\mathrm{LN}(2L\,x + F(\mathrm{LN}(x)))`
spheret    :math:`R_h(\alpha_l\lambda_l P_h F(h))`, any sphere retraction
geonorm    spheret with the exponential map
=========  ===================================================================

Names are part of the API: each block holds ``attn`` (linear maps ``q``, ``k``, ``v``, ``o``) and
``mlp`` (``fc``, ``proj``); optimizer policies recognize attention and MLP parameters by them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from manifoldlib.nn import DAMPINGS, STEP_FORMS
from manifoldlib.nn.residual import rotation_angle
from manifoldlib.retractions import available_retractions

from .connections import (
    CONNECTIONS,
    DAMPING_DEPTHS,
    EMBEDDING_INIT_STD,
    SPHERE_CONNECTIONS,
    make_connection,
    make_entry,
    make_exit,
)

__all__ = ["GPT", "MLP", "READ_RULES", "SPHERE_FIELDS", "Block", "CausalSelfAttention", "GPTConfig",
           "unread_fields"]


#: Largest size of a dimension (a C int): larger ones overflow inside torch's allocators.
SIZE_MAX = 2**31 - 1


def _number(value) -> bool:
    """Whether ``value`` is a plain number for a float field: an int or a float, not a bool
    (``True`` would pass as 1.0, ``False`` as 0.0)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if value > SIZE_MAX:
        raise ValueError(f"{name} must be at most 2**31 - 1, got {value!r}")


#: The sphere residual's fields: :class:`models.connections.Spheret` and the ScaleNorm entry
#: read them for the sphere connections only.
SPHERE_FIELDS = ("damping", "sphere_step", "alpha_init", "damping_depth", "norm_eps",
                 "learn_alpha", "learn_radius", "fused")

#: When a field is read, from the code that reads it (:mod:`models.connections` and :class:`GPT`):
#: ``(fields, cause, readers, note)`` — the ``fields`` are read only where the value of the field
#: ``cause`` is one of ``readers``; ``note`` ("" or a clause) says more. The first rule that
#: leaves a field unread names its cause. :class:`GPTConfig` refuses a field left unread at a
#: value other than its default, and :data:`models.config.INERT_RULES` (the command line's
#: refusal of settings that do nothing) takes its rules for the model's fields from here.
READ_RULES: tuple[tuple[tuple[str, ...], str, tuple[str, ...], str], ...] = (
    (("retraction", "p"), "connection", ("spheret",),
     "geonorm is spheret with the exponential map"),
    (("p",), "retraction", ("p",), ""),
    (SPHERE_FIELDS, "connection", SPHERE_CONNECTIONS, ""),
    (("damping_depth",), "damping", ("sqrt", "linear"), ""),
    (("dyt_alpha_init", "dyt_alpha_attn", "dyt_embed_scale"), "connection", ("pre-dyt",), ""),
    (("periln_embed_norm",), "connection", ("peri-ln",), ""),
    (("keel_alpha",), "connection", ("keel",), ""),
)


def unread_fields(config) -> dict[str, tuple[str, tuple[str, ...], str]]:
    """The fields ``config`` never reads, each with the ``(cause, readers, note)`` of the first
    rule of :data:`READ_RULES` that says so: ``{"p": ("connection", ("spheret",), "geonorm is
    ..."), ...}`` for ``connection="geonorm"``. ``config``: a :class:`GPTConfig`, or anything
    with its fields as attributes (a :class:`~models.config.TrainConfig`)."""
    out: dict[str, tuple[str, tuple[str, ...], str]] = {}
    for names, cause, readers, note in READ_RULES:
        if getattr(config, cause) in readers:
            continue
        for name in names:
            out.setdefault(name, (cause, readers, note))
    return out


@dataclass(frozen=True)
class GPTConfig:
    """Configuration of :class:`GPT` (frozen, plain data: round-trips through ``asdict`` / JSON).

    A field the ``connection`` (or the ``retraction``, ``damping``) never reads must keep its
    default (:data:`READ_RULES`): ``GPTConfig(connection="geonorm", p=2.0)`` raises a
    ``ValueError`` naming ``p``, its value, what leaves it unread and what reads it, since
    geonorm is the exponential map whatever ``p`` says. :meth:`from_settings` resets such fields
    to their defaults instead, for settings that hold every field (a saved run's).

    Attributes:
        vocab_size: number of token ids (256 = raw bytes).
        block_size: maximum context length :math:`T`.
        n_layer: number of blocks :math:`L` (each has two sub-layers).
        n_head: attention heads; must divide ``n_embd``.
        n_embd: model width :math:`d`.
        dropout: dropout probability in ``[0, 1)`` (attention weights and sub-layer outputs).
        bias: biases in linear layers and LayerNorms.
        connection: one of ``pre-ln``, ``post-ln``, ``peri-ln``, ``pre-dyt``, ``keel``,
            ``geonorm``, ``spheret``.
        retraction: sphere retraction name for ``spheret`` (any registered name, a user's own too).
        p: the ``p`` of the p-family when ``retraction == "p"``: 1 = Proj-SpheretNorm (gnomonic),
            2 = Cay-SpheretNorm (Cayley), ``inf`` = GeoNorm (exponential map).
        damping: sphere step damping :math:`\\lambda_l`: ``sqrt`` (:math:`1/\\sqrt l`), ``linear``
            (:math:`1/l`) or ``none``.
        sphere_step: what each sphere residual feeds its retraction: ``normalized`` (the direction
            of :math:`P_h F` at the radius, so the angle is :math:`\\theta_R(\\alpha_l\\lambda_l)`)
            or ``literal`` (the seed's :math:`\\alpha_l\\lambda_l P_h F`); see
            :class:`~manifoldlib.nn.SphereResidual`.
        alpha_init: initial learnable step :math:`\\alpha_l > 0` of every sphere residual (0.5 suits
            the normalized step; the seed's literal step starts at 1).
        damping_depth: what the :math:`l` of :math:`\\lambda_l` counts: ``sublayer`` (attention and
            MLP separately, :math:`l = 1 \\ldots 2L`) or ``block`` (both sub-layers of block
            :math:`i` share :math:`l = i`).
        dyt_alpha_init: initial :math:`\\alpha` of the DyT before every MLP and the final DyT
            (``pre-dyt``; the DyT paper's :math:`\\alpha_0` for "other" positions in LLMs).
        dyt_alpha_attn: initial :math:`\\alpha` of the DyT before every attention (the DyT paper
            initializes it higher than the others in LLMs).
        dyt_embed_scale: ``pre-dyt`` initializes the embeddings at std :math:`d^{-1/2}` and
            multiplies them by a learnable scalar starting at :math:`\\sqrt d` (the DyT paper's LLM
            recipe), so the stream enters the first DyT at unit scale.
        periln_embed_norm: ``peri-ln`` normalizes the embeddings with a LayerNorm before the
            first block (the Peri-LN paper's initial embedding normalization): every sub-layer
            adds a LayerNorm output of unit RMS, so without it GPT-2's std-0.02 embeddings enter
            the stream 30x below the first sub-layer's term. ``False``: the paper's per-sub-layer
            formula alone.
        keel_alpha: the highway weight :math:`\\alpha` of ``keel``; 0 = the Keel paper's
            :math:`\\alpha = ` number of sub-layers (``2 * n_layer``). The sub-layer outputs
            must stay small against :math:`\\alpha x` for the highway to carry the state, so
            the lr a Keel model tolerates grows with :math:`\\alpha`, hence with depth.
        norm_eps: :math:`\\varepsilon` of the ScaleNorm that puts embeddings on the sphere.
        learn_alpha: the sphere residuals' steps :math:`\\alpha_l` are learned (``False``: fixed at
            ``alpha_init``, an ablation).
        learn_radius: the sphere's radius (the entry ScaleNorm's scale, initially
            :math:`\\sqrt d`) is learned (``False``: fixed at :math:`\\sqrt d`, an ablation).
        tie_weights: share the token embedding with the LM head.
        fused: use the analytic-backward sphere residual (``False``: plain autograd reference).
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    connection: str = "spheret"
    retraction: str = "p"
    p: float = 1.0
    damping: str = "sqrt"
    sphere_step: str = "normalized"
    alpha_init: float = 0.5
    damping_depth: str = "sublayer"
    dyt_alpha_init: float = 0.2
    dyt_alpha_attn: float = 0.8
    dyt_embed_scale: bool = True
    periln_embed_norm: bool = True
    keel_alpha: float = 0.0
    norm_eps: float = 1e-6
    learn_alpha: bool = True
    learn_radius: bool = True
    tie_weights: bool = True
    fused: bool = True

    def __post_init__(self):
        _check_values(self)
        unread = [f"{name}={getattr(self, name)!r} does nothing with {cause}="
                  f"{getattr(self, cause)!r}: only {cause}={' or '.join(map(repr, readers))} "
                  f"reads it{f' ({note})' if note else ''}; leave {name} at its default "
                  f"{_DEFAULTS[name]!r}"
                  for name, (cause, readers, note) in unread_fields(self).items()
                  if getattr(self, name) != _DEFAULTS[name]]
        if unread:
            raise ValueError("; ".join(unread))

    @classmethod
    def from_settings(cls, **settings) -> GPTConfig:
        """The configuration of ``settings`` with each field it never reads at its default.

        What a :class:`~models.config.TrainConfig` builds from a preset, a config file or a
        saved run's ``config.json``: those hold a value for every field, the ones the
        connection never reads too (``p`` of a ``geonorm`` run), which the constructor refuses.
        Every value is checked as the constructor checks it, the unread ones included.

        Raises:
            TypeError: a name that is not a field.
            ValueError: a value the constructor refuses for its own sake.
        """
        unknown = sorted(set(settings) - set(_DEFAULTS))
        if unknown:
            raise TypeError(f"GPTConfig has no field {unknown[0]!r}")
        values = SimpleNamespace(**{**_DEFAULTS, **settings})
        _check_values(values)
        unread = unread_fields(values)
        return cls(**{name: _DEFAULTS[name] if name in unread else value
                      for name, value in vars(values).items()})

    @property
    def on_sphere(self) -> bool:
        """Whether the hidden states of this configuration live on a sphere."""
        return self.connection in SPHERE_CONNECTIONS

    def to_dict(self) -> dict:
        """Plain-data dict of the fields (JSON-serializable; ``p = inf`` becomes ``Infinity``)."""
        return asdict(self)


def _check_values(c) -> None:
    """Refuse a bad value of any field of ``c`` (a :class:`GPTConfig`, or its fields in a
    namespace), read or not: the error names the field, the value and what is accepted."""
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        _positive_int(name, getattr(c, name))
    if c.n_embd % c.n_head:
        raise ValueError(f"n_embd ({c.n_embd}) must be divisible by n_head ({c.n_head})")
    for name in ("bias", "tie_weights", "fused", "dyt_embed_scale", "periln_embed_norm"):
        if not isinstance(getattr(c, name), bool):
            raise ValueError(  # noqa: TRY004 - build_model makes a ValueError a ConfigError
                f"{name} must be True or False, got {getattr(c, name)!r}")
    if not (_number(c.dropout) and 0.0 <= c.dropout < 1.0):
        raise ValueError(f"dropout must be in [0, 1), got {c.dropout!r}")
    if c.connection not in CONNECTIONS:
        raise ValueError(
            f"unknown connection {c.connection!r}; valid connections: {', '.join(CONNECTIONS)}"
        )
    valid = available_retractions("sphere")
    if not isinstance(c.retraction, str) or c.retraction not in valid:
        raise ValueError(
            f"unknown sphere retraction {c.retraction!r}; valid names: {', '.join(valid)} "
            "(register your own with manifoldlib.retractions.register_retraction('sphere', name))"
        )
    if not (_number(c.p) and c.p > 0):
        raise ValueError(f"p must be a number in (0, inf], got {c.p!r}")
    if c.damping not in DAMPINGS:
        raise ValueError(f"unknown damping {c.damping!r}; valid dampings: {', '.join(DAMPINGS)}")
    for name in ("dyt_alpha_init", "dyt_alpha_attn"):
        value = getattr(c, name)
        if not (_number(value) and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not (_number(c.keel_alpha) and math.isfinite(c.keel_alpha) and c.keel_alpha >= 0):
        raise ValueError(f"keel_alpha must be a finite number >= 0 (0: 2 * n_layer), "
                         f"got {c.keel_alpha!r}")
    if not (_number(c.alpha_init) and math.isfinite(c.alpha_init) and c.alpha_init > 0):
        raise ValueError(f"alpha_init must be a finite number > 0, got {c.alpha_init!r}")
    if c.sphere_step not in STEP_FORMS:
        raise ValueError(f"unknown sphere_step {c.sphere_step!r}; valid step forms: "
                         f"{', '.join(STEP_FORMS)}")
    if c.damping_depth not in DAMPING_DEPTHS:
        raise ValueError(f"unknown damping_depth {c.damping_depth!r}; valid: "
                         f"{', '.join(DAMPING_DEPTHS)}")
    if not (_number(c.norm_eps) and 0 < c.norm_eps < 1):
        raise ValueError(f"norm_eps must be in (0, 1), got {c.norm_eps!r}")
    for name in ("learn_alpha", "learn_radius"):
        if not isinstance(getattr(c, name), bool):
            raise ValueError(  # noqa: TRY004 - build_model makes a ValueError a ConfigError
                f"{name} must be True or False, got {getattr(c, name)!r}")


#: Field name -> default of :class:`GPTConfig`.
_DEFAULTS = {f.name: f.default for f in fields(GPTConfig)}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate ``q``, ``k``, ``v``, ``o`` maps (SDPA kernel).

    Set :attr:`record_statistics` to ``True`` to store statistics of the next forward's attention
    in :attr:`statistics` (costs one explicit score matrix; the normal path never computes it):
    ``max_logit`` :math:`\\max |q\\cdot k|/\\sqrt{d_h}` over the causal pairs, ``entropy`` the
    mean over batch, heads and queries of the attention distribution's entropy (nats; a query at
    position :math:`t` has at most :math:`\\log(t+1)`), ``max_prob`` the mean of each query's
    largest attention probability (1 = a saturated softmax), all 0-dim tensors.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.n_embd
        self.n_head = config.n_head
        self.head_dim = d // config.n_head
        self.q = nn.Linear(d, d, bias=config.bias)
        self.k = nn.Linear(d, d, bias=config.bias)
        self.v = nn.Linear(d, d, bias=config.bias)
        self.o = nn.Linear(d, d, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.record_statistics = False
        self.statistics: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        v = self.v(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        if self.record_statistics:
            self.statistics = self._statistics(q, k)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.o(y))

    @torch.no_grad()
    def _statistics(self, q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
        T = q.shape[-2]
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~causal, -math.inf).softmax(dim=-1)  # (B, nh, T, T)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # (B, nh, T)
        return {"max_logit": scores.abs().masked_fill(~causal, 0.0).amax(),
                "entropy": entropy.mean(), "max_prob": probs.amax(-1).mean()}


class MLP(nn.Module):
    """Two-layer GELU MLP, ``fc`` (:math:`d \\to 4d`) then ``proj`` (:math:`4d \\to d`)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """One transformer block: ``x = conn1(x, attn)``, ``x = conn2(x, mlp)``.

    ``index`` is the 0-based block index; the connections get the 1-based sub-layer indices
    ``2*index + 1`` (attention) and ``2*index + 2`` (MLP).
    """

    def __init__(self, config: GPTConfig, index: int):
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)
        self.conn1 = make_connection(config, layer=2 * index + 1)
        self.conn2 = make_connection(config, layer=2 * index + 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conn1(x, self.attn)  # (B, T, C)
        return self.conn2(x, self.mlp)  # (B, T, C)


def _check_token_ids(idx: torch.Tensor, vocab_size: int) -> None:
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise ValueError(f"token ids must be an integer tensor, got dtype {idx.dtype}")
    if torch.compiler.is_compiling():  # a value check is a graph break and a device sync
        return
    if idx.numel() and bool(((idx < 0) | (idx >= vocab_size)).any()):
        lo, hi = int(idx.min()), int(idx.max())
        raise ValueError(f"token ids must be in [0, {vocab_size}) (vocab_size), got ids from "
                         f"{lo} to {hi}")


def _check_tied_entries(state_dict, prefix: str) -> None:
    """Refuse a state dict whose ``wte.weight`` and ``lm_head.weight`` differ, for a model that
    ties them: both entries are copied into the one shared tensor, so the one loaded last
    (``lm_head.weight``) would silently replace the embedding."""
    emb, head = state_dict.get(prefix + "wte.weight"), state_dict.get(prefix + "lm_head.weight")
    if not (isinstance(emb, torch.Tensor) and isinstance(head, torch.Tensor)) or emb is head:
        return
    if type(emb) is not torch.Tensor and not isinstance(emb, nn.Parameter):
        return  # a DTensor (sharded load) or another subclass: its entries are not compared here
    if type(head) is not torch.Tensor and not isinstance(head, nn.Parameter):
        return
    if emb.is_meta or head.is_meta:
        return
    if (emb.shape == head.shape and emb.dtype == head.dtype and emb.device == head.device
            and emb.stride() == head.stride() and emb.data_ptr() == head.data_ptr()):
        return  # one storage (a tied model's own state dict, saved and loaded)
    if emb.shape != head.shape:
        return  # load_state_dict reports the size mismatch itself
    if not torch.equal(emb, head.to(device=emb.device, dtype=emb.dtype)):
        diff = float((emb.double() - head.to(emb.device).double()).abs().max())
        raise ValueError(
            f"the state dict's {prefix}wte.weight and {prefix}lm_head.weight differ (largest "
            f"|difference| {diff:.3g}), but this model ties them (tie_weights=True): loading would "
            f"keep {prefix}lm_head.weight as the token embedding and lose {prefix}wte.weight. Load "
            f"it into a GPT with tie_weights=False"
        )


class GPT(nn.Module):
    """Decoder-only transformer; ``logits, loss = model(idx, targets)``.

    Data flow: ``wte(idx) + wpe(pos)`` → dropout → ``embed_norm`` (ScaleNorm onto the sphere of
    radius :math:`\\sqrt d` for sphere connections, LayerNorm for ``peri-ln``, the learnable
    scalar for ``pre-dyt``, identity otherwise) → ``blocks`` →
    ``norm_f`` (final LayerNorm / DyT, the sphere read-out with a learnable scale, or identity
    where the last block already ends in a LayerNorm) → ``lm_head``.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(  # noqa: TRY004 - as GPTConfig's own checks
                f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.embed_norm = make_entry(config)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm_f = make_exit(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2: scale the maps into the stream
        for name, param in self.named_parameters():
            if name.endswith(("attn.o.weight", "mlp.proj.weight")):
                nn.init.normal_(param, mean=0.0, std=residual_std)
        if config.connection == "pre-dyt" and config.dyt_embed_scale:
            # the DyT paper's LLM recipe: embeddings at std d^(-1/2), a learnable sqrt(d) after them
            for emb in (self.wte, self.wpe):
                nn.init.normal_(emb.weight, mean=0.0, std=config.n_embd ** -0.5)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.config.tie_weights:  # one comparison per load, never in the forward
            _check_tied_entries(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=EMBEDDING_INIT_STD)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; ``non_embedding`` leaves out the lookup tables, which do no matrix
        products: the position embedding (nanoGPT) and, under ``tie_weights=False``, the token
        embedding (tied, it is also the LM head's matrix, which does)."""
        n = sum(p.numel() for p in self.parameters())
        if not non_embedding:
            return n
        n -= self.wpe.weight.numel()
        return n if self.config.tie_weights else n - self.wte.weight.numel()

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be an integer tensor of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        return self.embed_norm(x)  # (B, T, C), on the sphere for sphere connections

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy when ``targets`` are given.

        Args:
            idx: ``(B, T)`` token ids, ``T <= block_size``.
            targets: ``(B, T)`` next-token ids (``-1`` is ignored) or ``None``.

        Returns:
            ``(logits, loss)``: logits ``(B, T, vocab_size)``; loss a scalar or ``None``.

        Raises:
            ValueError: ``idx`` is not an integer tensor or holds an id outside
                ``[0, vocab_size)`` (one reduction; torch would fail deep inside the embedding).
                Under :func:`torch.compile` only the dtype is checked: reading the ids' values
                would break the graph and wait for the device at every forward (the trainer's
                corpora are checked against the vocabulary when they are loaded).
        """
        _check_token_ids(idx, self.config.vocab_size)
        x = self._embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.norm_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def hidden_states(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The residual stream after the embedding and after every sub-layer: ``2*n_layer + 1``
        tensors ``(B, T, C)`` (diagnostics; on the sphere for sphere connections)."""
        x = self._embed(idx)
        states = [x]
        for block in self.blocks:
            x = block.conn1(x, block.attn)
            states.append(x)
            x = block.conn2(x, block.mlp)
            states.append(x)
        return states

    @torch.no_grad()
    def attention_statistics(self, idx: torch.Tensor) -> list[dict[str, float]]:
        """Per layer, the statistics :class:`CausalSelfAttention` records (``max_logit``,
        ``entropy``, ``max_prob``) over one forward of ``idx`` in eval mode (no dropout; the
        training flag is restored).

        Args:
            idx: ``(B, T)`` token ids.

        Returns:
            ``n_layer`` dicts of floats.
        """
        was_training = self.training
        self.eval()
        try:
            for block in self.blocks:
                block.attn.record_statistics = True
            self(idx)
            return [{k: float(v) for k, v in block.attn.statistics.items()} for block in self.blocks]
        finally:
            for block in self.blocks:
                block.attn.record_statistics = False
                block.attn.statistics = None
            self.train(was_training)

    @torch.no_grad()
    def max_attention_logit(self, idx: torch.Tensor) -> torch.Tensor:
        """:math:`\\max |q\\cdot k|/\\sqrt{d_h}` over heads, batch and causal pairs: ``(n_layer,)``."""
        return torch.tensor([layer["max_logit"] for layer in self.attention_statistics(idx)])

    @torch.no_grad()
    def step_angles(self, idx: torch.Tensor) -> list[float]:
        """Mean rotation angle (radians) of every sphere residual over one eval-mode forward of
        ``idx``, in sub-layer order (``2 * n_layer`` values; empty off the sphere)."""
        if not self.config.on_sphere:
            return []

        def angle(conn, sub, x):
            out = conn.residual(x, sub(x))  # one residual pass per sub-layer
            return float(rotation_angle(x, out).mean()), out
        return self._per_sub_layer(idx, angle)

    @torch.no_grad()
    def keel_branch_ratios(self, idx: torch.Tensor) -> list[float]:
        r"""Mean :math:`\|F(\mathrm{LN}(x))\| / \|\alpha x\|` of every Keel sub-layer over one
        eval-mode forward of ``idx``, in sub-layer order (``2 * n_layer`` values; empty for the
        other connections). The first block's :math:`x` is the raw embedding."""
        if self.config.connection != "keel":
            return []
        return self._per_sub_layer(
            idx, lambda conn, sub, x: (float(conn.branch_ratio(x, sub).mean()), conn(x, sub)))

    def _per_sub_layer(self, idx: torch.Tensor, measure) -> list[float]:
        """``measure(connection, sub_layer, x) -> (value, next state)`` at every sub-layer of one
        eval-mode forward of ``idx`` (no dropout; the training flag is restored), in order."""
        was_training = self.training
        self.eval()
        try:
            x = self._embed(idx)  # (B, T, C)
            values = []
            for block in self.blocks:
                for conn, sub in ((block.conn1, block.attn), (block.conn2, block.mlp)):
                    value, x = measure(conn, sub, x)
                    values.append(value)
            return values
        finally:
            self.train(was_training)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        vocab_limit: int | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (``(B, T)``); returns ``(B, T + max_new_tokens)``.

        The context is cropped to the last ``block_size`` tokens. ``top_k`` keeps the k most
        likely tokens; ``generator`` makes sampling reproducible; ``vocab_limit`` samples only
        the first ``vocab_limit`` ids (a padded vocabulary's extra ids are no tokens). The
        logits are shifted by their maximum before the division by ``temperature``, so a tiny
        temperature tends to greedy decoding instead of overflowing to NaN.
        """
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if not (_number(temperature) and temperature > 0):
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
        vocab = self.config.vocab_size
        if vocab_limit is not None and (not isinstance(vocab_limit, int) or isinstance(vocab_limit, bool)
                                        or not 1 <= vocab_limit <= vocab):
            raise ValueError(f"vocab_limit must be None or an integer in [1, {vocab}], got "
                             f"{vocab_limit!r}")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]  # (B, <=block_size)
            logits, _ = self(context)
            logits = logits[:, -1, :vocab_limit]  # (B, V)
            # <= 0 with an exact 0 at the maximum, in float64 (where any positive temperature
            # is nonzero): no overflow and no 0/0, whatever the temperature
            logits = (logits - logits.max(dim=-1, keepdim=True).values).double() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)  # (B, V)
            next_id = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx
