"""``colltune profile``: measure this cluster and write a profile; fit its learned model.

Measures every algorithm over a grid of calls (rows ``n``, density,
overlap, dtype) on ``P`` local gloo ranks per ``--world-size`` (under
``torchrun``, on the running ranks), interleaved, plus alpha-beta timings
of the primitives; fits the learned cost model and writes a profile
(format: ``colltune.model.profile``), through a temporary file. Each
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
    torchrun --nnodes 2 --nproc-per-node 8 ... -m colltune.cli -- profile --backend nccl --p2p --out profiles/h100.yaml
    colltune profile --active --measurements 60 --world-size 2 4 --out profiles/active.yaml
    colltune profile --active --simulate profiles/cpu-gloo-grid.yaml --seeds 5 --json active.json
    colltune profile --active --simulate profiles/cpu-gloo-grid.yaml --truth model --noise 0.1 --seeds 5

``--active`` measures only configurations where the decision is uncertain
(Optuna picks each next one; ``colltune.offline.active``); with ``--simulate`` it
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
"""

from __future__ import annotations

import argparse
import math
import os
from typing import TYPE_CHECKING

from colltune.cli.common import (
    Command,
    number_type,
    parse_density,
    parse_n,
    parse_nonneg_int,
    parse_overlap,
    parse_positive_int,
    parse_seconds,
    parse_world,
    write_json,
)

if TYPE_CHECKING:
    from colltune.model.profile import Profile
    from colltune.offline.profiling import Grid, ProfileResult, TimingPlan

#: Names of the built-in grids (:data:`colltune.offline.profiling.GRIDS`), the value dtypes a grid may take
#: (``DTYPES``) and the statistics a profile may record (``STATISTICS``), stated here so that ``--help`` needs
#: no NumPy (a test checks that they agree with :mod:`colltune.offline.profiling`).
GRID_NAMES = ("quick", "full")
DTYPES = ("float32", "float64", "float16", "bfloat16")
STATISTICS = ("median", "lower-quartile")


def _add_grid_options(parser: argparse.ArgumentParser, default_grid: str = "quick") -> None:
    g = parser.add_argument_group("grid")
    g.add_argument("--grid", choices=GRID_NAMES, default=default_grid,
                   help=f"built-in grid (default {default_grid}): quick (18 configurations per world size, about "
                        "a minute at P=2 and 4 on two cores), full (about 400 per world size)")
    g.add_argument("--n", type=parse_n, nargs="+", metavar="N", help="replace the grid's rows n (2^16 or 65536)")
    g.add_argument("--density", type=parse_density, nargs="+", metavar="D", help="replace the grid's densities")
    g.add_argument("--overlap", type=parse_overlap, nargs="+", metavar="O", help="replace the grid's overlaps")
    g.add_argument("--dtype", nargs="+", choices=DTYPES, metavar="DTYPE",
                   help=f"replace the grid's value dtypes ({', '.join(DTYPES)})")
    g.add_argument("--row-shape", type=parse_positive_int, nargs="+", metavar="D", default=[],
                   help="shape of one value row, e.g. 64 for embedding rows of width 64 (default: scalars); the "
                        "profile records the row's element count, which the cost model takes as a feature")
    g.add_argument("--seed", type=parse_nonneg_int, default=0, help="input seed and measuring order (default 0)")
    t = parser.add_argument_group("timing")
    t.add_argument("--repeats", "-R", type=parse_positive_int, metavar="R",
                   help="timed rounds per configuration at most (default 41; quick: 9); rounds stop earlier once "
                        "every median is known to 4%% (quick: 8%%) or after 1.5 s (quick: 0.4 s)")
    t.add_argument("--warmup", type=parse_nonneg_int, metavar="W", help="untimed calls per algorithm (default 1)")


def _grid_from_args(args: argparse.Namespace) -> tuple[Grid, TimingPlan]:
    """Return the grid and the timing plan the options ask for."""
    from colltune.offline.profiling import Grid, TimingPlan

    grid = Grid.preset(args.grid, n=args.n, density=args.density, overlap=args.overlap, dtype=args.dtype,
                       row_numel=math.prod(args.row_shape) if args.row_shape else None, seed=args.seed)
    base = TimingPlan.for_grid(args.grid)
    max_r = args.repeats or base.max_repeats
    plan = TimingPlan(warmup=base.warmup if args.warmup is None else args.warmup,
                      min_repeats=min(base.min_repeats, max_r), max_repeats=max_r, budget_s=base.budget_s,
                      precision=base.precision)
    return grid, plan


