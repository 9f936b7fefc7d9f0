"""``colltune bench``: time colltune's algorithms and PyTorch's own on synthetic inputs.

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
with its interquartile range (``!`` marks a result that disagrees with the
exact reference, below), the speedup of each of ours over ``torch`` (above
1: faster), and KiB sent per rank (``torch*`` is a model estimate); then one
block per top-k configuration, auto's decision table, and the agreement of
the results with the exact reference, per dtype. A progress bar goes to
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
      "contenders": ["auto", "dense", "allgather", "oktopk", "hashpart", "torch"],
      "configs": [
        {"n": 1048576, "density": 0.01, "world_size": 4,
         "overlap_requested": 0.5, "overlap": 0.5, "k": 10486, "union": 36701,
         "repeats": 15, "reference": "float64", "tolerance": 4.8e-07,
         "contenders": {
           "allgather": {"median_ms": 4.02, "q1_ms": 3.8, "q3_ms": 4.1, "iqr_ms": 0.31,
                         "min_ms": 3.7, "max_ms": 5.0, "times_ms": [...],
                         "bytes_per_rank": 251664, "bytes_per_rank_max": 251664,
                         "meta_bytes_per_rank": 288, "messages_per_rank": 6,
                         "bytes_estimated": false, "max_rel_err": 2.9e-08, "agrees": true},
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
      "elapsed_s": 812.5
    }

Times are the max over ranks of each rank's wall time for the call, one
sample per round; bytes are what each rank sent in its last timed call.

Every result (``torch``'s included) is checked against the exact sum: the
float64 sum of every rank's input, rebuilt from the seed. ``max_rel_err`` is
the largest ``|result - exact|`` over the sum of the magnitudes of the
terms, and a result agrees when that is within the configuration's
``tolerance``, ``P`` eps of the dtype (at P = 2: 2.4e-7 for float32, 2.0e-3
for float16, 1.6e-2 for bfloat16, 4.4e-16 for float64): more than twice the
worst error of a ``P``-term sum rounded in that dtype, in any order. The
summary counts the agreeing results per dtype, and the report stores the
same::

    "agreement": {"float32": {"eps": 1.2e-07, "results": 10, "agree": 10,
                              "worst": 0.25, "disagree": []}}

(``worst``: the largest error as a fraction of its tolerance).

``auto``, the selector's choice (:mod:`colltune.select.selector`), is a contender
too (``--profile FILE`` chooses its profile), and every configuration gets the
*oracle* (the fastest fixed algorithm, measured) and auto's time over the
oracle's, printed as a decision table after the timings and stored as::

    "oracle": {"algorithm": "allgather", "median_ms": 4.02},
    "auto": {"algorithm": "allgather", "reason": "...", "regret": 1.03,
             "choice_regret": 1.0, "speedup": {"dense": 2.3, "allgather": 0.97,
                                               "oktopk": 1.4, "torch": 1.8},
             "regret_paired": 1.02, "regret_lo": 0.97, "regret_hi": 1.08,
             "regret_confidence": 0.96, "paired_rounds": 15, "verdict": "within noise"}

``regret`` is the ratio of the medians; ``regret_paired`` the median of the
ratios of the same round's times (the contenders run interleaved, so a
round's load hits both), with its distribution-free confidence interval
``regret_lo`` to ``regret_hi`` (coverage ``regret_confidence``: 95% or more
from 6 rounds, min to max below that). The ``verdict`` reads the interval:
``"slower"`` (above 1: a regret), ``"within noise"`` (it holds 1),
``"faster"`` (below 1: auto beat the fastest fixed algorithm timed
separately, shown as ``1.5x faster``, never as a regret below 1) or
``"few rounds"`` (under 3). ``"auto_summary"`` at the top holds the
geometric means over the configurations and the count of each verdict.

The team's own performance targets are checked from this file by
``python3 tools/check_targets.py colltune-bench.json``, not printed here.
"""

from __future__ import annotations

import argparse
from typing import Any

from colltune.algorithms.registry import BUILTIN_NAMES, PLUGINS_ENV
from colltune.cli.common import (
    Command,
    UsageError,
    check_writable,
    parse_density,
    parse_n,
    parse_nonneg_int,
    parse_overlap,
    parse_positive_int,
    parse_seconds,
    parse_world,
    say,
    write_json,
)

