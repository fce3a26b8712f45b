"""Training configuration: one frozen dataclass with the model's ``GPTConfig`` nested in it,
named presets, TOML files, typed overrides.

A configuration is built in layers, later ones winning:

1. the dataclass defaults of :class:`TrainConfig` (and of its nested ``model``);
2. a preset (:data:`~models.presets.PRESETS`), or the ``preset`` key of a TOML file;
3. a TOML file (flat ``key = value`` pairs, read with :mod:`tomllib`);
4. command-line overrides ``--key value`` for any field, converted to the field's type.

Keys are flat everywhere (``--n_layer 4``, ``lr = 3e-3``, ``config.json``): a key that names a
field of :class:`models.gpt.GPTConfig` goes to ``TrainConfig.model``, every other key is a
training field; ``vocab_size`` is a training field (``0``: the corpus's vocabulary, a larger
number pads it), since the model's vocabulary is the corpus's unless it is padded. ``cfg.n_layer`` reads
``cfg.model.n_layer``. Training fields are validated in ``__post_init__``, model fields by
``GPTConfig``; a bad value raises :class:`ConfigError` naming the field, the value and what
was expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from manifoldlib.optim import available_policies

from .connections import CONNECTIONS as _CONNECTIONS
from .gpt import READ_RULES, GPTConfig
from .presets import PRESETS

__all__ = [
    "CONNECTIONS",
    "DTYPES",
    "INERT_RULES",
    "LEGACY_LR_SCHEDULE_VERSION",
    "LEGACY_MUON_NS_DTYPE",
    "LR_SCHEDULE_VERSIONS",
    "MODEL_KEYS",
    "RESUMABLE_FIELDS",
    "ConfigError",
    "TrainConfig",
    "build_config",
    "config_keys",
    "inert_settings",
    "parse_overrides",
    "refuse_inert_settings",
]

#: ``optimizer`` values: plain AdamW, or ``manifoldlib.optim.build_optimizer`` with ``policy``.
OPTIMIZERS = ("adamw", "manifold-muon")
#: ``sel`` values: no chart, or SEL on every block linear map with the given variant.
SEL_VARIANTS = ("none", "mismatched", "congruent", "no-linear")
SCHEDULES = ("cosine", "constant")
#: ``lr_schedule_version`` values: the cosine formulas of :func:`models.build.lr_scale`. 2 ends
#: at ``min_lr_ratio`` on the run's last update; 1, the formula of runs saved before the field
#: (its first decay update repeats the peak, its last stays above ``min_lr_ratio``), is kept so
#: that such runs resume bit for bit.
LR_SCHEDULE_VERSIONS = (1, 2)
#: ``muon_distributed`` values: each matrix solved on one rank, or on every rank.
MUON_DISTRIBUTED = ("sharded", "replicated")
#: ``muon_ns_dtype`` values (ManifoldMuon's ``ns_dtype``): ``auto`` runs Muon's Newton–Schulz in
#: bfloat16 where bfloat16 products are native and in float32 elsewhere (on an AVX2-only CPU the
#: bfloat16 iteration was half the default run's time).
MUON_NS_DTYPES = ("auto", "bfloat16", "float32")
#: ``muon_recipe`` values: the library's ManifoldMuon, or the step of the layer-wise-manifolds
#: paper's public code (:mod:`models.reference_muon`: an inexact 20-step dual and its DGram map).
MUON_RECIPES = ("library", "reference")
#: ``dtype`` values: the autocast dtype of forward and loss (float16 adds a GradScaler).
DTYPES = ("float32", "bfloat16", "float16")
#: ``tokenizer`` values: ``auto`` is the corpus's own (bytes for a text corpus, the one a
#: ``bin:`` folder's ``meta.json`` records, ``ids`` for nanoGPT shards without one); a run
#: records the tokenizer it trained with, never ``auto``. ``ids``: token ids read as they are.
TOKENIZERS = ("auto", "byte", "bpe", "ids")
#: ``log`` values: extra metric sinks besides ``metrics.jsonl``.
LOGS = ("none", "tensorboard")
#: ``shard_dtype`` values: the dtype ``meta.json`` records (a folder without one is refused), or
#: the ids' dtype given for shards without it (nanoGPT's ``prepare.py`` writes uint16).
SHARD_DTYPES = ("meta", "uint16", "uint32")
#: ``muon_ns_dtype`` of a saved configuration that predates the field (such runs used bfloat16).
LEGACY_MUON_NS_DTYPE = "bfloat16"
#: ``lr_schedule_version`` of a saved configuration that predates the field.
LEGACY_LR_SCHEDULE_VERSION = 1
#: Largest ``threads``: more than any CPU node has (torch crashes setting up ~1e5 threads).
MAX_THREADS = 4096
#: Largest ``seed``: numpy's global generator takes seeds in ``[0, 2**32 - 1]``.
SEED_MAX = 2**32 - 1

#: Residual-connection names the reference GPT implements (defined once, in ``models.connections``).
CONNECTIONS = _CONNECTIONS

#: Flat keys that belong to the nested ``GPTConfig`` (``vocab_size`` is the training field that
#: pads the corpus's vocabulary).
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(GPTConfig) if f.name != "vocab_size")

#: Fields that may change when a run is resumed; all others must match the saved config.
RESUMABLE_FIELDS = frozenset({
    "steps", "stop_at", "eval_interval", "eval_batches", "log_interval", "checkpoint",
    "device", "threads", "progress", "progress_interval", "sample_tokens", "sample_prompt",
    "temperature", "top_k", "muon_distributed", "peak_flops", "log", "grad_accum_steps",
    # the corpus fingerprint covers the dtype: a resume that reads the shards otherwise is refused
    "shard_dtype"})

#: The model of :class:`TrainConfig`'s defaults (``GPTConfig``'s own, but 4 layers of 128).
DEFAULT_MODEL = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128)


class ConfigError(ValueError):
    """A bad configuration value, preset name, TOML file or override."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on; saved (flat) as ``config.json`` in the run directory.

    ``model`` is the :class:`~models.gpt.GPTConfig` of the network (its ``vocab_size`` is
    replaced by the corpus's when the model is built); its fields read through:
    ``cfg.n_layer is cfg.model.n_layer``.

    A value of a model field the network never reads (``p`` under ``connection="geonorm"``:
    :func:`models.gpt.unread_fields`), which a preset, a config file or an older run's
    ``config.json`` may hold (the command line refuses one a user gives), stays out of
    ``model``, which :class:`~models.gpt.GPTConfig` keeps at the field's default
    (:meth:`~models.gpt.GPTConfig.from_settings`), so it builds the model it always built; it is
    held in ``unread_model_values`` and read through like the others (``cfg.p``,
    :meth:`to_dict`), so a saved run resumes as saved.
    """

    model: GPTConfig = DEFAULT_MODEL
    # data
    corpus: str = "stdlib"            #: ``stdlib``, ``file:PATH``, ``synthetic[:NBYTES]``, ...
    #: ``auto`` (the corpus's own), ``byte`` (vocabulary 256), ``bpe`` (extra ``bpe``) or, for
    #: nanoGPT shards, ``ids``; a run saves the one it trained with
    tokenizer: str = "auto"
    bpe_vocab_size: int = 1024
    #: the model's vocabulary: 0 = the corpus's; larger pads it (GPT-2's 50257 -> 50304), or
    #: sets it for nanoGPT shards without meta.json
    vocab_size: int = 0
    #: dtype of ``bin:`` token ids: ``meta`` (what meta.json records) | uint16 | uint32 (for
    #: shards without meta.json, whose files do not say)
    shard_dtype: str = "meta"
    val_fraction: float = 0.1
    # optimization
    optimizer: str = "adamw"          #: ``adamw`` or ``manifold-muon`` (uses ``policy``)
    policy: str = "hetero"            #: ManifoldMuon assignment policy (``manifold-muon`` only)
    muon_distributed: str = "sharded"  #: ManifoldMuon under torchrun: ``sharded``|``replicated``
    muon_ns_dtype: str = "auto"       #: Euclidean Newton–Schulz dtype: auto|bfloat16|float32
    muon_recipe: str = "library"      #: ``library`` (ManifoldMuon) or ``reference`` (the paper's code)
    sel: str = "none"                 #: SEL chart on block linear maps: none|mismatched|...
    sel_scale_lr: float = 0.0         #: AdamW lr of SEL scale parameters; 0 = same as ``lr``
    sel_anneal_steps: int = 0         #: steps of SEL's scale-lr annealing; 0 = no annealing
    #: SEL's curvature at the weights' own initial scale, :math:`b\,\mathrm{RMS}(W_0) = \kappa`
    sel_kappa: float = 1.0
    lr: float = 3e-3                  #: AdamW lr, or the ManifoldMuon lr for matrices
    #: AdamW lr of the attention and MLP matrices (SEL's raw coordinates where charted);
    #: 0 = same as ``lr`` (``adamw`` only)
    block_lr: float = 0.0
    adamw_lr: float = 3e-3            #: AdamW lr of non-matrix params under ``manifold-muon``
    #: AdamW's decoupled decay of matrices (under ``manifold-muon``: of the AdamW groups)
    weight_decay: float = 0.1
    #: ManifoldMuon's decoupled decay of the unconstrained (Euclidean) matrices, as the seed's
    #: code and torch.optim.Muon; constrained matrices take none (Stiefel and Oblique fix their
    #: scale, DGram's column norms are left free: the seed's "no additional scale control")
    muon_weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0            #: max global grad norm; 0 disables clipping
    schedule: str = "cosine"          #: ``cosine`` (to ``min_lr_ratio``) or ``constant``
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    #: the cosine's formula (:func:`models.build.lr_scale`): 2 reaches ``min_lr_ratio`` on the
    #: last update; 1 is that of runs saved before the field, which resume with it
    lr_schedule_version: int = 2
    batch_size: int = 16              #: sequences per optimizer step, over all ranks and micro-steps
    grad_accum_steps: int = 1         #: micro-steps per optimizer step (batch_size / K each)
    steps: int = 1000                 #: total optimizer steps (the schedule's length)
    stop_at: int = 0                  #: stop early at this step, resumable; 0 = run to ``steps``
    # precision and speed
    dtype: str = "float32"            #: autocast dtype: float32 (off) | bfloat16 | float16
    compile: bool = False             #: ``torch.compile`` the model
    #: shard parameters, gradients and optimizer state across the ranks with FSDP2
    #: (``fully_shard``) instead of replicating them with DDP; checkpoints become sharded
    fsdp: bool = False
    peak_flops: float = 0.0           #: per-device peak FLOP/s for MFU; 0 = look the device up
    # bookkeeping
    eval_interval: int = 100          #: evaluate every this many steps, at step 0 and at the end
    eval_batches: int = 8
    log_interval: int = 10
    log: str = "none"                 #: extra metric sink: none | tensorboard (offline)
    checkpoint: bool = True           #: write ``checkpoint.pt`` (at each evaluation and the end)
    seed: int = 0
    device: str = "auto"              #: ``auto`` (cuda, then mps, then cpu), or a torch device
    threads: int = 1                  #: torch threads; 1 is fastest on a shared CPU, 0 = default
    progress: bool = True             #: tqdm bar on a terminal, else a line every progress_interval
    progress_interval: float = 30.0   #: seconds between progress lines when not on a terminal
    sample_tokens: int = 300          #: tokens generated at the end (0 = no sample)
    sample_prompt: str = "def "
    temperature: float = 0.8
    top_k: int = 40
    #: ``(name, value)`` of each model field at a value ``model`` never reads (not a config key:
    #: :meth:`from_dict` fills it, :meth:`to_dict` and ``cfg.name`` report the values)
    unread_model_values: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.model, GPTConfig):
            raise ConfigError(f"model must be a GPTConfig, got {type(self.model).__name__}")
        _check_unread_model_values(self.model, self.unread_model_values)
        _check_types(self)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        # checked with adamw too, where it is unused: a misspelt policy is never silently ignored
        _check_choice("policy", self.policy, tuple(available_policies()))
        _check_choice("sel", self.sel, SEL_VARIANTS)
        _check_choice("schedule", self.schedule, SCHEDULES)
        if self.lr_schedule_version not in LR_SCHEDULE_VERSIONS:
            raise ConfigError(
                f"lr_schedule_version must be 2 (the cosine ends at min_lr_ratio on the last "
                f"update) or 1 (the formula of runs saved before the field, kept to resume them), "
                f"got {self.lr_schedule_version!r}")
        _check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        _check_choice("muon_distributed", self.muon_distributed, MUON_DISTRIBUTED)
        _check_choice("muon_ns_dtype", self.muon_ns_dtype, MUON_NS_DTYPES)
        _check_choice("muon_recipe", self.muon_recipe, MUON_RECIPES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("log", self.log, LOGS)
        _check_choice("shard_dtype", self.shard_dtype, SHARD_DTYPES)
        if self.shard_dtype != "meta" and not self.corpus.startswith("bin:"):
            raise ConfigError(f"shard_dtype {self.shard_dtype!r} is for token shards "
                              f"(--corpus bin:DIR); corpus {self.corpus!r} is text")
        for name in ("batch_size", "grad_accum_steps", "steps", "eval_interval", "eval_batches",
                     "log_interval", "bpe_vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "stop_at", "sel_anneal_steps", "threads", "sample_tokens",
                     "top_k", "vocab_size"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for field in dataclasses.fields(self):  # inf/nan pass the range checks below
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{field.name} must be a finite number, got {value}")
        if self.threads > MAX_THREADS:
            raise ConfigError(f"threads must be at most {MAX_THREADS}, got {self.threads} (0 "
                              f"keeps torch's default: one per core)")
        if not 0 <= self.seed <= SEED_MAX:
            raise ConfigError(f"seed must be in [0, {SEED_MAX}] (numpy's seed range), got "
                              f"{self.seed}")
        _check_device(self.device)
        for name in ("lr", "adamw_lr", "temperature", "sel_kappa"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "muon_weight_decay", "grad_clip", "sel_scale_lr", "block_lr",
                     "peak_flops", "progress_interval"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.stop_at > self.steps:
            raise ConfigError(f"stop_at must be <= steps ({self.steps}), got {self.stop_at}")
        if self.fsdp and self.dtype == "float16":
            raise ConfigError("dtype 'float16' with fsdp is not supported: the float16 loss "
                              "scaler would check each rank's gradient shards for overflow on "
                              "their own, and the ranks could disagree on skipping a step; use "
                              "dtype bfloat16 (no loss scaling) or float32")
        if self.batch_size % self.grad_accum_steps:
            raise ConfigError(f"batch_size {self.batch_size} is not divisible by "
                              f"grad_accum_steps {self.grad_accum_steps}; every micro-step "
                              f"takes batch_size / grad_accum_steps sequences")

    def __getattr__(self, name: str):
        """A model field read through: ``cfg.n_layer`` is ``cfg.model.n_layer`` (a value the
        model never reads: the one :attr:`unread_model_values` holds)."""
        if name in MODEL_KEYS:
            unread = dict(object.__getattribute__(self, "unread_model_values"))
            if name in unread:
                return unread[name]
            return getattr(object.__getattribute__(self, "model"), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def last_step(self) -> int:
        """The step this invocation stops at: ``stop_at`` if set, else ``steps``."""
        return self.stop_at or self.steps

    def to_dict(self) -> dict:
        """Flat plain data: the training fields and the model's (without ``vocab_size``), those
        the model never reads with the values :attr:`unread_model_values` holds."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in _NOT_KEYS}
        out.update({k: getattr(self.model, k) for k in MODEL_KEYS})
        out.update(self.unread_model_values)
        return out

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """The configuration of flat ``values`` (what :meth:`to_dict` and ``config.json`` hold);
        missing keys take the defaults.

        Raises:
            ConfigError: an unknown key or an invalid value (model values included).
        """
        train_names = {f.name for f in dataclasses.fields(cls)} - _NOT_KEYS
        unknown = sorted(set(values) - train_names - set(MODEL_KEYS))
        if unknown:
            raise ConfigError(f"unknown config key {unknown[0]!r}; "
                              + _suggest_key(unknown[0], config_keys()))
        settings = {**DEFAULT_MODEL.to_dict(),
                    **{k: v for k, v in values.items() if k in MODEL_KEYS}}
        try:  # a field the model never reads keeps its default (GPTConfig refuses another)
            model = GPTConfig.from_settings(**settings)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        unread = tuple((k, settings[k]) for k in MODEL_KEYS if settings[k] != getattr(model, k))
        return cls(model=model, unread_model_values=unread,
                   **{k: v for k, v in values.items() if k in train_names})

    def replace(self, **changes) -> TrainConfig:
        """A copy with flat ``changes`` (training or model fields)."""
        return TrainConfig.from_dict({**self.to_dict(), **changes})


#: :class:`TrainConfig` fields that are not flat config keys.
_NOT_KEYS = frozenset({"model", "unread_model_values"})


def _check_unread_model_values(model: GPTConfig, unread) -> None:
    """``unread`` holds distinct ``(name, value)`` pairs of valid values that ``model`` never
    reads, none at ``model``'s own value (so equal configurations compare equal)."""
    if not (isinstance(unread, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in unread)
            and len(dict(unread)) == len(unread)):
        raise ConfigError(f"unread_model_values must be distinct (name, value) pairs, got "
                          f"{unread!r}")
    try:
        held = GPTConfig.from_settings(**{**model.to_dict(), **dict(unread)})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"unread_model_values: {exc}") from None
    for name, value in unread:
        if getattr(held, name) != getattr(model, name) or value == getattr(model, name):
            raise ConfigError(f"unread_model_values holds {name}={value!r}, which is not a value "
                              f"the model leaves unread; set it in model")


