"""``colltune report``: draw a profile: decision maps and model accuracy.

Draws a profile: ``decision-density-world.png`` and
``decision-density-overlap.png`` (the chosen algorithm per cell, with the
predicted speedup over dense), ``predicted-vs-measured.png``
(cross-validated), and ``summary.md``. With ``--online RUN`` it draws a
run of online correction (the JSON ``tools/online_bench.py --json``
writes): ``online-regret.png`` (regret over calls, correction on and off),
``online-predicted-vs-measured.png`` (per algorithm, measured against the
profile's and the corrected prediction) and ``online-summary.md``
(:mod:`colltune.offline.online_report`)::

    colltune report profiles/local.yaml --out report/
    colltune report --online online.json --out report/
"""

from __future__ import annotations

import argparse
import os

from colltune.cli.common import Command, UsageError, parse_n, parse_overlap, parse_positive_int


class ReportCommand(Command):
    """``colltune report``: draw a profile (registered in :data:`colltune.cli.COMMANDS`)."""

    name = "report"
    help = "draw decision maps and predicted-versus-measured plots of a profile; write a markdown summary"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:

        parser.add_argument("profile", metavar="PROFILE", nargs="?",
                            help="a profile (colltune profile / fit); optional with --online")
        parser.add_argument("--online", metavar="RUN",
                            help="also draw a run of online correction: regret over calls and measured against "
                            "predicted (the JSON tools/online_bench.py --json writes)")
        parser.add_argument("--out", "-o", required=True, metavar="DIR",
                            help="directory for the PNG files and summary.md")
        parser.add_argument("--n", type=parse_n, metavar="N", help="rows of the decision maps (default: the "
                            "largest measured n up to 2^20)")
        parser.add_argument("--overlap", type=parse_overlap, default=0.5, metavar="O",
                            help="overlap of the density x world-size map (default 0.5)")
        parser.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"), default="float32",
                            help="value dtype of the maps (default float32)")
        parser.add_argument("--folds", type=parse_positive_int, default=5, metavar="K",
                            help="cross-validation folds (default 5)")

    def run(self, args: argparse.Namespace) -> int:
        from colltune.model.profile import load_profile
        from colltune.offline.profiling import ProfilingError
        from colltune.offline.report import write_report

        out = args.out
        if os.path.exists(out) and not os.path.isdir(out):
            raise ProfilingError(f"--out {out!r} is a file; pass a directory (it is created if missing).")
        parent = os.path.dirname(os.path.abspath(out))
        target = out if os.path.isdir(out) else parent
        if not os.path.isdir(target) or not os.access(target, os.W_OK):
            raise ProfilingError(f"--out {out!r} cannot be written (no writable directory {target!r}); pass a path in "
                                 "a writable directory.")
        if args.profile is None and args.online is None:
            raise UsageError("give a PROFILE to draw, --online RUN, or both")
        files: dict[str, str] = {}
        # Both inputs are read (and a bad one refused) before anything is created.
        run = None
        if args.online is not None:
            from colltune.offline.online_report import load_run, write_online_report

            run = load_run(args.online)
        profile = None if args.profile is None else load_profile(args.profile)
        if profile is not None:
            files.update(write_report(args.profile, out, n=args.n, overlap=args.overlap, dtype=args.dtype,
                                      folds=max(2, args.folds), profile=profile))
        if run is not None:
            files.update({f"online {k}": v for k, v in write_online_report(args.online, out, run).items()})
        for path in files.values():
            print(f"wrote {path}")
        return 0
