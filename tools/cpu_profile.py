"""Measure the CPU/gloo profile shipped as ``profiles/cpu-gloo.yaml`` and fit its cost model.

The measuring run first times the collective primitives at a few message
sizes per world size (:func:`colltune.offline.profiling.measure_primitives`) and fits
their alpha-beta constants: the profile's ``primitives``, and the prior of the
cost model. Then it times the algorithms a profile measures with the
benchmark engine (:func:`colltune.offline.bench.run`: interleaved rounds, the max over
ranks per call, medians) on a grid of rows ``n``, density, overlap and world
size ``P`` in 2, 4, 8, on local CPU ranks over gloo, and writes every
configuration as a profile measurement with its exact union size. The fit
learns the per-algorithm correction of the alpha-beta prediction
(:class:`colltune.model.cost_model.LearnedCostModel`, settings :data:`MODEL`), stored
in the profile as plain numbers, so loading it costs no refit.

Usage::

    python tools/cpu_profile.py measure --out profiles/cpu-gloo.yaml   # about 12 minutes on 2 cores
    python tools/cpu_profile.py fit profiles/cpu-gloo.yaml             # refit in place from its measurements
    python tools/cpu_profile.py cv profiles/cpu-gloo.yaml              # leave-one-configuration-out CV
    python tools/cpu_profile.py pool a.json b.json --primitives a.yaml --out profiles/cpu-gloo.yaml
    python tools/cpu_profile.py measure --row-shape 64 --n 12 14 16 18 --out rows.yaml --raw rows.json
    python tools/cpu_profile.py measure --dtype bfloat16 --row-shape 64 --n 12 14 16 18 \
        --primitives profiles/cpu-gloo.yaml --out bf16.yaml --raw bf16-a.json
    python tools/cpu_profile.py pool bf16-a.json bf16-b.json --primitives profiles/cpu-gloo.yaml --add --min-n 14 \
        --notes " ..." --out profiles/cpu-gloo.yaml

``measure --row-shape D ...`` measures value rows of that shape (embedding
rows) instead of scalars; ``--n`` takes the grid's rows as powers of two.

``measure --raw FILE`` also keeps the benchmark report; ``pool`` merges the
timed rounds of several reports of the same grid (each configuration's time
becomes the median of all its rounds), which steadies the medians when other
processes load the machine. The shipped profile pools two measuring runs
of float32 scalars and two of 64-wide float32 rows (``pool`` keeps every
configuration of every report; the same configuration's rounds are merged),
then two each of 64-wide bfloat16, float16 and float64 rows, added with
``pool --add --min-n 14`` (``measure --dtype D --primitives profiles/cpu-gloo.yaml``:
the primitives are those timed for float32; their n = 2^12, latency-bound,
is left out so that the file stays under 2,500 flow-style lines, which
:mod:`colltune.model.yamlsafe` composes in C).

The grid is disjoint from the held-out grid of ``tools/selector_bench.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from colltune.model.cost_model import LearnedCostModel, cross_validate  # noqa: E402
from colltune.model.features import Features  # noqa: E402
from colltune.model.profile import (  # noqa: E402  # noqa: E402
    Measurement,
    Primitive,
    Profile,
    load_profile,
    profile_from_measurements,
    save_profile,
)
from colltune.offline import bench, launch, profiling  # noqa: E402

#: The measured grid.
GRID_N = (2**12, 2**14, 2**16, 2**18, 2**20)
GRID_DENSITY = (1e-4, 1e-3, 1e-2, 5e-2, 0.2)
GRID_OVERLAP = (0.0, 0.5, 1.0)
GRID_WORLD = (2, 4, 8)
#: The algorithms a profile measures (the built-in ones: the learned model's feature layout).
ALGORITHMS = profiling.ALGORITHMS
#: Estimator settings of the shipped model. The measured primitives are kept
#: as they are (``calibrate=False``): refitting 15 constants on sweeps that
#: barely exercise some of them (all_to_all carries only counts when every
#: rank holds the same k) gives unphysical values that extrapolate badly.
#: Chosen by 10-fold cross-validation on the profile (``cv``) among ridge,
#: gradient boosting and random forests of a few sizes: 30 trees of depth 6
#: had the lowest selection regret at a size that keeps the file small.
MODEL = {"estimator": "rf", "n_estimators": 30, "max_depth": 6, "min_samples_leaf": 2, "calibrate": False}
#: Message sizes of the primitive timings, in bytes.
PRIMITIVE_SIZES = (8, 1024, 65536, 1048576, 4194304)


def _config_key(c: dict) -> tuple:
    return (c["n"], c["density"], c["overlap_requested"], c["world_size"], tuple(c["row_shape"]), c["dtype"])


def pool_reports(reports: list[dict]) -> dict:
    """Merge several reports into one: the rounds of the same configuration pooled (medians over all), others kept."""
    base = json.loads(json.dumps(reports[0]))
    index = {_config_key(c): c for c in base["configs"]}
    for other in reports[1:]:
        for c in other["configs"]:
            key = _config_key(c)
            mine = index.get(key)
            if mine is None:  # a configuration the earlier reports lack: kept as it is
                index[key] = json.loads(json.dumps(c))
                base["configs"].append(index[key])
                continue
            for name, e in c["contenders"].items():
                if name in mine["contenders"] and "times_ms" in e:
                    mine["contenders"][name]["times_ms"] += e["times_ms"]
            mine["repeats"] += c["repeats"]
    for c in base["configs"]:
        for e in c["contenders"].values():
            ts = sorted(e.get("times_ms", []))
            if not ts:
                continue
            e["median_ms"] = statistics.median(ts)
            q = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else [ts[0]] * 3
            e["iqr_ms"] = q[2] - q[0]
    return base


def measurements_from_report(report: dict) -> list[Measurement]:
    """Turn a benchmark report into profile measurements (one per configuration and algorithm)."""
    out = []
    for c in report["configs"]:
        p, k = c["world_size"], c["k"]
        row = 1
        for d in c["row_shape"]:
            row *= d
        f = Features.build(numel=c["n"], row_numel=row, dtype=c["dtype"], k_per_rank=[k] * p, union=c["union"])
        for name in ALGORITHMS:
            e = c["contenders"].get(name)
            if e is None:
                continue
            out.append(Measurement.from_features(
                f, name, time_us=e["median_ms"] * 1e3, spread_us=e["iqr_ms"] * 1e3,
                repeats=c["repeats"], bytes_sent=int(round(e["bytes_per_rank_max"])),
            ))
    return out


def fit(measurements: list[Measurement], primitives: dict[str, Primitive]) -> LearnedCostModel:
    """Fit the shipped model on the measurements, with the measured primitives as its alpha-beta part."""
    prior = {k: p.to_dict() for k, p in primitives.items()}
    return LearnedCostModel(**MODEL, primitives=prior).fit(measurements)


def build_profile(measurements: list[Measurement], primitives: dict[str, Primitive], meta: dict) -> Profile:
    """Return the measured profile: primitives, measurements and the learned model."""
    model = fit(measurements, primitives)
    return profile_from_measurements(measurements, primitives, meta, model=model.to_dict())


def measure_primitives(world_sizes: tuple[int, ...]) -> dict[str, Primitive]:
    """Time the primitives on local ranks for every world size and fit their constants."""
    samples: list = []
    for p in world_sizes:
        samples += launch.run_local(profiling.measure_primitives, p, list(PRIMITIVE_SIZES),
                                    profiling.TimingPlan(1, 5, 11, 1.0), timeout=900)[0]
    return profiling.fit_primitives(samples)


def _meta(plan: bench.Plan, elapsed: float, row_shape: tuple[int, ...] = (), ns: tuple[int, ...] = GRID_N,
          dtype: str = "float32") -> dict:
    rows = f"rows of shape {row_shape}" if row_shape else "scalars"
    n_text = (f"2^{ns[0].bit_length() - 1}..2^{ns[-1].bit_length() - 1}" if len(ns) > 1
              else f"2^{ns[0].bit_length() - 1}")
    return {
        "backend": "gloo",
        "world_sizes": list(GRID_WORLD),
        "nodes": 1,
        "torch_version": str(torch.__version__),
        "date": datetime.date.today().isoformat(),
        "notes": (
            "Measured on CPU ranks over gloo on one 2-core machine (ranks share the cores: P = 4 and 8 "
            f"oversubscribe them). Grid: n in {n_text}, density 1e-4, 1e-3, 1e-2, 5e-2, 0.2, "
            f"overlap 0, 0.5, 1, P in 2, 4, 8; {dtype} {rows}; each time is the median over "
            f"{plan.min_repeats} to {plan.max_repeats} interleaved rounds of the max over ranks "
            f"(about {elapsed / 60:.0f} minutes in all). Primitives: alpha-beta constants fitted to timings "
            "of each primitive at 8 B to 4 MiB per world size; model: the learned correction of the "
            "alpha-beta prediction (tools/cpu_profile.py)."
        ),
    }


def cmd_measure(args: argparse.Namespace) -> int:
    plan = bench.Plan(warmup=1, min_repeats=3, max_repeats=args.repeats, budget_s=args.budget)
    worlds = tuple(args.world_size or GRID_WORLD)
    ns = tuple(2**e for e in args.n) if args.n else GRID_N
    row_shape = tuple(args.row_shape or ())
    configs = bench.full_grid(ns, GRID_DENSITY, GRID_OVERLAP, worlds, row_shape=row_shape, dtype=args.dtype)
    t0 = time.perf_counter()
    primitives = load_profile(args.primitives).primitives if args.primitives else measure_primitives(worlds)
    for name, prim in primitives.items():
        print(f"{name}: launch {prim.launch_us:.1f} us, alpha {prim.alpha_us:.1f} us, "
              f"beta {prim.beta_us_per_byte * 1e3:.3f} ns/byte", flush=True)
    print(f"measuring {len(configs)} configurations x {len(ALGORITHMS)} algorithms", flush=True)
    print(bench.format_header(ALGORITHMS), flush=True)

    def save_raw(rep: dict) -> None:
        if args.raw:
            with open(args.raw, "w") as fh:
                json.dump(rep, fh)

    report = bench.run(configs, contenders=ALGORITHMS, plan=plan, progress=False, on_partial=save_raw)
    save_raw(report)
    elapsed = time.perf_counter() - t0
    ms = measurements_from_report(report)
    prof = build_profile(ms, primitives, _meta(plan, elapsed, row_shape, ns, args.dtype))
    save_profile(prof, args.out)
    print(f"wrote {args.out}: {len(ms)} measurements in {elapsed:.0f} s", flush=True)
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    prof = load_profile(args.profile)
    new = build_profile(prof.measurements, prof.primitives, prof.meta)
    save_profile(new, args.out or args.profile)
    print(f"refitted {len(prof.measurements)} measurements -> {args.out or args.profile}")
    return 0


def cmd_pool(args: argparse.Namespace) -> int:
    reports = []
    for path in args.raw:
        with open(path) as fh:
            reports.append(json.load(fh))
    pooled = pool_reports(reports)
    if args.min_n:
        pooled["configs"] = [c for c in pooled["configs"] if c["n"] >= 2**args.min_n]
    ms = measurements_from_report(pooled)
    prof = load_profile(args.primitives)
    meta = dict(prof.meta)
    meta["notes"] = meta.get("notes", "") + (args.notes or f" Pooled: the rounds of {len(reports)} measuring runs.")
    kept = list(prof.measurements) if args.add else []
    save_profile(build_profile(kept + ms, prof.primitives, meta), args.out)
    print(f"pooled {len(reports)} runs -> {args.out}: {len(ms)} measurements"
          + (f" added to the {len(kept)} of {args.primitives}" if args.add else ""))
    return 0


def cmd_cv(args: argparse.Namespace) -> int:
    prof = load_profile(args.profile)
    prior = {k: p.to_dict() for k, p in prof.primitives.items()}
    for label, model in (("analytic (the profile's primitives)", LearnedCostModel(estimator="none", calibrate=False,
                                                                                   primitives=prior)),
                         ("learned (shipped settings)", LearnedCostModel(**MODEL, primitives=prior))):
        res = cross_validate(prof, model=model, n_splits=args.folds)
        r = res["regret"]
        errs = ", ".join(f"{a} {v['median_rel_error']:.0%}" for a, v in res["per_algorithm"].items())
        print(f"{label}: {res['n_folds']} folds over {res['n_groups']} configurations; median |error| {errs}; "
              f"regret geomean {r['geomean']:.3f}, p95 {r['p95']:.3f}, max {r['max']:.2f}, "
              f"optimal {r['optimal_fraction']:.0%}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="measure the grid and write the profile")
    m.add_argument("--out", default=os.path.join(_ROOT, "profiles", "cpu-gloo.yaml"))
    m.add_argument("--raw", help="also write the benchmark report (JSON) here")
    m.add_argument("--world-size", type=int, nargs="+", help="subset of 2 4 8")
    m.add_argument("--repeats", type=int, default=7, help="timed rounds at most (default 7)")
    m.add_argument("--budget", type=float, default=1.0, help="seconds of rounds per configuration (default 1)")
    m.add_argument("--row-shape", type=int, nargs="+", help="value rows of this shape (default: scalars)")
    m.add_argument("--n", type=int, nargs="+", metavar="E", help="grid rows as powers of two (default 12 14 16 18 20)")
    m.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"),
                   help="value dtype (default float32)")
    m.add_argument("--primitives", metavar="PROFILE",
                   help="take the primitives from this profile instead of timing them (saves a minute or two)")
    f = sub.add_parser("fit", help="refit the model of a profile from its measurements")
    f.add_argument("profile")
    f.add_argument("--out")
    pl = sub.add_parser("pool", help="merge the rounds of several measuring runs (--raw reports) into one profile")
    pl.add_argument("raw", nargs="+", help="benchmark reports written by measure --raw")
    pl.add_argument("--primitives", required=True, help="a profile whose primitives (and meta) to keep")
    pl.add_argument("--out", required=True)
    pl.add_argument("--notes", help="text appended to meta.notes (default: how many runs were pooled)")
    pl.add_argument("--min-n", type=int, metavar="E",
                    help="keep only the configurations with n >= 2^E (each measurement is a line of the file; the "
                         "shipped profile stays under 2,500 of them, where its YAML is composed in C)")
    pl.add_argument("--add", action="store_true",
                    help="keep the measurements of the --primitives profile and add the pooled ones (another dtype "
                         "or row width measured later)")
    c = sub.add_parser("cv", help="cross-validate the cost model on a profile")
    c.add_argument("profile")
    c.add_argument("--folds", type=int, default=None, help="GroupKFold folds (default: leave one configuration out)")
    args = parser.parse_args(argv)
    return {"measure": cmd_measure, "fit": cmd_fit, "pool": cmd_pool, "cv": cmd_cv}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