def profile_summary(res: ProfileResult) -> str:
    """Return the lines printed after a profile run: what was written, what is left, the primitives."""
    from colltune.offline.profiling import algorithm_order, format_seconds, measurement_key

    prof = res.profile
    algs = sorted({m.algorithm for m in prof.measurements}, key=algorithm_order())
    n_cfg = len({measurement_key(m) for m in prof.measurements})
    lines = [
        f"wrote {res.path}: {len(prof.measurements)} measurements ({n_cfg} configurations x "
        f"{', '.join(algs)}) at P={','.join(map(str, res.world_sizes))}; "
        f"{res.configs_measured} measured now, {res.configs_resumed} resumed; {format_seconds(res.elapsed_s)}",
    ]
    if not res.complete:
        lines.append(f"incomplete: {res.configs_total - res.configs_resumed - res.configs_measured} configurations "
                     f"left; run the same command with --resume to measure them (journal {res.journal})")
    p = prof.primitives
    lines.append("primitives (launch + alpha per step + beta per byte): " + "; ".join(
        f"{k} {v.launch_us:.1f}+{v.alpha_us:.1f} us, {1 / v.beta_us_per_byte / 1e3:.2f} GB/s"
        if v.beta_us_per_byte > 0 else f"{k} {v.launch_us:.1f}+{v.alpha_us:.1f} us" for k, v in p.items()))
    return "\n".join(lines)


class ProfileCommand(Command):
    """``colltune profile``: measure this cluster and write a profile (registered in :data:`colltune.cli.COMMANDS`)."""

    name = "profile"
    help = "measure every algorithm over a grid of calls on local ranks (or torchrun's) and write a profile"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--world-size", "-P", type=parse_world, nargs="+", metavar="P",
                            help="ranks to start, one run per value (default 2 4; under torchrun: the running ranks)")
        parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                            help="gloo: CPU tensors (default); nccl: CUDA tensors, one GPU per rank")
        parser.add_argument("--out", "-o", default=None, metavar="FILE",
                            help="the profile to write (default profiles/<backend>-local.yaml)")
        parser.add_argument("--budget", type=parse_minutes, metavar="MINUTES",
                            help="start no configuration after this many minutes; the profile holds what was "
                                 "measured and --resume continues")
        parser.add_argument("--resume", action="store_true",
                            help="continue an interrupted run from its journal (OUT.journal.jsonl); nothing "
                                 "measured is measured again")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")
        parser.add_argument("--p2p", action="store_true",
                            help="also measure point-to-point latency and bandwidth within and across nodes (on the "
                            "largest world size, or torchrun's ranks) into the profile's meta.p2p, which the NCCL "
                            "model then prices point-to-point steps and all_to_all with")
        parser.add_argument("--statistic", choices=STATISTICS, default="median",
                            help="what a configuration's time is: the median of its rounds (default), or their "
                                 "lower quartile, robust on a machine shared with other jobs (their load only adds "
                                 "time); the journal keeps every round, so a complete run can be re-summarized with "
                                 "--resume --keep-journal")
        parser.add_argument("--notes", default="", metavar="TEXT", help="free text for the profile's meta.notes")
        parser.add_argument("--keep-journal", action="store_true",
                            help="keep OUT.journal.jsonl (every round's time) after a complete run")
        parser.add_argument("--timeout", type=parse_seconds, default=6 * 3600.0,
                            help="kill the ranks of one world size after this many seconds (default 21600)")
        _add_grid_options(parser)
        a = parser.add_argument_group("active profiling (see colltune.offline.active)")
        a.add_argument("--active", action="store_true",
                       help="measure only where the decision is uncertain (Optuna picks each next configuration) "
                            "instead of walking the grid")
        a.add_argument("--measurements", type=parse_positive_int, metavar="M",
                       help="--active: configurations to measure (default: a sixth of the grid)")
        a.add_argument("--simulate", metavar="PROFILE",
                       help="--active: do not measure; replay the fixed grid and the active strategy against the "
                            "measurements stored in PROFILE and compare their regret on held-out configurations")
        a.add_argument("--json", metavar="FILE", help="--simulate: also write the curves as JSON")
        a.add_argument("--seeds", type=parse_positive_int, default=5, metavar="S",
                       help="--simulate: repetitions with different held-out sets and seeds (default 5)")
        a.add_argument("--truth", choices=("measured", "model"), default="measured",
                       help="--simulate: score regret against the stored medians (default), or against a model "
                            "fitted on the whole profile, measuring it with --noise (semi-synthetic)")
        a.add_argument("--explore-every", type=parse_nonneg_int, default=0, metavar="K",
                       help="--active: every K-th choice is a space-filling point instead (default 0: never)")
        a.add_argument("--noise", type=parse_fraction, default=0.1, metavar="SIGMA",
                       help="--simulate --truth model: log-normal timing noise of a measurement (default 0.1)")

    #: Printed after the options by ``colltune profile --help``.
    epilog = """examples:
  colltune profile --grid quick --world-size 2 4 --out profiles/local.yaml
  colltune profile --grid full --world-size 2 4 --out profiles/grid.yaml --budget 30 --resume

on a GPU cluster (NCCL, one GPU per rank; each rank's group is bound to cuda:LOCAL_RANK), run the same
command on every node; rank 0 writes the profile (--p2p adds point-to-point figures), and jobs use it
through COLLTUNE_PROFILE:
  torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id prof \\
      -m colltune.cli -- profile --backend nccl --p2p --out profiles/cluster.yaml
"""

    def run(self, args: argparse.Namespace) -> int:
        if args.simulate or args.active:
            return run_active(args)
        from colltune.offline import launch
        from colltune.offline.profiling import PRIMITIVE_SIZES, PRIMITIVE_SIZES_QUICK, run_profile

        grid, plan = _grid_from_args(args)
        out = args.out or os.path.join("profiles", f"{args.backend}-local.yaml")
        worlds = args.world_size or ([] if launch.in_torchrun() else [2, 4])
        res = run_profile(out, worlds, grid, backend=args.backend, plan=plan, budget_s=args.budget, resume=args.resume,
                          progress=not args.no_progress, timeout=args.timeout,
                          primitive_sizes=PRIMITIVE_SIZES_QUICK if args.grid == "quick" else PRIMITIVE_SIZES,
                          statistic=args.statistic, keep_journal=args.keep_journal, notes=args.notes)
        figures = None
        if args.p2p:
            from colltune.offline.p2p import measure_into_profile

            figures = measure_into_profile(out, max(worlds) if worlds else 0, backend=args.backend,
                                           timeout=args.timeout, profile=None if res is None else res.profile)
        if res is None:
            return 0
        print(profile_summary(res), flush=True)
        if figures is not None:
            print("point to point (meta.p2p): " + "; ".join(
                f"{level.replace('_', ' ')} {f['latency_us']:g} us, {f['bandwidth_GBps']:g} GB/s"
                for level, f in figures.items()), flush=True)
        return 0