_CLASH = set(MODEL_KEYS) & {f.name for f in dataclasses.fields(TrainConfig)}
if _CLASH:  # a flat key must name one field: rename one side
    raise ImportError(f"GPTConfig and TrainConfig both define {sorted(_CLASH)}; flat config "
                      f"keys route by name, so each name may belong to one of them only")


#: What a value of each field type must be, as an error names it.
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _check_types(cfg: TrainConfig) -> None:
    """Every training field holds a value of its declared type (an integer is a valid number;
    a boolean is not a number), so a hand-edited ``config.json`` fails here, not mid-run."""
    hints = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(cfg):
        typ, value = hints[field.name], getattr(cfg, field.name)
        if typ not in _TYPE_NAMES:
            continue
        accepted = (int, float) if typ is float else typ
        if not isinstance(value, accepted) or (typ in (int, float) and isinstance(value, bool)):
            raise ConfigError(f"{field.name} must be {_TYPE_NAMES[typ]}, got {value!r}")


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


def _field_types() -> dict[str, type]:
    """Flat key -> type: the training fields and the model's (:data:`MODEL_KEYS`)."""
    hints = typing.get_type_hints(TrainConfig)
    types = {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)
             if f.name not in _NOT_KEYS}
    model_hints = typing.get_type_hints(GPTConfig)
    types.update({k: model_hints[k] for k in MODEL_KEYS})
    return types


