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

``colltune bench``
------------------

Times ``dense``, ``allgather`` and ``oktopk`` (colltune's algorithms, forced)
and ``torch`` (PyTorch's gloo sparse ``all_reduce``, the peer) on the same
synthetic inputs, over a grid of rows ``n``, density (entries per rank over
``n``), overlap of the ranks' index sets and world size ``P``; local CPU
ranks are started for each world size (under ``torchrun``, the running ranks
are used and the grid is cut to their world size).

Input: options only. Lists take several values; ``n`` accepts ``2^20`` and
``2**20`` as well as ``1048576``::

    colltune bench --quick                      # 4 configs at P=4, under a minute
    colltune bench                              # the full grid (n 2^16, 2^20, 2^22;
                                                #   density 1e-4 .. 0.2; overlap 0, .5, 1; P 2, 4, 8)
    colltune bench --world-size 2 4 --n 2^20 --density 1e-3 1e-2 --overlap 0 1 \\
        --repeats 10 --json out.json
    colltune bench --topk                       # add the top-k section
    colltune bench --topk-only --world-size 8   # only the top-k section
    colltune bench -P 2 --burst 10              # time per call of 10 calls in a row, not one call's latency

Output, on screen: one line per configuration as it finishes: ``n``,
density, ``P``, the overlap *achieved* (raised when ``n`` is too small for
the overlap asked), the timed rounds, each contender's median time in ms
with its interquartile range (``!`` marks a result that disagreed with the
reference), the speedup of each of ours over ``torch`` (above 1: faster),
and KiB sent per rank (``torch*`` is a model estimate); then one block per
top-k configuration and the verdict on the targets. A progress bar goes to
stderr when it is a terminal. Example line::

        n density  P overlap reps          dense ms      allgather ms ...
     2^20    0.01  4    0.50   15      9.10 ±0.52        4.02 ±0.31   ...

Output, on disk (``--json``, default ``colltune-bench.json``; written after
each world size, so a partial run keeps its results)::

    {
      "format": "colltune-bench/1",
      "created": "2025-01-01T12:00:00+0000",
      "environment": {"colltune": "0.1.0", "torch": "2.5.0", "cpus": 2, ...},
      "plan": {"warmup": 1, "min_repeats": 3, "max_repeats": 15, "budget_s": 4.0, "burst": 1},
      "contenders": ["dense", "allgather", "oktopk", "torch"],
      "configs": [
        {"n": 1048576, "density": 0.01, "world_size": 4,
         "overlap_requested": 0.5, "overlap": 0.5, "k": 10486, "union": 36701,
         "repeats": 15, "reference": "torch",
         "contenders": {
           "allgather": {"median_ms": 4.02, "q1_ms": 3.8, "q3_ms": 4.1, "iqr_ms": 0.31,
                         "min_ms": 3.7, "max_ms": 5.0, "times_ms": [...],
                         "bytes_per_rank": 251664, "bytes_per_rank_max": 251664,
                         "meta_bytes_per_rank": 288, "messages_per_rank": 6,
                         "bytes_estimated": false, "max_rel_err": 0.0},
           "torch": {..., "bytes_estimated": true}, ...},
         "speedup_vs_torch": {"dense": 0.8, "allgather": 1.9, "oktopk": 1.5}}
      ],
      "topk": [
        {"n": 1048576, "density": 0.01, "world_size": 8, "k": 10486, "steps": 40,
         "bound_words": 55051.5, "lower_bound_words": 18350.5,
         "contenders": {"oktopk": {"median_ms": ..., "words_per_rank_median": ...,
                                   "words_per_rank_max": ..., "meta_words_per_rank_max": ...,
                                   "words_over_bound_max": ..., ...}, ...}}
      ],
      "targets": {"a": {"holds": true, ...}, "b": {...}, "c": {...}},
      "elapsed_s": 812.5
    }

Times are the max over ranks of each rank's wall time for the call, one
sample per round; bytes are what each rank sent in its last timed call.

With the selector (``tuner/selector.py``) ``auto`` is a contender too
(``--profile FILE`` chooses its profile), and every configuration gets the
*oracle* (the fastest fixed algorithm, measured) and auto's regret against
it, printed as a decision table after the timings and stored as::

    "oracle": {"algorithm": "allgather", "median_ms": 4.02},
    "auto": {"algorithm": "allgather", "reason": "...", "regret": 1.03,
             "choice_regret": 1.0, "speedup": {"dense": 2.3, "allgather": 0.97,
                                               "oktopk": 1.4, "torch": 1.8}}

with ``"auto_summary"`` (geometric means over the configurations) at the top.

``colltune profile``
--------------------

Measures every algorithm over a grid of calls (rows ``n``, density,
overlap, dtype) on ``P`` local gloo ranks per ``--world-size`` (under
``torchrun``, on the running ranks), interleaved, plus alpha-beta timings
of the primitives; fits the learned cost model and writes a profile
(format: ``tuner/profile.py``), through a temporary file. Each
measurement's ``time_us`` is the median of its rounds (a round's time: the
max over ranks), or with ``--statistic lower-quartile`` their lower
quartile; the statistic used is recorded as the profile's
``meta.statistic``, and ``spread_us`` is the interquartile range either way.
Each configuration is appended to ``OUT.journal.jsonl`` (fsync'd) as it
finishes; ``--resume`` measures only what is missing::

    colltune profile --grid quick --world-size 2 4 --out profiles/local.yaml   # about a minute
    colltune profile --grid full --world-size 2 4 --out profiles/grid.yaml --budget 30
    colltune profile --grid full --world-size 2 4 --out profiles/grid.yaml --resume
    torchrun --nproc-per-node 8 -m colltune.cli -- profile --backend nccl --out profiles/a100.yaml
    colltune profile --active --measurements 60 --world-size 2 4 --out profiles/active.yaml
    colltune profile --active --simulate profiles/cpu-gloo-grid.yaml --seeds 5 --json active.json
    colltune profile --active --simulate profiles/cpu-gloo-grid.yaml --truth model --noise 0.1 --seeds 5

``--active`` measures only configurations where the decision is uncertain
(Optuna picks each next one; ``tuner/active.py``); with ``--simulate`` it
measures nothing and replays the fixed grid, active and random order
against a stored grid profile, printing how many configurations each needs
to reach the grid's regret on held-out configurations (``--truth model``:
against a cost surface fitted on the whole profile, measured with
``--noise``, a semi-synthetic check of the strategy itself).

``colltune fit``
----------------

Cross-validates the learned model on a profile's measurements (folds over
configurations), prints the median and p90 relative error per algorithm and
the selection regret on held-out configurations (next to the alpha-beta
model alone), and stores the fitted model in the profile's ``model``
(plain data) and a summary in ``meta.fit``::

    colltune fit profiles/local.yaml                     # in place
    colltune fit profiles/local.yaml --out fitted.yaml --json cv.json

