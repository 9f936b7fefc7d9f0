"""The ``colltune`` command line.

Subcommands are small classes registered in one table (:data:`COMMANDS`);
``main(argv) -> int`` parses, dispatches and turns errors into exit statuses:

====  ==========================================================
0     success
1     the run failed (a rank raised; the message names the rank)
2     bad usage: an unknown option, a bad option value, an
      unwritable output path (a one-line message, no traceback)
130   interrupted
141   standard output closed early (``colltune explain --json | head -1``):
      the rest of the output is dropped, without a message, as a
      shell tool stopped by ``SIGPIPE`` would end (128 + 13)
====  ==========================================================

``colltune --version`` prints ``colltune <version>``.

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

import colltune
from colltune.algorithms.errors import ColltuneError
from colltune.cli.bench import BenchCommand
from colltune.cli.common import Command, UsageError, discard_stdout
from colltune.cli.demo import DemoCommand
from colltune.cli.explain import ExplainCommand
from colltune.cli.profile import FitCommand, ProfileCommand
from colltune.cli.report import ReportCommand
from colltune.cli.simulate import SimulateCommand
from colltune.cli.tune import TuneCommand

__all__ = ["main", "Command", "COMMANDS", "EXIT_BROKEN_PIPE", "UsageError"]

logger = logging.getLogger(__name__)


#: Every subcommand, in the order ``colltune --help`` lists them.
COMMANDS: dict[str, Command] = {  # type: ignore[misc]
    c.name: c
    for c in (
        BenchCommand(), ProfileCommand(), FitCommand(), TuneCommand(), ExplainCommand(), SimulateCommand(),
        ReportCommand(), DemoCommand(),
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
    parser.add_argument("--version", action="version", version=f"colltune {colltune.__version__}")
    parser.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
    return parser


#: The exit status when standard output is closed early: 128 + SIGPIPE, as a shell reports it.
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``colltune`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    A reader that closes standard output early (``colltune explain --json |
    head -1``) ends the run quietly with status 141.
    """
    try:
        status = _dispatch(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        discard_stdout()
        return EXIT_BROKEN_PIPE
    return status


def _dispatch(argv: Sequence[str] | None) -> int:
    """Parse ``argv``, run the chosen command and turn its errors into exit statuses."""
    from colltune.offline.launch import RankError

    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help, --version
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
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in CLI_EXTRAS:
            raise
        print(f"colltune {args.command}: error: it needs {exc.name.split('.')[0]}, one of the command line's "
              "extras, which is not installed; install them with pip install 'colltune[cli]'", file=sys.stderr)
        return 2


#: Top-level modules of the ``cli`` extra (``pip install 'colltune[cli]'``); a training job needs none of them.
CLI_EXTRAS = ("sklearn", "scipy", "optuna", "tqdm", "matplotlib")
