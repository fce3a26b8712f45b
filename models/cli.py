"""The command line of ``python -m models.train``: arguments, the run's configuration, signals,
exit codes.

``--help`` lists every config field with the value the chosen preset gives it (``default``
unless ``--preset`` says otherwise), so what it shows is what the command will run.

SIGTERM and SIGHUP (what batch schedulers send before they kill a job, and what a closed
terminal sends) end a run gracefully: during training the signal waits for the current step to
finish, the trainer writes its checkpoint there and exits with status 128 + the signal's number
(143, 129) after one line saying where to resume; anywhere else it stops the run at once, as
Ctrl-C does (:data:`TERMINATION`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import textwrap
import threading
import warnings
from pathlib import Path

from .config import (
    RESUMABLE_FIELDS,
    ConfigError,
    TrainConfig,
    build_config,
    load_toml,
    parse_overrides,
    refuse_inert_settings,
)
from .data import CorpusError, check_given_tokenizer, resolve_tokenizer
from .presets import PRESETS
from .run_dir import RunError, describe_os_error, has_checkpoint, read_saved_config

__all__ = ["EXIT_DIVERGED", "EXIT_ENVIRONMENT", "EXIT_INTERRUPTED", "EXIT_USER_ERROR",
           "TERMINATING_SIGNALS", "TERMINATION", "Terminated", "config_from_args", "flags_of",
           "main", "parse_args"]

EXIT_ENVIRONMENT = 1
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130
DEFAULT_PRESET = "default"
#: The signals that end a run gracefully (exit status 128 + the signal's number).
TERMINATING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                            if hasattr(signal, name))


class Terminated(BaseException):
    """A run ended by a terminating signal (a :class:`BaseException`, as ``KeyboardInterrupt``
    is, so that no ``except Exception`` swallows it).

    Args:
        signum: the signal.
        step: the step the training loop stopped at; None outside the loop.
        saved: a checkpoint of that step was written.
    """

    def __init__(self, signum: int, step: int | None = None, saved: bool = False) -> None:
        super().__init__(signum, step, saved)
        self.signum, self.step, self.saved = signum, step, saved

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class _Termination:
    """The terminating signal this process received, and whether the training loop holds it
    until a step boundary (:meth:`deferred`) or it ends the run at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferring = False

    def handle(self, signum: int, frame) -> None:
        """The signal handler :func:`main` installs."""
        self.signum = signum
        if not self.deferring:
            raise Terminated(signum)

    @contextlib.contextmanager
    def deferred(self):
        """Hold a signal that arrives inside the block for the loop to act on; one still
        pending when the block ends ends the run there."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.signum is not None:
            raise Terminated(self.signum)

    @contextlib.contextmanager
    def immediate(self):
        """Inside :meth:`deferred`: a signal (already pending or arriving) ends the run at once."""
        if self.signum is not None:
            raise Terminated(self.signum)
        self.deferring = False
        try:
            yield
        finally:
            self.deferring = True


#: This process's signal state; the training loop asks ``TERMINATION.signum`` at each step.
TERMINATION = _Termination()


class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump, caught in main
        raise _ArgumentError(message)


def _option_in(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` (``--preset``, ``--config``) in ``argv``, before parsing (for ``--help``)."""
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith(flag + "="):
            return tok.partition("=")[2]
    return None


def starting_preset(preset: str | None, config: str | None) -> str | None:
    """The preset a fresh run starts from: ``--preset``, else the ``--config`` file's ``preset``
    key, else (no ``--config``) :data:`DEFAULT_PRESET`; ``None`` for a ``--config`` file without
    one (the dataclass defaults, then the file).

    Raises:
        ConfigError: the ``--config`` file cannot be read.
    """
    if preset is not None:
        return preset
    if config is None:
        return DEFAULT_PRESET
    return load_toml(config).get("preset")


def _epilog(preset: str | None, config: str | None) -> str:
    try:
        values = build_config(preset, config).to_dict()
        source = (f"preset {preset!r}" if preset is not None else "the dataclass defaults") + \
            (f" and config file {config}" if config is not None else "")
    except ConfigError:  # an unknown preset or an unreadable file: refused when the run starts
        values, source = build_config(DEFAULT_PRESET).to_dict(), f"preset {DEFAULT_PRESET!r}"
    fields = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return (f"config fields (--key value) with the values of {source}:\n"
            + textwrap.fill(fields, width=96, initial_indent="  ", subsequent_indent="  ",
                            break_on_hyphens=False, break_long_words=False)
            + f"\npresets: {', '.join(PRESETS)} (--preset NAME --help shows its values)")


