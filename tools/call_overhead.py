"""Measure what one small call costs on the calling thread: ours against PyTorch's gloo sparse ``all_reduce``.

On tiny inputs a call's time is not its bytes but its operations: Python,
torch dispatch, and the hand-offs to the backend's threads. This tool runs
``colltune.sparse_allreduce`` (an explicit algorithm, default ``allgather``)
and ``dist.all_reduce`` of a ``torch.sparse_coo_tensor`` on the same random
input on local gloo ranks, interleaved, each call after a barrier, and
reports per call, as medians over the calls:

- **thread CPU**: ``time.thread_time()`` of the calling thread. It leaves out
  waiting, so it is the steadiest measure of our per-call work on a shared
  machine. PyTorch's figure is its Python-side cost only: its work runs on
  gloo's threads.
- **process CPU**: ``time.process_time()``, every thread of the rank,
  gloo's included.
- **wall**: the max over ranks of the call's wall time (as ``colltune bench``
  measures it).

Usage::

    python tools/call_overhead.py                          # P = 2, k = 7, 65 and 655 in n = 2^16
    python tools/call_overhead.py --world-size 4 --k 7 655 --calls 500 --json overhead.json

Compare two versions by running each in turn, a few times, and reading the
thread CPU column: the wall times of two runs are not comparable on a busy
machine, the ratios inside one run are.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import colltune  # noqa: E402
from colltune.cli.common import save_json  # noqa: E402
from colltune.offline import launch  # noqa: E402

#: Calls per contender before timing (the record's eager slot settles, the caches fill).
WARMUP = 20


def _rank(rank: int, world_size: int, cfg: dict) -> dict:
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.set_num_threads(1)
    n, algorithm = cfg["n"], cfg["algorithm"]
    out = {}
    for k in cfg["k"]:
        g = torch.Generator().manual_seed(rank + 1)
        idx = torch.randperm(n, generator=g)[:k]
        vals = torch.randn(k, generator=g)
        sp = torch.sparse_coo_tensor(idx.view(1, -1), vals, (n,), check_invariants=False)
        calls = {
            "colltune": lambda: colltune.sparse_allreduce(idx, vals, n, algorithm=algorithm),
            "torch": lambda: dist.all_reduce(sp.clone()),
        }
        rows: dict[str, dict[str, list[float]]] = {c: {"thread": [], "process": [], "wall": []} for c in calls}
        for i in range(WARMUP + cfg["calls"]):
            for name, call in calls.items():
                dist.barrier()
                w0, p0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
                call()
                t1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
                if i >= WARMUP:
                    rows[name]["thread"].append(t1 - t0)
                    rows[name]["process"].append(p1 - p0)
                    rows[name]["wall"].append(w1 - w0)
        out[k] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", "-P", type=int, default=2, help="local gloo ranks (default 2)")
    ap.add_argument("--n", type=int, default=2**16, help="dense rows (default 65536)")
    ap.add_argument("--k", type=int, nargs="+", default=[7, 65, 655], help="entries per rank (default 7 65 655)")
    ap.add_argument("--calls", type=int, default=300, help="timed calls per contender and k (default 300)")
    ap.add_argument("--algorithm", default="allgather", choices=colltune.algorithms.names(),
                    help="our algorithm (default allgather)")
    ap.add_argument("--json", metavar="FILE", help="write the medians here")
    args = ap.parse_args(argv)
    if args.world_size < 2 or args.calls < 1 or any(k < 1 or k > args.n for k in args.k):
        ap.error("need --world-size >= 2, --calls >= 1 and 1 <= k <= n for every --k")
    cfg = {"n": args.n, "k": args.k, "calls": args.calls, "algorithm": args.algorithm}
    per_rank = launch.run_local(_rank, args.world_size, cfg, backend="gloo", timeout=1800)
    report = {"world_size": args.world_size, "n": args.n, "algorithm": args.algorithm, "calls": args.calls, "k": {}}
    print(f"P={args.world_size} n={args.n}: us per call, medians over {args.calls} calls "
          "(thread and process CPU of rank 0, wall the max over ranks)")
    print(f"{'k':>6}  {'contender':<10} {'thread CPU':>10} {'process CPU':>12} {'wall':>8}")
    for k in args.k:
        report["k"][k] = {}
        for name in ("colltune", "torch"):
            r0 = per_rank[0][k][name]
            wall = [max(r[k][name]["wall"][i] for r in per_rank) for i in range(args.calls)]
            med = {
                "thread_cpu_us": statistics.median(r0["thread"]) * 1e6,
                "process_cpu_us": statistics.median(r0["process"]) * 1e6,
                "wall_us": statistics.median(wall) * 1e6,
            }
            report["k"][k][name] = med
            print(f"{k:>6}  {name:<10} {med['thread_cpu_us']:>10.0f} {med['process_cpu_us']:>12.0f} "
                  f"{med['wall_us']:>8.0f}")
    save_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
