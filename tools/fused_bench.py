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

On GPUs (``--device cuda``) every rank's tensors live on ``cuda:<rank %
GPUs>`` and each contender's call is timed between
``torch.cuda.synchronize()`` calls. The backend (``--backend``) is NCCL at
every P whose ranks each have a GPU of their own, else gloo with the ranks
sharing the GPUs (a note says so; for testing). On NCCL the ``torch``
contender is skipped with a line saying why (NCCL has no sparse allreduce)::

    python tools/fused_bench.py --device cuda --ranks 2 4 8       # NCCL on an 8-GPU machine
    python tools/fused_bench.py --device cuda --ranks 2           # on one GPU: 2 ranks share it over gloo
    python tools/fused_bench.py --device cuda --bytes --ranks 8
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

from colltune.cli.common import save_json  # noqa: E402
from colltune.offline import launch  # noqa: E402

CONTENDERS = ("fused", "per-table", "torch")
WARMUP = 3
#: Contenders NCCL cannot run, and why (they are skipped with this line).
NCCL_SKIPS = {"torch": "dist.all_reduce of a sparse tensor is gloo's sparse allreduce; NCCL has none"}


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


def step_gradients(rank: int, cfg: dict[str, Any], device: torch.device = torch.device("cpu")) -> list[torch.Tensor]:
    """This rank's sparse gradient of every table for one step (coalesced COO), on ``device``."""
    g = torch.Generator().manual_seed(1000 + rank)
    grads = []
    for n in table_sizes(cfg["tables"], cfg["max_rows"]):
        ids = zipf_ids(n, cfg["batch"], g)
        rows = torch.randn(ids.numel(), cfg["dim"], generator=g)
        # Checked, once before timing: with check_invariants=False torch 2.11 warned here on every step's gradients
        # ("Sparse invariant checks are implicitly disabled", seen with --device cuda on one H200).
        grad = torch.sparse_coo_tensor(ids.view(1, -1), rows, (n, cfg["dim"]), check_invariants=True).coalesce()
        grads.append(grad.to(device) if device.type != "cpu" else grad)
    return grads


def rank_device(rank: int, cfg: dict[str, Any]) -> torch.device:
    """This rank's device: the host, or ``cuda:<rank % GPUs>``, made the current device."""
    if cfg.get("device", "cpu") != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)  # NCCL's communicators and barriers use the current device
    return device


def _time_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import colltune

    device = rank_device(rank, cfg)
    grads = step_gradients(rank, cfg, device)
    calls = {
        "fused": lambda: colltune.sparse_allreduce_many(grads, op="avg"),
        "per-table": lambda: [colltune.sparse_allreduce(t, op="avg") for t in grads],
        "torch": lambda: [dist.all_reduce(t.clone()) for t in grads],
    }
    for name in cfg.get("skip", ()):
        del calls[name]

    def wait() -> None:  # on a GPU: time the work, not its enqueueing
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {c: [] for c in calls}
    for i in range(WARMUP + cfg["repeats"]):
        for name, call in calls.items():
            dist.barrier()
            wait()
            t0 = time.perf_counter()
            call()
            wait()
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
           "repeats": args.repeats, "device": args.device}
    out: dict[str, Any] = {"config": cfg, "runs": {}}
    print(f"{args.tables} tables of rows 10..{args.max_rows} x {args.dim} fp32, {args.batch} Zipf lookups per table "
          f"and rank; ms per step's synchronization, median of {args.repeats} rounds (slowest rank)"
          + (f"; on {args.device}" if args.device != "cpu" else ""))
    for line in args.notes:
        print(line)
    on_nccl = [p for p in args.ranks if args.backends[p] == "nccl"]
    for name, why in NCCL_SKIPS.items() if on_nccl else ():
        print(f"skipping {name} at P={', '.join(map(str, on_nccl))} (nccl): {why}")
    print(f"{'P':>3} {'fused':>9} {'per-table':>10} {'torch':>9} {'per-table/fused':>16} {'torch/fused':>12} "
          f"{'bits':>5} {'KiB sent: fused':>15} {'per-table':>10}  algorithms")
    for p in args.ranks:
        skips = _skips(args.backends[p])
        per_rank = launch.run_local(_time_rank, p, {**cfg, "skip": sorted(skips)}, backend=args.backends[p],
                                    timeout=1800)
        med = {c: statistics.median(max(r["times"][c][i] for r in per_rank) for i in range(args.repeats)) * 1e3
               for c in CONTENDERS if c not in skips}
        row = {"median_ms": med, "same_bits": all(r["same_bits"] for r in per_rank),
               "algorithms": per_rank[0]["algorithms"], "fused_bytes": per_rank[0]["fused_bytes"],
               "per_table_bytes": per_rank[0]["per_table_bytes"], "entries_rank0": per_rank[0]["entries"]}
        if args.device != "cpu":
            row["backend"] = args.backends[p]
        if skips:
            row["skipped"] = skips
        out["runs"][p] = row
        torch_ms = f"{med['torch']:>9.2f}" if "torch" in med else f"{'skipped':>9}"
        torch_ratio = f"{med['torch'] / med['fused']:>12.2f}" if "torch" in med else f"{'-':>12}"
        print(f"{p:>3} {med['fused']:>9.2f} {med['per-table']:>10.2f} {torch_ms} "
              f"{med['per-table'] / med['fused']:>16.2f} {torch_ratio} "
              f"{'same' if row['same_bits'] else 'DIFF':>5} {row['fused_bytes'] / 1024:>15.0f} "
              f"{row['per_table_bytes'] / 1024:>10.0f}  {', '.join(row['algorithms'])}"
              + (f"  ({args.backends[p]})" if args.device != "cpu" else ""))
    return out


