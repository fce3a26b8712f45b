"""Training configuration: one frozen dataclass, named presets, TOML files, typed overrides.

A configuration is built in layers, later ones winning:

1. the dataclass defaults of :class:`TrainConfig`;
2. a preset (:data:`PRESETS`: ``smoke``, ``default``, ...), or the ``preset`` key of a TOML file;
3. a TOML file (flat ``key = value`` pairs, read with :mod:`tomllib`);
4. command-line overrides ``--key value`` for any field, converted to the field's type.

Every field is validated in ``__post_init__``; bad values raise :class:`ConfigError` naming the
field, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from .connections import CONNECTIONS as _CONNECTIONS

__all__ = [
    "CONNECTIONS",
    "LEGACY_MUON_NS_DTYPE",
    "PRESETS",
    "ConfigError",
    "TrainConfig",
    "build_config",
    "parse_overrides",
]

#: ``optimizer`` values: plain AdamW, or ``manifoldlib.optim.build_optimizer`` with ``policy``.
OPTIMIZERS = ("adamw", "manifold-muon")
#: ``sel`` values: no chart, or SEL on every block linear map with the given variant.
SEL_VARIANTS = ("none", "mismatched", "congruent", "no-linear")
SCHEDULES = ("cosine", "constant")
#: ``muon_distributed`` values: each matrix solved on one rank, or on every rank.
MUON_DISTRIBUTED = ("sharded", "replicated")
#: ``muon_ns_dtype`` values (ManifoldMuon's ``ns_dtype``): ``auto`` runs Muon's Newton–Schulz in
#: bfloat16 where bfloat16 products are native and in float32 elsewhere (on an AVX2-only CPU the
#: bfloat16 iteration was half the default run's time).
MUON_NS_DTYPES = ("auto", "bfloat16", "float32")
#: ``muon_ns_dtype`` of a saved configuration that predates the field (such runs used bfloat16).
LEGACY_MUON_NS_DTYPE = "bfloat16"
#: Largest ``seed``: numpy's global generator takes seeds in ``[0, 2**32 - 1]``.
SEED_MAX = 2**32 - 1


#: Residual-connection names the reference GPT implements (defined once, in ``models.connections``).
CONNECTIONS = _CONNECTIONS


class ConfigError(ValueError):
    """A bad configuration value, preset name, TOML file or override."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on; saved as ``config.json`` in the run directory.

    Model fields carry the names of ``models.gpt.GPTConfig`` and are passed through to it
    (``vocab_size`` comes from the corpus).
    """

    # data
    corpus: str = "stdlib"            #: ``stdlib``, ``file:PATH`` or ``synthetic[:NBYTES]``
    tokenizer: str = "byte"           #: ``byte`` (vocabulary 256) or ``bpe`` (extra ``bpe``)
    bpe_vocab_size: int = 1024
    val_fraction: float = 0.1
    # model (GPTConfig fields)
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    connection: str = "spheret"
    retraction: str = "p"             #: sphere retraction of ``spheret`` (any registered name)
    p: float = 1.0                    #: p of the ``p`` retraction (1 = Proj-SpheretNorm)
    damping: str = "sqrt"             #: step damping of sphere residuals: sqrt|linear|none
    sphere_step: str = "normalized"   #: sphere residual step: normalized|literal (the seed's)
    alpha_init: float = 0.5           #: initial learnable step alpha_l > 0 of sphere residuals
    damping_depth: str = "sublayer"   #: what l of the damping counts: sublayer|block
    dyt_alpha_init: float = 0.2       #: initial alpha of DyT before MLPs and at the end (``pre-dyt``)
    dyt_alpha_attn: float = 0.8       #: initial alpha of DyT before attention (``pre-dyt``)
    dyt_embed_scale: bool = True      #: learnable scalar after the embedding (``pre-dyt``)
    tie_weights: bool = True          #: share the token embedding with the LM head
    norm_eps: float = 1e-6            #: epsilon of the ScaleNorm that puts embeddings on the sphere
    fused: bool = True                #: analytic-backward sphere residual (False: plain autograd)
    # optimization
    optimizer: str = "adamw"          #: ``adamw`` or ``manifold-muon`` (uses ``policy``)
    policy: str = "hetero"            #: ManifoldMuon assignment policy (``manifold-muon`` only)
    muon_distributed: str = "sharded"  #: ManifoldMuon under torchrun: ``sharded``|``replicated``
    muon_ns_dtype: str = "auto"       #: Euclidean Newton–Schulz dtype: auto|bfloat16|float32
    sel: str = "none"                 #: SEL chart on block linear maps: none|mismatched|...
    sel_scale_lr: float = 0.0         #: AdamW lr of SEL scale parameters; 0 = same as ``lr``
    sel_anneal_steps: int = 0         #: steps of SEL's scale-lr annealing; 0 = no annealing
    lr: float = 3e-3                  #: AdamW lr, or the ManifoldMuon lr for matrices
    adamw_lr: float = 3e-3            #: AdamW lr of non-matrix params under ``manifold-muon``
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0            #: max global grad norm; 0 disables clipping
    schedule: str = "cosine"          #: ``cosine`` (to ``min_lr_ratio``) or ``constant``
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    batch_size: int = 16
    steps: int = 1000                 #: total optimizer steps (the schedule's length)
    stop_at: int = 0                  #: stop early at this step, resumable; 0 = run to ``steps``
    # bookkeeping
    eval_interval: int = 100
    eval_batches: int = 8
    log_interval: int = 10
    checkpoint: bool = True           #: write ``checkpoint.pt`` (at each evaluation and the end)
    seed: int = 0
    device: str = "auto"              #: ``auto`` (cuda, then mps, then cpu), or a torch device
    threads: int = 1                  #: torch threads; 1 is fastest on a shared CPU, 0 = default
    progress: bool = True             #: tqdm bar (only shown when stderr is a terminal)
    sample_tokens: int = 300          #: tokens generated at the end (0 = no sample)
    sample_prompt: str = "def "
    temperature: float = 0.8
    top_k: int = 40

    def __post_init__(self) -> None:
        _check_choice("connection", self.connection, CONNECTIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("sel", self.sel, SEL_VARIANTS)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("tokenizer", self.tokenizer, ("byte", "bpe"))
        _check_choice("muon_distributed", self.muon_distributed, MUON_DISTRIBUTED)
        _check_choice("muon_ns_dtype", self.muon_ns_dtype, MUON_NS_DTYPES)
        for name in ("block_size", "n_layer", "n_head", "n_embd", "batch_size", "steps",
                     "eval_interval", "eval_batches", "log_interval", "bpe_vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "stop_at", "sel_anneal_steps", "threads", "sample_tokens",
                     "top_k"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd must be divisible by n_head, got n_embd={self.n_embd}, "
                              f"n_head={self.n_head}")
        for field in dataclasses.fields(self):  # inf/nan pass the range checks below
            value = getattr(self, field.name)
            if isinstance(value, float) and field.name != "p" and not math.isfinite(value):
                raise ConfigError(f"{field.name} must be a finite number, got {value}")
        if not 0 <= self.seed <= SEED_MAX:
            raise ConfigError(f"seed must be in [0, {SEED_MAX}] (numpy's seed range), got "
                              f"{self.seed}")
        _check_device(self.device)
        for name in ("lr", "adamw_lr", "p", "temperature"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip", "sel_scale_lr"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("dropout", "beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.stop_at > self.steps:
            raise ConfigError(f"stop_at must be <= steps ({self.steps}), got {self.stop_at}")

    @property
    def last_step(self) -> int:
        """The step this invocation stops at: ``stop_at`` if set, else ``steps``."""
        return self.stop_at or self.steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def _check_device(name: str) -> None:
    """``auto`` or a cpu / cuda[:N] / mps torch device (availability is checked at run time)."""
    import torch

    accepted = "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device must be {accepted}, got {name!r}") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device must be {accepted}, got {name!r}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

#: Named starting points. ``smoke`` runs in seconds (tests use it); ``default`` is the README's
#: main job, a few minutes on a 2-core CPU. The method choices of ``default`` (connection,
#: optimizer/policy, sel) follow what ``python -m models.compare`` measured; see
#: ``docs/results``.
PRESETS: dict[str, dict] = {
    "smoke": dict(
        corpus="synthetic:60000", block_size=32, n_layer=2, n_head=2, n_embd=32,
        batch_size=8, steps=30, warmup_steps=5, lr=1e-2, adamw_lr=1e-2, eval_interval=10,
        eval_batches=2, log_interval=5, sample_tokens=40),
    # 1-SpheretNorm with plain (unconstrained) ManifoldMuon: the best policy of the manifolds
    # suite; it reached 1.44 nats against AdamW's 2.26 in the same 600 steps (docs/results)
    "default": dict(
        corpus="stdlib", block_size=128, n_layer=4, n_head=4, n_embd=128,
        connection="spheret", retraction="p", p=1.0,
        optimizer="manifold-muon", policy="unconstrained", sel="none",
        batch_size=16, steps=600, warmup_steps=30, lr=0.02, adamw_lr=3e-3,
        eval_interval=100, eval_batches=8, log_interval=10),
}


def _field_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _convert(key: str, value, typ: type):
    """Convert a CLI string (or a TOML value) to the field type ``typ``."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{key} expects a boolean (true/false), got {value!r}")
    if typ is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"--{key} expects an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"--{key} expects an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"--{key} expects a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"--{key} expects a number, got {value!r}") from None
    if not isinstance(value, (str, int, float)):
        raise ConfigError(f"--{key} expects a string, got {value!r}")
    return str(value)