def config_keys() -> tuple[str, ...]:
    """Every flat config key, sorted: the training fields and the model's."""
    return tuple(sorted(_field_types()))


def _closest(name: str, candidates: Sequence[str]) -> str | None:
    """The one of ``candidates`` that ``name`` most likely misspells, or None."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def _suggest_key(key: str, keys: Sequence[str]) -> str:
    """``"did you mean 'lr'?"`` for a misspelt key, else the list of the valid ones."""
    close = _closest(key.replace("-", "_"), keys)
    return f"did you mean {close!r}?" if close else f"valid keys: {', '.join(keys)}"


def _unknown_option(key: str, flags: Sequence[str]) -> ConfigError:
    """The error of a command-line option ``--key`` that is neither one of the program's
    ``flags`` nor a config key, naming the closest of them as what it is."""
    flag_names = [f[2:] for f in flags]
    close = _closest(key.replace("-", "_"), [*flag_names, *config_keys()])
    what = f"unknown option --{key}: neither a flag nor a config key"
    if close is None:
        listed = [f for f in flags if f != "--help"]
        return ConfigError(f"{what}; the flags are {', '.join(listed)} and --help, which lists "
                           f"the config keys (any of them is an option --key value)")
    kind = "flag" if close in flag_names else "config key"
    return ConfigError(f"{what}; did you mean the {kind} --{close}?")


def _convert(label: str, value, typ: type):
    """Convert a CLI string (or a TOML value) to the field type ``typ``; errors name the value
    by ``label`` (``--lr`` on the command line, ``'lr' in config file F`` elsewhere)."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{label} expects a boolean (true/false), got {value!r}")
    if typ is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{label} expects an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{label} expects an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{label} expects a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{label} expects a number, got {value!r}") from None
    if not isinstance(value, (str, int, float)):
        raise ConfigError(f"{label} expects a string, got {value!r}")
    return str(value)