def _skips(backend: str) -> dict[str, str]:
    """The contenders a backend cannot run, and why."""
    return dict(NCCL_SKIPS) if backend == "nccl" else {}


def _bytes_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[int, dict[str, int]]:
    import colltune

    device = rank_device(rank, cfg)
    out: dict[int, dict[str, int]] = {}
    for n in cfg["ns"]:
        k = max(1, round(n * cfg["density"]))
        tables = []
        for t in range(cfg["tables_per_call"]):
            g = torch.Generator().manual_seed(n + t)  # the same rows on every rank: overlap 1
            idx = torch.randperm(n, generator=g)[:k]
            vals = torch.randn(k, generator=torch.Generator().manual_seed(rank + 10 * t))
            tables.append((idx.to(device), vals.to(device), n) if device.type != "cpu" else (idx, vals, n))
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
    cfg = {"ns": ns, "density": 1e-2, "tables_per_call": args.tables_per_call, "device": args.device}
    for line in args.notes:
        print(line)
    per_rank = launch.run_local(_bytes_rank, p, cfg, backend=args.backends[p], timeout=1800)
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


def resolve_backends(ap: argparse.ArgumentParser, device: str, backend: str | None,
                     ranks: list[int]) -> tuple[dict[int, str], list[str]]:
    """The backend at each P, and the notes to print; ``ap.error`` on what cannot run (before any rank starts).

    CPU: gloo. CUDA: NCCL at every P whose ranks can each have a GPU of their
    own, else gloo (ranks share GPUs: for testing); ``backend`` forces one.
    """
    if device == "cpu":
        if backend == "nccl":
            ap.error("--backend nccl needs --device cuda (NCCL runs on GPUs only)")
        return {p: "gloo" for p in ranks}, []
    if not torch.cuda.is_available():
        ap.error(f"--device cuda: CUDA is not available here (torch {torch.__version__}, "
                 f"torch.cuda.is_available() is False); use --device cpu")
    gpus = torch.cuda.device_count()
    if backend == "nccl" and max(ranks) > gpus:
        ap.error(f"--backend nccl needs a GPU per rank: --ranks {max(ranks)} on {gpus} GPU(s); "
                 "leave --backend out or pass gloo to let ranks share GPUs")
    backends = {p: backend or ("nccl" if p <= gpus else "gloo") for p in ranks}
    shared = [p for p in ranks if backends[p] == "gloo" and p > gpus]
    notes = [f"note: at P={', '.join(map(str, shared))} the ranks share {gpus} GPU(s) over gloo (cuda:<rank % {gpus}>): "
             "for testing, not for figures of a GPU per rank"] if shared else []
    return backends, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", "-P", type=int, nargs="+", default=None,
                    help="local ranks (default 2 4 8; --bytes: 8)")
    ap.add_argument("--tables", type=int, default=26, help="embedding tables (default 26)")
    ap.add_argument("--max-rows", type=int, default=1_000_000, help="rows of the largest table (default 1000000)")
    ap.add_argument("--dim", type=int, default=16, help="embedding width (default 16)")
    ap.add_argument("--batch", type=int, default=2048, help="lookups per table and rank (default 2048)")
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    ap.add_argument("--bytes", action="store_true", help="Ok-Topk's bytes against allgather's instead of times")
    ap.add_argument("--tables-per-call", type=int, default=4, help="--bytes: tables of n rows per call (default 4)")
    ap.add_argument("--max-log-n", type=int, default=22, help="--bytes: the largest n is 2^this (default 22)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the tensors live (cuda: cuda:<rank %% GPUs>; default cpu)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                    help="process group backend (default: gloo on cpu; on cuda nccl where every rank has a GPU "
                         "of its own, else gloo with ranks sharing GPUs)")
    ap.add_argument("--json", metavar="FILE", help="write the figures here")
    args = ap.parse_args(argv)
    if args.ranks is None:
        args.ranks = [8] if args.bytes else [2, 4, 8]
    if min(args.ranks) < 2 or args.tables < 1 or args.max_rows < 10 or args.repeats < 1 or args.batch < 1:
        ap.error("need --ranks >= 2, --tables >= 1, --max-rows >= 10, --repeats >= 1 and --batch >= 1")
    args.backends, args.notes = resolve_backends(ap, args.device, args.backend, args.ranks[:1] if args.bytes else args.ranks)
    report = run_bytes(args) if args.bytes else run_time(args)
    save_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