def _parser(preset: str | None = DEFAULT_PRESET, config: str | None = None) -> argparse.ArgumentParser:
    p = _Parser(
        allow_abbrev=False, prog="python -m models.train", epilog=_epilog(preset, config),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train the reference GPT. Any config field can be overridden with "
                    "--key value (e.g. --lr 1e-3 --connection pre-ln).")
    p.add_argument("--preset", help=f"named preset: {', '.join(PRESETS)} "
                                    f"(default: {DEFAULT_PRESET})")
    p.add_argument("--config", help="TOML file of config fields (may name a preset)")
    p.add_argument("--out", help="run directory (default: runs/<preset>, or runs/<config file's "
                                 "name> for a --config file without a preset key)")
    p.add_argument("--steps", help="total optimizer steps")
    p.add_argument("--corpus", help="stdlib | file:PATH | synthetic[:NBYTES] | bin:DIR")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    return p


def flags_of(parser: argparse.ArgumentParser) -> list[str]:
    """The long flags ``parser`` defines (``--preset``, ..., ``--help``), in their order."""
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict]:
    """``(known arguments, overrides)`` of ``argv``."""
    preset, config = _option_in(argv, "--preset"), _option_in(argv, "--config")
    try:
        start = starting_preset(preset, config)
    except ConfigError:  # an unreadable file: refused when the run starts
        start = preset
    parser = _parser(start, config)
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest, flags_of(parser))
    for key in ("steps", "corpus"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    return args, overrides


def config_from_args(args: argparse.Namespace, overrides: dict, out: Path) -> TrainConfig:
    """The run's configuration.

    A fresh run layers preset (:func:`starting_preset`: ``--preset``, else the TOML file's
    ``preset`` key, else ``default`` where there is no TOML file), TOML file and overrides. ``--resume`` starts from the saved ``config.json`` (or,
    when it is missing, the checkpoint's configuration) instead (``stop_at`` is cleared) and
    applies the TOML file and overrides on top; the run then refuses changes outside
    ``RESUMABLE_FIELDS``. A preset named there (``--preset``, the TOML file's ``preset`` key) is
    not applied, and is refused unless it describes the run (:func:`_check_resumed_preset`).

    A setting the user gave (an override or a key of the TOML file; not a preset's, nor a saved
    run's) that the configuration never reads is refused (:func:`~models.config.inert_settings`:
    ``--muon_ns_dtype`` under ``optimizer=adamw``, ``--sel_kappa`` under ``sel=none``, ...), and
    so is a tokenizer the user gave that is not the one the ``bin:`` shards were made with
    (:func:`~models.data.check_given_tokenizer`: the shards' own would be used): both before
    the run starts. A fresh run's tokenizer ``auto`` (the default) becomes the corpus's own
    (:func:`~models.data.resolve_tokenizer`: ``bpe`` on BPE shards), as the run saves it; a
    resumed run's stays as saved.

    Raises:
        ConfigError, CorpusError: the configuration or a given setting is refused.
    """
    toml = load_toml(args.config) if args.config is not None else {}
    toml_preset = toml.pop("preset", None)
    resumed = args.resume and ((out / "config.json").exists() or has_checkpoint(out))
    if resumed:
        base = read_saved_config(out)
        base["stop_at"] = 0
        cfg = build_config(overrides={**toml, **overrides}, base=base)
        if args.preset is not None or toml_preset is not None:
            _check_resumed_preset(args.preset or toml_preset,
                                  None if args.preset is not None else args.config, cfg,
                                  {**toml, **overrides}, out)
    else:
        preset = args.preset if args.preset is not None or args.config is not None \
            else DEFAULT_PRESET
        cfg = build_config(preset, args.config, overrides)
    given = {key.replace("-", "_"): f"{key.replace('-', '_')!r} in config file {args.config}"
             for key in toml}
    given.update({key.replace("-", "_"): f"--{key}" for key in overrides})
    if "tokenizer" in given:
        check_given_tokenizer(cfg.corpus, cfg.tokenizer, given["tokenizer"])
    if not resumed:  # a saved run's stays as saved (a run on BPE shards saved as byte resumes)
        cfg = resolve_tokenizer(cfg)
    refuse_inert_settings(cfg, given)  # on shards the corpus makes bpe_vocab_size inert either way
    return cfg


def _check_resumed_preset(name: str, config: str | None, cfg: TrainConfig, given: dict,
                          out: Path) -> None:
    """Refuse a preset named on ``--resume`` (by ``--preset``, or by the ``preset`` key of the
    TOML file ``config``) that does not describe the run: one of its values outside
    ``RESUMABLE_FIELDS`` that no setting the user gave (``given``) replaces differs from the
    resumed configuration ``cfg``. The same command again with ``--resume`` passes; another
    preset would otherwise be dropped unsaid while the run goes on as saved.

    Raises:
        ConfigError: an unknown preset, or one naming each value it would change.
    """
    build_config(name)  # an unknown preset: the fresh run's error
    saved = cfg.to_dict()
    given = {key.replace("-", "_") for key in given}
    differ = [f"{key} {saved[key]!r} (the run) != {value!r} (the preset)"
              for key, value in PRESETS[name].items()
              if key not in RESUMABLE_FIELDS and key not in given and saved[key] != value]
    if differ:
        label, drop = (f"--preset {name!r}", "--preset") if config is None else \
            (f"preset {name!r} (config file {config})", "the file's preset key")
        raise ConfigError(f"{label} does not describe the run in {out}: {', '.join(differ)}; "
                          f"--resume continues the run's saved configuration: drop {drop}, or "
                          f"start a fresh run in another --out")


def _is_rank_zero() -> bool:
    """Rank 0 of a torchrun job, or a plain process (the only one that prints errors)."""
    return os.environ.get("RANK", "0") == "0"


def _interrupted_line(out: Path | None) -> str:
    """What to do after Ctrl-C: resume from the checkpoint, or, before the first one, start over."""
    if out is not None and has_checkpoint(out):
        return "interrupted; resume with --resume (from the last checkpoint)"
    return ("interrupted before the first checkpoint: nothing to resume; run the same command "
            "again to start over")


def _terminated_line(stop: Terminated, out: Path | None) -> str:
    """What a terminating signal left: the checkpoint it wrote, or the last one, or nothing."""
    resume = f"resume with python -m models.train --resume --out {out}"
    if stop.step is not None and stop.saved:
        return f"terminated by {stop.name} at step {stop.step}: checkpoint written; {resume}"
    if stop.step is not None and stop.step > 0:
        return (f"terminated by {stop.name} at step {stop.step} without a checkpoint "
                f"(checkpoint=false)")
    if out is not None and has_checkpoint(out):
        return f"terminated by {stop.name}; {resume} (from the last checkpoint)"
    return (f"terminated by {stop.name} before the first checkpoint: nothing to resume; run the "
            f"same command again to start over")


@contextlib.contextmanager
def _signal_handlers():
    """SIGINT raises ``KeyboardInterrupt``, SIGTERM / SIGHUP go to :data:`TERMINATION`; the
    previous handlers are restored afterwards (main thread only: elsewhere none can be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = {signal.SIGINT: signal.default_int_handler,
              **{signum: TERMINATION.handle for signum in TERMINATING_SIGNALS}}
    previous = {signum: signal.signal(signum, handler) for signum, handler in wanted.items()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        TERMINATION.signum = None


def _checkpoint_clause(out: Path | None) -> str:
    """What a file-system error leaves to resume from: the last checkpoint (written atomically,
    so whole) or, before the first one, nothing."""
    try:
        kept = out is not None and has_checkpoint(out)
    except OSError:  # the run directory itself cannot be read: say nothing about it
        return ""
    return "; the last checkpoint is kept" if kept else "; no checkpoint had been written yet"


def main(argv: list[str] | None, run) -> int:
    """Parse ``argv``, call ``run(cfg, out, resume=...)`` and map the outcome to an exit status
    (0 ok, 1 file-system fault, 2 bad input, 3 diverged, 130 interrupted, 143 / 129 ended by
    SIGTERM / SIGHUP)."""
    argv = sys.argv[1:] if argv is None else argv
    with _signal_handlers(), _short_warnings():
        return _main(argv, run)


@contextlib.contextmanager
def _short_warnings():
    """The trainer's own warnings (a warm-up that outlasts the run, a missing plotting package)
    printed as one ``warning: ...`` line, as errors are; others as before. Only the text is
    formatted here: a caller that records warnings (``warnings.catch_warnings(record=True)``)
    still gets them."""
    previous = warnings.formatwarning
    ours = Path(__file__).resolve().parent

    def formatwarning(message, category, filename, lineno, line=None) -> str:
        if Path(filename).resolve().parent == ours:
            return f"warning: {message}\n"
        return previous(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        warnings.formatwarning = previous


def _main(argv: list[str], run) -> int:
    out = None
    try:
        args, overrides = parse_args(argv)
        if args.out is not None and not args.out.strip():
            raise ConfigError("--out must name a run directory, got ''")
        if args.out:
            out = Path(args.out)
        else:  # a --config file's preset names the directory too
            start = starting_preset(args.preset, args.config)
            out = Path("runs") / (start if start is not None else Path(args.config).stem)
        cfg = config_from_args(args, overrides, out)
        summary = run(cfg, out, resume=args.resume)
    except (_ArgumentError, ConfigError, CorpusError, RunError) as exc:
        if _is_rank_zero():  # every rank failed with the same message (raise_together)
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as exc:  # the environment: a full disk, a directory we may not write, ...
        if _is_rank_zero():
            print(f"error: {describe_os_error(exc)}{_checkpoint_clause(out)}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except KeyboardInterrupt:
        print(_interrupted_line(out), file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated as stop:
        if _is_rank_zero():
            print(_terminated_line(stop, out), file=sys.stderr, flush=True)
        return 128 + stop.signum
    if summary.get("diverged"):
        if _is_rank_zero():
            print(f"error: training diverged: {summary.get('error')}", file=sys.stderr)
        return EXIT_DIVERGED
    return 0
