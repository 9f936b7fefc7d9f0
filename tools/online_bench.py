"""Online correction's targets: choice regret over a stream of calls, with it on and off, in one run.

A training-like stream: ``--sites`` call sites (tensors of ``n`` rows from
2^14 to 2^20), each called ``--calls`` times with its density drifting
(half an octave up and down around its base, 1e-3 to 5e-2) and fresh
indices every call (overlap about 0.5). In every call, on the same inputs,
one after another after a barrier (a busy moment slows all alike), once
the fresh inputs have been touched untimed (the first call to touch them
runs slower): the forced algorithms in an order that rotates from call to
call, ``on`` and ``off`` side by side at a rotating place among them, in
turn first (on a busy machine the second of two like calls runs faster,
by far more than the 1% being compared, so a fixed order would decide the
comparison; each call's order is in the ``--json`` file):

* every registered algorithm, forced: the call's truth (the slowest rank's
  time of each);
* ``auto`` with online correction **on** (its own selector);
* ``auto`` with it **off** (another selector, same profile).

Regret of a choice = the forced time of the algorithm it chose / the fastest
forced time of that call. Printed per mode, over each site's calls after its
first ``--settle`` (50): geometric mean, 95th percentile, the share of calls
and of time spent exploring, the cost of ``on`` against ``off``, and
whether every rank decided the same in every call (checked). The cost of
``on`` is given two ways: the geometric mean of auto's own times, on over
off in the same call (the calls where on ran first and those where off
did weighing the same), with its 95% confidence interval (one call's time
is a noisy sample, so the interval is wide on a busy machine); and the cost of
on's choices against off's, each priced by the smoothed truth (below),
which leaves the noise out but also on's own bookkeeping (a clock read and
a few dictionary look-ups a call).

``--wrong ALG:X`` makes the profile wrong in a known way: its predictions of
``ALG`` are multiplied by ``X`` (``allgather:0.33`` prices allgather 3x too
low). Targets (issue: online correction): with a wrong profile, ``on`` at
most 1.03 geometric mean and 1.10 at the 95th percentile, exploring at most
3% of the time; with the right profile, ``on`` costs at most 1% over ``off``.

Usage::

    python tools/online_bench.py --ranks 4 --calls 200
    python tools/online_bench.py --ranks 4 --calls 200 --wrong allgather:0.33
    python tools/online_bench.py --ranks 4 --profile profiles/cpu-gloo.yaml --json online.json
    python tools/online_bench.py --replay online.json   # this selector on that run's recorded calls
    python tools/online_bench.py --replay profiles/measurements/online-*.json.gz
    python tools/online_bench.py --replay profiles/measurements/online-*.json.gz --busy 8 --resample 8

``--replay`` ends with the forced times' upper tail over the runs given: the share of calls over 1.5x, 2x
and 3x the median of the same site's and algorithm's within 5 calls. ``--clip`` replays with other caps on a
call's measurement (``--clip inf`` lifts ``CLIP``, ``--clip inf:inf`` ``CLIP_FIRST`` too: nothing cut)::

    python tools/online_bench.py --replay profiles/measurements/online-*.json.gz --busy 8 --clip inf:inf
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import colltune  # noqa: E402
from colltune.cli.common import save_json  # noqa: E402
from colltune.offline import launch  # noqa: E402
from colltune.offline.online_report import load_run, wrong_label  # noqa: E402
from colltune.select.selector import Selector  # noqa: E402

SIZES = (2**14, 2**16, 2**18, 2**20)
BASES = (1e-3, 5e-3, 2e-2, 5e-2)


class _Scaled:
    """A profile's model with one algorithm's predictions multiplied by a factor (the known error)."""

    def __init__(self, model: Any, algorithm: str, factor: float) -> None:
        self._model, self._algorithm, self._factor = model, algorithm, factor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def _scaled(self, pred: dict[str, float]) -> dict[str, float]:
        return {a: t * self._factor if a == self._algorithm else t for a, t in pred.items()}

    def predict(self, f: Any) -> dict[str, float]:
        return self._scaled(self._model.predict(f))

    def predict_many(self, feats: Any) -> list[dict[str, float]]:
        return [self._scaled(p) for p in self._model.predict_many(feats)]


def _wrong(sel: Selector, backend: str, wrong: tuple[str, float] | None) -> None:
    """Make the selector's model of ``backend`` wrong in a known way."""
    if wrong is not None:
        sel._models[backend] = _Scaled(sel.model(backend), *wrong)  # type: ignore[assignment]


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t) * 1e6


