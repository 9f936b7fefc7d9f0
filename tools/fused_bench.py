"""The fused call's targets: a step's sparse synchronization against PyTorch's, and Ok-Topk's bytes.

1. **Time** (default). A step's sparse gradients, many embedding tables
   (``--tables``, 26 by default, rows log-spaced from 10 to ``--max-rows``,
   rows of ``--dim``), each rank's ids Zipf-distributed over a table
   (``--batch`` lookups per table, so hot rows recur across ranks, tiny
   tables are hit everywhere and large ones sparsely), coalesced as
   ``nn.Embedding(sparse=True)`` gives them. Three contenders reduce the same
   tensors with ``op="avg"``, one after another in every round after a
   barrier, so that a busy moment slows all alike:

   ``fused``      one ``colltune.sparse_allreduce_many`` (``auto``)
   ``per-table``  one ``colltune.sparse_allreduce`` (``auto``) per table
   ``torch``      ``dist.all_reduce`` of each sparse tensor, table by table
                  (gloo's sparse allreduce), summed

   A round's time is the slowest rank's; the tool prints the medians over
   ``--repeats`` rounds and the ratios. Target: ``fused`` never slower than
   ``torch``, and at least 1.3x faster than ``per-table``.

2. **Bytes** (``--bytes``). At P = 8 (``--ranks``), overlap 1 (every rank
   holds the same rows) and density 1e-2, for n from 2^12 to 2^22 (every 4x): the bytes
   one rank sends in a fused call of ``--tables-per-call`` tables of n rows,
   with ``oktopk`` and with ``allgather``, in all and without control data
   (the metadata record and Ok-Topk's counts and boundaries). Target:
   Ok-Topk's at most a third of allgather's at every n.

Usage::

    python tools/fused_bench.py --ranks 2 4 --repeats 15
    python tools/fused_bench.py --bytes --ranks 8
    python tools/fused_bench.py --ranks 4 --json fused.json
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

from colltune.cli.common import write_json  # noqa: E402
from colltune.offline import launch  # noqa: E402

CONTENDERS = ("fused", "per-table", "torch")
WARMUP = 3


def table_sizes(tables: int, max_rows: int) -> list[int]:
    """Rows of each table, log-spaced from 10 to ``max_rows``, in a shuffled but fixed order."""
    if tables == 1:
        return [max_rows]
    sizes = [round(10 * (max_rows / 10) ** (i / (tables - 1))) for i in range(tables)]
    order = torch.randperm(tables, generator=torch.Generator().manual_seed(7)).tolist()
    return [sizes[i] for i in order]


def zipf_ids(n: int, count: int, g: torch.Generator, s: float = 1.1) -> torch.Tensor:
    """``count`` ids in ``[0, n)``, Zipf(``s``)-distributed by rank (id 0 the hottest)."""
    u = torch.rand(count, generator=g, dtype=torch.float64)
    if n == 1:
        return torch.zeros(count, dtype=torch.int64)
    # Inverse CDF of the continuous power law on [1, n + 1): hot ids recur.
    a = 1.0 - s
    x = ((n + 1) ** a - 1) * u + 1
    return (x ** (1 / a) - 1).long().clamp_(0, n - 1)


def step_gradients(rank: int, cfg: dict[str, Any]) -> list[torch.Tensor]:
    """This rank's sparse gradient of every table for one step (coalesced COO)."""
    g = torch.Generator().manual_seed(1000 + rank)
    grads = []
    for n in table_sizes(cfg["tables"], cfg["max_rows"]):
        ids = zipf_ids(n, cfg["batch"], g)
        rows = torch.randn(ids.numel(), cfg["dim"], generator=g)
        grads.append(torch.sparse_coo_tensor(ids.view(1, -1), rows, (n, cfg["dim"]), check_invariants=False).coalesce())
    return grads


def _time_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import colltune

    grads = step_gradients(rank, cfg)
    calls = {
        "fused": lambda: colltune.sparse_allreduce_many(grads, op="avg"),
        "per-table": lambda: [colltune.sparse_allreduce(t, op="avg") for t in grads],
        "torch": lambda: [dist.all_reduce(t.clone()) for t in grads],
    }
    times: dict[str, list[float]] = {c: [] for c in calls}
    for i in range(WARMUP + cfg["repeats"]):
        for name, call in calls.items():
            dist.barrier()
            t0 = time.perf_counter()
            call()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    fused = colltune.sparse_allreduce_many(grads, op="avg")
    per = [colltune.sparse_allreduce(t, op="avg") for t in grads]
    same = all(torch.equal(a.values.view(torch.int32), b.values.view(torch.int32)) and torch.equal(a.indices, b.indices)
               for a, b in zip(fused, per))
    return {
        "times": times,
        "same_bits": same,
        "algorithms": sorted({r.algorithm for r in fused}),
        "fused_bytes": fused[0].traffic.bytes_sent if fused else 0,
        "per_table_bytes": sum(r.traffic.bytes_sent for r in per),
        "entries": [int(t._nnz()) for t in grads],
    }


