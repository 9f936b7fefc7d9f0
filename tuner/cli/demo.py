"""``colltune demo``: profile this machine, then benchmark auto against every algorithm.

Profiles this machine with the quick grid at P = 2 and 4 (local gloo
ranks), then runs ``colltune bench --quick`` with that profile: auto, each
algorithm, the oracle and PyTorch side by side, and the decision table::

    colltune demo                     # about 2-3 minutes on two cores
"""

from __future__ import annotations

import argparse
import os

from colltune.cli.bench import BenchCommand
from colltune.cli.common import parse_world
from colltune.cli.profile import profile_summary
from colltune.offline.profiling import (
    PRIMITIVE_SIZES_QUICK,
    Grid,
    TimingPlan,
    check_output_path,
    journal_path,
    run_profile,
)


class DemoCommand:
    """``colltune demo``: profile this machine quickly, then benchmark auto against every fixed choice."""

    name = "demo"
    help = "profile this machine quickly (local gloo ranks), then bench auto, each algorithm, the oracle and torch"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--world-size", "-P", type=parse_world, nargs="+", metavar="P", default=[2, 4],
                            help="ranks to profile (default 2 4); the bench runs at the largest")
        parser.add_argument("--out", "-o", default=os.path.join("profiles", "local.yaml"), metavar="FILE",
                            help="the profile to write (default profiles/local.yaml)")
        parser.add_argument("--json", default="colltune-bench.json", metavar="FILE",
                            help="the bench results (default colltune-bench.json)")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")

    def run(self, args: argparse.Namespace) -> int:
        directory = os.path.dirname(os.path.abspath(args.out))
        if args.out == os.path.join("profiles", "local.yaml") and not os.path.isdir(directory):
            os.makedirs(directory, exist_ok=True)  # the default, outside a checkout: make its directory
        check_output_path(args.out)
        check_output_path(args.json, "--json")
        jpath = journal_path(args.out)
        if os.path.exists(jpath):
            os.remove(jpath)  # the demo always starts afresh
        print(f"== 1/2 profile this machine: quick grid at P={','.join(map(str, args.world_size))} "
              f"(gloo, local ranks) -> {args.out}", flush=True)
        res = run_profile(args.out, args.world_size, Grid.preset("quick"), plan=TimingPlan.for_grid("quick"),
                          progress=not args.no_progress, primitive_sizes=PRIMITIVE_SIZES_QUICK)
        assert res is not None
        print(profile_summary(res), flush=True)
        print(f"\n== 2/2 bench on the profile: auto, each algorithm, the oracle, torch (P={max(args.world_size)})",
              flush=True)
        argv = ["--quick", "--world-size", str(max(args.world_size)), "--profile", args.out,
                "--json", args.json] + (["--no-progress"] if args.no_progress else [])
        bench = BenchCommand()
        parser = argparse.ArgumentParser(prog="colltune bench")
        bench.add_arguments(parser)
        return bench.run(parser.parse_args(argv))
