"""Soak the front door: thousands of mixed calls on local gloo ranks, each rank's memory over time.

Every rank makes the same sequence of ``--calls`` calls, drawn from one
seeded generator that all ranks share (what to call), on inputs drawn from
a generator of its own (what each rank contributes):

- ``sparse_allreduce`` (about 70 %): ``dense``, ``allgather``, ``oktopk`` or
  ``auto``; 1,000 to 524,288 rows of shape ``[]``, ``[4]``, ``[3, 5]`` or
  ``[16]``; float32, float64, float16 or bfloat16 values; int32 or int64
  indices, unsorted and with duplicates; 0 to 4,096 entries per rank, spread
  over the rows or crowded into a hot range (overlapping ranks); ``sum`` or
  ``avg``;
- ``topk_allreduce`` (about 30 %): six gradient tensors, each with a
  :class:`colltune.TopkState` per algorithm kept for the whole run.

About a third of the calls are asynchronous, with up to four handles in
flight before the oldest is waited on. Every result (indices, values and
the algorithm that ran) is hashed on its rank; every ``--every`` calls the
ranks gather the hashes with ``dist.all_gather_object``, so every call's
result is compared bit for bit across ranks, and each rank samples its
resident memory (``/proc/self/statm``).

The report gives each rank's RSS at every sample, then per rank the median
RSS just after warm-up (the first quarter of the samples after the first
``--warmup`` calls), the median over the last quarter of the samples, and
the growth between the two; and how many calls differed across ranks. The
exit status is 1 if any did.

Usage::

    python tools/soak.py                                        # P = 4, 3,000 calls
    python tools/soak.py --ranks 2 --calls 300 --every 25       # a quick look
    python tools/soak.py --ranks 4 --calls 6000 --seed 3 --json soak.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
import warnings
from collections import Counter, deque
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import colltune  # noqa: E402
from colltune.offline import launch  # noqa: E402

#: Every registered algorithm, then the front door's own choice.
ALGORITHMS = (*colltune.algorithms.names(), "auto")
SIZES = (1000, 2**14, 100_000, 2**19)
ROW_SHAPES: tuple[tuple[int, ...], ...] = ((), (4,), (3, 5), (16,))
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: Largest rows x row elements of a sparse call (the dense algorithm allocates that much).
MAX_ELEMENTS = 2**19
#: Largest entries a rank contributes to one sparse call.
MAX_K = 4096
#: Top-k tensors: shape, dtype and density, each with one state per algorithm.
TOPK_TENSORS: tuple[tuple[tuple[int, ...], torch.dtype, float], ...] = (
    ((256,), torch.float32, 0.05),
    ((64, 64), torch.float32, 0.01),
    ((1000, 8), torch.float32, 0.005),
    ((128, 33), torch.float64, 0.02),
    ((4096,), torch.bfloat16, 0.01),
    ((300, 20), torch.float16, 0.02),
)
#: Most asynchronous handles in flight at once.
MAX_IN_FLIGHT = 4


# --------------------------------------------------------------------------- rank side


def _rss_bytes() -> int:
    """Return this process's resident set size in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # no procfs: the peak is the best figure there is
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _draw(plan: random.Random) -> dict[str, Any]:
    """Draw the next call (the same on every rank: ``plan`` is seeded alike everywhere)."""
    spec: dict[str, Any] = {
        "algorithm": plan.choice(ALGORITHMS),
        "async": plan.random() < 0.35,
        "op": plan.choice(("sum", "avg")),
    }
    if plan.random() < 0.7:
        n = plan.choice(SIZES)
        rows = [r for r in ROW_SHAPES if n * max(1, _numel(r)) <= MAX_ELEMENTS]
        spec.update(
            kind="sparse",
            n=n,
            row_shape=plan.choice(rows),
            dtype=plan.choice(DTYPES),
            index_dtype=plan.choice((torch.int32, torch.int64)),
            k_max=min(MAX_K, plan.choice((1, 16, 256, 4096))),
            hot=plan.random() < 0.5,
        )
    else:
        spec.update(kind="topk", tensor=plan.randrange(len(TOPK_TENSORS)))
    return spec


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _digest(algorithm: str, *tensors: torch.Tensor | None) -> bytes:
    """Hash a result: the algorithm that ran, then each tensor's dtype, shape and bytes."""
    h = hashlib.blake2b(algorithm.encode(), digest_size=8)
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def _hash_result(res: Any) -> bytes:
    return _digest(res.algorithm, res.indices, res.values)


