"""``colltune demo``: profile this machine, then benchmark auto against every algorithm.

Profiles this machine with the quick grid at P = 2 and 4 (local gloo
ranks), then runs ``colltune bench --quick`` with that profile: auto, each
algorithm, the oracle and PyTorch side by side, and the decision table.

Input: options only::

    colltune demo                     # about 2-3 minutes on two cores
    colltune demo --out /tmp/demo -P 2

Output: everything goes under one directory, ``--out`` (default
``colltune-demo``, created if missing; files of an earlier demo there are
replaced), and nothing else is written:

``DIR/profile.yaml``
    the profile (``colltune profile``'s format); use it with
    ``colltune.configure(profile="DIR/profile.yaml")`` or draw it with
    ``colltune report DIR/profile.yaml --out DIR/report``.
``DIR/bench.json``
    the benchmark (``colltune bench``'s format).

On screen: the profile's summary, then ``colltune bench``'s table, decision
table and agreement with the exact reference, and the paths written.
"""

from __future__ import annotations

import argparse
import os

from colltune.cli.bench import BenchCommand
from colltune.cli.common import Command, UsageError, parse_world
from colltune.cli.profile import profile_summary

#: Where ``colltune demo`` writes without ``--out``.
DEFAULT_OUT = "colltune-demo"
#: The files the demo writes in its directory.
PROFILE_NAME = "profile.yaml"
BENCH_NAME = "bench.json"


class DemoCommand(Command):
    """``colltune demo``: profile this machine quickly, then benchmark auto against every fixed choice."""

    name = "demo"
    help = "profile this machine quickly (local gloo ranks), then bench auto, each algorithm, the oracle and torch"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--world-size", "-P", type=parse_world, nargs="+", metavar="P", default=[2, 4],
                            help="ranks to profile (default 2 4); the bench runs at the largest")
        parser.add_argument("--out", "-o", default=DEFAULT_OUT, metavar="DIR",
                            help=f"directory for everything the demo writes: {PROFILE_NAME} and {BENCH_NAME} "
                                 f"(default {DEFAULT_OUT}; created if missing)")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")

    def run(self, args: argparse.Namespace) -> int:
        from colltune.offline import profiling

        profile, bench_json = demo_paths(args.out)
        jpath = profiling.journal_path(profile)
        if os.path.exists(jpath):
            os.remove(jpath)  # the demo always starts afresh
        print(f"colltune demo: writing {profile} and {bench_json}", flush=True)
        print(f"\n== 1/2 profile this machine: quick grid at P={','.join(map(str, args.world_size))} "
              "(gloo, local ranks)", flush=True)
        res = profiling.run_profile(profile, args.world_size, profiling.Grid.preset("quick"),
                                    plan=profiling.TimingPlan.for_grid("quick"), progress=not args.no_progress,
                                    primitive_sizes=profiling.PRIMITIVE_SIZES_QUICK)
        if res is not None:  # rank 0 (under torchrun, the others print nothing)
            print(profile_summary(res), flush=True)
            print(f"\n== 2/2 bench on the profile: auto, each algorithm, the oracle, torch (P={max(args.world_size)})",
                  flush=True)
        argv = ["--quick", "--world-size", str(max(args.world_size)), "--profile", profile,
                "--json", bench_json] + (["--no-progress"] if args.no_progress else [])
        bench = BenchCommand()
        parser = argparse.ArgumentParser(prog="colltune bench")
        bench.add_arguments(parser)
        status = bench.run(parser.parse_args(argv))
        if res is not None:
            print(f"\ncolltune demo: everything is in {args.out}{os.sep}: {PROFILE_NAME} (the profile), "
                  f"{BENCH_NAME} (the benchmark); draw the profile with "
                  f"colltune report {profile} --out {os.path.join(args.out, 'report')}", flush=True)
        return status


def demo_paths(out: str) -> tuple[str, str]:
    """Create the directory ``out`` if missing; return the profile and bench paths in it.

    Raises:
        UsageError: ``out`` is a file, names a file (``.yaml``, ``.json``),
            or cannot be created or written.
    """
    from colltune.offline.profiling import check_output_path

    if os.path.isfile(out) or os.path.splitext(out)[1].lower() in (".yaml", ".yml", ".json"):
        raise UsageError(f"--out is the directory the demo writes {PROFILE_NAME} and {BENCH_NAME} into, but got "
                         f"the file {out!r}; pass a directory such as {DEFAULT_OUT!r}.")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out!r} cannot be created ({exc.strerror}); pass a directory in a writable "
                         "place.") from None
    profile, bench_json = os.path.join(out, PROFILE_NAME), os.path.join(out, BENCH_NAME)
    check_output_path(profile)
    check_output_path(bench_json)
    return profile, bench_json
