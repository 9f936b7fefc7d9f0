"""Measure the selector: regret on a held-out grid, the cost of a cached decision, the cost of its collective.

1. **Regret.** Times ``dense``, ``allgather`` and ``oktopk`` with the
   benchmark engine on a grid of rows, density, overlap and ``P`` in 2, 4, 8
   that the shipped profile never measured (every value lies between the
   profile's grid points), then asks the selector (``algorithm="auto"``,
   end to end, on the same local gloo ranks and inputs) which it would run:
   once cold (a fresh call site: the overlap from the sketches in the metadata record) and
   once warm (the exact overlap of the previous call). Regret is
   ``time(chosen) / time(fastest)`` on that input, both from the timed
   medians; the same for each fixed choice. Online correction is off in
   both selectors, so the regret is the profile's own (``--online`` leaves
   it on: then each selector learns over the grid's calls, and a site's
   early calls also try algorithms it has not measured yet, see
   :mod:`colltune.select.online`).
2. **Cached decision.** CPU time of :meth:`Selector.decide_sparse` plus
   :meth:`Selector.observe_sparse` on a cache hit (no process group), the
   median over many calls.
3. **Extra collective.** At ``n = 2^20``, density 1e-2, ``P = 4``: the
   collectives and time of a first call at a new call site (overlap from the
   sketches in the metadata record) against a cached call and the same
   algorithm forced, and, for reference, the time of the bitmap
   ``all_reduce`` that runs only when the decision changes inside the
   sketch's error band; all the max over ranks, medians over interleaved rounds.

The regret's grid is ``--grid interpolate`` (the default: fp32 scalars,
every value between the profile's grid points, ``P`` in 2, 4, 8) or
``--grid generalize``: world sizes, and pairs of value dtype and row width,
the profile never measured (``P`` from 2 to 8, 3, 5, 6 and 7 among them;
float32 rows of 8, 16 and 32; bfloat16, float16 and float64 scalars and rows
of 8, 16 and 32, where the profile holds these dtypes at rows of 64 only), on the held-out rows,
densities and overlaps, sampled with ``--seed`` (``--per-world``
configurations per world size; the cells whose dense tensor holds more than
:data:`GEN_MAX_ELEMENTS` values are left out to keep the run short). The
sampled grid is printed first; the same seed gives the same grid.

Usage::

    python tools/selector_bench.py                       # all three, about 8 minutes on 2 cores
    python tools/selector_bench.py --grid generalize --regret-only --seed 16   # 70 cells, about 3 minutes
    python tools/selector_bench.py --skip-regret         # 2 and 3 only, under a minute
    python tools/selector_bench.py --json selector-bench.json --world-size 2 4
    python tools/selector_bench.py --json run2.json --pool run1.json   # medians over both runs' rounds

Prints a table per held-out configuration and a summary; ``--json`` keeps everything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from colltune.offline import bench, launch  # noqa: E402

#: The fixed algorithms timed beside the selector (every registered one): the oracle is the fastest of them.
ALGORITHMS = bench.fixed_algorithms()
#: The held-out grid: between the profile's grid points (2^12..2^20 every 4x; 1e-4, 1e-3, 1e-2, 5e-2, 0.2; 0, .5, 1).
HELD_N = (2**13, 2**15, 2**17, 2**19)
HELD_DENSITY = (3e-4, 3e-3, 2e-2, 0.1)
HELD_OVERLAP = (0.25, 0.75)
HELD_WORLD = (2, 4, 8)
#: The generalization grid (``--grid generalize``): world sizes, dtypes and row widths beyond the profile's
#: (float32 scalars, and rows of 64 float32, bfloat16, float16 and float64, at P = 2, 4, 8); a float32 cell
#: has rows, a scalar cell another dtype.
GEN_WORLD = (2, 3, 4, 5, 6, 7, 8)
GEN_DTYPE = ("float32", "bfloat16", "float16", "float64")
GEN_ROW = (1, 8, 16, 32)
#: The largest dense tensor (rows times row width) a sampled cell may have: keeps the run near 10 minutes.
GEN_MAX_ELEMENTS = 2**24


# --------------------------------------------------------------------------- rank functions


def _choices_rank(rank: int, world_size: int, configs: list, profile: str | None, online: bool) -> list[dict] | None:
    import colltune
    from colltune.select.selector import Selector

    # The profile's own decisions, unless ``online``: then, as in a job, each selector's corrections learn
    # from its calls over the whole grid.
    colltune.configure(selector=Selector(profile=profile, online=online))
    # Decides afresh at every call, with no hysteresis: its second call at a
    # site decides from the exact overlap the first call revealed.
    again = Selector(profile=profile, reevaluate_every=1, margin=0.0, online=online)
    out = []
    for i, cfg in enumerate(configs):
        idx, vals = cfg.workload().make(rank)
        name = f"heldout-{world_size}-{i}"
        cold = colltune.sparse_allreduce(idx, vals, cfg.n, name=name)  # a fresh site: the sketch estimate
        colltune.sparse_allreduce(idx, vals, cfg.n, name=name, policy=again)
        warm = colltune.sparse_allreduce(idx, vals, cfg.n, name=name, policy=again)
        out.append({
            "cold": cold.algorithm, "cold_source": cold.decision.source, "cold_overlap": cold.decision.overlap,
            "cold_overlap_source": cold.decision.overlap_source,
            "warm": warm.algorithm, "warm_source": warm.decision.source, "warm_overlap": warm.decision.overlap,
            "predicted_us": dict(cold.decision.predicted_us or {}),
        })
    return out if rank == 0 else None


def _collective_rank(rank: int, world_size: int, n: int, density: float, overlap: float, rounds: int) -> dict | None:
    """Time a fresh call site, a cached one, a forced algorithm and the bitmap estimate; rank 0 returns the row."""
    import itertools

    import colltune
    from colltune.algorithms.comm import Comm
    from colltune.algorithms.sparse import coalesce
    from colltune.model.features import estimate_union_collective, overlap_bitmap_bits
    from colltune.offline.workloads import Workload, k_for_density
    from colltune.select.selector import Selector

    # The profile's decisions: with online correction a site's early calls try other algorithms, and the cached
    # and forced calls would time different algorithms.
    colltune.configure(selector=Selector(online=False))

    w = Workload(n, k_for_density(n, density), world_size, overlap, seed=1)
    idx, vals = w.make(rank)
    cidx, _ = coalesce(idx, vals.view(-1, 1), torch.float32)
    counts = [int(cidx.numel())] * world_size
    name = "overhead"
    for _ in range(2):
        colltune.sparse_allreduce(idx, vals, n, name=name)  # warm the site: later calls are cached
    comm = Comm(None, torch.device("cpu"))
    fixed = colltune.sparse_allreduce(idx, vals, n, name=name).algorithm
    fresh = itertools.count()  # the same names on every rank: each "first" call is at a new call site
    calls = {
        "first": lambda: colltune.sparse_allreduce(idx, vals, n, name=f"first-{next(fresh)}"),
        "cached": lambda: colltune.sparse_allreduce(idx, vals, n, name=name),
        "fixed": lambda: colltune.sparse_allreduce(idx, vals, n, algorithm=fixed),
        "bitmap": lambda: estimate_union_collective(comm, cidx, counts),
    }
    out, per, sources = _rotated_rounds(calls, rounds)
    if rank != 0:
        return None

    def collectives(res: object) -> int:
        return sum(v["calls"] for v in res.traffic.by_primitive.values())  # type: ignore[attr-defined]

    first = out["first"]
    est = out["bitmap"]
    return {
        "n": n, "density": density, "overlap": overlap, "world_size": world_size, "k": w.k,
        "union_exact": w.union, "overlap_exact": w.overlap,
        "algorithm": first.algorithm,  # type: ignore[attr-defined]
        "first_overlap": first.decision.overlap,  # type: ignore[attr-defined]
        "first_overlap_sources": sorted(set(sources)),
        "collectives_first": collectives(first),
        "collectives_cached": collectives(out["cached"]),
        "collectives_fixed": collectives(out["fixed"]),
        "first_ms": statistics.median(per["first"]) * 1e3,
        "call_ms": statistics.median(per["cached"]) * 1e3,
        "fixed_call_ms": statistics.median(per["fixed"]) * 1e3,
        "bitmap_bits": overlap_bitmap_bits(sum(counts)),
        "bitmap_overlap_estimate": est[1],  # type: ignore[index]
        "bitmap_ms": statistics.median(per["bitmap"]) * 1e3,
    }


def _rotated_rounds(calls: dict, rounds: int) -> tuple[dict[str, object], dict[str, list[float]], list[str]]:
    """Run every call once a round, the order rotated every round.

    Returns:
        The last output of each call, its times in seconds (the max over
        ranks, per round) and the overlap sources of the ``first`` calls.
    """
    names = list(calls)
    times: dict[str, list[float]] = {k: [] for k in names}
    out: dict[str, object] = {}
    sources: list[str] = []
    for i in range(rounds):
        for key in names[i % len(names):] + names[: i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            out[key] = calls[key]()
            times[key].append(time.perf_counter() - t0)
            if key == "first":
                sources.append(str(out[key].decision.overlap_source))  # type: ignore[attr-defined]
    flat = torch.tensor([t for key in names for t in times[key]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return out, {key: flat[j * rounds : (j + 1) * rounds].tolist() for j, key in enumerate(names)}, sources


# --------------------------------------------------------------------------- pieces


def generalize_grid(worlds: tuple[int, ...], per_world: int, seed: int) -> list:
    """Return ``per_world`` cells per world size of the generalization grid, sampled with ``seed``.

    The cells are the held-out rows, densities and overlaps crossed with
    :data:`GEN_DTYPE` and :data:`GEN_ROW`, less float32 scalars (the profile's
    own kind of value) and the cells over :data:`GEN_MAX_ELEMENTS`.
    """
    import random

    rng = random.Random(seed)
    out = []
    for p in worlds:
        cells = [(n, d, o, dt, r) for n in HELD_N for d in HELD_DENSITY for o in HELD_OVERLAP
                 for dt in GEN_DTYPE for r in GEN_ROW
                 if (dt, r) != ("float32", 1) and n * r <= GEN_MAX_ELEMENTS]
        for n, d, o, dt, r in sorted(rng.sample(cells, min(per_world, len(cells)))):
            out.append(bench.BenchConfig(n, d, o, p, () if r == 1 else (r,), dt, seed=7))
    return out


def _key(c: object) -> tuple:
    """Return the identity of a configuration (a BenchConfig or a report's config mapping)."""
    if isinstance(c, dict):
        return (c["n"], c["density"], c["overlap_requested"], c["world_size"], tuple(c.get("row_shape", ())),
                c.get("dtype", "float32"))
    return (c.n, c.density, c.overlap, c.world_size, tuple(c.row_shape), c.dtype)  # type: ignore[attr-defined]


def _row_width(c: dict) -> int:
    return int(math.prod(c.get("row_shape", ()) or (1,)))


def cached_decision_us(profile: str | None, calls: int = 20000) -> dict:
    """Return the CPU cost of a cached decision (decide + observe), in microseconds."""
    from colltune.select.selector import Selector

    class _Comm:
        world_size, rank = 4, 0

    sel = Selector(profile=profile, environ={})
    counts = (10486, 10486, 10486, 10486)
    site = ("sparse", "w", 2**20, 1, torch.float32, 4, 0)
    sel.observe_sparse(site, counts, 26214)
    first = sel.decide_sparse(site, comm=_Comm(), backend="gloo", name="w", size=2**20, row_numel=1,
                              dtype=torch.float32, counts=counts, indices=None)
    samples = []
    for _ in range(5):
        t0 = time.process_time()
        w0 = time.perf_counter()
        for _ in range(calls):
            c = sel.decide_sparse(site, comm=_Comm, backend="gloo", name="w", size=2**20, row_numel=1,
                                  dtype=torch.float32, counts=counts, indices=None)
            sel.observe_sparse(site, counts, 26214)
        samples.append(((time.process_time() - t0) / calls * 1e6, (time.perf_counter() - w0) / calls * 1e6))
        entries = sel._sites.get(site).entries
        entries[next(iter(entries))].age = 1  # keep it cached
    # And the miss it replaces (the cost model's evaluation), for scale.
    t0 = time.process_time()
    for _ in range(20):
        sel.reset()
        sel.observe_sparse(site, counts, 26214)
        sel.decide_sparse(site, comm=_Comm(), backend="gloo", name="w", size=2**20, row_numel=1,
                          dtype=torch.float32, counts=counts, indices=None)
    miss = (time.process_time() - t0) / 20 * 1e6
    return {
        "cached_cpu_us": statistics.median(s[0] for s in samples),
        "cached_wall_us": statistics.median(s[1] for s in samples),
        "miss_cpu_us": miss,
        "algorithm": c.algorithm,
        "cached": c.cached,
        "first": first.algorithm,
    }


def _geomean(xs: list[float]) -> float:
    return float(math.exp(statistics.fmean(math.log(x) for x in xs))) if xs else float("nan")


def _p95(xs: list[float]) -> float:
    return float(np.percentile(xs, 95)) if xs else float("nan")


def _pool_rounds(report: dict, earlier: list[str]) -> dict:
    """Add the timed rounds of earlier runs' held-out benchmarks to ``report``; recompute the medians."""
    index = {_key(c): c for c in report["configs"]}
    for path in earlier:
        with open(path) as fh:
            old = json.load(fh)["regret"]["bench"]
        for c in old["configs"]:
            mine = index.get(_key(c))
            if mine is None:
                continue
            for a in ALGORITHMS:
                if "times_ms" in c["contenders"].get(a, {}) and "times_ms" in mine["contenders"].get(a, {}):
                    mine["contenders"][a]["times_ms"] += c["contenders"][a]["times_ms"]
            mine["repeats"] += c["repeats"]
    for c in report["configs"]:
        for a in ALGORITHMS:
            e = c["contenders"].get(a, {})
            if "times_ms" in e:
                e["median_ms"] = statistics.median(e["times_ms"])
    return report


def _summarize(report: dict, choices: dict[tuple, dict], worlds: tuple[int, ...]) -> tuple[list[dict], dict]:
    """Return the per-configuration rows and the regret summary of ``choices`` on ``report``'s medians."""
    rows = []
    for c in report["configs"]:
        ch = choices[_key(c)]
        if any("median_ms" not in c["contenders"].get(a, {}) for a in ALGORITHMS):
            print(f"skipped (a contender failed): {c['n']} {c['density']} {c['world_size']}", flush=True)
            continue
        t = {a: c["contenders"][a]["median_ms"] for a in ALGORITHMS}
        best = min(t.values())
        fastest = min(t, key=t.get)
        rounds = {a: c["contenders"][a].get("times_ms", []) for a in ALGORITHMS}
        rows.append({
            "n": c["n"], "density": c["density"], "world_size": c["world_size"], "overlap": c["overlap"],
            "k": c["k"], "dtype": c.get("dtype", "float32"), "row": _row_width(c), "times_ms": t,
            "fastest": fastest, **ch,
            "regret_cold": t[ch["cold"]] / best, "regret_warm": t[ch["warm"]] / best,
            "regret_fixed": {a: t[a] / best for a in ALGORITHMS},
            # The choice's time over the fastest's round by round, with its confidence interval and verdict.
            "noise_cold": bench.paired_ratio(rounds[ch["cold"]], rounds[fastest]),
            "noise_warm": bench.paired_ratio(rounds[ch["warm"]], rounds[fastest]),
        })

    def stats(xs: list[float], noise: list[dict] | None = None) -> dict:
        out = {"geomean": _geomean(xs), "p95": _p95(xs), "max": max(xs),
               "optimal_fraction": statistics.fmean(x <= 1.0 for x in xs)}
        if noise is not None:  # the fastest, or not slower than it beyond noise
            out["not_slower_fraction"] = statistics.fmean(
                x <= 1.0 or n["verdict"] in ("within noise", "faster") for x, n in zip(xs, noise))
        return out

    summary = {
        "configs": len(rows),
        "selector_cold": stats([r["regret_cold"] for r in rows], [r["noise_cold"] for r in rows]),
        "selector_warm": stats([r["regret_warm"] for r in rows], [r["noise_warm"] for r in rows]),
        "fixed": {a: stats([r["regret_fixed"][a] for r in rows]) for a in ALGORITHMS},
    }
    for p in worlds:
        sub = [r for r in rows if r["world_size"] == p]
        summary[f"P={p}"] = {"selector_cold_geomean": _geomean([r["regret_cold"] for r in sub]),
                             "selector_warm_geomean": _geomean([r["regret_warm"] for r in sub])}
    return rows, summary


def _print_summary(label: str, s: dict) -> None:
    print(f"{label}:")
    for key in ("selector_cold", "selector_warm"):
        v = s[key]
        print(f"  {key}: geomean {v['geomean']:.3f}, p95 {v['p95']:.3f}, max {v['max']:.2f}, "
              f"optimal {v['optimal_fraction']:.0%} of {s['configs']}"
              + (f", optimal or within noise {v['not_slower_fraction']:.0%}" if "not_slower_fraction" in v else ""))
    for a, v in s["fixed"].items():
        print(f"  always {a}: geomean {v['geomean']:.3f}, p95 {v['p95']:.3f}")
    print("  per P (selector, cold): " + ", ".join(
        f"{k} {v['selector_cold_geomean']:.3f}" for k, v in s.items() if k.startswith("P=")), flush=True)


def regret(args: argparse.Namespace) -> dict:
    plan = bench.Plan(warmup=1, min_repeats=3, max_repeats=args.repeats, budget_s=args.budget)
    worlds = tuple(args.world_size)
    if args.grid == "generalize":
        configs = generalize_grid(worlds, args.per_world, args.seed)
        print(f"held-out generalization grid (seed {args.seed}, {args.per_world} per world size): "
              f"{len(configs)} configurations; timing {', '.join(ALGORITHMS)}", flush=True)
        for c in configs:
            print(f"  P={c.world_size} n={c.n} density={c.density:g} overlap={c.overlap:g} {c.dtype} "
                  f"rows of {_row_width({'row_shape': c.row_shape})}", flush=True)
    else:
        configs = bench.full_grid(HELD_N, HELD_DENSITY, HELD_OVERLAP, worlds, seed=7)
        print(f"held-out grid: {len(configs)} configurations; timing {', '.join(ALGORITHMS)}", flush=True)
    print(bench.format_header(ALGORITHMS), flush=True)
    report = bench.run(configs, contenders=ALGORITHMS, plan=plan, progress=False)
    choices: dict[tuple, dict] = {}
    for p in worlds:
        group = [c for c in configs if c.world_size == p]
        got = launch.run_local(_choices_rank, p, group, args.profile, args.online, timeout=1800)[0]
        for cfg, ch in zip(group, got):
            choices[_key(cfg)] = ch
    rows, summary = _summarize(report, choices, worlds)
    out = {"rows": rows, "summary": summary, "bench": report}
    if args.pool:
        pooled = _pool_rounds(json.loads(json.dumps(report)), args.pool)
        rows, out["summary_pooled"] = _summarize(pooled, choices, worlds)
        out["rows_pooled"] = rows
        out["pooled_with"] = list(args.pool)
    print()
    width = {a: max(8, len(a)) for a in ALGORITHMS}
    print(f"{'n':>7} {'dens':>6} {'P':>2} {'ovl':>4} {'dtype':>8} {'row':>3} | "
          f"{' '.join(f'{a:>{width[a]}}' for a in ALGORITHMS)} ms | "
          f"{'fastest':>9} {'cold':>9} {'warm':>9} | regret cold/warm"
          + ("   (medians over the pooled runs)" if args.pool else ""))
    for r in rows:
        t = r["times_ms"]
        print(f"{r['n']:>7} {r['density']:>6g} {r['world_size']:>2} {r['overlap']:>4.2f} {r['dtype']:>8} {r['row']:>3} | "
              f"{' '.join(f'{t[a]:>{width[a]}.2f}' for a in ALGORITHMS)}    | "
              f"{r['fastest']:>9} {r['cold']:>9} {r['warm']:>9} | "
              f"{_regret_text(r, 'cold')} / {_regret_text(r, 'warm')}")
    print("regret: the choice's time over the fastest's, round by round, median [95% confidence interval; min-max "
          "under 6 rounds]; within noise: the interval holds 1")
    return out


def _regret_text(row: dict, which: str) -> str:
    """The regret of the cold or warm choice with its noise (``1.00`` when it is the fastest)."""
    if row[which] == row["fastest"]:
        return "1.00"
    n = row.get(f"noise_{which}")
    if not n or n["regret_paired"] is None:
        return f"{row[f'regret_{which}']:.2f}"
    return bench.describe_regret(n["regret_paired"], n["regret_lo"], n["regret_hi"], n["verdict"])


def overheads(args: argparse.Namespace, out: dict) -> None:
    """Measure and print 2 and 3 (the cached decision, the extra collective of a first call) into ``out``."""
    cached = cached_decision_us(args.profile)
    out["cached_decision"] = cached
    print(f"cached decision: {cached['cached_cpu_us']:.2f} us CPU ({cached['cached_wall_us']:.2f} us wall) per call "
          f"(decide + observe; a miss, the cost model's evaluation: {cached['miss_cpu_us']:.0f} us)", flush=True)

    coll = launch.run_local(_collective_rank, 4, 2**20, 1e-2, 0.5, 30, timeout=600)[0]
    # Against a cached auto call on the same inputs: an explicit call may send less (an Ok-Topk call that
    # names its algorithm puts its region counts in the metadata record, which an auto call cannot).
    coll["extra_collectives_first"] = coll["collectives_first"] - coll["collectives_cached"]
    coll["first_overhead"] = coll["first_ms"] / coll["call_ms"] - 1.0
    out["extra_collective"] = coll
    print(f"first call at a new site, n=2^20, density 1e-2, P=4 (overlap {coll['overlap_exact']:.2f}, from "
          f"{'/'.join(coll['first_overlap_sources'])}: {coll['first_overlap']:.3f}): "
          f"{coll['collectives_first']} collectives against {coll['collectives_cached']} for a cached call "
          f"({coll['algorithm']}; forced: {coll['collectives_fixed']}), so {coll['extra_collectives_first']} extra; "
          f"first call {coll['first_ms']:.2f} ms, cached {coll['call_ms']:.2f} ms, forced "
          f"{coll['fixed_call_ms']:.2f} ms ({coll['first_overhead']:+.1%} for the first call); the bitmap "
          f"all_reduce, run only when the decision changes inside the sketch's band, would cost "
          f"{coll['bitmap_ms']:.2f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, nargs="+",
                        help="world sizes (default 2 4 8; with --grid generalize, 2 to 8)")
    parser.add_argument("--grid", choices=("interpolate", "generalize"), default="interpolate",
                        help="the held-out grid: fp32 scalars between the profile's points (default), or world "
                             "sizes, dtypes and row widths the profile lacks")
    parser.add_argument("--per-world", type=int, default=10, help="--grid generalize: cells per world size (default 10)")
    parser.add_argument("--seed", type=int, default=16, help="--grid generalize: the sampling seed (default 16)")
    parser.add_argument("--regret-only", action="store_true", help="only the regret (skip 2 and 3)")
    parser.add_argument("--profile", help="profile to use (default: the shipped one for gloo)")
    parser.add_argument("--online", action="store_true",
                        help="leave online correction on in both selectors, as in a job (default off: the profile's "
                             "own decisions; tools/online_bench.py measures the correction)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds at most per configuration (default 7)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of rounds per configuration (default 1)")
    parser.add_argument("--skip-regret", action="store_true", help="only the overhead measurements")
    parser.add_argument("--pool", nargs="+", metavar="JSON", default=[],
                        help="earlier --json outputs whose held-out rounds join this run's (steadier medians "
                             "on a loaded machine); the choices are this run's")
    parser.add_argument("--json", help="write everything here")
    args = parser.parse_args(argv)
    if not args.world_size:
        args.world_size = list(GEN_WORLD if args.grid == "generalize" else HELD_WORLD)
    out: dict = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
                 "torch": str(torch.__version__)}

    if not args.regret_only:
        overheads(args, out)
    if not args.skip_regret:
        res = regret(args)
        out["regret"] = res
        print()
        _print_summary("regret on this run's medians", res["summary"])
        if "summary_pooled" in res:
            _print_summary(f"regret on the medians of this run pooled with {len(args.pool)} earlier run(s)",
                           res["summary_pooled"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