``colltune tune``
-----------------

An Optuna study over the knobs (allgather's ``mode``; Ok-Topk's
``boundary_refresh``, ``peers_in_flight``, ``dense_fallback_ratio``; with
``--topk`` its ``local_refresh`` and ``global_refresh``) minimizing the
measured time on one workload, the default knobs timed in the same rounds.
Trials live in an Optuna journal file (``--storage``); running the command
again resumes the study up to ``--trials``. Prints every trial, the best one
marked ``<== BEST``, and writes a policy (format: ``tuner/policy.py``)::

    colltune tune --world-size 4 --trials 30 --storage tune.journal --out tuned.yaml
    colltune tune --world-size 4 --topk --n 2^22 --density 1e-3 --trials 40

``colltune report``
-------------------

Draws a profile: ``decision-density-world.png`` and
``decision-density-overlap.png`` (the chosen algorithm per cell, with the
predicted speedup over dense), ``predicted-vs-measured.png``
(cross-validated), and ``summary.md``::

    colltune report profiles/local.yaml --out report/

``colltune demo``
-----------------

Profiles this machine with the quick grid at P = 2 and 4 (local gloo
ranks), then runs ``colltune bench --quick`` with that profile: auto, each
algorithm, the oracle and PyTorch side by side, and the decision table::

    colltune demo                     # about 2-3 minutes on two cores
"""

from __future__ import annotations

import abc
import argparse
import json
import logging
import os
import sys
from typing import Any, ClassVar, Sequence

from colltune.algorithms.errors import ColltuneError
from colltune.autotune import TuneCommand
from colltune.explain import ExplainCommand
from colltune.profiling import DemoCommand, FitCommand, ProfileCommand
from colltune.report import ReportCommand

__all__ = ["main", "Command", "COMMANDS", "UsageError"]

logger = logging.getLogger(__name__)


class UsageError(ColltuneError, ValueError):
    """A command-line option has a bad value (exit status 2)."""


class Command(abc.ABC):
    """One ``colltune`` subcommand.

    :meth:`add_arguments` is called once when the parser is built;
    :meth:`run` is called with the parsed options when the subcommand is
    chosen, and returns the exit status. It raises :class:`UsageError` for
    option values the parser could not check.
    """

    name: ClassVar[str]
    help: ClassVar[str]

    @abc.abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this command's options to ``parser``."""

    @abc.abstractmethod
    def run(self, args: argparse.Namespace) -> int:
        """Run the command; return the exit status."""


# --------------------------------------------------------------------------- option parsing


