"""Per-module manifold assignment policies: which matrix is optimized on which manifold.

A *policy* is a callable ``policy(name, module, param) -> str | None`` called once per parameter
with its qualified name (``"blocks.0.attn.q.weight"``), the module that owns it and the tensor.
It returns a manifold name for :class:`~manifoldlib.optim.ManifoldMuon` (``"euclidean"``,
``"stiefel"``, ``"dgram"``, ``"oblique"``) or ``None`` for AdamW. A weight tied under several names
is stepped once: the policy must give every name the same answer.

Built-in policies (the study of the layer-wise manifolds seed):

=============== =========================== =========================== =====================
name            attention matrices          MLP matrices                other hidden matrices
=============== =========================== =========================== =====================
unconstrained   euclidean                   euclidean                   euclidean
all-stiefel     stiefel                     stiefel                     stiefel
all-dgram       dgram                       dgram                       dgram
hetero          stiefel                     dgram                       euclidean
hetero-inv      dgram                       stiefel                     euclidean
=============== =========================== =========================== =====================

Embeddings, the output head, gains, biases and every non-matrix go to AdamW under every
built-in policy, and so do the raw tensors of a :mod:`torch.nn.utils.parametrize` parametrization
(a chart of :mod:`manifoldlib.charts`, or ``orthogonal``, ``weight_norm``, a user's own: the model
uses the parametrized weight, not them), with a warning naming them
(:func:`is_hidden_matrix`; the blocks of :func:`~manifoldlib.charts.split_blocks` are the fused
weight's own entries and keep their manifold). Attention and MLP are recognized by :func:`default_classifier` from the parameter's
qualified name, innermost component first: a block name (``attn``, ``self_attn``, ``attention``,
``mlp``, ``ffn``, T5's ``EncDecAttention`` / ``DenseReluDense``, BERT's ``intermediate``, ...;
:data:`ATTN_NAMES`, :data:`MLP_NAMES`) or a projection name (``q_proj`` ... ``o_proj``,
``c_attn``, ``gate_proj`` / ``up_proj`` / ``down_proj``, ``c_fc``, ``linear1`` / ``linear2``, ...;
generic names such as ``out_proj``, ``dense`` or ``wo`` count only inside a recognized block),
a layer's ``output`` outside attention (:data:`LAYER_MLP_NAMES`: BERT's
``encoder.layer.0.output.dense`` is MLP, ``encoder.layer.0.attention.output.dense`` attention), and
:class:`torch.nn.MultiheadAttention`'s own matrices. That covers :mod:`models.gpt`, nanoGPT,
Hugging Face GPT-2 (``Conv1D``), LLaMA/Mistral/Qwen2-style models, OPT, GPT-NeoX, Falcon,
BERT/RoBERTa, T5, ViT and :class:`torch.nn.TransformerEncoderLayer`. The output head is a module
named in :data:`HEAD_NAMES` (``lm_head``, BERT's ``cls``, the task heads ``classifier``, ``score``,
``qa_outputs``) with every module inside it. A fused ``c_attn`` / ``in_proj_weight`` is *one* matrix
on the attention manifold; to constrain q, k and v as separate blocks, split it first with
:func:`manifoldlib.charts.split_blocks`. A hidden matrix that no rule recognizes goes to the
policy's ``other`` manifold (the *fallback*), and :func:`warn_unclassified` (called by
:func:`~manifoldlib.optim.assign_parameters`) names every such matrix in one warning when the
fallback differs from the attention or MLP choice. The router of a mixture-of-experts block (a
module named ``router`` or ``gate``, :data:`ROUTER_NAMES`: Mixtral's, Qwen-MoE's and DeepSeek's
``mlp.gate``, Jamba's ``feed_forward.router``) maps the hidden state to expert logits, not through
the MLP: it is classified ``"other"`` (recognized, neither role) and takes the ``other`` manifold
without a warning; under ``hetero`` it is not put on DGram with the MLP. Matrices stacked in one tensor of more than two
dimensions (the experts of a mixture-of-experts MLP, ``(experts, out, in)``) stay on AdamW, since
Manifold Muon takes 2-D parameters; :func:`warn_stacked` names those inside an attention or MLP
block. A model that names its blocks differently passes
a *classifier* ``classifier(name, module) -> "attn" | "mlp" | "other" | None`` (``"other"``: a
recognized hidden matrix of neither role, ``None``: unrecognized; both take the ``other`` manifold,
only ``None`` is warned about).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..charts.base import Chart
from ..charts.blocks import SplitBlocks

__all__ = [
    "ATTN_NAMES",
    "HEAD_NAMES",
    "LAYER_MLP_NAMES",
    "MLP_NAMES",
    "ROUTER_NAMES",
    "Classifier",
    "Policy",
    "RolePolicy",
    "available_policies",
    "default_classifier",
    "get_policy",
    "is_hidden_matrix",
    "register_policy",
    "stacked_matrices",
    "unclassified_matrices",
    "warn_stacked",
    "warn_unclassified",
]

Policy = Callable[[str, nn.Module, torch.Tensor], str | None]
Classifier = Callable[[str, nn.Module], str | None]

#: Module names treated as the output head: a parameter of such a module, or of any module inside
#: it, is never a hidden matrix. Language-model heads (``lm_head``; RoBERTa's ``lm_head.dense``),
#: BERT's prediction heads ``cls`` and the task heads of Hugging Face models
#: (``*ForSequenceClassification`` / ``ForImageClassification``: ``classifier`` or ``score``;
#: ``*ForQuestionAnswering``: ``qa_outputs``).
HEAD_NAMES = ("lm_head", "head", "cls", "classifier", "score", "qa_outputs")

#: Name components (blocks or projections, lower case) that mark an attention matrix.
ATTN_NAMES = frozenset({
    "attn", "attention", "self_attn", "self_attention", "selfattention", "cross_attn",
    "cross_attention", "crossattention", "encoder_attn", "encdecattention",
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "c_attn", "wqkv", "query_key_value",
})

#: Name components (blocks or projections, lower case) that mark an MLP matrix.
MLP_NAMES = frozenset({
    "mlp", "ffn", "feed_forward", "feedforward",
    "intermediate", "densereludense", "densegatedactdense",
    "gate_proj", "up_proj", "down_proj", "gate_up_proj", "c_fc", "fc1", "fc2",
    "linear1", "linear2", "dense_h_to_4h", "dense_4h_to_h",
})

#: Name components (lower case) that mark the router of a mixture-of-experts block: a hidden matrix
#: of neither role (expert logits), classified ``"other"``. ``gate`` alone is the router (Mixtral,
#: Qwen-MoE, DeepSeek, OLMoE); the gate *projection* of a gated MLP is ``gate_proj`` (or
#: ``w1``/``c_fc``), and Qwen-MoE's ``shared_expert_gate`` is the sigmoid gate of its shared expert.
ROUTER_NAMES = frozenset({"router", "gate", "shared_expert_gate"})

#: Name components that mark an MLP matrix only inside a numbered layer (``layer.0``) and outside
#: every attention name: BERT's ``encoder.layer.0.output.dense`` is its MLP's second matrix, while
#: ``encoder.layer.0.attention.output.dense`` is attention and a top-level ``output`` a head.
LAYER_MLP_NAMES = frozenset({"output"})

_POLICIES: dict[str, Policy] = {}


def register_policy(name: str, *, override: bool = False) -> Callable[[Policy], Policy]:
    """Decorator registering ``policy(name, module, param) -> str | None`` under ``name``.

    The registry is process-wide: a name that is taken already (a built-in such as ``"hetero"``,
    or an earlier registration) is refused with a ``ValueError`` unless ``override=True``, since
    replacing it changes what that name means for every later ``build_optimizer`` call in the
    process. Re-running a notebook cell that registers a policy therefore needs ``override=True``.

    Raises:
        ValueError: an empty name, a non-callable, or a taken name without ``override``.

    Example:
        >>> @register_policy("attn-only")  # doctest: +SKIP
        ... def attn_only(name, module, param):
        ...     return "stiefel" if ".attn." in name and param.dim() == 2 else None
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a policy name must be a non-empty string, got {name!r}")
    if not isinstance(override, bool):
        raise ValueError(f"override must be True or False, got {override!r}")

    def decorator(policy: Policy) -> Policy:
        if not callable(policy):
            raise ValueError(f"register_policy decorates a callable, got {policy!r}")
        if name in _POLICIES and not override:
            raise ValueError(
                f"policy {name!r} is already registered; registering it again would replace it "
                f"for the whole process: pass override=True to replace it on purpose, or choose "
                f"another name"
            )
        _POLICIES[name] = policy
        return policy

    return decorator


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_POLICIES)


