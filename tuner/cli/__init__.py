"""The ``colltune`` command line.

Subcommands are small classes registered in one table (:data:`TABLE`;
:data:`COMMANDS` maps each name to its command); ``main(argv) -> int``
parses, dispatches and turns errors into exit statuses:

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
``fit``), ``tune``, ``explain``, ``simulate``, ``report``, ``demo``), each
with its input and output formats; :mod:`colltune.cli.common` holds the
argument types and the :class:`Command` base. Nothing in the package imports
the CLI.

The table of commands (:data:`TABLE`) names each command's module, class and
one-line help, so ``colltune --help`` lists the commands without importing
them, and ``colltune CMD ...`` imports only ``CMD``'s module. A command
module imports torch and the ``cli`` extras inside ``run``, never at module
level, so every ``--help`` answers without loading them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from typing import Collection, Iterator, Mapping, NamedTuple, Sequence

import colltune
from colltune.algorithms.errors import ColltuneError
from colltune.cli.common import Command, UsageError, discard_stdout

__all__ = ["main", "build_parser", "Command", "COMMANDS", "TABLE", "Entry", "EXIT_BROKEN_PIPE", "UsageError"]

logger = logging.getLogger(__name__)


class Entry(NamedTuple):
    """Where one subcommand lives, and its one-line help (the class's ``help``; a test checks they agree)."""

    module: str
    cls: str
    help: str


#: Every subcommand, in the order ``colltune --help`` lists them.
TABLE: dict[str, Entry] = {
    "bench": Entry("colltune.cli.bench", "BenchCommand",
                   "time every registered algorithm, auto and PyTorch's gloo sparse all_reduce on the same inputs"),
    "profile": Entry("colltune.cli.profile", "ProfileCommand",
                     "measure every algorithm over a grid of calls on local ranks (or torchrun's) and write a "
                     "profile"),
    "fit": Entry("colltune.cli.profile", "FitCommand",
                 "fit the learned cost model on a profile; print cross-validated error and regret; store the model"),
    "tune": Entry("colltune.cli.tune", "TuneCommand",
                  "tune the algorithms' knobs with Optuna on a workload (resumable); write them as a policy"),
    "explain": Entry("colltune.cli.explain", "ExplainCommand",
                     "show each algorithm's predicted time for a call, the selector's choice, and why"),
    "simulate": Entry("colltune.cli.simulate", "SimulateCommand",
                      "predict each algorithm's time and bytes on a cluster, per world size, and the choice"),
    "report": Entry("colltune.cli.report", "ReportCommand",
                    "draw decision maps and predicted-versus-measured plots of a profile; write a markdown summary"),
    "demo": Entry("colltune.cli.demo", "DemoCommand",
                  "profile this machine quickly (local gloo ranks), then bench auto, each algorithm, the oracle and "
                  "torch"),
}


class _Commands(Mapping[str, Command]):
    """The commands by name; a command's module is imported the first time the command is looked up."""

    def __init__(self, table: Mapping[str, Entry]) -> None:
        self._table = table
        self._made: dict[str, Command] = {}

    def __getitem__(self, name: str) -> Command:
        if name not in self._made:
            entry = self._table[name]
            self._made[name] = getattr(importlib.import_module(entry.module), entry.cls)()
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table


#: Every subcommand by name, in :data:`TABLE`'s order (a mapping; a command is built on first lookup).
COMMANDS: Mapping[str, Command] = _Commands(TABLE)


# --------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises instead of exiting, so ``main`` returns the status."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message}")


#: The levels ``--log-level`` takes.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def build_parser(only: Collection[str] | None = None) -> argparse.ArgumentParser:
    """Return the parser with every registered subcommand.

    Args:
        only: the commands whose options are added (their modules are
            imported); the others are listed with their help alone. Default:
            every command.
    """
    parser = _Parser(
        prog="colltune",
        description="Autotuned sparse gradient collectives on torch.distributed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"colltune {colltune.__version__}")
    parser.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS, help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, entry in TABLE.items():
        p = sub.add_parser(name, help=entry.help, description=entry.help,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if only is None or name in only:
            command = COMMANDS[name]
            p.epilog = getattr(command, "epilog", None)  # examples, printed as written
            command.add_arguments(p)
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """Return the subcommand ``argv`` names (its first word that is not an option or an option's value), or None."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word if word in TABLE else None
    return None


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
    words = list(sys.argv[1:] if argv is None else argv)
    chosen = command_of(words)
    parser = build_parser(only=() if chosen is None else (chosen,))
    try:
        args = parser.parse_args(words)
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help, --version
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    missing = [m for m in CLI_EXTRAS if importlib.util.find_spec(m) is None]
    if missing:  # before any work: a command would otherwise meet it minutes in (demo after profiling)
        print(_needs_extras(args.command, missing), file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as exc:
        print(f"colltune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ColltuneError as exc:
        if _is_rank_error(exc):
            print(f"colltune {args.command}: failed: {exc}", file=sys.stderr)
            return 1
        print(f"colltune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"colltune {args.command}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in CLI_EXTRAS:
            raise
        print(_needs_extras(args.command, [exc.name.split(".")[0]]), file=sys.stderr)
        return 2


def _needs_extras(command: str, missing: Sequence[str]) -> str:
    """The error for a command run without the ``cli`` extra: what is missing and how to install it."""
    return (f"colltune {command}: error: it needs {', '.join(missing)}, of the command line's extras, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed; install them with pip install 'colltune[cli]'")


def _is_rank_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a rank's failure (:class:`colltune.offline.launch.RankError`).

    Only a command that launched ranks can raise one, and that command has
    imported the launcher; the others never load it (nor torch) to ask.
    """
    launch = sys.modules.get("colltune.offline.launch")
    return launch is not None and isinstance(exc, launch.RankError)


#: Top-level modules of the ``cli`` extra (``pip install 'colltune[cli]'``); a training job needs none of them.
CLI_EXTRAS = ("sklearn", "scipy", "optuna", "tqdm", "matplotlib")