def _timed(call: Any) -> tuple[Any, float]:
    dist.barrier()
    t0 = time.perf_counter()
    res = call()
    return res, _slowest(time.perf_counter() - t0)


def _order(turn: int, names: list[str]) -> list[str]:
    """The order a call's contenders run in: the forced algorithms rotated by ``turn``, and ``on`` and ``off``
    side by side at a place that rotates too, each first in turn, so that every place sees both orders within
    ``2 (len(names) + 1)`` turns (with an even number of places, the order flips once per round of them)."""
    slots = len(names) + 1
    forced = names[turn % len(names):] + names[: turn % len(names)]
    flip = turn % 2 if slots % 2 else (turn // slots) % 2
    return forced[: turn % slots] + (["off", "on"] if flip else ["on", "off"]) + forced[turn % slots:]


def _rank(rank: int, world_size: int, cfg: dict) -> dict:
    wrong = tuple(cfg["wrong"]) if cfg["wrong"] else None
    sels = {}
    for mode, on in (("on", True), ("off", False)):
        sels[mode] = Selector(profile=cfg["profile"], environ={}, online=on)
        _wrong(sels[mode], "gloo", wrong)  # type: ignore[arg-type]
    names = list(colltune.algorithms.names())
    out: list[dict] = []
    gen = torch.Generator().manual_seed(1000 + rank)
    for i in range(cfg["calls"]):
        for s in range(cfg["sites"]):
            n, base = SIZES[s % len(SIZES)], BASES[s % len(BASES)]
            density = base * 2 ** (0.5 * math.sin(2 * math.pi * i / 97 + s))
            k = max(1, int(n * density))
            shared = torch.randperm(n, generator=torch.Generator().manual_seed(i * 31 + s))[: k // 2]
            idx = torch.cat([shared, torch.randint(0, n, (k - shared.numel(),), generator=gen)])
            vals = torch.randn(idx.numel(), generator=gen)
            rec: dict[str, Any] = {"site": s, "call": i, "forced": {}}
            torch.unique(idx), vals.sum()  # touch the fresh inputs, untimed and like no contender
            rec["order"] = _order(i + s, names)
            for who in rec["order"]:
                if who in sels:
                    sel = sels[who]
                    res, t = _timed(lambda sel=sel: colltune.sparse_allreduce(idx, vals, n, name=f"site{s}",
                                                                              policy=sel))
                    d = res.decision
                    rec[who] = {"algorithm": res.algorithm, "source": d.source, "us": t,
                                "correction": {a: d.corrected_us[a] / d.predicted_us[a] for a in d.predicted_us
                                               if d.corrected_us and d.predicted_us[a] > 0}}
                else:
                    res, rec["forced"][who] = _timed(lambda a=who: colltune.sparse_allreduce(idx, vals, n, algorithm=a))
                    union = res.indices.numel()
            rec["forced"] = {a: rec["forced"][a] for a in names}
            rec["predicted"] = _predicted(sels["off"], n, idx, union, world_size)
            rec.update(n=n, k=k, union=union)
            out.append(rec)
    return {"calls": out}


def _predicted(sel: Selector, n: int, idx: torch.Tensor, union: int, world_size: int) -> dict[str, float]:
    """The profile's prediction of each algorithm for this call (the selector's model, uncorrected)."""
    from colltune.model.features import Features

    k = torch.tensor([torch.unique(idx).numel()], dtype=torch.int64)
    ks = [torch.zeros_like(k) for _ in range(world_size)]
    dist.all_gather(ks, k)
    f = Features.build(numel=n, row_numel=1, dtype="float32", k_per_rank=[int(x) for x in ks], union=union,
                       ranks_per_node=world_size)
    return dict(sel.model("gloo").predict(f))  # type: ignore[union-attr]


def _smoothed(records: list[dict], window: int) -> list[dict[str, float]]:
    """Each call's forced times, each the median over the site's calls within ``window`` of it (the call's truth).

    One forced call is one noisy sample: where two algorithms lie within the
    noise, the faster of two samples is the lucky one as often as the
    better one, and a perfect choice still shows regret. The site's
    densities drift over about a hundred calls, so a few neighbours share
    the call's truth.
    """
    by_site: dict[int, list[dict]] = {}
    for r in records:
        by_site.setdefault(r["site"], []).append(r)
    truth: dict[int, dict[str, float]] = {}
    for calls in by_site.values():
        calls.sort(key=lambda r: r["call"])
        for j, r in enumerate(calls):
            near = calls[max(0, j - window) : j + window + 1]
            truth[id(r)] = {a: statistics.median(c["forced"][a] for c in near) for a in r["forced"]}
    return [truth[id(r)] for r in records]


def _paired(records: list[dict]) -> tuple[float, float]:
    """The log of auto's own time on over off, and its 95% half-width: the mean of the two orders' means.

    Of two like calls side by side the second is faster here, so the calls
    where ``on`` ran first and those where ``off`` did are averaged
    separately and then together, each order weighing the same whatever
    their counts; the interval adds the two means' variances.
    """
    by_order: dict[bool, list[float]] = {True: [], False: []}
    for r in records:
        first = r["order"].index("on") < r["order"].index("off") if "order" in r else True
        by_order[first].append(math.log(r["on"]["us"] / r["off"]["us"]))
    groups = [xs for xs in by_order.values() if xs]
    if not groups:
        return 0.0, math.inf
    mean = statistics.fmean(statistics.fmean(xs) for xs in groups)
    if any(len(xs) < 2 for xs in groups):
        return mean, math.inf
    var = sum(statistics.variance(xs) / len(xs) for xs in groups) / len(groups) ** 2
    return mean, 1.96 * math.sqrt(var)


#: The floor's truth: each forced time the median over the site's calls within this many (25 calls).
FLOOR_WINDOW = 12
#: The calls either side of a call that share its time's neighbourhood: the upper tail's median
#: (:func:`tail_shares`) and a resampled call's draw (:func:`resampled`).
NEAR = 5


def _summary(records: list[dict], settle: int, window: int) -> dict[str, Any]:
    """Regret per mode, and the floor: what choosing by a far steadier truth scores against the same truth.

    The floor picks, in each call, the algorithm fastest by the site's
    forced times over :data:`FLOOR_WINDOW` calls each side: a selector
    that knew each algorithm's time near that call. Its regret is about
    what the per-call noise of the truth itself leaves; its picks are
    estimates too, so a selector may come out a little under it by luck.
    """
    after = [r for r in records if r["call"] >= settle]
    smooth = [t for r, t in zip(records, _smoothed(records, window)) if r["call"] >= settle]
    wide = [t for r, t in zip(records, _smoothed(records, FLOOR_WINDOW)) if r["call"] >= settle]

    def regret(chosen: list[str]) -> dict[str, float]:
        got: dict[str, float] = {}
        for label, truths in (("", [r["forced"] for r in after]), ("smoothed_", smooth)):
            rs = sorted(t[a] / min(t.values()) for a, t in zip(chosen, truths))
            got.update({f"{label}regret_geomean": statistics.geometric_mean(rs),
                        f"{label}regret_p95": rs[min(len(rs) - 1, int(0.95 * len(rs)))], f"{label}regret_max": rs[-1]})
        return got

    out: dict[str, Any] = {}
    for mode in ("on", "off"):
        explored = [r for r in records if r[mode]["source"] == "explore"]
        out[mode] = {"explore_calls": len(explored) / len(records),
                     "explore_time": sum(r[mode]["us"] for r in explored) / sum(r[mode]["us"] for r in records),
                     **regret([r[mode]["algorithm"] for r in after])}
    out["floor"] = regret([min(w, key=w.__getitem__) for w in wide])
    mean, half = _paired(after)
    out["on_over_off"] = math.exp(mean)
    out["on_over_off_ci95"] = [math.exp(mean - half), math.exp(mean + half)]
    out["on_over_off_choices"] = statistics.geometric_mean(
        [t[r["on"]["algorithm"]] / t[r["off"]["algorithm"]] for r, t in zip(after, smooth)])
    return out


class _Recorded:
    """A cost model that predicts what a recorded call's profile predicted (``--replay``)."""

    kind, label, analytic, learned = "recorded", "the recorded predictions", None, None

    def __init__(self) -> None:
        self.now: dict[str, float] = {}

    def predict(self, f: Any) -> dict[str, float]:
        return dict(self.now)

    def predict_many(self, feats: Any) -> list[dict[str, float]]:
        return [dict(self.now) for _ in feats]

    def extrapolation(self, f: Any) -> None:
        return None

    def terms(self, f: Any) -> dict[str, dict[str, float]]:
        return {a: {} for a in self.now}


def tail_shares(runs: list[dict], within: int = NEAR,
                factors: tuple[float, ...] = (1.5, 2.0, 3.0)) -> dict[float, float]:
    """The share of forced times over each of ``factors`` times the median of the same site's and algorithm's
    forced times within ``within`` calls (itself included, :func:`_smoothed`): how heavy the upper tail of a
    call's time is."""
    over, total = dict.fromkeys(factors, 0), 0
    for run in runs:
        for r, truth in zip(run["calls"], _smoothed(run["calls"], within)):
            for a, t in r["forced"].items():
                total += 1
                for x in factors:
                    over[x] += t > x * truth[a]
    return {x: c / max(total, 1) for x, c in over.items()}


def resampled(run: dict, seed: int, within: int = NEAR) -> dict:
    """``run`` with another draw of its noise: each call's forced times, all of them, those of a call of the same
    site within ``within`` calls, drawn at random (a busy moment still slows every algorithm of a call alike).

    A call keeps its own entries and predictions, so the times it takes are of a density up to ``within``
    calls of drift away (about 10%); near a site's first and last calls the draw, kept inside the site's
    calls, falls on the end call more often (the first call takes its own times with chance 6/11).
    """
    import random

    rng = random.Random(seed)
    calls = [dict(r) for r in run["calls"]]
    by_site: dict[Any, list[int]] = {}
    for i, r in enumerate(calls):
        by_site.setdefault(r["site"], []).append(i)
    for idx in by_site.values():
        for j, i in enumerate(idx):
            k = idx[min(len(idx) - 1, max(0, j + rng.randint(-within, within)))]
            calls[i]["forced"] = run["calls"][k]["forced"]
    return {**run, "calls": calls}


def replay(run: dict, busy: float = 1.0) -> list[dict]:
    """The recorded stream of ``run`` decided again by fresh selectors (correction on and off), on one process.

    Each call is priced by the profile's recorded predictions, and the
    algorithm a selector picks "takes" that algorithm's recorded forced
    time, which it learns from before the next call (on a group, the next
    exchange carries it). So the machine's noise is the recorded one and
    two versions of the selector can be compared call for call, in seconds.

    ``busy``: with correction on, each site's first measured call of the
    algorithm fastest there (by its median forced time) takes this many
    times its time: one busy moment where it costs most. Regret is priced
    by the forced times and does not see it; the exploring time and on's
    own time (``us``) do, as they would live.
    """
    from types import SimpleNamespace

    fastest: dict[Any, str] = {}
    if busy != 1.0:
        times: dict[Any, dict[str, list[float]]] = {}
        for r in run["calls"]:
            for a, t in r["forced"].items():
                times.setdefault(r["site"], {}).setdefault(a, []).append(t)
        fastest = {s: min(ts, key=lambda a: statistics.median(ts[a])) for s, ts in times.items()}
    p = run["summary"]["ranks"]
    comm = SimpleNamespace(world_size=p, rank=0)
    sels, models = {}, {}
    for mode, on in (("on", True), ("off", False)):
        sels[mode] = Selector(environ={}, online=on)
        sels[mode].model("gloo")
        models[mode] = sels[mode]._models["gloo"] = _Recorded()  # type: ignore[assignment]
    out = []
    for r in run["calls"]:
        s, i = r["site"], r["call"]
        n, k = r["n"], r["k"]
        counts = [k] * p
        key = ("sparse", f"site{s}", n, 1, "float32", p, 0)
        rec = {"site": s, "call": i, "forced": r["forced"]}
        for mode, sel in sels.items():
            sel.observe_sparse(key, counts, r["union"])
            models[mode].now = r["predicted"]
            c = sel.decide_sparse(key, comm=comm, backend="gloo", name=f"site{s}", size=n, row_numel=1,
                                  dtype="float32", counts=counts, indices=None, ranks_per_node=p)
            t = r["forced"][c.algorithm]
            if c.predicted_us is not None:
                # The site's first measured call (a warm site's, as observe_time counts them) of its fastest.
                if mode == "on" and fastest.get(s) == c.algorithm and sel._sites.get(key).warm:
                    t *= busy
                    del fastest[s]
                sel.observe_time(key, c.algorithm, c.predicted_us[c.algorithm], t, c.source == "explore")
            rec[mode] = {"algorithm": c.algorithm, "source": c.source, "us": t}
        out.append(rec)
    return out


def _print(summary: dict, settle: int, window: int) -> None:
    print(f"{'mode':>5} {'regret gm':>10} {'p95':>6} {'max':>6} {'smoothed gm':>12} {'p95':>6} {'max':>6} "
          f"{'explore calls':>14} {'explore time':>13}")
    for mode in ("on", "off", "floor"):
        m = summary[mode]
        explore = (f"{100 * m['explore_calls']:>13.1f}% {100 * m['explore_time']:>12.1f}%" if "explore_calls" in m
                   else f"{'-':>14} {'-':>13}")
        print(f"{mode:>5} {m['regret_geomean']:>10.3f} {m['regret_p95']:>6.2f} {m['regret_max']:>6.2f} "
              f"{m['smoothed_regret_geomean']:>12.3f} {m['smoothed_regret_p95']:>6.2f} {m['smoothed_regret_max']:>6.2f} "
              f"{explore}")
    print(f"(after each site's first {settle} calls. regret: the chosen algorithm's forced time in that call over "
          f"the fastest's; smoothed: each forced time the median over the site's calls within {window}; floor: "
          f"each call's pick by the median within {FLOOR_WINDOW}, what the truth's own noise leaves)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--calls", type=int, default=200, help="calls per site (default 200)")
    ap.add_argument("--sites", type=int, default=4, help="call sites (default 4)")
    ap.add_argument("--settle", type=int, default=50, help="calls of a site before regret counts (default 50)")
    ap.add_argument("--window", type=int, default=2,
                    help="the smoothed truth: each forced time the median over the site's calls within this many "
                    "calls (default 2: five calls)")
    ap.add_argument("--profile", default=None, help="the profile (default: the one shipped for gloo)")
    ap.add_argument("--wrong", default=None, metavar="ALG:X", help="multiply the profile's predictions of ALG by X")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--replay", nargs="+", default=None, metavar="RUN",
                    help="decide the calls of runs this tool wrote (--json) again with this colltune's selector, "
                    "each algorithm taking its recorded time: no ranks, seconds a run")
    ap.add_argument("--busy", type=float, default=1.0, metavar="X",
                    help="with --replay: each site's first measured call, with correction on, of the algorithm "
                    "fastest there takes X times its time (one busy moment where it costs most)")
    ap.add_argument("--resample", type=int, default=0, metavar="DRAWS",
                    help="with --replay: also replay each run DRAWS times more, each call's forced times those of "
                    f"a call of the same site within {NEAR}, drawn at random, and print the geometric means")
    ap.add_argument("--clip", metavar="LOG[:FIRST]",
                    help="with --replay: decide with online correction's CLIP (and CLIP_FIRST) set to these natural "
                    "logs instead of the installed ones (FIRST omitted: the installed CLIP_FIRST); inf:inf cuts nothing "
                    "(how the caps were chosen)")
    args = ap.parse_args(argv)
    if args.clip:
        from colltune.select import online

        try:
            caps = [float(x) for x in args.clip.split(":")]
            if len(caps) > 2:
                raise ValueError(args.clip)
        except ValueError:
            ap.error(f"--clip takes LOG or LOG:FIRST, natural logs (inf for no cap), not {args.clip!r}")
        online.CLIP, online.CLIP_FIRST = caps[0], caps[-1] if len(caps) > 1 else online.CLIP_FIRST
    if args.replay:
        draws, runs = [], []
        for path in args.replay:
            run = load_run(path)
            runs.append(run)
            summary = _summary(replay(run, args.busy), args.settle, args.window)
            s = run["summary"]
            label = [f"P={s['ranks']}", f"profile {s['profile']}", wrong_label(s.get("wrong")),
                     f"busy x{args.busy:g}" if args.busy != 1.0 else ""]
            print(f"{path}: " + ", ".join(x for x in label if x))
            _print(summary, args.settle, args.window)
            print(f"on's choices against off's, priced by the smoothed truth: {summary['on_over_off_choices']:.3f}")
            for seed in range(args.resample):
                got = _summary(replay(resampled(run, seed), args.busy), args.settle, args.window)
                draws.append([got[m]["smoothed_regret_geomean"] for m in ("on", "off", "floor")])
        tail = ", ".join(f"{x:g}x {100 * share:.1f}%" for x, share in tail_shares(runs).items())
        print(f"forced times over the median of the same site's and algorithm's within {NEAR} calls: {tail}")
        if draws:
            gm = [math.exp(statistics.fmean(math.log(d[i]) for d in draws)) for i in range(3)]
            print(f"{len(draws)} resampled replays, smoothed regret geometric mean: on {gm[0]:.4f}, off {gm[1]:.4f}, "
                  f"floor {gm[2]:.4f}; on's 90th percentile {sorted(d[0] for d in draws)[int(0.9 * len(draws))]:.3f}")
        return 0
    wrong = None
    if args.wrong:
        alg, _, x = args.wrong.partition(":")
        if alg not in colltune.algorithms.names() or not x:
            ap.error(f"--wrong takes ALG:X with ALG one of {', '.join(colltune.algorithms.names())}")
        wrong = [alg, float(x)]
    cfg = {"calls": args.calls, "sites": args.sites, "profile": args.profile, "wrong": wrong}
    per_rank = launch.run_local(_rank, args.ranks, cfg, timeout=3600)
    same = all(
        [(c["on"]["algorithm"], c["on"]["source"], c["off"]["algorithm"]) for c in r["calls"]]
        == [(c["on"]["algorithm"], c["on"]["source"], c["off"]["algorithm"]) for c in per_rank[0]["calls"]]
        for r in per_rank
    )
    records = per_rank[0]["calls"]
    summary = _summary(records, args.settle, args.window)
    summary.update(ranks=args.ranks, calls=args.calls, sites=args.sites, wrong=wrong, same_on_every_rank=same,
                   profile=args.profile or "shipped (gloo)")
    print(f"P={args.ranks}, {args.sites} sites x {args.calls} calls, profile {summary['profile']}"
          f"{f', {wrong_label(wrong)}' if wrong else ''}; regret after each site's first {args.settle}")
    _print(summary, args.settle, args.window)
    lo, hi = summary["on_over_off_ci95"]
    print(f"auto's own time, on / off (geometric mean of each call's ratio): {summary['on_over_off']:.3f} "
          f"(95% confidence {lo:.3f} to {hi:.3f}); on's choices against off's, priced by the smoothed truth: "
          f"{summary['on_over_off_choices']:.3f}")
    print(f"the same decisions on every rank: {same}")
    save_json(args.json, {"summary": summary, "calls": records})
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