def _parse_n(text: str, scientific: bool = False) -> int:
    """Parse ``1048576``, ``2^20`` or ``2**20`` (and ``1e6`` when ``scientific``)."""
    t = text.strip().replace("**", "^")
    try:
        if "^" in t:
            base, exp = t.split("^", 1)
            value = int(base) ** int(exp)
        else:
            value = int(float(t)) if scientific and "e" in t.lower() else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer such as 1048576 or 2^20, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _number_type(convert: Any, ok: Any, expected: str, must: str, name: str, scale: float = 1.0) -> Any:
    """Return an argparse ``type``: ``convert(text)`` checked by ``ok(value)``.

    A text ``convert`` rejects gives "expected EXPECTED, got 'TEXT'"; a value
    ``ok`` rejects gives "must be MUST, got 'TEXT'". A value that passes is
    multiplied by ``scale`` when that is not 1.
    """

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}")
        return value if scale == 1.0 else value * scale

    parse.__name__ = parse.__qualname__ = name
    return parse


_parse_world = _number_type(int, lambda v: v >= 1, "an integer >= 1", ">= 1 (the number of ranks)", "_parse_world")
_parse_positive_int = _number_type(int, lambda v: v >= 1, "an integer >= 1", ">= 1", "_parse_positive_int")
_parse_nonneg_int = _number_type(int, lambda v: v >= 0, "an integer >= 0", ">= 0", "_parse_nonneg_int")
_parse_density = _number_type(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1] such as 1e-3",
                              "in (0, 1] (entries per rank over n)", "_parse_density")
_parse_overlap = _number_type(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]",
                              "in [0, 1] (0: disjoint index sets, 1: identical)", "_parse_overlap")
_parse_seconds = _number_type(float, lambda v: v > 0, "a number of seconds > 0", "> 0 seconds", "_parse_seconds")