def run_time(args: argparse.Namespace) -> dict[str, Any]:
    cfg = {"tables": args.tables, "max_rows": args.max_rows, "batch": args.batch, "dim": args.dim,
           "repeats": args.repeats}
    out: dict[str, Any] = {"config": cfg, "runs": {}}
    print(f"{args.tables} tables of rows 10..{args.max_rows} x {args.dim} fp32, {args.batch} Zipf lookups per table "
          f"and rank; ms per step's synchronization, median of {args.repeats} rounds (slowest rank)")
    print(f"{'P':>3} {'fused':>9} {'per-table':>10} {'torch':>9} {'per-table/fused':>16} {'torch/fused':>12} "
          f"{'bits':>5} {'KiB sent: fused':>15} {'per-table':>10}  algorithms")
    for p in args.ranks:
        per_rank = launch.run_local(_time_rank, p, cfg, backend="gloo", timeout=1800)
        med = {c: statistics.median(max(r["times"][c][i] for r in per_rank) for i in range(args.repeats)) * 1e3
               for c in CONTENDERS}
        row = {"median_ms": med, "same_bits": all(r["same_bits"] for r in per_rank),
               "algorithms": per_rank[0]["algorithms"], "fused_bytes": per_rank[0]["fused_bytes"],
               "per_table_bytes": per_rank[0]["per_table_bytes"], "entries_rank0": per_rank[0]["entries"]}
        out["runs"][p] = row
        print(f"{p:>3} {med['fused']:>9.2f} {med['per-table']:>10.2f} {med['torch']:>9.2f} "
              f"{med['per-table'] / med['fused']:>16.2f} {med['torch'] / med['fused']:>12.2f} "
              f"{'same' if row['same_bits'] else 'DIFF':>5} {row['fused_bytes'] / 1024:>15.0f} "
              f"{row['per_table_bytes'] / 1024:>10.0f}  {', '.join(row['algorithms'])}")
    return out


def _bytes_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[int, dict[str, int]]:
    import colltune

    out: dict[int, dict[str, int]] = {}
    for n in cfg["ns"]:
        k = max(1, round(n * cfg["density"]))
        tables = []
        for t in range(cfg["tables_per_call"]):
            g = torch.Generator().manual_seed(n + t)  # the same rows on every rank: overlap 1
            idx = torch.randperm(n, generator=g)[:k]
            tables.append((idx, torch.randn(k, generator=torch.Generator().manual_seed(rank + 10 * t)), n))
        out[n] = {}
        for algo in ("oktopk", "allgather"):
            colltune.sparse_allreduce_many(tables, algorithm=algo)  # Ok-Topk's boundaries cached from here on
            res = colltune.sparse_allreduce_many(tables, algorithm=algo)
            out[n][algo] = res[0].traffic.bytes_sent
            out[n][algo + "_meta"] = res[0].traffic.meta_bytes
    return out


def run_bytes(args: argparse.Namespace) -> dict[str, Any]:
    p = args.ranks[0]
    ns = [2**e for e in range(12, args.max_log_n + 1, 2)]
    cfg = {"ns": ns, "density": 1e-2, "tables_per_call": args.tables_per_call}
    per_rank = launch.run_local(_bytes_rank, p, cfg, backend="gloo", timeout=1800)
    print(f"P={p}, overlap 1, density 1e-2, {args.tables_per_call} tables of n rows per fused call: "
          "bytes one rank sends (the largest over ranks), in all and without control data (the metadata "
          "record, counts, boundaries)")
    print(f"{'n':>9} {'oktopk':>10} {'allgather':>10} {'ratio':>6}   {'entries: oktopk':>15} {'allgather':>10} {'ratio':>6}")
    rows = {}
    for n in ns:
        ok, ag = (max(r[n][a] for r in per_rank) for a in ("oktopk", "allgather"))
        ok_e, ag_e = (max(r[n][a] - r[n][a + "_meta"] for r in per_rank) for a in ("oktopk", "allgather"))
        rows[n] = {"oktopk": ok, "allgather": ag, "ratio": ok / ag,
                   "oktopk_entries": ok_e, "allgather_entries": ag_e, "entries_ratio": ok_e / max(1, ag_e)}
        print(f"{'2^%d' % int(math.log2(n)):>9} {ok:>10} {ag:>10} {ok / ag:>6.3f}   {ok_e:>15} {ag_e:>10} "
              f"{rows[n]['entries_ratio']:>6.3f}")
    return {"world_size": p, "config": cfg, "bytes": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", "-P", type=int, nargs="+", default=None, help="local gloo ranks (default 2 4 8; --bytes: 8)")
    ap.add_argument("--tables", type=int, default=26, help="embedding tables (default 26)")
    ap.add_argument("--max-rows", type=int, default=1_000_000, help="rows of the largest table (default 1000000)")
    ap.add_argument("--dim", type=int, default=16, help="embedding width (default 16)")
    ap.add_argument("--batch", type=int, default=2048, help="lookups per table and rank (default 2048)")
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    ap.add_argument("--bytes", action="store_true", help="Ok-Topk's bytes against allgather's instead of times")
    ap.add_argument("--tables-per-call", type=int, default=4, help="--bytes: tables of n rows per call (default 4)")
    ap.add_argument("--max-log-n", type=int, default=22, help="--bytes: the largest n is 2^this (default 22)")
    ap.add_argument("--json", metavar="FILE", help="write the figures here")
    args = ap.parse_args(argv)
    if args.ranks is None:
        args.ranks = [8] if args.bytes else [2, 4, 8]
    if min(args.ranks) < 2 or args.tables < 1 or args.max_rows < 10 or args.repeats < 1 or args.batch < 1:
        ap.error("need --ranks >= 2, --tables >= 1, --max-rows >= 10, --repeats >= 1 and --batch >= 1")
    report = run_bytes(args) if args.bytes else run_time(args)
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
