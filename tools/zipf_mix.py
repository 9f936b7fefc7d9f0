"""Time every algorithm and auto on a recommendation-like mix: Zipf ids whose hot set shifts between calls.

Embedding gradients are the skewed case: a few ids of each table are hot
in every batch, on every rank, and which ids are hot changes as the data
does. Per configuration (a table of ``n`` rows, ``density * n`` lookups per
rank and call) each call draws every rank's ids Zipf(``--zipf``)-distributed
by rank (id rank 0 the hottest), then maps rank ``z`` to row
``(z * M + shift) mod n`` with ``M`` a prime and ``shift`` new on every call
and the same on every rank: the ranks share each call's hot rows, and the
hot rows move between calls (a range partition balanced on the last
call's counts no longer fits the next). Values are rows of ``--dim``
float32; duplicate ids are summed by the call itself, as an ``EmbeddingBag``
gradient's are.

Every registered algorithm and ``auto`` run the same ``--calls`` inputs per
round, in an order rotated every round; a round's time is the max over
ranks of the calls' wall time, and a contender's time is the median over
``--rounds`` rounds, per call. Per configuration the table gives each
contender's time, the fastest, auto's choice (its most frequent algorithm),
auto's regret (its own time over the fastest's, same run: the choice and
what deciding costs) and its choice regret (the time of the algorithm it
ran, forced, over the fastest's), and the bytes
each rank sent per call for ``hashpart`` and ``oktopk`` (entries, the
metadata record apart) beside the bound of a balanced hash: ``k (P - 1) / P`` entries out (``k`` a rank's distinct
ids) plus the gather of the reduced union, ``u (P - 1) / P`` entries. The
summary: auto's regret (geometric mean and maximum over the mix) and, where
``hashpart`` is the fastest, whether auto picked it.

Usage::

    python tools/zipf_mix.py                        # P = 8, 9 configurations, about 10 minutes on 2 cores
    python tools/zipf_mix.py -P 4 --n 10000 100000 --density 0.01 --json mix.json

``--profile`` names the profile auto decides with (default: the selector's).
"""

from __future__ import annotations

import argparse
import collections
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

from colltune.cli.common import save_json  # noqa: E402
from colltune.offline import launch  # noqa: E402

#: The multiplier that scatters Zipf ranks over a table's rows (a prime: a bijection modulo any ``n`` it does not divide).
MUL = 2_654_435_761