def _apply(base: dict, updates: dict, source: str) -> dict:
    types = _field_types()
    out = dict(base)
    for key, value in updates.items():
        name = key.replace("-", "_")
        if name not in types:
            raise ConfigError(f"unknown config key {key!r} in {source}; valid keys: "
                              f"{', '.join(sorted(types))}")
        out[name] = _convert(name, value, types[name])
    return out


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """``["--lr", "1e-3", "--bias=true"]`` -> ``{"lr": "1e-3", "bias": "true"}``.

    Raises:
        ConfigError: a token that is not ``--key`` or a key without a value.
    """
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"unexpected argument {tok!r}; overrides are --key value")
        key, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens):
                raise ConfigError(f"--{key} needs a value")
            value = tokens[i + 1]
            i += 1
        out[key] = value
        i += 1
    return out


def load_toml(path: str | Path) -> dict:
    """Read a flat TOML config file; a ``preset`` key names the preset it starts from."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; --config takes a TOML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for key, value in data.items():
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config file {path}: key {key!r} must be a plain value, "
                              f"tables and arrays are not config fields")
    return data


def build_config(preset: str | None = None, toml_path: str | Path | None = None,
                 overrides: dict | None = None, base: dict | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from layers: base (or defaults), preset, TOML, overrides.

    Args:
        preset: a key of :data:`PRESETS`; a TOML ``preset`` key is used when this is None.
        toml_path: a TOML file of field values.
        overrides: field values, strings converted to the field types (from ``--key value``).
        base: start from these values instead of the defaults (``--resume`` uses config.json).

    Raises:
        ConfigError: unknown preset or key, a value of the wrong type, an invalid value.
    """
    values = dict(base) if base is not None else {}
    toml = load_toml(toml_path) if toml_path is not None else {}
    toml_preset = toml.pop("preset", None)
    name = preset if preset is not None else toml_preset
    if name is not None:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
        values = _apply(values, PRESETS[name], f"preset {name!r}")
    values = _apply(values, toml, f"config file {toml_path}")
    values = _apply(values, overrides or {}, "the command line")
    try:
        return TrainConfig(**values)
    except TypeError as exc:  # e.g. a stale config.json key
        raise ConfigError(f"bad configuration: {exc}") from None