#: World sizes of the full grid: :data:`colltune.offline.bench.FULL_WORLD`, stated here so that ``--help``
#: needs no torch (a test checks that the two agree).
FULL_WORLD = (2, 4, 8)


class BenchCommand(Command):
    """``colltune bench``: time the algorithms and PyTorch's sparse all_reduce."""

    name = "bench"
    help = "time every registered algorithm, auto and PyTorch's gloo sparse all_reduce on the same inputs"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("grid (each takes one or more values; defaults: the full grid)")
        g.add_argument("--world-size", "-P", type=parse_world, nargs="+", metavar="P",
                       help=f"ranks (default {' '.join(map(str, FULL_WORLD))}; --quick: 4)")
        g.add_argument("--n", type=parse_n, nargs="+", metavar="N",
                       help="dense rows, e.g. 65536 or 2^16 (default 2^16 2^20 2^22)")
        g.add_argument("--density", type=parse_density, nargs="+", metavar="D",
                       help="entries per rank over n (default 1e-4 1e-3 1e-2 5e-2 0.2)")
        g.add_argument("--overlap", type=parse_overlap, nargs="+", metavar="O",
                       help="index overlap between ranks, 0 to 1 (default 0 0.5 1)")
        g.add_argument("--row-shape", type=parse_positive_int, nargs="+", metavar="D", default=[],
                       help="shape of one value row, e.g. 64 for embedding rows (default: scalars)")
        g.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"), default="float32",
                       help="value dtype (default float32)")
        g.add_argument("--seed", type=parse_nonneg_int, default=0, help="input seed (default 0)")
        g.add_argument("--quick", action="store_true",
                       help="small grid (n=2^16, density 1e-3 1e-2, overlap 0 1, P=4) and few rounds: under a minute")
        t = parser.add_argument_group("timing")
        t.add_argument("--repeats", "-R", type=parse_positive_int, metavar="R",
                       help="timed rounds at most (default 15; --quick: 5); at least min(3, R) are run")
        t.add_argument("--warmup", type=parse_nonneg_int, metavar="W", help="untimed calls per contender (default 1)")
        t.add_argument("--budget", type=parse_seconds, metavar="S",
                       help="no new round after S seconds of rounds per configuration (default 4; --quick: 1)")
        t.add_argument("--burst", type=parse_positive_int, metavar="B",
                       help="calls in a row per timed sample (default 1: one call after a barrier, its latency); "
                            "B > 1 reports the time per call of B back-to-back calls, as when a training step "
                            "reduces many tensors in a row (sparse grid only)")
        t.add_argument("--contenders", nargs="+", metavar="NAME",
                       help="what to time (default all): auto, any registered algorithm (the built-in "
                            f"{', '.join(BUILTIN_NAMES)} and plugins named in {PLUGINS_ENV}), torch")
        t.add_argument("--timeout", type=parse_seconds, default=3600.0,
                       help="kill the ranks of one world size after this many seconds (default 3600)")
        t.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                       help="gloo (CPU tensors, default) or nccl (each rank's inputs on its GPU, one GPU per rank: "
                            "under torchrun, or local ranks on a machine with a GPU for each; torch, PyTorch's "
                            "gloo-only sparse all_reduce, is left out)")
        k = parser.add_argument_group("top-k section")
        k.add_argument("--topk", action="store_true",
                       help="also run topk_allreduce (every registered algorithm) for each P "
                            "(see --topk-n, --topk-density)")
        k.add_argument("--topk-only", action="store_true", help="run only the top-k section")
        k.add_argument("--topk-steps", type=parse_positive_int, metavar="S",
                       help="steps of the top-k section (default 40; --quick: 10)")
        k.add_argument("--topk-n", type=parse_n, metavar="N",
                       help="elements of the gradient (default 2^20; --quick: 2^16)")
        k.add_argument("--topk-density", type=parse_density, default=1e-2, metavar="D",
                       help="entries each rank selects over N (default 1e-2)")
        o = parser.add_argument_group("output")
        o.add_argument("--json", metavar="FILE", default="colltune-bench.json",
                       help="where to write the results (default colltune-bench.json)")
        o.add_argument("--no-progress", action="store_true", help="no progress bar")
        o.add_argument("--profile", metavar="FILE",
                       help="the profile auto decides with (colltune profile); default: the selector's default")

    def run(self, args: argparse.Namespace) -> int:
        from colltune.offline import bench, launch

        args.contenders = _checked_contenders(args.contenders, bench.all_contenders())
        if args.backend == "nccl":
            worlds = args.world_size or ([4] if args.quick else list(FULL_WORLD))
            args.contenders = _nccl_contenders(args.contenders, worlds, launch.in_torchrun())
        check_writable(args.json)
        if args.profile is not None:
            from colltune.model.profile import load_profile

            load_profile(args.profile)  # a bad profile is a usage error before any rank starts
        configs, topk_configs, plan = _workload(args)
        is_root = not launch.in_torchrun() or launch.torchrun_rank()[0] == 0
        if is_root and configs:
            if plan.burst > 1:
                say(f"ms per call, in bursts of {plan.burst} back-to-back calls after each barrier")
            say(bench.format_header(args.contenders))

        def save(report: dict[str, Any]) -> None:
            write_json(args.json, report)

        report = bench.run(configs, topk_configs=topk_configs, contenders=args.contenders, plan=plan,
                           progress=not args.no_progress, timeout=args.timeout, on_partial=save, profile=args.profile,
                           backend=args.backend)
        if not is_root:
            return 0
        save(report)
        _print_summary(args, report)
        return 0


