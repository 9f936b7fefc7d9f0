"""Per-call time and host syncs of colltune on one device, beside ``all_reduce`` and densify + ``all_reduce``.

What a call costs locally on a GPU: on one rank (NCCL refuses two ranks on
one GPU) no byte crosses a wire, so the figure is the call's own work: its
kernels, its host synchronizations and its Python. Per input (n rows,
scalars or rows of 64, a density) the contenders run interleaved, round after
round, each call between two ``torch.cuda.synchronize()``, and the table
shows medians in ms, the host syncs of one steady-state call counted with
``torch.cuda.set_sync_debug_mode("warn")``, and its kernel launches counted
by ``torch.profiler`` (what ``tools/fit_host_cost.py`` fits the host's
per-kernel cost to):

- ``all_reduce``: ``dist.all_reduce`` of the dense ``[n, *row]`` tensor;
- ``densify+all_reduce``: ``index_put_`` of the entries into zeros, then the
  same ``all_reduce`` (what DDP with dense gradients pays);
- each algorithm, and ``auto``, through ``colltune.sparse_allreduce``.

Top-k rows (``--topk``) time ``colltune.topk_allreduce`` per algorithm
beside ``torch.topk`` alone, on flat tensors of 2^22 to 2^26 values.

Usage (one GPU)::

    python tools/gpu_call_bench.py --json gpu-calls.json
    python tools/gpu_call_bench.py --log-n 16 20 24 --density 1e-4 1e-3 1e-2 --topk
    python tools/gpu_call_bench.py --fused --floor    # a fused call over 26 DLRM-like gradients; the machine's floor
    python tools/gpu_call_bench.py --summary profiles/measurements/h200-per-call.json   # a stored run's table

A run ends with the summary per contender over the exact rows: ms, syncs
and kernels per call, and the median of each input's ratio to densify +
``all_reduce`` in the same run.

On a machine without CUDA it runs on the CPU over gloo (for tests; syncs
and launches are then not counted).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import colltune  # noqa: E402
from colltune.algorithms import names  # noqa: E402
from colltune.algorithms.state import TopkState  # noqa: E402
from colltune.cli.common import write_json  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_syncs(fn, device: torch.device) -> int | None:
    """Host synchronizations of one call of ``fn``, as ``torch.cuda.set_sync_debug_mode`` warns them (``None`` off CUDA).

    ``fn``'s result stays alive until the mode is switched back, and a
    warning raised inside the switch itself is not ``fn``'s: on torch 2.11
    switching back now and then warns once, attributed to
    ``set_sync_debug_mode``'s own line, after ``fn`` has returned.
    """
    if device.type != "cuda":
        return None
    _sync(device)
    switch = torch.cuda.set_sync_debug_mode
    lines, first = inspect.getsourcelines(switch)
    own = (os.path.realpath(inspect.getsourcefile(switch)), range(first, first + len(lines)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        switch("warn")
        try:
            result = fn()
        finally:
            switch("default")
    del result
    return sum("synchroniz" in str(w.message) and (os.path.realpath(w.filename), w.lineno in own[1]) != (own[0], True)
               for w in caught)


def count_launches(fn, device: torch.device) -> int | None:
    """Kernel launches of one call of ``fn``, counted by ``torch.profiler`` (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return sum(e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")) for e in prof.events())


def _time(contenders: dict, device: torch.device, rounds: int, warmup: int) -> dict:
    """Median ms per contender, interleaved round by round, and the syncs and kernel launches of one call."""
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: {"ms": statistics.median(ts), "syncs": count_syncs(contenders[name], device),
                   "launches": count_launches(contenders[name], device)}
            for name, ts in times.items()}


def _sparse_row(n: int, row: tuple[int, ...], density: float, device: torch.device, args) -> dict:
    g = torch.Generator().manual_seed(n + len(row))
    k = max(1, int(density * n))
    idx = torch.randint(0, n, (k,), generator=g).to(device)
    vals = torch.randn((k, *row), generator=g).to(device)
    dense = torch.randn((n, *row), generator=g).to(device)

    def densify_all_reduce():
        out = torch.zeros((n, *row), device=device)
        out.index_put_((idx,), vals, accumulate=True)
        dist.all_reduce(out)

    contenders = {"all_reduce": lambda: dist.all_reduce(dense), "densify+all_reduce": densify_all_reduce}
    for algorithm in (*names(), "auto"):
        contenders[algorithm] = (lambda a: lambda: colltune.sparse_allreduce(idx, vals, size=n, algorithm=a,
                                                                            name=f"bench-{a}"))(algorithm)
    return {"n": n, "row": list(row), "density": density, "k": k, **_time(contenders, device, args.rounds, args.warmup)}


def _topk_row(n: int, density: float, device: torch.device, args) -> dict:
    g = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=g).to(device)
    k = max(1, int(density * n))
    contenders = {"torch.topk": lambda: torch.topk(grad.abs(), k, sorted=False)}
    for algorithm in names():
        state = TopkState(density=density)
        contenders[algorithm] = (lambda a, s: lambda: colltune.topk_allreduce(grad, s, algorithm=a))(algorithm, state)
    return {"topk_n": n, "density": density, **_time(contenders, device, args.rounds, args.warmup)}


#: The fused rows' tables (``--fused``): a DLRM-like model's 26 embedding gradients, rows of 64.
FUSED_TABLES = [10**6] * 6 + [10**5] * 10 + [10**3] * 10