def _check_writable(path: str) -> None:
    """Raise :class:`UsageError` unless ``path`` can be written (checked before a long run)."""
    if os.path.isdir(path):
        raise UsageError(f"--json {path!r} is a directory; pass a file name such as {os.path.join(path, 'bench.json')!r}.")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"--json {path!r} cannot be written ({exc.strerror}); pass a path in a writable directory.") from None
    if not existed:
        os.remove(path)


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=True)
        f.write("\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- bench


class BenchCommand(Command):
    """``colltune bench``: time the algorithms and PyTorch's sparse all_reduce."""

    name = "bench"
    help = "time dense, allgather, oktopk and PyTorch's gloo sparse all_reduce on the same inputs"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from colltune import bench

        g = parser.add_argument_group("grid (each takes one or more values; defaults: the full grid)")
        g.add_argument("--world-size", "-P", type=_parse_world, nargs="+", metavar="P",
                       help=f"ranks (default {' '.join(map(str, bench.FULL_WORLD))}; --quick: 4)")
        g.add_argument("--n", type=_parse_n, nargs="+", metavar="N",
                       help="dense rows, e.g. 65536 or 2^16 (default 2^16 2^20 2^22)")
        g.add_argument("--density", type=_parse_density, nargs="+", metavar="D",
                       help="entries per rank over n (default 1e-4 1e-3 1e-2 5e-2 0.2)")
        g.add_argument("--overlap", type=_parse_overlap, nargs="+", metavar="O",
                       help="index overlap between ranks, 0 to 1 (default 0 0.5 1)")
        g.add_argument("--row-shape", type=_parse_positive_int, nargs="+", metavar="D", default=[],
                       help="shape of one value row, e.g. 64 for embedding rows (default: scalars)")
        g.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"), default="float32",
                       help="value dtype (default float32)")
        g.add_argument("--seed", type=_parse_nonneg_int, default=0, help="input seed (default 0)")
        g.add_argument("--quick", action="store_true",
                       help="small grid (n=2^16, density 1e-3 1e-2, overlap 0 1, P=4) and few rounds: under a minute")
        t = parser.add_argument_group("timing")
        t.add_argument("--repeats", "-R", type=_parse_positive_int, metavar="R",
                       help="timed rounds at most (default 15; --quick: 5); at least min(3, R) are run")
        t.add_argument("--warmup", type=_parse_nonneg_int, metavar="W", help="untimed calls per contender (default 1)")
        t.add_argument("--budget", type=_parse_seconds, metavar="S",
                       help="no new round after S seconds of rounds per configuration (default 4; --quick: 1)")
        t.add_argument("--burst", type=_parse_positive_int, metavar="B",
                       help="calls in a row per timed sample (default 1: one call after a barrier, its latency); "
                            "B > 1 reports the time per call of B back-to-back calls, as when a training step "
                            "reduces many tensors in a row (sparse grid only)")
        t.add_argument("--contenders", nargs="+", choices=bench.CONTENDERS, default=list(bench.CONTENDERS),
                       help="what to time (default all)")
        t.add_argument("--timeout", type=_parse_seconds, default=3600.0,
                       help="kill the ranks of one world size after this many seconds (default 3600)")
        k = parser.add_argument_group("top-k section")
        k.add_argument("--topk", action="store_true",
                       help="also run topk_allreduce (dense, allgather, oktopk) for each P (see --topk-n, --topk-density)")
        k.add_argument("--topk-only", action="store_true", help="run only the top-k section")
        k.add_argument("--topk-steps", type=_parse_positive_int, metavar="S",
                       help="steps of the top-k section (default 40; --quick: 10)")
        k.add_argument("--topk-n", type=_parse_n, metavar="N", help="elements of the gradient (default 2^20; --quick: 2^16)")
        k.add_argument("--topk-density", type=_parse_density, default=1e-2, metavar="D",
                       help="entries each rank selects over N (default 1e-2)")
        o = parser.add_argument_group("output")
        o.add_argument("--json", metavar="FILE", default="colltune-bench.json",
                       help="where to write the results (default colltune-bench.json)")
        o.add_argument("--no-progress", action="store_true", help="no progress bar")
        o.add_argument("--profile", metavar="FILE",
                       help="the profile auto decides with (colltune profile); default: the selector's default")

    def run(self, args: argparse.Namespace) -> int:
        from colltune import bench, launch

        _check_writable(args.json)
        if args.profile is not None:
            from colltune.profile import load_profile

            load_profile(args.profile)  # a bad profile is a usage error before any rank starts
        quick = args.quick
        worlds = args.world_size or ([4] if quick else list(bench.FULL_WORLD))
        if launch.in_torchrun():
            _, here = launch.torchrun_rank()
            if args.world_size and here not in args.world_size:
                raise UsageError(
                    f"--world-size {' '.join(map(str, args.world_size))} does not include the {here} ranks "
                    f"torchrun started; omit --world-size under torchrun or pass --world-size {here}."
                )
            worlds = [here]
        ns = args.n or ([2**16] if quick else list(bench.FULL_N))
        densities = args.density or ([1e-3, 1e-2] if quick else list(bench.FULL_DENSITY))
        overlaps = args.overlap if args.overlap is not None else ([0.0, 1.0] if quick else list(bench.FULL_OVERLAP))
        base = bench.Plan.quick() if quick else bench.Plan()
        max_r = args.repeats or base.max_repeats
        plan = bench.Plan(
            warmup=base.warmup if args.warmup is None else args.warmup,
            min_repeats=min(base.min_repeats, max_r),
            max_repeats=max_r,
            budget_s=args.budget or base.budget_s,
            burst=args.burst or 1,
        )
        row_shape = tuple(args.row_shape)
        configs = [] if args.topk_only else bench.full_grid(
            ns, densities, overlaps, worlds, row_shape=row_shape, dtype=args.dtype, seed=args.seed
        )
        topk_configs = []
        if args.topk or args.topk_only:
            steps = args.topk_steps or (10 if quick else 40)
            topk_n = args.topk_n or (2**16 if quick else 2**20)
            topk_configs = [bench.TopkConfig(topk_n, args.topk_density, p, steps, args.seed) for p in worlds]
        is_root = not launch.in_torchrun() or launch.torchrun_rank()[0] == 0
        if is_root:
            if configs:
                if plan.burst > 1:
                    print(f"ms per call, in bursts of {plan.burst} back-to-back calls after each barrier", flush=True)
                print(bench.format_header(args.contenders), flush=True)

        def save(report: dict[str, Any]) -> None:
            _write_json(args.json, report)

        report = bench.run(
            configs,
            topk_configs=topk_configs,
            contenders=args.contenders,
            plan=plan,
            progress=not args.no_progress,
            timeout=args.timeout,
            on_partial=save,
            profile=args.profile,
        )
        if not is_root:
            return 0
        save(report)
        print()
        if "auto" in args.contenders and report["configs"]:
            print(bench.format_auto(report))
            print()
        if plan.burst > 1:
            print(f"targets, from times per call in bursts of {plan.burst}:")
        print(bench.format_targets(report["targets"]))
        bad = [
            f"{bench._cfg_name(c)}: {name}"
            for c in report["configs"]
            for name, e in c["contenders"].items()
            if e.get("max_rel_err", 0.0) > 1e-4
        ]
        if bad:
            print("results that disagree with the reference (marked !): " + "; ".join(bad))
        failed = [
            f"{bench._cfg_name(c)}: {name}: {e['error']}"
            for c in report["configs"]
            for name, e in c["contenders"].items()
            if "error" in e
        ]
        for line in failed:
            print(f"failed: {line}")
        print(f"wrote {args.json} ({report.get('elapsed_s', 0.0):.0f} s)")
        return 0


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
    from colltune.launch import RankError

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


if __name__ == "__main__":
    sys.exit(main())