def _nccl_contenders(contenders: list[str], world_sizes: list[int], torchrun: bool) -> list[str]:
    """The contenders that run on NCCL (``torch`` left out, saying why); refuse local ranks without a GPU each."""
    import torch

    if not torchrun:
        need, have = max(world_sizes), torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < need:
            raise UsageError(f"--backend nccl needs a GPU per rank (NCCL refuses two ranks on one GPU): P = {need} "
                             f"local ranks but {have} GPU(s) here; run under torchrun across nodes, lower "
                             "--world-size, or use --backend gloo.")
    if "torch" in contenders:
        say("skipping torch: PyTorch's sparse all_reduce runs on gloo only (NCCL has no sparse all_reduce)")
    kept = [c for c in contenders if c != "torch"]
    if not kept:
        raise UsageError("--contenders: nothing left to time on NCCL; name auto or an algorithm.")
    return kept


def _checked_contenders(asked: list[str] | None, known: tuple[str, ...]) -> list[str]:
    """Return ``--contenders`` (default: every contender), refusing a name that is not one."""
    if asked is None:
        return list(known)
    unknown = [a for a in asked if a not in known]
    if unknown:
        raise UsageError(f"--contenders: {', '.join(map(repr, unknown))} is not a contender; pass some of "
                         f"{', '.join(known)} (a plugin's algorithm counts once its module is named in "
                         f"{PLUGINS_ENV}).")
    return list(asked)


def _workload(args: argparse.Namespace) -> tuple[list[Any], list[Any], Any]:
    """Return the exact configurations, the top-k configurations and the timing plan the options ask for."""
    from colltune.offline import bench, launch

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
    configs = [] if args.topk_only else bench.full_grid(
        ns, densities, overlaps, worlds, row_shape=tuple(args.row_shape), dtype=args.dtype, seed=args.seed
    )
    topk_configs = []
    if args.topk or args.topk_only:
        steps = args.topk_steps or (10 if quick else 40)
        topk_n = args.topk_n or (2**16 if quick else 2**20)
        topk_configs = [bench.TopkConfig(topk_n, args.topk_density, p, steps, args.seed) for p in worlds]
    return configs, topk_configs, plan


def _print_summary(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Print auto's decision table, results that disagree with the reference, failures, and the file written."""
    from colltune.offline import bench

    lines = [""]
    if "auto" in args.contenders and report["configs"]:
        lines += [bench.format_auto(report), ""]
    if report["configs"]:
        lines.append(bench.format_agreement(report))
    for c in report["configs"]:
        for name, e in c["contenders"].items():
            if "error" in e:
                lines.append(f"failed: {bench.config_name(c)}: {name}: {e['error']}")
    lines.append(f"wrote {args.json} ({report.get('elapsed_s', 0.0):.0f} s)")
    say(*lines)
