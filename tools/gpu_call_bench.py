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
    python tools/gpu_call_bench.py --log-n 20 --density 1e-3 --rows 0 --rounds 5 --trace traces   # where host time goes

A run ends with the summary per contender over the exact rows: ms, syncs
and kernels per call, and the median of each input's ratio to densify +
``all_reduce`` in the same run.

``--trace DIR`` also profiles a few steady-state calls of every contender
of the first input (and of the fused call with ``--fused``) with
``torch.profiler``: a Chrome trace per contender (open it in Perfetto), the
ops table by self host time, and in ``DIR/host.json`` and on standard
output where a call's host time goes, per call: aten ops (their own time,
views and allocations included), the CUDA runtime (launches, copies,
syncs: their counts too), and the rest, Python, which add up to the wall
time with the profiler on, printed beside the wall time without it.

On a machine without CUDA it runs on the CPU over gloo (for tests; syncs
and launches are then not counted); ``--device-path`` has CPU tensors take
the code path CUDA tensors take, so that ``--trace`` shows its host time
on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
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
from colltune.algorithms.sparse import device_path  # noqa: E402
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
    return sum(_is_launch(e.name) for e in prof.events())


def _is_launch(name: str) -> bool:
    """Whether a profiler event of the CUDA runtime or driver launches a kernel."""
    return name.startswith(("cudaLaunchKernel", "cuLaunchKernel"))


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


def _sparse_row(n: int, row: tuple[int, ...], density: float, device: torch.device, args) -> tuple[dict, dict]:
    """One input's row of the table, and its contenders (for ``--trace``)."""
    k, contenders = _sparse_contenders(n, row, density, device)
    timed = _time(contenders, device, args.rounds, args.warmup)
    return {"n": n, "row": list(row), "density": density, "k": k, **timed}, contenders


def _sparse_contenders(n: int, row: tuple[int, ...], density: float, device: torch.device) -> tuple[int, dict]:
    """An input's entries per rank and its contenders: ``all_reduce``, densify + ``all_reduce``, each algorithm."""
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
    return k, contenders


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


def _fused_row(device: torch.device, args) -> tuple[dict, dict]:
    """One ``sparse_allreduce_many`` over the 26 gradients, 8192 Zipf(1.05) ids each, per algorithm; and its
    contenders (for ``--trace``)."""
    contenders = _fused_contenders(device)
    return {"fused_tables": len(FUSED_TABLES), **_time(contenders, device, args.rounds, args.warmup)}, contenders


def _fused_contenders(device: torch.device) -> dict:
    rng = np.random.default_rng(0)
    tables = [(torch.from_numpy((rng.zipf(1.05, 8192) - 1) * 2654435761 % n).to(device),
               torch.randn(8192, 64).to(device), n) for n in FUSED_TABLES]
    return {a: (lambda a: lambda: colltune.sparse_allreduce_many(tables, algorithm=a))(a)
            for a in ("auto", "allgather", "dense")}


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


#: How many profiled calls ``--trace`` takes per contender, after as many untimed ones.
TRACE_CALLS = 10


def _host_split(averages, calls: int) -> dict:
    """Sort a profile's host events into time per call: aten ops' own time, the CUDA runtime's, and counts.

    The runtime's ``cudaDeviceSynchronize`` is left out: the profiled loop
    ends with one of its own, so that the trace holds every kernel.
    """
    from torch.autograd import DeviceType

    ops_us = runtime_us = 0.0
    runtime: dict[str, float] = {}
    top: dict[str, dict] = {}
    for e in averages:
        if e.device_type != DeviceType.CPU:  # kernels and copies on the GPU: their time is not the host's
            continue
        if e.key.startswith("aten::"):
            ops_us += e.self_cpu_time_total / calls
            top[e.key] = {"us": e.self_cpu_time_total / calls, "count": e.count / calls}
        elif e.key.startswith("cu") and e.key != "cudaDeviceSynchronize":  # cudaLaunchKernel, cudaMemcpyAsync...
            runtime_us += e.self_cpu_time_total / calls
            runtime[e.key] = e.count / calls
    heaviest = dict(sorted(top.items(), key=lambda kv: -kv[1]["us"])[:12])
    return {"aten_us": ops_us, "runtime_us": runtime_us, "runtime_calls": runtime, "ops": heaviest,
            "launches": sum(n for key, n in runtime.items() if _is_launch(key))}