def zipf_rows(n: int, count: int, zipf: float, shift: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` row ids of a table of ``n`` rows: Zipf(``zipf``) ranks (continuous inverse CDF), scattered by ``shift``."""
    a = 1.0 - zipf
    u = rng.random(count)
    ranks = np.floor((((n + 1.0) ** a - 1.0) * u + 1.0) ** (1.0 / a)) - 1.0
    ranks = np.clip(ranks.astype(np.int64), 0, n - 1)
    return (ranks * (MUL % n) + shift) % n


def _inputs(rank: int, cfg: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``calls`` inputs: ids (shared hot rows per call, new shift per call) and random rows."""
    n, k = cfg["n"], max(1, round(cfg["density"] * cfg["n"]))
    out = []
    for call in range(cfg["calls"]):
        shift = int(np.random.default_rng([cfg["seed"], call]).integers(0, n))  # the same on every rank
        rng = np.random.default_rng([cfg["seed"], call, rank])
        ids = torch.from_numpy(zipf_rows(n, k, cfg["zipf"], shift, rng))
        g = torch.Generator().manual_seed(cfg["seed"] * 1009 + call * 31 + rank)
        out.append((ids, torch.randn(k, cfg["dim"], generator=g)))
    return out


def _rank(rank: int, world_size: int, cfg: dict) -> dict | None:
    import colltune
    from colltune.algorithms import names

    torch.set_num_threads(1)
    if cfg.get("profile"):
        colltune.configure(profile=cfg["profile"])
    inputs = _inputs(rank, cfg)
    contenders = [*names(), "auto"]
    times: dict[str, list[float]] = {c: [] for c in contenders}
    sent: dict[str, list[int]] = collections.defaultdict(list)
    chose: collections.Counter[str] = collections.Counter()
    union: list[int] = []
    distinct = [int(torch.unique(ids).numel()) for ids, _ in inputs]

    def run(name: str, record: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        results = [colltune.sparse_allreduce(ids, vals, size=cfg["n"], algorithm=name, name=f"mix.{name}")
                   for ids, vals in inputs]
        elapsed = time.perf_counter() - t0
        if record:
            for res in results:
                if name == "auto":
                    chose[res.algorithm] += 1
                else:
                    sent[name].append(res.traffic.bytes_sent - res.traffic.meta_bytes)  # the record apart
            if name == "allgather":
                union.extend(res.indices.numel() for res in results)
        return elapsed

    for name in contenders:  # warm-up: boundaries, eager slots and auto's decisions settle
        run(name, False)
    for i in range(cfg["rounds"]):
        for name in contenders[i % len(contenders):] + contenders[: i % len(contenders)]:
            times[name].append(run(name, i == 0))
    flat = torch.tensor([t for c in contenders for t in times[c]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    r = cfg["rounds"]
    per_call = {c: statistics.median(flat[j * r : (j + 1) * r].tolist()) / cfg["calls"] for j, c in enumerate(contenders)}
    return None if rank else {"ms": {c: 1e3 * t for c, t in per_call.items()}, "chose": dict(chose),
                              "sent": {a: statistics.median(b) for a, b in sent.items()},
                              "distinct": statistics.median(distinct), "union": statistics.median(union)}


def _bound_bytes(k: float, u: float, p: int, entry: int) -> float:
    """A balanced hash's bytes per rank: ``k (P-1)/P`` entries to their owners, then ``u (P-1)/P`` gathered."""
    return (k + u) * (p - 1) / p * entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", "-P", type=int, default=8, help="local gloo ranks (default 8)")
    ap.add_argument("--n", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="table rows")
    ap.add_argument("--density", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1],
                    help="lookups per rank and call over the table's rows")
    ap.add_argument("--dim", type=int, default=16, help="embedding row width (default 16)")
    ap.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids (default 1.05)")
    ap.add_argument("--calls", type=int, default=4, help="calls per round, each with new ids (default 4)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", help="the profile auto decides with (default: the selector's)")
    ap.add_argument("--json", metavar="FILE", help="write every configuration's figures here")
    args = ap.parse_args(argv)
    if args.world_size < 2 or args.calls < 1 or args.rounds < 1 or args.zipf <= 1.0:
        ap.error("need --world-size >= 2, --calls >= 1, --rounds >= 1 and --zipf > 1")
    p, entry = args.world_size, 4 + 4 * args.dim
    rows, regrets, choices = [], [], []
    print(f"P={p} local gloo ranks, rows of {args.dim} float32, Zipf {args.zipf} ids with a new hot set each call; "
          f"ms per call (median of {args.rounds} rounds of {args.calls} calls, max over ranks)")
    head = None
    for n in args.n:
        for density in args.density:
            cfg = {"n": n, "density": density, "dim": args.dim, "zipf": args.zipf, "calls": args.calls,
                   "rounds": args.rounds, "seed": args.seed, "profile": args.profile}
            res = launch.run_local(_rank, p, cfg, backend="gloo", timeout=3600)[0]
            ms = res["ms"]
            fixed = {a: t for a, t in ms.items() if a != "auto"}
            fastest = min(fixed, key=fixed.get)
            picked = max(res["chose"], key=res["chose"].get)
            regret = ms["auto"] / fixed[fastest]
            regrets.append(regret)
            choice = fixed[picked] / fixed[fastest]
            choices.append(choice)
            bound = _bound_bytes(res["distinct"], res["union"], p, entry)
            row = {"n": n, "density": density, **res, "fastest": fastest, "auto_picked": picked, "regret": regret,
                   "choice_regret": choice, "hashpart_bound_bytes": bound}
            rows.append(row)
            if head is None:
                head = list(fixed)
                print(f"{'n':>9} {'dens':>6} " + " ".join(f"{a:>9}" for a in head)
                      + f" {'auto':>9} {'fastest':>9} {'auto ran':>9} {'regret':>6}  KiB/rank: hashpart oktopk bound")
            print(f"{n:>9} {density:>6g} " + " ".join(f"{fixed[a]:>9.2f}" for a in head)
                  + f" {ms['auto']:>9.2f} {fastest:>9} {picked:>9} {regret:>6.3f}  "
                  f"{res['sent'].get('hashpart', float('nan')) / 1024:>8.1f} "
                  f"{res['sent'].get('oktopk', float('nan')) / 1024:>6.1f} {bound / 1024:>5.1f}")
    geo = statistics.geometric_mean(regrets)
    geo_choice = statistics.geometric_mean(choices)
    wins = [r for r in rows if r["fastest"] == "hashpart"]
    print(f"\nauto's regret over the mix (its own time over the fastest's): geomean {geo:.3f}, max {max(regrets):.3f}; "
          f"choice regret (the time of the algorithm it ran over the fastest's): geomean {geo_choice:.3f}, "
          f"max {max(choices):.3f} ({len(rows)} configurations)")
    print(f"hashpart fastest in {len(wins)}; auto picked it in "
          f"{sum(r['auto_picked'] == 'hashpart' for r in wins)} of those")
    if args.json:
        save_json(args.json, {"world_size": p, "dim": args.dim, "zipf": args.zipf, "calls": args.calls,
                              "rounds": args.rounds, "rows": rows, "regret_geomean": geo,
                              "choice_regret_geomean": geo_choice})
    return 0


if __name__ == "__main__":
    sys.exit(main())
