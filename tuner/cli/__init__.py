"""The ``colltune`` command line.

Subcommands are small classes registered in one table (:data:`COMMANDS`);
``main(argv) -> int`` parses, dispatches and turns errors into exit statuses:

====  ==========================================================
0     success
1     the run failed (a rank raised; the message names the rank)
2     bad usage: an unknown option, a bad option value, an
      unwritable output path (a one-line message, no traceback)
130   interrupted
====  ==========================================================

One module per subcommand (:mod:`colltune.cli.bench`, ``profile`` (with
``fit``), ``tune``, ``explain``, ``report``, ``demo``), each with its input
and output formats; :mod:`colltune.cli.common` holds the argument types and
the :class:`Command` base. Nothing in the package imports the CLI.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from colltune.algorithms.errors import ColltuneError
from colltune.cli.bench import BenchCommand
from colltune.cli.common import Command, UsageError
from colltune.cli.demo import DemoCommand
from colltune.cli.explain import ExplainCommand
from colltune.cli.profile import FitCommand, ProfileCommand
from colltune.cli.report import ReportCommand
from colltune.cli.tune import TuneCommand

__all__ = ["main", "Command", "COMMANDS", "UsageError"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- option parsing


# --------------------------------------------------------------------------- bench


#: Every subcommand, in the order ``colltune --help`` lists them.
COMMANDS: dict[str, Command] = {  # type: ignore[misc]
    c.name: c
    for c in (
        BenchCommand(), ProfileCommand(), FitCommand(), TuneCommand(), ExplainCommand(), ReportCommand(),
        DemoCommand(),
    )
}


# --------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises instead of exiting, so ``main`` returns the status."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    """Return the parser with every registered subcommand."""
    parser = _Parser(
        prog="colltune",
        description="Autotuned sparse gradient collectives on torch.distributed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``colltune`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    from colltune.offline.launch import RankError

    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as exc:
        print(f"colltune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RankError as exc:
        print(f"colltune {args.command}: failed: {exc}", file=sys.stderr)
        return 1
    except ColltuneError as exc:
        print(f"colltune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"colltune {args.command}: interrupted", file=sys.stderr)
        return 130