def _call(spec: dict[str, Any], data: torch.Generator, states: dict[tuple[int, str], colltune.TopkState]) -> Any:
    """Make the call ``spec`` describes on this rank's own random inputs."""
    algorithm, async_op, op = spec["algorithm"], spec["async"], spec["op"]
    if spec["kind"] == "sparse":
        n, row_shape = spec["n"], spec["row_shape"]
        k = int(torch.randint(0, spec["k_max"] + 1, (1,), generator=data))
        span = min(n, 4 * spec["k_max"]) if spec["hot"] else n  # a hot range makes the ranks overlap
        idx = torch.randint(0, span, (k,), generator=data).to(spec["index_dtype"])
        vals = torch.randn((k,) + row_shape, generator=data).to(spec["dtype"])
        return colltune.sparse_allreduce(idx, vals, n, op=op, algorithm=algorithm, async_op=async_op)
    shape, dtype, density = TOPK_TENSORS[spec["tensor"]]
    state = states.get((spec["tensor"], algorithm))
    if state is None:
        state = states[(spec["tensor"], algorithm)] = colltune.TopkState(density=density)
    grad = torch.randn(shape, generator=data).to(dtype)
    return colltune.topk_allreduce(grad, state, op=op, algorithm=algorithm, async_op=async_op,
                                name=f"grad{spec['tensor']}")


def _rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    plan = random.Random(cfg["seed"])
    data = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + rank + 1)
    states: dict[tuple[int, str], colltune.TopkState] = {}
    in_flight: deque[tuple[int, Any]] = deque()
    digests: dict[int, bytes] = {}
    kinds: Counter[str] = Counter()
    mismatches: list[dict[str, Any]] = []
    specs: dict[int, str] = {}
    samples = [{"calls": 0, "seconds": 0.0, "rss": _rss_bytes()}]
    start = time.perf_counter()

    def finish_oldest() -> None:
        i, handle = in_flight.popleft()
        digests[i] = _hash_result(handle.wait())

    for i in range(cfg["calls"]):
        spec = _draw(plan)
        kinds[f"{spec['kind']}/{spec['algorithm']}" + (" async" if spec["async"] else "")] += 1
        specs[i] = f"{spec['kind']}/{spec['algorithm']}"
        out = _call(spec, data, states)
        if spec["async"]:
            in_flight.append((i, out))
            if len(in_flight) > plan.randint(1, MAX_IN_FLIGHT):
                finish_oldest()
        else:
            digests[i] = _hash_result(out)
        if (i + 1) % cfg["every"] == 0 or i + 1 == cfg["calls"]:
            while in_flight:
                finish_oldest()
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, digests)
            for j in sorted(digests):
                if any(other.get(j) != digests[j] for other in gathered):
                    mismatches.append({"call": j, "what": specs[j]})
            digests.clear()
            specs.clear()
            samples.append({"calls": i + 1, "seconds": time.perf_counter() - start, "rss": _rss_bytes()})
    return {"samples": samples, "mismatches": mismatches, "kinds": dict(kinds)}


# --------------------------------------------------------------------------- parent side