def parse_fraction(text: str) -> float:
    return number_type(float, lambda v: 0.0 <= v < 10.0, "a number >= 0 such as 0.1", "in [0, 10)",
                               "parse_fraction")(text)


def parse_minutes(text: str) -> float:
    return number_type(float, lambda v: v > 0 and math.isfinite(v), "a number of minutes > 0", "> 0 minutes",
                               "parse_minutes", scale=60.0)(text)


class FitCommand(Command):
    """``colltune fit``: cross-validate and fit the learned model of a profile.

    Registered in :data:`colltune.cli.COMMANDS`.
    """

    name = "fit"
    help = "fit the learned cost model on a profile; print cross-validated error and regret; store the model"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("profile", metavar="PROFILE", help="a measured profile (colltune profile)")
        parser.add_argument("--out", "-o", metavar="FILE",
                            help="where to write the fitted profile (default: PROFILE, in place)")
        parser.add_argument("--folds", type=parse_positive_int, default=5, metavar="K",
                            help="cross-validation folds over configurations (default 5; 1: leave one out)")
        parser.add_argument("--estimator", choices=("gbr", "rf", "ridge", "none"), default="gbr",
                            help="correction regressor of the learned model (default gbr)")
        parser.add_argument("--json", metavar="FILE", help="also write the cross-validation report as JSON")
        parser.add_argument("--online", metavar="STATE", nargs="+", default=[],
                            help="fold in the calls online correction measured: state files a job wrote "
                            "(COLLTUNE_ONLINE_STATE), each site's last calls added to the profile's measurements")
        parser.add_argument("--add", metavar="OTHER", nargs="+", default=[],
                            help="fold in the measurements of other measured profiles of the same backend "
                            "(colltune profile runs of another row shape, dtype or grid); PROFILE's primitives "
                            "and meta are kept, the others' grids are listed in meta.added")
        parser.add_argument("--notes", metavar="TEXT", help="replace the profile's meta.notes (how it was made)")

    def run(self, args: argparse.Namespace) -> int:
        import dataclasses

        from colltune.model.profile import load_profile, save_profile
        from colltune.offline.profiling import ProfilingError, check_output_path, fit_profile, format_fit_report

        out = args.out or args.profile
        check_output_path(out)
        if args.json:
            check_output_path(args.json, "--json")
        prof = load_profile(args.profile)
        if prof.kind != "measured" or not prof.measurements:
            raise ProfilingError(f"{args.profile}: a {prof.kind} profile without measurements has nothing to fit; "
                                 "measure one with colltune profile.")
        if args.add:
            prof = _with_profiles(prof, args.profile, args.add)
        if args.online:
            prof = _with_online(prof, args.online)
        if args.notes is not None:
            prof = dataclasses.replace(prof, meta={**prof.meta, "notes": args.notes})
        fitted, report = fit_profile(prof, folds=None if args.folds == 1 else args.folds, estimator=args.estimator)
        print(format_fit_report(report))
        save_profile(fitted, out)
        if args.json:
            write_json(args.json, report)
        print(f"\nwrote the fitted model to {out} ({report['fit_s']:.1f} s)")
        return 0