def _trace(contenders: dict, device: torch.device, directory: str, label: str) -> dict:
    """Profile :data:`TRACE_CALLS` steady-state calls of each contender; write its Chrome trace and ops table
    under ``directory``; return where each one's host time goes (:func:`_host_split`) beside its wall time."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(directory, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities):  # the profiler's own start-up, which its first session pays
        next(iter(contenders.values()))()
    out = {}
    for name, fn in contenders.items():
        for _ in range(TRACE_CALLS):
            fn()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(TRACE_CALLS):  # host-bound: the device keeps up with small calls
            fn()
        _sync(device)
        wall_us = (time.perf_counter() - t0) * 1e6 / TRACE_CALLS
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(TRACE_CALLS):
                fn()
            _sync(device)
            profiled_us = (time.perf_counter() - t0) * 1e6 / TRACE_CALLS
        stem = os.path.join(directory, f"{label}-{name}".replace("+", "-plus-"))
        prof.export_chrome_trace(stem + ".json.gz")  # torch compresses it
        averages = prof.key_averages()
        with open(stem + ".txt", "w") as fh:
            fh.write(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        split = _host_split(averages, TRACE_CALLS)
        # The rest against the profiled wall time, which the profiler's own cost inflates as it does the parts.
        split["wall_us"], split["profiled_wall_us"] = wall_us, profiled_us
        split["other_us"] = profiled_us - split["aten_us"] - split["runtime_us"]
        out[name] = split
    return out


def _print_trace(label: str, traced: dict) -> None:
    print(f"# where host time goes, {label}: us per call, wall without the profiler, then with it: aten ops' own "
          "time, CUDA runtime, the rest (Python)")
    for name, got in traced.items():
        calls = ", ".join(f"{k} {v:g}" for k, v in got["runtime_calls"].items() if v)
        heavy = ", ".join(f"{k[6:]} {v['us']:.0f}" for k, v in list(got["ops"].items())[:4])
        print(f"  {name:20s} wall {got['wall_us']:7.0f}  profiled {got['profiled_wall_us']:7.0f} = aten "
              f"{got['aten_us']:6.0f} + runtime {got['runtime_us']:6.0f} + rest {got['other_us']:6.0f}  | {heavy}"
              + (f" | {calls}" if calls else ""), flush=True)


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
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="also profile the first input's contenders (and the fused call's, with --fused): Chrome "
                         "traces, ops tables and DIR/host.json, where each call's host time goes")
    ap.add_argument("--device-path", action="store_true",
                    help="without CUDA: CPU tensors take the device code path (colltune.algorithms.sparse.device_path)")
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
          f"P = {dist.get_world_size()}, medians of {args.rounds} rounds"
          + (", the device path on CPU tensors" if args.device_path and not cuda else ""), flush=True)
    with device_path() if args.device_path else contextlib.nullcontext():
        rows = _measure(args, device)
    if args.json:
        write_json(args.json, {"device": str(device), "gpu": torch.cuda.get_device_name(device) if cuda else None,
                               "torch": torch.__version__,
                               "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, "rows": rows})
    dist.destroy_process_group()
    return 0


def _measure(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Time every input the options ask for, print its row, the summary and any traces; return the rows."""
    rows = []
    to_trace: dict[str, dict] = {}  # --trace: the first input's contenders and the fused call's, as timed
    for log_n in args.log_n:
        for width in args.rows:
            for density in args.density:
                row, contenders = _sparse_row(1 << log_n, (width,) if width else (), density, device, args)
                rows.append(row)
                _print(row)
                if args.trace and not to_trace:
                    to_trace[f"n{row['n']}-row{'x'.join(map(str, row['row'])) or 1}-d{row['density']:g}"] = contenders
    if args.topk:
        for log_n in args.topk_log_n:
            rows.append(_topk_row(1 << log_n, 1e-3, device, args))
            _print(rows[-1])
    if args.fused:
        row, contenders = _fused_row(device, args)
        rows.append(row)
        _print(row)
        if args.trace:
            to_trace["fused"] = contenders
    if args.floor:
        rows.append(_floor_row(device, args))
        _print(rows[-1])
    print("\n".join(summary(rows)), flush=True)
    if args.trace:
        traced = {label: _trace(contenders, device, args.trace, label) for label, contenders in to_trace.items()}
        for label, got in traced.items():
            _print_trace(label, got)
        write_json(os.path.join(args.trace, "host.json"), {"device": str(device), "torch": torch.__version__,
                                                           "calls": TRACE_CALLS, "inputs": traced})
    return rows


if __name__ == "__main__":
    sys.exit(main())
