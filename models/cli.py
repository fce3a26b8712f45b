"""The command line of ``python -m models.train``: arguments, the run's configuration, exit codes.

``--help`` lists every config field with the value the chosen preset gives it (``default``
unless ``--preset`` says otherwise), so what it shows is what the command will run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap
import threading
from pathlib import Path

from .config import ConfigError, TrainConfig, build_config, load_toml, parse_overrides
from .data import CorpusError
from .presets import PRESETS
from .run_dir import RunError, describe_os_error, has_checkpoint, read_saved_config

__all__ = ["EXIT_DIVERGED", "EXIT_ENVIRONMENT", "EXIT_INTERRUPTED", "EXIT_USER_ERROR",
           "config_from_args", "flags_of", "main", "parse_args"]

EXIT_ENVIRONMENT = 1
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130
DEFAULT_PRESET = "default"


class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump, caught in main
        raise _ArgumentError(message)


def _preset_in(argv: list[str]) -> str:
    """The ``--preset`` of ``argv`` (for ``--help``), else the default preset."""
    for i, tok in enumerate(argv):
        if tok == "--preset" and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith("--preset="):
            return tok.partition("=")[2]
    return DEFAULT_PRESET


def _epilog(preset: str) -> str:
    try:
        values = build_config(preset if preset in PRESETS else DEFAULT_PRESET).to_dict()
    except ConfigError:  # pragma: no cover - the presets are valid (tested)
        values = TrainConfig().to_dict()
    fields = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return (f"config fields (--key value) with the values of preset {preset!r}:\n"
            + textwrap.fill(fields, width=96, initial_indent="  ", subsequent_indent="  ",
                            break_on_hyphens=False, break_long_words=False)
            + f"\npresets: {', '.join(PRESETS)} (--preset NAME --help shows its values)")


def _parser(preset: str = DEFAULT_PRESET) -> argparse.ArgumentParser:
    p = _Parser(
        allow_abbrev=False, prog="python -m models.train", epilog=_epilog(preset),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train the reference GPT. Any config field can be overridden with "
                    "--key value (e.g. --lr 1e-3 --connection pre-ln).")
    p.add_argument("--preset", help=f"named preset: {', '.join(PRESETS)} "
                                    f"(default: {DEFAULT_PRESET})")
    p.add_argument("--config", help="TOML file of config fields (may name a preset)")
    p.add_argument("--out", help="run directory (default: runs/<preset>)")
    p.add_argument("--steps", help="total optimizer steps")
    p.add_argument("--corpus", help="stdlib | file:PATH | synthetic[:NBYTES] | bin:DIR")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    return p


def flags_of(parser: argparse.ArgumentParser) -> list[str]:
    """The long flags ``parser`` defines (``--preset``, ..., ``--help``), in their order."""
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict]:
    """``(known arguments, overrides)`` of ``argv``."""
    parser = _parser(_preset_in(argv))
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest, flags_of(parser))
    for key in ("steps", "corpus"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    return args, overrides


def config_from_args(args: argparse.Namespace, overrides: dict, out: Path) -> TrainConfig:
    """The run's configuration.

    A fresh run layers preset (``default`` unless ``--preset`` / a TOML ``preset`` key says
    otherwise), TOML file and overrides. ``--resume`` starts from the saved ``config.json`` (or,
    when it is missing, the checkpoint's configuration) instead (``--preset`` is ignored,
    ``stop_at`` is cleared) and applies the TOML file and overrides on top; the run then
    refuses changes outside ``RESUMABLE_FIELDS``.
    """
    if args.resume and ((out / "config.json").exists() or has_checkpoint(out)):
        base = read_saved_config(out)
        base["stop_at"] = 0
        toml = load_toml(args.config) if args.config is not None else {}
        toml.pop("preset", None)
        return build_config(overrides={**toml, **overrides}, base=base)
    preset = args.preset if args.preset is not None or args.config is not None \
        else DEFAULT_PRESET
    return build_config(preset, args.config, overrides)


def _is_rank_zero() -> bool:
    """Rank 0 of a torchrun job, or a plain process (the only one that prints errors)."""
    return os.environ.get("RANK", "0") == "0"


def _interrupted_line(out: Path | None) -> str:
    """What to do after Ctrl-C: resume from the checkpoint, or, before the first one, start over."""
    if out is not None and has_checkpoint(out):
        return "interrupted; resume with --resume (from the last checkpoint)"
    return ("interrupted before the first checkpoint: nothing to resume; run the same command "
            "again to start over")


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
    (0 ok, 1 file-system fault, 2 bad input, 3 diverged, 130 interrupted)."""
    argv = sys.argv[1:] if argv is None else argv
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt from here on
    out = None
    try:
        args, overrides = parse_args(argv)
        if args.out is not None and not args.out.strip():
            raise ConfigError("--out must name a run directory, got ''")
        out = Path(args.out) if args.out else Path("runs") / (args.preset or DEFAULT_PRESET)
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
    if summary.get("diverged"):
        if _is_rank_zero():
            print(f"error: training diverged: {summary.get('error')}", file=sys.stderr)
        return EXIT_DIVERGED
    return 0
