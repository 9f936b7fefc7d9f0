"""Count what each call costs on a GPU, on CPU tensors: host syncs and ops per call on the device code path.

The README's "On GPUs" table comes from here. Local gloo ranks run every
call through the device (CUDA) code path (``colltune.algorithms.sparse.device_path``)
under ``tests/dispatch_audit.py``'s ``TorchDispatchMode``. It counts, for one
steady-state call (after a few at the same call site):

- host syncs: scalar reads, data-sized outputs, boolean masks, and reads of
  a tensor's contents (an upper bound: on CPU every tensor is "on the device");
- ops: aten ops dispatched, and kernels (the ops less views);
- nondeterministic ops: those PyTorch lists as nondeterministic on CUDA that
  accumulate, or listed writes to one place twice (counted, not refused);
- host us: the calling thread's CPU time per call (``time.thread_time``,
  the median over 30 calls after the audit, no audit running): Python and
  torch dispatch on this machine's CPU tensors, the proxy for what a call
  costs the host on a GPU (kernels there run elsewhere). Noisy on a shared
  machine: compare two commits in alternate runs.

Per algorithm on n = 2^16 rows (scalars and rows of 64, k = 3000 per rank;
``--k`` sets it: at small k the host column is the call's own overhead),
per top-k algorithm (2^16 values, density 1e-3, after 7 steps), top-k
Ok-Topk's calls off the steady state (a refresh of both thresholds, a
missed local threshold, a gradient 30x larger: one call each, no host
column), and a fused call over 2 and over 26 tables (``auto``, then each
algorithm named). Usage::

    python tools/device_path_audit.py             # P = 2
    python tools/device_path_audit.py -P 3 --json audit.json
    python tools/device_path_audit.py -P 1 --k 65          # host us: per-call overhead, little data

Run on an earlier commit (with this file and ``tests/dispatch_audit.py``
copied in) to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from colltune.cli.common import write_json  # noqa: E402
from colltune.offline import launch  # noqa: E402

STEADY = 3
#: Calls timed for the host column, after the audited one.
TIMED = 30


def _audited(call) -> dict:
    from dispatch_audit import audit

    for _ in range(STEADY):
        call()
    with audit(strict=False) as a:
        call()
    host = []
    for _ in range(TIMED):
        t0 = time.thread_time()
        call()
        host.append(time.thread_time() - t0)
    return _row(a, round(statistics.median(host) * 1e6, 1))


def _row(a: Any, host_us: float | None) -> dict:
    """One call's figures from its audit: syncs, ops, kernels (ops less views), nondeterministic ops, host time."""
    return {"syncs": a.n_syncs, "ops": a.n_ops, "kernels": a.n_kernels, "nondeterministic": len(a.nondeterministic),
            "host_us": host_us, "which": dict(a.syncs)}


def _rank(rank: int, world_size: int, cfg: dict) -> dict:
    import colltune
    from colltune.algorithms import names
    from colltune.algorithms.sparse import device_path
    from colltune.algorithms.state import TopkState
    from colltune.select.selector import Selector

    torch.set_num_threads(1)
    # The decisions from the profile alone: online correction could change an auto call's algorithm between
    # the calls counted, and what is counted is the code path of each algorithm.
    colltune.configure(selector=Selector(online=False))
    g = torch.Generator().manual_seed(rank)
    n, out = 1 << 16, {}
    with device_path():
        for algorithm in (*names(), "auto"):
            for row in ((), (64,)):
                idx = torch.randint(0, n, (cfg["k"],), generator=g)
                vals = torch.randn((cfg["k"], *row), generator=g)
                out[f"{algorithm} {'rows of 64' if row else 'scalars'}"] = _audited(
                    lambda a=algorithm, i=idx, v=vals: colltune.sparse_allreduce(i, v, size=n, algorithm=a, name=a))
        for algorithm in names():
            state = TopkState(density=1e-3)
            for _ in range(7):
                colltune.topk_allreduce(torch.randn(n, generator=g), state, algorithm=algorithm)
            grad = torch.randn(n, generator=g)
            with_audit = _audited(lambda a=algorithm, s=state: colltune.topk_allreduce(grad, s, algorithm=a))
            out[f"top-k {algorithm}"] = with_audit
        out.update(_oktopk_topk_events(g, n))
        for tables in (2, 26):
            tensors = [(torch.randint(0, 1000 + 100 * t, (200,), generator=g), torch.randn(200, 16, generator=g),
                        1000 + 100 * t) for t in range(tables)]
            out[f"fused, {tables} tables"] = _audited(lambda ts=tensors: colltune.sparse_allreduce_many(ts))
        for algorithm in names():  # one bucket of 26 tables per algorithm: its payload rides in the fused record
            out[f"fused, 26 tables, {algorithm}"] = _audited(
                lambda ts=tensors, a=algorithm: colltune.sparse_allreduce_many(ts, algorithm=a, name=a))
    return out


def _oktopk_topk_events(g: torch.Generator, n: int) -> dict:
    """Top-k Ok-Topk's calls off the steady state, each counted once: a refresh of both thresholds (every 4th
    call here), a reused local threshold no nudge of which fits (set 30x too high), and a gradient 30x larger
    (neither reused threshold fits). No host column: one call, under the audit."""
    from dispatch_audit import audit

    import colltune
    from colltune.algorithms.state import TopkState

    state = TopkState(density=1e-3, local_refresh=4, global_refresh=4)
    events = {5: "local miss", 6: "30x gradient", 8: "refresh"}
    out = {}
    for step in range(9):
        grad = torch.randn(n, generator=g) * (30 if events.get(step) == "30x gradient" else 1)
        if events.get(step) == "local miss":
            state.local_threshold = state.local_threshold * 30
        with audit(strict=False) as a:
            colltune.topk_allreduce(grad, state, algorithm="oktopk")
        if step in events:
            out[f"top-k oktopk, {events[step]}"] = _row(a, None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", "-P", type=int, default=2, help="local gloo ranks (default 2)")
    ap.add_argument("--k", type=int, default=3000, help="entries per rank of the single calls (default 3000)")
    ap.add_argument("--json", metavar="FILE", help="write rank 0's counts here")
    args = ap.parse_args(argv)
    if args.world_size < 1:
        ap.error("--world-size must be >= 1")
    if args.k < 1:
        ap.error("--k must be >= 1")
    per_rank = launch.run_local(_rank, args.world_size, {"k": args.k}, backend="gloo", timeout=1800)
    rows = per_rank[0]
    print(f"P={args.world_size}, device path on CPU tensors: per steady-state call (rank 0)")
    print(f"{'call':<28} {'syncs':>5} {'ops':>5} {'kernels':>7} {'nondet.':>7} {'host us':>8}  syncs by kind")
    for name, r in rows.items():
        host = "-" if r["host_us"] is None else f"{r['host_us']:.0f}"
        print(f"{name:<28} {r['syncs']:>5} {r['ops']:>5} {r['kernels']:>7} {r['nondeterministic']:>7} "
              f"{host:>8}  {r['which']}")
    if args.json:
        write_json(args.json, {"world_size": args.world_size, "calls": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