def _fused_row(device: torch.device, args) -> dict:
    """One ``sparse_allreduce_many`` over the 26 gradients, 8192 Zipf(1.05) ids each, per algorithm."""
    rng = np.random.default_rng(0)
    tables = [(torch.from_numpy((rng.zipf(1.05, 8192) - 1) * 2654435761 % n).to(device),
               torch.randn(8192, 64).to(device), n) for n in FUSED_TABLES]
    contenders = {a: (lambda a: lambda: colltune.sparse_allreduce_many(tables, algorithm=a))(a)
                  for a in ("auto", "allgather", "dense")}
    return {"fused_tables": len(tables), **_time(contenders, device, args.rounds, args.warmup)}


def _floor_row(device: torch.device, args) -> dict:
    """The machine's floor: an empty kernel launch, a read of a ready scalar, an ``all_reduce`` of one element (us)."""
    x = torch.zeros(1, device=device)

    def median_us(fn, reps: int = 1) -> float:
        times = _time({"fn": fn}, device, args.rounds, args.warmup)["fn"]["ms"]
        return times * 1e3 / reps

    def launches() -> None:
        for _ in range(100):
            x.add_(1)

    return {"floor": True, "launch_us": median_us(launches, 100), "read_us": median_us(lambda: x.item()),
            "all_reduce_1_us": median_us(lambda: dist.all_reduce(x))}


def _span(xs: list[int]) -> str:
    return f"{min(xs)} to {max(xs)}" if min(xs) != max(xs) else f"{min(xs)}"


def summary(rows: list[dict]) -> list[str]:
    """Per contender over the exact rows: ms, syncs and launches per call, and the median of each input's ratio
    to densify + ``all_reduce`` in the same run (the README's table)."""
    exact = [r for r in rows if "n" in r]
    out = []
    for name in (exact[0] if exact else {}):
        if not isinstance(exact[0][name], dict):
            continue
        ms = [r[name]["ms"] for r in exact]
        syncs = sorted({r[name]["syncs"] for r in exact if r[name]["syncs"] is not None})
        kernels = [r[name]["launches"] for r in exact if r[name].get("launches") is not None]
        ratio = statistics.median(r[name]["ms"] / r["densify+all_reduce"]["ms"] for r in exact)
        out.append(f"{name:20s} {min(ms):.2f} to {max(ms):.2f} ms, syncs {syncs}, "
                   + (f"kernels {_span(kernels)}, " if kernels else "")
                   + f"median / densify+all_reduce {ratio:.2f}")
    return out


def _print(row: dict) -> None:
    if "floor" in row:
        print(f"floor: launch {row['launch_us']:.1f} us, read {row['read_us']:.1f} us, "
              f"all_reduce of one element {row['all_reduce_1_us']:.1f} us", flush=True)
        return
    head = (f"n=2^{row['n'].bit_length() - 1} row={tuple(row['row'])} d={row['density']:g}" if "n" in row
            else f"fused, {row['fused_tables']} tables" if "fused_tables" in row
            else f"top-k n=2^{row['topk_n'].bit_length() - 1} d={row['density']:g}")
    cells = [f"{name} {got['ms']:.3f} ms"
             + ("" if got["syncs"] is None else f" ({got['syncs']} syncs, {got['launches']} kernels)")
             for name, got in row.items() if isinstance(got, dict)]
    print(f"{head:30s} " + " | ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--log-n", type=int, nargs="+", default=[16, 20, 24], help="rows, as powers of two")
    ap.add_argument("--density", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    ap.add_argument("--rows", type=int, nargs="+", default=[0, 64], help="row widths (0: scalars)")
    ap.add_argument("--topk", action="store_true", help="also top-k calls beside torch.topk")
    ap.add_argument("--topk-log-n", type=int, nargs="+", default=[22, 24, 26])
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds per input")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    ap.add_argument("--fused", action="store_true", help="also a fused call over 26 DLRM-like gradients")
    ap.add_argument("--floor", action="store_true", help="also the machine's floor: a launch, a read, a tiny all_reduce")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--summary", metavar="FILE", default=None,
                    help="print the summary of a file this tool wrote, and nothing else (no GPU needed)")
    args = ap.parse_args(argv)
    if args.summary:
        with open(args.summary) as fh:
            print("\n".join(summary(json.load(fh)["rows"])))
        return 0
    cuda = torch.cuda.is_available()
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if cuda and gpus > 1 and local_rank >= gpus:
        ap.error(f"local rank {local_rank} but {gpus} GPUs on this node: NCCL refuses two ranks on one GPU; start "
                 "at most one rank per GPU (torchrun --nproc-per-node)")
    # One visible GPU: a launcher that gives each rank its own (CUDA_VISIBLE_DEVICES), or one rank.
    device = torch.device("cuda", local_rank if gpus > 1 else 0) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        else:
            store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
            dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                                    device_id=device if cuda else None)
    if cuda:
        torch.cuda.set_device(device)
    print(f"# {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}, "
          f"P = {dist.get_world_size()}, medians of {args.rounds} rounds", flush=True)
    rows = []
    for log_n in args.log_n:
        for width in args.rows:
            for density in args.density:
                rows.append(_sparse_row(1 << log_n, (width,) if width else (), density, device, args))
                _print(rows[-1])
    if args.topk:
        for log_n in args.topk_log_n:
            rows.append(_topk_row(1 << log_n, 1e-3, device, args))
            _print(rows[-1])
    for wanted, make in ((args.fused, _fused_row), (args.floor, _floor_row)):
        if wanted:
            rows.append(make(device, args))
            _print(rows[-1])
    print("\n".join(summary(rows)), flush=True)
    if args.json:
        write_json(args.json, {"device": str(device), "gpu": torch.cuda.get_device_name(device) if cuda else None,
                               "torch": torch.__version__,
                               "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, "rows": rows})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