def get_policy(policy: str | Policy, *, classifier: Classifier | None = None) -> Policy:
    """Resolve a registered name (or pass a callable through); bind ``classifier`` to a built-in.

    Raises:
        ValueError: unknown name (the valid ones are listed), or a ``classifier`` given for a
            policy that cannot take one (a plain function).
    """
    if isinstance(policy, str):
        found = _POLICIES.get(policy)
        if found is None:
            raise ValueError(f"unknown policy {policy!r}; valid policies: {', '.join(available_policies())}")
        policy = found
    elif not callable(policy):
        raise ValueError(f"policy must be a registered name or a callable, got {policy!r}")
    if classifier is not None:
        if not isinstance(policy, RolePolicy):
            raise ValueError(
                f"policy {policy!r} does not take a classifier; only role policies "
                f"({', '.join(n for n, p in _POLICIES.items() if isinstance(p, RolePolicy))}) do"
            )
        policy = policy.with_classifier(classifier)
    return policy


def default_classifier(name: str, module: nn.Module) -> str | None:
    """``"attn"`` / ``"mlp"`` / ``"other"`` from the innermost recognized name component, else ``None``.

    Components are whole path parts (``"blocks.0.attnx.q"`` is not attention), compared in lower
    case against :data:`ATTN_NAMES`, :data:`MLP_NAMES` and :data:`ROUTER_NAMES` (``"other"``: a
    mixture-of-experts router) from the end of the name, so a projection name decides before its
    block name: ``blocks.0.attn.c_proj`` is attention, ``blocks.0.mlp.c_proj`` MLP and
    ``layers.0.mlp.gate`` a router. A part in :data:`LAYER_MLP_NAMES` preceded by a layer index
    means MLP unless an attention name follows it outward. The matrices of a
    :class:`torch.nn.MultiheadAttention` are attention whatever it is called.
    """
    if isinstance(module, nn.MultiheadAttention):
        return "attn"
    parts = name.lower().split(".")
    layer_mlp = False
    for i in range(len(parts) - 1, -1, -1):
        part = parts[i]
        if part in ATTN_NAMES:
            return "attn"
        if part in MLP_NAMES:
            return "mlp"
        if part in ROUTER_NAMES:
            return "other"
        if part in LAYER_MLP_NAMES and any(p.isdigit() for p in parts[:i]):
            layer_mlp = True
    return "mlp" if layer_mlp else None