#: The source name of :func:`build_config`'s ``overrides`` (``--key value`` options).
_COMMAND_LINE = "the command line"


def _apply(base: dict, updates: dict, source: str, extra_keys: tuple[str, ...] = ()) -> dict:
    """``base`` updated by ``updates`` from ``source``; ``extra_keys``: other keys valid
    there (a TOML file's ``preset``), suggested for a misspelt one."""
    types = _field_types()
    out = dict(base)
    for key, value in updates.items():
        name = key.replace("-", "_")
        if name not in types:
            raise ConfigError(f"unknown config key {key!r} in {source}; "
                              + _suggest_key(key, sorted([*types, *extra_keys])))
        label = f"--{name}" if source == _COMMAND_LINE else f"{name!r} in {source}"
        out[name] = _convert(label, value, types[name])
    return out


def parse_overrides(tokens: list[str], flags: Sequence[str] = ()) -> dict[str, str]:
    """``["--lr", "1e-3", "--bias=true"]`` -> ``{"lr": "1e-3", "bias": "true"}``.

    A boolean key given alone (last, or followed by another ``--`` option) is true:
    ``["--fsdp", "--steps", "10"]`` -> ``{"fsdp": "true", "steps": "10"}``.

    Args:
        tokens: what a program's own parser left of its command line.
        flags: that program's own flags (``--preset``, ...): a misspelt one is suggested as a
            flag, a misspelt key as a config key.

    Raises:
        ConfigError: a token that is not ``--key``, a key that is not a config key (with the
            closest flags and keys), or a key without a value.
    """
    types = _field_types()
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"unexpected argument {tok!r}; overrides are --key value")
        key, eq, value = tok[2:].partition("=")
        if key.replace("-", "_") not in types:
            raise _unknown_option(key, flags)
        if not eq and types[key.replace("-", "_")] is bool and (
                i + 1 >= len(tokens) or tokens[i + 1].startswith("--")):
            value = "true"  # a switch: --fsdp
        elif not eq:
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
            close = _closest(str(name), list(PRESETS))
            hint = f"did you mean {close!r}? " if close else ""
            raise ConfigError(f"unknown preset {name!r}; {hint}available: {', '.join(PRESETS)}")
        values = _apply(values, PRESETS[name], f"preset {name!r}")
    values = _apply(values, toml, f"config file {toml_path}", extra_keys=("preset",))
    values = _apply(values, overrides or {}, _COMMAND_LINE)
    return TrainConfig.from_dict(values)


