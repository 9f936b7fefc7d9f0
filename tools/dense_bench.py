"""Dense at density 1 against a plain ``dist.all_reduce`` of the same tensor, on local gloo ranks.

Every rank holds every one of ``n`` rows (indices ``0..n-1``, rows of
``r`` values). Three contenders reduce the same ``[n, r]`` tensor, one after
the other in every round after a barrier (their order rotates from round
to round), so that a busy moment slows all alike:

``all_reduce``  ``dist.all_reduce`` of the tensor (a copy refilled before the timer starts)
``donated``     ``colltune.sparse_allreduce(indices, values, n, algorithm="dense", donate=True)`` on such a
                copy: like ``all_reduce`` it may reduce into the tensor it is given
``dense``       the same call without ``donate``: the caller's tensor keeps its bits, so the result is
                written to new memory

A round's time is the slowest rank's; the tool prints the medians over
``--repeats`` rounds and their ratios to ``all_reduce`` (the target is at
most 1.1), and whether dense's values have the bits of the plain
``all_reduce``'s result (``same_bits``: at fp32, and for 16-bit rows with
``--wire value``, they do, since dense hands the backend a tensor of the same
size and dtype; with ``--wire accum`` 16-bit rows are summed in fp32).

On the CPU, new memory costs more than the copy into it: a tensor of more
than 32 MiB comes from the kernel on every call, page by page (glibc's
largest mmap threshold), so ``dense`` pays that where ``donated`` does not;
PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` (huge pages for large CPU tensors)
shrinks it.

Usage::

    python tools/dense_bench.py                                   # P = 2 and 4, n = 2^16, 2^18, 2^20, r = 1 and 64
    python tools/dense_bench.py --ranks 2 --log-n 16 --row-numel 1 --repeats 5 --json dense.json
    python tools/dense_bench.py --dtype bfloat16 --wire value     # 16-bit rows travel as 16-bit
"""

from __future__ import annotations

import argparse
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

CONTENDERS = ("all_reduce", "donated", "dense")
WARMUP = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import colltune

    torch.set_num_threads(1)
    dtype = DTYPES[cfg["dtype"]]
    out: dict[str, Any] = {}
    for log_n in cfg["log_n"]:
        for r in cfg["row_numel"]:
            n = 1 << log_n
            g = torch.Generator().manual_seed(1000 * rank + log_n + r)
            src = torch.randn((n, r), generator=g).to(dtype)
            idx = torch.arange(n)
            buf, given = torch.empty_like(src), torch.empty_like(src)
            results: dict[str, Any] = {}

            def plain() -> None:
                dist.all_reduce(buf)

            def donated() -> None:
                results["donated"] = colltune.sparse_allreduce(idx, given, n, algorithm="dense",
                                                               knobs={"wire": cfg["wire"]}, donate=True)

            def dense() -> None:
                results["dense"] = colltune.sparse_allreduce(idx, src, n, algorithm="dense",
                                                             knobs={"wire": cfg["wire"]})

            calls = {"all_reduce": plain, "donated": donated, "dense": dense}
            times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
            for i in range(WARMUP + cfg["repeats"]):
                shift = i % len(CONTENDERS)
                for name in CONTENDERS[shift:] + CONTENDERS[:shift]:
                    buf.copy_(src)
                    given.copy_(src)
                    dist.barrier()
                    t0 = time.perf_counter()
                    calls[name]()
                    if i >= WARMUP:
                        times[name].append(time.perf_counter() - t0)
            given.copy_(src)  # the timed rounds refill the donated tensor: check one call of its own
            donated()
            buf.copy_(src)
            dist.all_reduce(buf)
            bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
            same = all(torch.equal(res.indices, idx) and res.values.dtype == dtype
                       and torch.equal(res.values.reshape(n, r).view(bits), buf.view(bits))
                       for res in (results["dense"], results["donated"]))
            res = results["dense"]
            reduced = res.traffic.by_primitive.get("all_reduce", {}).get("bytes", 0)
            out[f"{log_n}:{r}"] = {"times": times, "same_bits": bool(same), "bytes_sent": res.traffic.bytes_sent,
                                   "all_reduce_bytes": reduced}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = {"log_n": args.log_n, "row_numel": args.row_numel, "repeats": args.repeats, "dtype": args.dtype,
           "wire": args.wire}
    report: dict[str, Any] = {"config": cfg, "runs": {}}
    wire = f" (dense's wire: {args.wire})" if args.dtype in ("bfloat16", "float16") else ""
    print(f"density 1, {args.dtype} rows{wire}, local gloo ranks; ms per call, median of {args.repeats} rounds "
          "(slowest rank)")
    print(f"{'P':>3} {'n':>8} {'r':>4} {'MiB':>7} {'all_reduce':>11} {'donated':>9} {'dense':>9} {'donated/ar':>11} "
          f"{'dense/ar':>9} {'bits':>5} {'KiB sent':>9}")
    esize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    for p in args.ranks:
        per_rank = launch.run_local(_rank, p, cfg, backend="gloo", timeout=3600)
        rows: dict[str, Any] = {}
        for log_n in args.log_n:
            for r in args.row_numel:
                key = f"{log_n}:{r}"
                med = {c: statistics.median(max(pr[key]["times"][c][i] for pr in per_rank)
                                            for i in range(args.repeats)) * 1e3 for c in CONTENDERS}
                row = {"n": 1 << log_n, "row_numel": r, "median_ms": med,
                       "ratio": med["dense"] / med["all_reduce"],
                       "donated_ratio": med["donated"] / med["all_reduce"],
                       "same_bits": all(pr[key]["same_bits"] for pr in per_rank),
                       "bytes_sent": per_rank[0][key]["bytes_sent"],
                       "all_reduce_bytes": per_rank[0][key]["all_reduce_bytes"]}
                rows[key] = row
                mib = (1 << log_n) * r * esize / 2**20
                print(f"{p:>3} {1 << log_n:>8} {r:>4} {mib:>7.2f} {med['all_reduce']:>11.2f} {med['donated']:>9.2f} "
                      f"{med['dense']:>9.2f} {row['donated_ratio']:>11.3f} {row['ratio']:>9.3f} "
                      f"{'same' if row['same_bits'] else 'DIFF':>5} "
                      f"{row['bytes_sent'] / 1024:>9.0f}", flush=True)
        report["runs"][p] = rows
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    ap.add_argument("--log-n", type=int, nargs="+", default=[16, 18, 20], help="log2 of the rows (default 16 18 20)")
    ap.add_argument("--row-numel", type=int, nargs="+", default=[1, 64], help="values per row (default 1 64)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per cell (default 7)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="value dtype (default float32)")
    ap.add_argument("--wire", choices=("accum", "value"), default="accum",
                    help="dense's `wire` knob: the dtype 16-bit rows travel in (default accum: fp32)")
    ap.add_argument("--json", metavar="FILE", help="write the medians here")
    args = ap.parse_args(argv)
    if min(args.ranks) < 2 or args.repeats < 1 or min(args.row_numel) < 1 or not 1 <= min(args.log_n) <= max(args.log_n) <= 30:
        ap.error("need --ranks >= 2, --repeats >= 1, --row-numel >= 1 and 1 <= --log-n <= 30")
    report = run(args)
    save_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