def _belongs_to_chart(module: nn.Module) -> bool:
    """A chart's own scale, or the raw coordinates of a charted tensor (a ParametrizationList)."""
    if isinstance(module, Chart):
        return True
    return isinstance(module, parametrize.ParametrizationList) and any(isinstance(p, Chart) for p in module)


def _foreign_parametrization(module: nn.Module) -> list[str]:
    """The class names of the parametrizations that make ``module``'s tensors raw coordinates of
    another weight: a ParametrizationList holding anything but :class:`~manifoldlib.charts.SplitBlocks`
    (whose blocks are the weight's own entries) and no chart (charts are handled by
    :func:`_belongs_to_chart`); empty for every other module."""
    if not isinstance(module, parametrize.ParametrizationList) or _belongs_to_chart(module):
        return []
    return [type(p).__name__ for p in module if not isinstance(p, SplitBlocks)]


def is_hidden_matrix(name: str, module: nn.Module, param: torch.Tensor) -> bool:
    """A 2-D weight of a hidden layer: not an embedding, not in a head, not a vector, not a chart's.

    The head is a module named in :data:`HEAD_NAMES` with everything inside it.

    Raw chart coordinates and chart scales (:mod:`manifoldlib.charts`) are Euclidean coordinates of
    a curved map, never points of a matrix manifold, so every built-in policy sends them to AdamW
    (see :func:`~manifoldlib.charts.assert_chart_compatible`). So are the raw tensors
    (``parametrizations.weight.original``, ``original0``, ...) of any other
    :mod:`torch.nn.utils.parametrize` parametrization (``orthogonal``, ``weight_norm``,
    ``spectral_norm``, a user's own): the model uses the parametrized weight, not them, and a
    constraint on them would not hold for it. Only the blocks of
    :func:`~manifoldlib.charts.split_blocks` (the fused weight's own entries) stay hidden matrices.
    """
    if param.dim() != 2 or isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False
    if _belongs_to_chart(module) or _foreign_parametrization(module):
        return False
    return not any(part in HEAD_NAMES for part in name.split(".")[:-1])  # inside a head module


class RolePolicy:
    """Assign a manifold by role: attention, MLP, or another hidden matrix.

    Args:
        attn: manifold (or ``None``) for attention matrices.
        mlp: manifold (or ``None``) for MLP matrices.
        other: manifold (or ``None``) for hidden matrices that are neither (classified
            ``"other"``, or unclassified: ``None``).
        classifier: ``classifier(name, module) -> "attn" | "mlp" | "other" | None``
            (default :func:`default_classifier`).
    """

    def __init__(self, attn: str | None, mlp: str | None, other: str | None, classifier: Classifier | None = None):
        self.attn, self.mlp, self.other = attn, mlp, other
        self.classifier = default_classifier if classifier is None else classifier

    def with_classifier(self, classifier: Classifier) -> RolePolicy:
        """The same assignment with another classifier."""
        if not callable(classifier):
            raise ValueError(f"classifier must be callable, got {classifier!r}")
        return RolePolicy(self.attn, self.mlp, self.other, classifier)

    def __call__(self, name: str, module: nn.Module, param: torch.Tensor) -> str | None:
        if not is_hidden_matrix(name, module, param):
            return None
        role = self.classifier(name, module)
        if role == "attn":
            return self.attn
        if role == "mlp":
            return self.mlp
        if role is not None and role != "other":
            raise ValueError(f"classifier returned {role!r} for parameter {name!r}; expected 'attn', 'mlp', "
                             f"'other' or None")
        return self.other

    def unclassified(self, name: str, module: nn.Module, param: torch.Tensor) -> bool:
        """True for a hidden matrix the classifier leaves unrecognized (``None``; it goes to
        ``other`` with a warning, while one classified ``"other"`` goes there silently)."""
        return is_hidden_matrix(name, module, param) and self.classifier(name, module) is None

    def __repr__(self) -> str:
        return f"RolePolicy(attn={self.attn!r}, mlp={self.mlp!r}, other={self.other!r})"