# ---- settings that do nothing under the chosen configuration ----------------------------------

#: ManifoldMuon's settings: :func:`models.build.build_train_optimizer` reads them under
#: ``optimizer="manifold-muon"`` only.
_MUON_SETTINGS = ("policy", "adamw_lr", "muon_weight_decay", "muon_ns_dtype", "muon_recipe",
                  "muon_distributed")


def _no_euclidean_matrix(policy: str) -> bool:
    """Whether ``policy`` puts none of the reference GPT's matrices on the Euclidean manifold.

    The GPT's hidden matrices are attention and MLP maps only, so a role policy's ``other``
    choice never applies to them (``hetero``'s Euclidean ``other`` included). A policy that is
    not a role policy (a user's own function) is not known here: False.
    """
    from manifoldlib.optim import RolePolicy, get_policy

    found = get_policy(policy)
    return isinstance(found, RolePolicy) and "euclidean" not in (found.attn, found.mlp)


#: When settings do nothing, read from the code that uses each field: ``(settings, cause, inert,
#: used)`` — under ``inert(cfg)`` the ``settings`` are never read, ``cause`` names the field that
#: makes them inert and ``used`` says what reads them. The first rule that holds for a setting
#: names its cause.
INERT_RULES: tuple[tuple[tuple[str, ...], str, Callable[[TrainConfig], bool], str], ...] = (
    (_MUON_SETTINGS, "optimizer", lambda c: c.optimizer == "adamw",
     "only --optimizer manifold-muon reads it"),
    (("block_lr",), "optimizer", lambda c: c.optimizer == "manifold-muon",
     "only --optimizer adamw reads it (ManifoldMuon steps the block matrices at --lr)"),
    (("muon_ns_dtype", "muon_distributed"), "muon_recipe", lambda c: c.muon_recipe == "reference",
     "only --muon_recipe library reads it"),
    (("muon_ns_dtype", "muon_weight_decay"), "policy", lambda c: _no_euclidean_matrix(c.policy),
     ("it acts on Euclidean matrices, and this policy puts none of the GPT's there "
      "(--policy unconstrained does)")),
    (("sel_scale_lr", "sel_anneal_steps", "sel_kappa"), "sel", lambda c: c.sel == "none",
     f"only --sel {', '.join(SEL_VARIANTS[1:-1])} or {SEL_VARIANTS[-1]} reads it"),
    (("min_lr_ratio", "lr_schedule_version"), "schedule", lambda c: c.schedule == "constant",
     "only --schedule cosine reads it"),
    (("bpe_vocab_size", "val_fraction"), "corpus", lambda c: c.corpus.startswith("bin:"),
     "token shards carry their tokenizer and their split; only a text corpus reads it"),
    (("bpe_vocab_size",), "tokenizer", lambda c: c.tokenizer != "bpe",
     "only --tokenizer bpe reads it"),
    (("shard_dtype",), "corpus", lambda c: not c.corpus.startswith("bin:"),
     "only a --corpus bin:DIR reads it"),
    (("sample_prompt", "temperature", "top_k"), "sample_tokens", lambda c: c.sample_tokens == 0,
     "only --sample_tokens N > 0 reads it"),
    (("sample_prompt",), "tokenizer", lambda c: c.tokenizer == "ids",
     ("ids read as they are have no text to encode a prompt with (the sample starts from the "
      "first training token); only a corpus with a tokenizer reads it")),
    (("progress_interval",), "progress", lambda c: not c.progress,
     "only --progress true reads it"),
    # the model's fields: the GPT's own rules (models.gpt.READ_RULES), as the command line says them
    *((names, cause, lambda c, cause=cause, readers=readers: getattr(c, cause) not in readers,
       f"only --{cause} {' or '.join(readers)} reads it" + (f" ({note})" if note else ""))
      for names, cause, readers, note in READ_RULES),
)


def inert_settings(cfg: TrainConfig) -> dict[str, str]:
    """The fields ``cfg`` never reads, each with why: ``{"muon_ns_dtype": "does nothing with
    optimizer=adamw: only --optimizer manifold-muon reads it", ...}``."""
    out: dict[str, str] = {}
    for settings, cause, inert, used in INERT_RULES:
        if not inert(cfg):
            continue
        value = getattr(cfg, cause)
        value = str(value).lower() if isinstance(value, bool) else value  # as --progress takes it
        why = f"does nothing with {cause}={value}: {used}"
        for name in settings:
            out.setdefault(name, why)
    return out


def refuse_inert_settings(cfg: TrainConfig, given: dict[str, str]) -> None:
    """Refuse the settings a user gave that ``cfg`` never reads.

    Args:
        cfg: the configuration built from them.
        given: the keys the user set (on the command line or in a ``--config`` file, not a
            preset's or a saved run's values) -> how the error names each (``--muon_ns_dtype``).

    Raises:
        ConfigError: one line naming each inert setting, the field that makes it inert and what
            would read it.
    """
    inert = inert_settings(cfg)
    unused = [f"{label} {inert[name]}" for name, label in given.items() if name in inert]
    if unused:
        raise ConfigError("; ".join(unused))
