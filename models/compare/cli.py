"""``python -m models.compare``: parse the command line, narrow the suite, run it."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..cli import flags_of
from ..config import ConfigError, parse_overrides
from ..data import CorpusError
from ..train import RunError
from .runner import run_suite
from .suites import SUITES, narrow_suite

__all__ = ["EXIT_USER_ERROR", "main"]


#: Exit status of a bad command line, configuration or corpus, or a missing module.
EXIT_USER_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    from ..train import _Parser

    p = _Parser(prog="python -m models.compare", allow_abbrev=False,
                description="Run a comparison suite; extra --key value pairs override the "
                            "config of every run (refused where they would make two arms the "
                            "same configuration, or where no arm reads them).")
    p.add_argument("--suite", required=True, choices=sorted(SUITES))
    p.add_argument("--quick", action="store_true", help="tiny version (seconds per run)")
    p.add_argument("--out", help="output directory (default: runs/compare-<suite>[-quick])")
    p.add_argument("--seeds", type=int, nargs="+",
                   help="seeds (default: the suite's, 0-4 for most; quick: the first)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at the same time, one process each (default 1)")
    p.add_argument("--arms", nargs="+", metavar="ARM",
                   help="run only these arms of the suite (default: all)")
    p.add_argument("--sweep", type=float, nargs="+", metavar="VALUE",
                   help="values of the suite's swept key instead of its grid")
    p.add_argument("--tune_seeds", type=int, metavar="N",
                   help="tune on the first N reported seeds instead of the suite's held-out tuning seeds")
    p.add_argument("--tuning_seeds", type=int, nargs="+", metavar="SEED",
                   help="held-out seeds the sweep runs on (default: the suite's, 100 101 102)")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad input or missing module)."""
    from ..train import _ArgumentError

    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = _parser()
        args, rest = parser.parse_known_args(argv)
        overrides = parse_overrides(rest, flags_of(parser))
        suite = narrow_suite(SUITES[args.suite], arms=args.arms,
                             sweep=None if args.sweep is None else tuple(args.sweep),
                             tune_seeds=args.tune_seeds,
                             tuning_seeds=None if args.tuning_seeds is None else tuple(args.tuning_seeds))
        out = Path(args.out) if args.out else \
            Path("runs") / f"compare-{suite.name}{'-quick' if args.quick else ''}"
        command = "python -m models.compare " + " ".join(shlex.quote(a) for a in argv)
        run_suite(suite, out, quick=args.quick, seeds=tuple(args.seeds or ()),
                  overrides=overrides, command=command, jobs=args.jobs)
    except (_ArgumentError, ConfigError, CorpusError, RunError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'}, {out / 'curves.png'}")
    return 0