register_policy("unconstrained")(RolePolicy("euclidean", "euclidean", "euclidean"))
register_policy("all-stiefel")(RolePolicy("stiefel", "stiefel", "stiefel"))
register_policy("all-dgram")(RolePolicy("dgram", "dgram", "dgram"))
register_policy("hetero")(RolePolicy("stiefel", "dgram", "euclidean"))
register_policy("hetero-inv")(RolePolicy("dgram", "stiefel", "euclidean"))


def unclassified_matrices(policy: Policy, named: Iterable[tuple[str, nn.Module, torch.Tensor]]) -> list[str]:
    """Names of the hidden matrices a role policy sends to its fallback ``other``.

    Empty for a policy that is not a :class:`RolePolicy` (a plain function decides by itself) and
    for a role policy whose fallback equals both role choices (``unconstrained``, ``all-*``: the
    classification changes nothing there).
    """
    if not isinstance(policy, RolePolicy) or policy.attn == policy.mlp == policy.other:
        return []
    return [name for name, module, param in named if policy.unclassified(name, module, param)]


def _warn_listing(names: list[str], what: str, advice: str, shown: int = 20) -> list[str]:
    """One ``UserWarning`` (at the caller's caller): ``what``, the first ``shown`` of ``names``
    and how many more, then ``advice``. Returns ``names``."""
    more = len(names) - shown
    listed = ", ".join(names[:shown]) + (f", ... ({more} more)" if more > 0 else "")
    warnings.warn(f"{what}: {listed}. {advice}", UserWarning, stacklevel=4)
    return names


def warn_unclassified(policy: Policy, named: Iterable[tuple[str, nn.Module, torch.Tensor]]) -> list[str]:
    """Warn once, naming every hidden matrix that went to the fallback; return those names.

    ``named`` yields ``(qualified name, owning module, parameter)``. Nothing is mis-assigned
    silently: a LLaMA block whose ``self_attn`` a name rule did not know would otherwise train on
    the fallback manifold without a word.
    """
    names = unclassified_matrices(policy, named)
    if not names:  # (a custom policy has no .other to name)
        return names
    plural = len(names) != 1
    return _warn_listing(
        names,
        f"{len(names)} hidden {'matrices' if plural else 'matrix'} matched no attention or MLP name "
        f"rule and went to the fallback {policy.other!r} ({policy!r})",
        "Pass classifier=... (name, module) -> 'attn' | 'mlp' | 'other' | None to classify them.",
    )


def stacked_matrices(policy: Policy, named: Iterable[tuple[str, nn.Module, torch.Tensor]]) -> list[str]:
    """Names of the parameters of more than two dimensions that a role policy's classifier puts in
    an attention or MLP block whose manifold is not ``None`` (stacked expert matrices).

    Empty for a policy that is not a :class:`RolePolicy`; chart coordinates are never counted.
    """
    if not isinstance(policy, RolePolicy):
        return []
    choice = {"attn": policy.attn, "mlp": policy.mlp}
    return [name for name, module, param in named
            if param.dim() > 2 and not _belongs_to_chart(module)
            and choice.get(policy.classifier(name, module)) is not None]


def warn_stacked(policy: Policy, named: Iterable[tuple[str, nn.Module, torch.Tensor]]) -> list[str]:
    """Warn once, naming every stacked attention or MLP tensor that stays on AdamW; return them.

    A mixture-of-experts MLP that stores its experts as ``(experts, out, in)`` would otherwise
    train them on AdamW without a word while the policy constrains the dense MLPs of other models.
    """
    names = stacked_matrices(policy, named)
    if not names:
        return names
    plural = len(names) != 1
    return _warn_listing(
        names,
        f"{len(names)} attention/MLP {'parameters stack' if plural else 'parameter stacks'} matrices "
        f"in more than two dimensions and {'stay' if plural else 'stays'} on AdamW ({policy!r}; "
        f"Manifold Muon takes 2-D parameters)",
        "Store them as separate 2-D layers to constrain them, or pass classifier=... returning None "
        "for them.",
    )