def _with_profiles(prof: "Profile", source: str, paths: list[str]) -> "Profile":
    """``prof`` with the measurements of the measured profiles at ``paths`` added (the same backend only).

    A configuration measured by more than one run keeps every run's measurement: each is one more sample
    of it for the fit (runs are pooled, not deduplicated).
    """
    import dataclasses

    from colltune.model.profile import load_profile
    from colltune.offline.profiling import ProfilingError

    measurements, meta = list(prof.measurements), dict(prof.meta)
    added = list(meta.get("added") or [])
    for path in paths:
        other = load_profile(path)
        if other.kind != "measured" or not other.measurements:
            raise ProfilingError(f"--add {path}: a {other.kind} profile without measurements has nothing to add.")
        if other.meta.get("backend") != prof.meta.get("backend"):
            raise ProfilingError(
                f"--add {path}: measured on backend {other.meta.get('backend')!r}, but {source} on "
                f"{prof.meta.get('backend')!r}; a cost model is fitted on one backend's measurements."
            )
        measurements += other.measurements
        added.append({"measurements": len(other.measurements), "world_sizes": other.meta.get("world_sizes"),
                      "grid": other.meta.get("grid"), "date": other.meta.get("date")})
        print(f"adding {len(other.measurements)} measurements from {path}")
    sizes = sorted({*(meta.get("world_sizes") or []), *(w for a in added for w in (a["world_sizes"] or []))})
    meta.update(added=added, world_sizes=sizes)
    return dataclasses.replace(prof, meta=meta, measurements=measurements)


def _with_online(prof: "Profile", paths: list[str]) -> "Profile":
    """``prof`` with the measured calls of online-correction state files added to its measurements."""
    import dataclasses

    from colltune.offline.profiling import ProfilingError
    from colltune.select.online import measurements_from_state

    added = []
    for path in paths:
        try:
            added += measurements_from_state(path)
        except (OSError, ValueError) as exc:
            raise ProfilingError(f"--online {path}: {exc}") from None
    print(f"folding in {len(added)} measured calls from {len(paths)} online-correction state file(s)")
    return dataclasses.replace(prof, measurements=list(prof.measurements) + added)


def run_active(args: argparse.Namespace) -> int:
    """``colltune profile --active [--simulate PROFILE]``."""
    from colltune.model.profile import load_profile
    from colltune.offline import active  # Optuna: imported only when asked for
    from colltune.offline.profiling import check_output_path

    if args.simulate:
        if args.json:
            check_output_path(args.json, "--json")
        prof = load_profile(args.simulate)
        worlds = args.world_size or None
        result = active.simulate(prof, seeds=args.seeds, limit=args.measurements, world_sizes=worlds,
                          progress=lambda s: print(s, flush=True), truth=args.truth, noise=args.noise,
                          explore_every=args.explore_every)
        print()
        print(active.format_simulation(result))
        if args.json:
            write_json(args.json, result)
            print(f"wrote {args.json}")
        return 0
    grid, plan = _grid_from_args(args)
    out = args.out or os.path.join("profiles", f"{args.backend}-active.yaml")
    res = active.run_live(out, args.world_size or [2, 4], grid, count=args.measurements, backend=args.backend,
                          plan=plan, resume=args.resume, seed=args.seed, show=not args.no_progress,
                          timeout=args.timeout)
    print(profile_summary(res), flush=True)
    return 0