def growth(samples: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Return the median RSS just after warm-up, over the last quarter, and the growth between them.

    Args:
        samples: ``{"calls", "rss"}`` records in call order.
        warmup: calls before the baseline starts.

    Returns:
        ``{"after_warmup": bytes, "last_quarter": bytes, "growth": fraction}``; the
        baseline is the first quarter of the samples after warm-up.
    """
    after = [s["rss"] for s in samples if s["calls"] >= warmup] or [samples[-1]["rss"]]
    quarter = max(1, len(after) // 4)
    base = statistics.median(after[:quarter])
    last = statistics.median(after[-quarter:])
    return {"after_warmup": base, "last_quarter": last, "growth": last / base - 1.0}


def run(world_size: int, calls: int, every: int, seed: int, warmup: int | None = None) -> dict[str, Any]:
    """Run the soak on fresh local ranks and return the report (see the module docstring)."""
    warmup = calls // 5 if warmup is None else warmup
    cfg = {"calls": calls, "every": every, "seed": seed}
    start = time.perf_counter()
    per_rank = launch.run_local(_rank, world_size, cfg, backend="gloo", timeout=3600)
    wall = time.perf_counter() - start
    return {
        "world_size": world_size,
        "calls": calls,
        "every": every,
        "seed": seed,
        "warmup_calls": warmup,
        "wall_s": wall,
        "kinds": per_rank[0]["kinds"],
        "mismatches": per_rank[0]["mismatches"],
        "samples": [
            {"calls": s["calls"], "seconds": s["seconds"], "rss": [r["samples"][j]["rss"] for r in per_rank]}
            for j, s in enumerate(per_rank[0]["samples"])
        ],
        "ranks": [growth(r["samples"], warmup) for r in per_rank],
    }


def _mb(x: float) -> str:
    return f"{x / 2**20:.1f}"


def print_report(report: dict[str, Any], rows: int = 25) -> None:
    """Print the RSS table (at most about ``rows`` samples, evenly spaced) and the per-rank summary."""
    p = report["world_size"]
    samples = report["samples"]
    step = max(1, -(-len(samples) // rows))
    shown = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    print(f"P={p}, {report['calls']} calls (seed {report['seed']}), {report['wall_s']:.0f} s; RSS in MiB")
    print(f"{'calls':>7} {'seconds':>8} " + " ".join(f"{'rank ' + str(r):>8}" for r in range(p)))
    for s in shown:
        print(f"{s['calls']:>7} {s['seconds']:>8.1f} " + " ".join(f"{_mb(x):>8}" for x in s["rss"]))
    print(f"growth after warm-up ({report['warmup_calls']} calls): median of the first quarter of the later "
          "samples vs median of the last quarter")
    print(f"{'rank':>4} {'after warm-up':>14} {'last quarter':>13} {'growth':>8}")
    for r, g in enumerate(report["ranks"]):
        print(f"{r:>4} {_mb(g['after_warmup']):>14} {_mb(g['last_quarter']):>13} {100 * g['growth']:>7.2f}%")
    mix = ", ".join(f"{k} {v}" for k, v in sorted(report["kinds"].items()))
    print(f"calls: {mix}")
    print(f"results compared bit for bit across ranks: {report['calls']} calls, "
          f"{len(report['mismatches'])} differed")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", "-P", type=int, default=4, help="local gloo ranks (default 4)")
    ap.add_argument("--calls", type=int, default=3000, help="calls per rank (default 3000)")
    ap.add_argument("--every", type=int, default=100,
                    help="compare results and sample RSS every this many calls (default 100)")
    ap.add_argument("--warmup", type=int, default=None, help="calls before the baseline (default a fifth of --calls)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the call sequence and inputs (default 0)")
    ap.add_argument("--json", metavar="FILE", help="write the report here")
    args = ap.parse_args(argv)
    if args.ranks < 2 or args.calls < 1 or args.every < 1 or (args.warmup is not None and args.warmup < 0):
        ap.error("need --ranks >= 2, --calls >= 1, --every >= 1 and --warmup >= 0")
    report = run(args.ranks, args.calls, args.every, args.seed, args.warmup)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if report["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
