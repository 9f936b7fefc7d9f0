"""Benchmark the algorithms, and PyTorch's gloo sparse ``all_reduce`` as the peer, on the same inputs.

For every configuration (rows ``n``, density, overlap, world size ``P``) every
rank builds its input from a shared seed (:class:`~colltune.offline.workloads.Workload`:
``k = round(density * n)`` entries per rank, a controlled index overlap), then

1. **warms up** each contender and checks its result against the exact
   sum: the float64 sum of every rank's input, rebuilt from the seed; the
   indices must be the same, and each value within :func:`tolerance` of its
   dtype (``P`` eps, relative to the sum of the magnitudes of its terms);
2. **repeats** rounds in which every contender runs once, in an order rotated
   each round (so drift and noise from other processes spread evenly), with a
   barrier before each timed call (with :attr:`Plan.burst` > 1, before each
   burst of back-to-back calls, timed per call); at least ``min_repeats``
   rounds, at most ``max_repeats``, and no new round once ``budget_s`` seconds
   went by;
3. takes each call's time as the **max over ranks** of the per-rank wall
   time, and reports the median with the quartiles (IQR) over the rounds,
   and the bytes each rank sent (mean and max over ranks).

Contenders: every registered algorithm (through
:func:`colltune.sparse_allreduce` with the algorithm forced, so the metadata
exchange is included), ``auto``, and ``torch``: ``dist.all_reduce`` of a
``torch.sparse_coo_tensor`` and a ``coalesce()``. PyTorch does not count its
traffic; its bytes per rank are the model estimate ``(P-1) k (8 + row bytes)``
(it all-gathers int64 indices and values), flagged ``bytes_estimated``.

The top-k section runs ``topk_allreduce`` with every registered algorithm
(TopkA is ``allgather``) for a number of steps on fresh random gradients per
rank (error feedback on), and reports the median time and the entry words
(4 bytes) each rank sent, ``(bytes_sent - meta_bytes) / 4``, against
Ok-Topk's bound ``6k(P-1)/P``.

Example:
    >>> from colltune.offline import bench
    >>> report = bench.run(bench.quick_grid(), plan=bench.Plan.quick())  # doctest: +SKIP
    >>> report["configs"][0]["oracle"]["algorithm"]  # doctest: +SKIP
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence, TextIO

import torch
import torch.distributed as dist

import colltune
from colltune import algorithms
from colltune.algorithms.comm import group_device
from colltune.algorithms.errors import ColltuneValueError
from colltune.offline import launch
from colltune.offline.workloads import Workload, k_for_density

__all__ = [
    "agreement",
    "format_agreement",
    "tolerance",
    "all_contenders",
    "fixed_algorithms",
    "topk_contenders",
    "auto_summary",
    "format_auto",
    "BenchConfig",
    "TopkConfig",
    "Plan",
    "full_grid",
    "quick_grid",
    "run",
    "format_header",
    "format_row",
    "format_topk",
    "reduce_max",
    "run_rounds",
    "budget_rounds",
]


def all_contenders() -> tuple[str, ...]:
    """Contenders of the exact benchmark, in table order: ``auto`` (the selector's choice through a profile's
    cost model), every registered algorithm, and ``torch`` (PyTorch's gloo sparse ``all_reduce``)."""
    return ("auto", *algorithms.names(), "torch")


def fixed_algorithms() -> tuple[str, ...]:
    """The fixed algorithms: the oracle of a configuration is the fastest of those timed."""
    return algorithms.names()


def topk_contenders() -> tuple[str, ...]:
    """Contenders of the top-k section: every registered algorithm."""
    return algorithms.names()


logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: The issue's grid.
FULL_N = (2**16, 2**20, 2**22)
FULL_DENSITY = (1e-4, 1e-3, 1e-2, 5e-2, 0.2)
FULL_OVERLAP = (0.0, 0.5, 1.0)
FULL_WORLD = (2, 4, 8)


@dataclass(frozen=True)
class BenchConfig:
    """One point of the exact grid."""

    n: int
    density: float
    overlap: float
    world_size: int
    row_shape: tuple[int, ...] = ()
    dtype: str = "float32"
    seed: int = 0

    def workload(self) -> Workload:
        """Return the input generator of this configuration."""
        return Workload(
            self.n,
            k_for_density(self.n, self.density),
            self.world_size,
            self.overlap,
            row_shape=self.row_shape,
            dtype=_DTYPES[self.dtype],
            seed=self.seed,
        )


@dataclass(frozen=True)
class TopkConfig:
    """One point of the top-k section."""

    n: int
    density: float
    world_size: int
    steps: int = 40
    seed: int = 0


@dataclass(frozen=True)
class Plan:
    """How many calls each configuration gets.

    Args:
        warmup: untimed calls per contender before timing.
        min_repeats: timed rounds at least.
        max_repeats: timed rounds at most.
        budget_s: no new round starts after this many seconds of timed rounds
            (once ``min_repeats`` are done), so slow configurations get fewer.
        burst: calls of a contender in a row per timed sample. 1 (the
            default) times one call after a barrier: its latency. More times
            that many back-to-back calls after one barrier and reports the
            time per call, as in a training step that reduces many tensors
            in a row, where one call's work overlaps the next one's waits.
    """

    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 15
    budget_s: float = 4.0
    burst: int = 1

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ColltuneValueError(f"warmup must be >= 0, but got {self.warmup}.")
        if self.min_repeats < 1 or self.max_repeats < self.min_repeats:
            raise ColltuneValueError(
                f"repeats must satisfy 1 <= min_repeats <= max_repeats, but got "
                f"min_repeats={self.min_repeats}, max_repeats={self.max_repeats}."
            )
        if not self.budget_s > 0:
            raise ColltuneValueError(f"budget_s must be > 0, but got {self.budget_s}.")
        if self.burst < 1:
            raise ColltuneValueError(f"burst must be >= 1 (calls in a row per timed sample), but got {self.burst}.")

    @classmethod
    def quick(cls) -> Plan:
        """Return the plan of ``--quick``: one warm-up, 3 to 5 rounds, one second per configuration."""
        return cls(warmup=1, min_repeats=3, max_repeats=5, budget_s=1.0)


def full_grid(
    n: Iterable[int] = FULL_N,
    density: Iterable[float] = FULL_DENSITY,
    overlap: Iterable[float] = FULL_OVERLAP,
    world_size: Iterable[int] = FULL_WORLD,
    *,
    row_shape: tuple[int, ...] = (),
    dtype: str = "float32",
    seed: int = 0,
) -> list[BenchConfig]:
    """Return the cross product, ordered by world size, then n, density and overlap."""
    return [
        BenchConfig(nn, d, o, p, row_shape, dtype, seed)
        for p in world_size
        for nn in n
        for d in density
        for o in overlap
    ]


def quick_grid(world_size: Iterable[int] = (4,), **kw: Any) -> list[BenchConfig]:
    """Return the small grid of ``--quick``: n = 2^16, density 1e-3 and 1e-2, overlap 0 and 1."""
    return full_grid((2**16,), (1e-3, 1e-2), (0.0, 1.0), world_size, **kw)


# --------------------------------------------------------------------------- rank side


_contender_groups: dict[tuple[str, int], Any] = {}


def contender_group(name: str) -> Any:
    """Return this contender's own process group over all ranks (created on first use, collectively).

    Each contender runs on its own group so that what one leaves in its
    group's state (the size of the metadata record's eager slot, see
    :func:`colltune.algorithms.meta.slot_bytes`) never changes another's timing:
    each is measured as it runs when a call site keeps to one algorithm.
    Every rank must ask for the same names in the same order.
    """
    key = (name, dist.get_world_size())
    group = _contender_groups.get(key)
    if group is None:
        group = _contender_groups[key] = dist.new_group()
    return group


def _make_call(name: str, idx: torch.Tensor, vals: torch.Tensor, n: int) -> Callable[[], Any]:
    group = contender_group(name)
    if name == "torch":
        shape = (n,) + tuple(vals.shape[1:])
        ind = idx.view(1, -1)

        def call() -> torch.Tensor:
            t = torch.sparse_coo_tensor(ind, vals, shape, check_invariants=False)
            dist.all_reduce(t, group=group)
            return t.coalesce()

        return call

    def ours() -> Any:
        return colltune.sparse_allreduce(idx, vals, n, algorithm=name, group=group)

    return ours


class _Guard:
    """Where a rank notes which contender of which task raised, before the error ends the launch."""

    __slots__ = ("path", "task")

    def __init__(self, path: str | None, task: int) -> None:
        self.path, self.task = path, task

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Return ``fn`` that, when it raises, first writes a note naming the task and ``name``."""
        if self.path is None:
            return fn

        def guarded(*args: Any, **kw: Any) -> Any:
            try:
                return fn(*args, **kw)
            except BaseException as exc:
                note = {"task": self.task, "contender": name, "error": f"{type(exc).__name__}: {exc}"}
                with open(self.path, "w") as f:
                    json.dump(note, f)
                raise

        return guarded


def _as_pair(name: str, out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "torch":
        return out.indices().view(-1), out.values()
    return out.indices, out.values


def tolerance(dtype: str, world_size: int) -> float:
    """Return the largest error a correct sum of ``world_size`` values of ``dtype`` may show: ``P`` eps.

    The error is measured against the exact sum and relative to the sum of
    the magnitudes of the terms (:func:`_rel_error`). Summing ``P`` terms in
    any order with rounding to nearest errs by at most ``P - 1`` unit
    roundoffs (eps / 2) of that sum, so ``P`` eps is more than twice the
    worst a correct algorithm can do, and far below the error of a wrong one
    (a term lost or counted twice errs by about that term). For float32 at
    P = 2 that is 2.4e-7, for bfloat16 1.6e-2.
    """
    return max(1, world_size) * torch.finfo(_DTYPES[dtype]).eps


def _exact_reference(w: Workload) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return the exact sum of every rank's input: sorted unique indices, float64 sums and sums of magnitudes.

    Every rank rebuilds the other ranks' inputs from the workload's seed, so
    the reference depends on no collective. Inputs of a narrower dtype are
    exact in float64, and so, to within float64 rounding, are their sums.
    """
    parts = [w.make(r) for r in range(w.world_size)]
    idx = torch.cat([i for i, _ in parts])
    vals = torch.cat([v for _, v in parts]).double()
    uniq, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    shape = (uniq.numel(), *vals.shape[1:])
    total = torch.zeros(shape, dtype=torch.float64).index_add_(0, inverse, vals)
    magnitude = torch.zeros(shape, dtype=torch.float64).index_add_(0, inverse, vals.abs())
    return uniq, total, magnitude


def _rel_error(ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Return the largest ``|got - exact| / sum(|terms|)`` over the entries; inf if the indices differ or a value is NaN."""
    idx, total, magnitude = ref
    if idx.shape != got[0].shape or not torch.equal(idx, got[0]):
        return math.inf
    if total.numel() == 0:
        return 0.0
    err = (got[1].double().reshape(total.shape) - total).abs() / magnitude.clamp_min(torch.finfo(torch.float64).tiny)
    return float(torch.nan_to_num(err, nan=math.inf).max())


def _stats(times_s: Sequence[float]) -> dict[str, Any]:
    ms = sorted(t * 1e3 for t in times_s)
    if len(ms) >= 2:
        q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    else:
        q1 = q3 = ms[0]
    return {
        "median_ms": statistics.median(ms),
        "q1_ms": q1,
        "q3_ms": q3,
        "iqr_ms": q3 - q1,
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "times_ms": [t * 1e3 for t in times_s],
    }


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so that a wall-clock interval holds what ran in it (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reduce_max(values: list[float]) -> list[float]:
    """The elementwise maximum of ``values`` over the default group's ranks (collective)."""
    t = torch.tensor(values, dtype=torch.float64).to(group_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _gather_traffic(rows: list[list[int]]) -> list[list[list[int]]]:
    """All-gather per-contender ``[bytes, meta, messages]``; return ``[rank][contender][field]``."""
    t = torch.tensor(rows, dtype=torch.int64).to(group_device())
    p = dist.get_world_size() if dist.is_initialized() else 1
    if p == 1:
        return [t.tolist()]
    out = [torch.empty_like(t) for _ in range(p)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _traffic_summary(per_rank: list[list[int]]) -> dict[str, Any]:
    bytes_ = [r[0] for r in per_rank]
    meta = [r[1] for r in per_rank]
    msgs = [r[2] for r in per_rank]
    return {
        "bytes_per_rank": sum(bytes_) / len(bytes_),
        "bytes_per_rank_max": max(bytes_),
        "meta_bytes_per_rank": sum(meta) / len(meta),
        "messages_per_rank": sum(msgs) / len(msgs),
        "bytes_estimated": False,
    }


def _one_round(
    calls: Mapping[str, Callable[[], Any]], names: list[str], rounds: int, last: dict[str, Any], burst: int = 1
) -> dict[str, float]:
    """Run every call ``burst`` times in a row, in ``names`` rotated by ``rounds``, each burst after a barrier.

    Stores each call's last output in ``last``; returns this rank's wall time
    (seconds) per call of each burst.
    """
    shift = rounds % len(names)
    local: dict[str, float] = {}
    device = group_device()
    for name in names[shift:] + names[:shift]:
        call = calls[name]
        sync_device(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(burst):
            last[name] = call()
        sync_device(device)
        local[name] = (time.perf_counter() - t0) / burst
    return local


def run_rounds(
    calls: Mapping[str, Callable[[], Any]],
    plan: Any,
    record: Callable[[dict[str, float], float], None],
    done: Callable[[float], bool],
    burst: int = 1,
) -> dict[str, Any]:
    """Run interleaved rounds (:func:`_one_round`) until ``plan.max_repeats``.

    After ``plan.min_repeats`` rounds, stop as soon as ``done(start)`` is true.

    ``record(local_times, start)`` is called after every round; ``start`` is
    the ``time.perf_counter()`` of the first round. Returns the last output of each call.
    """
    names = list(calls)
    last: dict[str, Any] = {}
    start = time.perf_counter()
    rounds = 0
    while True:
        record(_one_round(calls, names, rounds, last, burst), start)
        rounds += 1
        if rounds >= plan.max_repeats:
            break
        if rounds >= plan.min_repeats and done(start):
            break
    return last


def budget_rounds(
    calls: dict[str, Callable[[], Any]], plan: Plan
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Run the interleaved timed rounds; return per-rank times and the last output of each contender."""
    times: dict[str, list[float]] = {name: [] for name in calls}

    def record(local: dict[str, float], start: float) -> None:
        for name, t in local.items():
            times[name].append(t)

    def done(start: float) -> bool:
        # The same reduced number on every rank, so every rank stops after the same round.
        return reduce_max([time.perf_counter() - start])[0] >= plan.budget_s

    last = run_rounds(calls, plan, record, done, plan.burst)
    return times, last


def _bench_one(
    rank: int, world_size: int, cfg: BenchConfig, contenders: Sequence[str], plan: Plan, guard: _Guard
) -> dict[str, Any]:
    w = cfg.workload()
    idx, vals = (t.to(group_device()) for t in w.make(rank))
    calls = {name: guard.wrap(name, _make_call(name, idx, vals, cfg.n)) for name in contenders}
    gc.collect()
    errors = _warm_up_and_check(calls, contenders, plan, w, vals, cfg)
    tol = tolerance(cfg.dtype, world_size)
    times, last = budget_rounds(calls, plan)
    rounds = len(times[contenders[0]])
    flat = reduce_max([t for name in contenders for t in times[name]])
    traffic = _contender_traffic(last, contenders, cfg, w, world_size)
    auto_ran = {name: last[name].algorithm for name in contenders if name == "auto"}
    auto_why = {name: str(getattr(last[name].decision, "reason", "") or "") for name in auto_ran}
    del last
    out: dict[str, Any] = {
        "n": cfg.n,
        "density": cfg.density,
        "world_size": world_size,
        "overlap_requested": cfg.overlap,
        "overlap": w.overlap,
        "k": w.k,
        "union": w.union,
        "row_shape": list(w.row_shape),
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "repeats": rounds,
        "reference": "float64",
        "tolerance": tol,
        "contenders": {},
    }
    for j, name in enumerate(contenders):
        entry = _stats(flat[j * rounds : (j + 1) * rounds])
        entry.update(_traffic_summary([traffic[r][j] for r in range(world_size)]))
        if name == "torch":
            entry["bytes_estimated"] = True
        entry["max_rel_err"] = errors[j]
        entry["agrees"] = errors[j] <= tol
        out["contenders"][name] = entry
    if "torch" in out["contenders"]:
        t_ms = out["contenders"]["torch"]["median_ms"]  # errors are added by the parent, later
        out["speedup_vs_torch"] = {
            name: t_ms / c["median_ms"] for name, c in out["contenders"].items() if name != "torch"
        }
    _add_oracle(out, auto_ran.get("auto"), auto_why.get("auto"))
    return out


def _warm_up_and_check(calls: dict[str, Callable[[], Any]], contenders: Sequence[str], plan: Plan, w: Workload,
                       vals: torch.Tensor, cfg: BenchConfig) -> list[float]:
    """Warm up, interleaved too; return every contender's largest error (max over ranks) against the exact sum.

    The reference is :func:`_exact_reference`: the float64 sum of every
    rank's input, built from the workload. A contender that changes its
    input values is an error.
    """
    vals_before = vals.clone()
    outputs: dict[str, Any] = {}
    for i in range(plan.warmup):
        shift = i % len(contenders)
        for name in list(contenders)[shift:] + list(contenders)[:shift]:
            dist.barrier()
            outputs[name] = calls[name]()
    if not outputs:
        outputs = {name: calls[name]() for name in contenders}
    ref = _exact_reference(w)
    errors = reduce_max([_rel_error(ref, tuple(t.cpu() for t in _as_pair(name, outputs[name])))  # type: ignore[arg-type]
                          for name in contenders])
    if not torch.equal(vals, vals_before):
        raise RuntimeError(f"a contender modified its input values in place (config {cfg}).")
    return errors


def _contender_traffic(last: Mapping[str, Any], contenders: Sequence[str], cfg: BenchConfig, w: Workload,
                       p: int) -> list[list[list[int]]]:
    """Return every rank's bytes sent, control bytes and messages per contender, from its last call.

    PyTorch's are estimated: ``(P-1) k`` entries of an int64 index and a row.
    """
    row_bytes = int(torch.Size(w.row_shape).numel()) * _DTYPES[cfg.dtype].itemsize
    rows = []
    for name in contenders:
        if name == "torch":
            rows.append([(p - 1) * w.k * (8 + row_bytes), 0, 2 * (p - 1) if p > 1 else 0])
        else:
            tr = last[name].traffic
            rows.append([tr.bytes_sent, tr.meta_bytes, tr.messages])
    return _gather_traffic(rows)


def _add_oracle(out: dict[str, Any], auto_ran: str | None, auto_why: str | None) -> None:
    """Add the oracle (the fastest fixed algorithm timed) and, with ``auto``, its choice, regret and speedups."""
    cs = out["contenders"]
    fixed = [a for a in fixed_algorithms() if "median_ms" in cs.get(a, {})]
    if not fixed:
        return
    best = min(fixed, key=lambda a: cs[a]["median_ms"])
    out["oracle"] = {"algorithm": best, "median_ms": cs[best]["median_ms"]}
    if auto_ran is None or "median_ms" not in cs.get("auto", {}):
        return
    t_auto = cs["auto"]["median_ms"]
    out["auto"] = {
        "algorithm": auto_ran,
        "reason": auto_why or "",
        # Measured time of auto (selector included) over the oracle's; 1 is perfect.
        "regret": t_auto / cs[best]["median_ms"],
        # The same for the algorithm auto picked, timed as a fixed contender (no selector overhead).
        "choice_regret": (cs[auto_ran]["median_ms"] / cs[best]["median_ms"]) if auto_ran in fixed else None,
        "speedup": {a: cs[a]["median_ms"] / t_auto
                    for a in (*fixed_algorithms(), "torch") if "median_ms" in cs.get(a, {})},
        **paired_ratio(cs["auto"].get("times_ms", []), cs[best].get("times_ms", [])),
    }


#: The fewest paired rounds whose interval tells noise from a difference.
MIN_PAIRED_ROUNDS = 3
#: The confidence the interval of the median ratio aims at (fewer than 6 rounds reach less: min to max).
CONFIDENCE = 0.95


def median_interval(n: int, confidence: float = CONFIDENCE) -> tuple[int, float]:
    """Return ``k`` and the coverage of the distribution-free interval of a median from ``n`` samples.

    The interval runs from the ``k``-th smallest to the ``k``-th largest
    sample (1-based); its coverage is ``1 - 2 P(B <= k - 1)`` for ``B``
    binomial with ``n`` trials and probability 1/2 (the sign test). ``k``
    is the largest that keeps the coverage at least ``confidence``, and 1
    (min to max) when even that falls short.
    """
    pmf = [math.comb(n, j) / 2**n for j in range(n + 1)]
    k = 1
    while k < (n + 1) // 2 and 1 - 2 * sum(pmf[: k + 1]) >= confidence:
        k += 1
    return k, 1 - 2 * sum(pmf[:k])


def _verdict(lo: float, hi: float) -> str:
    """What an interval of auto's time over the oracle's says: ``faster``, ``slower`` or ``within noise``."""
    return "faster" if hi < 1.0 else "slower" if lo > 1.0 else "within noise"


def paired_ratio(auto_ms: Sequence[float], oracle_ms: Sequence[float]) -> dict[str, Any]:
    """Return auto's time over the oracle's, round by round, with its confidence interval and what it says.

    The contenders run interleaved, each once per round on the same inputs,
    so the ratio of the same round's times cancels the load both met. The
    median ratio's interval (:func:`median_interval`) is the noise: one that
    holds 1 is ``"within noise"``; one wholly below 1 is ``"faster"`` (auto
    beat the fastest fixed algorithm timed separately, so there is no
    regret), wholly above is ``"slower"``. Under :data:`MIN_PAIRED_ROUNDS`
    rounds there is nothing to judge by: ``"few rounds"``.

    Returns:
        ``{"regret_paired", "regret_lo", "regret_hi", "regret_confidence",
        "paired_rounds", "verdict"}``: the median ratio, its interval and
        the interval's coverage (``None`` without a paired round).
    """
    ratios = sorted(a / o for a, o in zip(auto_ms, oracle_ms) if o > 0)
    if not ratios:
        return {"regret_paired": None, "regret_lo": None, "regret_hi": None, "regret_confidence": None,
                "paired_rounds": 0, "verdict": "few rounds"}
    k, coverage = median_interval(len(ratios))
    lo, hi = ratios[k - 1], ratios[-k]
    if len(ratios) < MIN_PAIRED_ROUNDS:
        verdict = "few rounds"
    else:
        verdict = _verdict(lo, hi)
    return {"regret_paired": statistics.median(ratios), "regret_lo": lo, "regret_hi": hi,
            "regret_confidence": coverage, "paired_rounds": len(ratios), "verdict": verdict}


def describe_regret(ratio: float, lo: float | None, hi: float | None, verdict: str) -> str:
    """Say auto's time over the oracle's with its interval; a ratio below 1 is a speedup, never a regret.

    Example: ``regret 1.48 [1.40-1.55]``, ``within noise (0.97 [0.90-1.05])``,
    ``1.52x faster [1.40-1.61]``, ``0.97 (2 rounds)``.
    """
    if lo is None or hi is None or verdict == "few rounds":
        return f"{ratio:.2f} (too few rounds to judge)"
    if verdict == "faster":
        return f"{1 / ratio:.2f}x faster [{1 / hi:.2f}-{1 / lo:.2f}]"
    if verdict == "slower":
        return f"regret {ratio:.2f} [{lo:.2f}-{hi:.2f}]"
    return f"within noise ({ratio:.2f} [{lo:.2f}-{hi:.2f}])"


def _progress(total: int, initial: int, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, initial=initial, desc=desc, file=sys.stderr, leave=False, disable=None, mininterval=0.5)


def _emit(line: str, bar: Any, stream: TextIO | None) -> None:
    if stream is None:
        return
    try:
        if bar is not None and not bar.disable:
            bar.write(line, file=stream)
        else:
            print(line, file=stream, flush=True)
    except BrokenPipeError:
        # The reader left (``colltune bench | head -3``): the benchmark goes on and still writes its report.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def _bench_rank(
    rank: int,
    world_size: int,
    tasks: Sequence[tuple[str, Any, tuple[str, ...]]],
    columns: Sequence[str],
    plan: Plan,
    show: bool,
    progress: tuple[int, int] | None,
    journal: str | None,
    profile: str | None = None,
) -> list[dict[str, Any]] | None:
    """The rank function: run the tasks (``("exact" | "topk", config, contenders)``) of one world size.

    With ``profile``, ``auto`` calls use it (:func:`colltune.configure`); otherwise
    the selector's default (the environment, or the profile shipped for the backend).

    Rank 0 prints one line per task and appends each record to ``journal``
    (JSON lines) as it finishes, so that the parent keeps what was done if a
    later task fails; a rank whose contender raises notes the task and the
    contender in ``journal + ".fail<rank>"`` first. Rank 0 returns the records.
    """
    stream = sys.stdout if (show and rank == 0) else None
    if profile is not None:
        colltune.configure(profile=profile)
    bar = None
    if rank == 0 and progress is not None:
        bar = _progress(progress[1], progress[0], f"bench P={world_size}")
    records: list[dict[str, Any]] = []
    try:
        for i, (kind, cfg, contenders) in enumerate(tasks):
            guard = _Guard(None if journal is None else f"{journal}.fail{rank}", i)
            if kind == "exact":
                rec = _bench_one(rank, world_size, cfg, contenders, plan, guard)
                line = format_row(rec, columns)
            else:
                rec = _topk_one(rank, world_size, cfg, contenders, guard)
                line = format_topk(rec)
            rec["section"] = kind
            records.append(rec)
            if rank == 0 and journal is not None:
                with open(journal, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            _emit(line, bar, stream)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return records if rank == 0 else None


# --------------------------------------------------------------------------- top-k section


def _topk_one(
    rank: int, world_size: int, cfg: TopkConfig, contenders: Sequence[str] | None = None, guard: _Guard | None = None
) -> dict[str, Any]:
    n, p = cfg.n, world_size
    names = list(topk_contenders() if contenders is None else contenders)
    states = {name: colltune.TopkState(density=cfg.density) for name in names}
    k = colltune.TopkState(density=cfg.density).k_for(n)
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + 1 + rank)
    guard = guard or _Guard(None, 0)
    calls = {name: guard.wrap(name, colltune.topk_allreduce) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    words: dict[str, list[float]] = {name: [] for name in names}
    meta: dict[str, list[float]] = {name: [] for name in names}
    counts: dict[str, list[float]] = {name: [] for name in names}
    device = group_device()
    for step in range(cfg.steps):
        grad = torch.randn(n, generator=gen).to(device)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            sync_device(device)
            dist.barrier()
            t0 = time.perf_counter()
            res = calls[name](grad, states[name], op="avg", algorithm=name)
            sync_device(device)
            times[name].append(time.perf_counter() - t0)
            tr = res.traffic
            words[name].append((tr.bytes_sent - tr.meta_bytes) / 4)
            meta[name].append(tr.meta_bytes / 4)
            counts[name].append(res.global_count)
    flat_t = reduce_max([t for name in names for t in times[name]])
    flat_w = reduce_max([x for name in names for x in words[name]])
    flat_m = reduce_max([x for name in names for x in meta[name]])
    s, bound = cfg.steps, 6 * k * (p - 1) / p
    out: dict[str, Any] = {"n": n, "density": cfg.density, "world_size": p, "k": k, "steps": s, "bound_words": bound,
                           "lower_bound_words": 2 * k * (p - 1) / p, "contenders": {}}
    for j, name in enumerate(names):
        w = flat_w[j * s : (j + 1) * s]
        m = flat_m[j * s : (j + 1) * s]
        entry = _stats(flat_t[j * s : (j + 1) * s])
        entry.update(
            {
                "words_per_rank_median": statistics.median(w),
                "words_per_rank_max": max(w),
                "meta_words_per_rank_median": statistics.median(m),
                "meta_words_per_rank_max": max(m),
                "words_over_bound_median": statistics.median(w) / bound if bound else 0.0,
                "words_over_bound_max": max(w) / bound if bound else 0.0,
                "global_count_median": statistics.median(counts[name]),
            }
        )
        out["contenders"][name] = entry
    return out


# --------------------------------------------------------------------------- driver


def _environment() -> dict[str, Any]:
    return {
        "colltune": colltune.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "algorithms": list(colltune.algorithms.names()),
    }


def run(
    configs: Sequence[BenchConfig],
    *,
    topk_configs: Sequence[TopkConfig] = (),
    contenders: Sequence[str] | None = None,
    plan: Plan = Plan(),
    show: bool = True,
    progress: bool = True,
    timeout: float = 3600.0,
    on_partial: Callable[[dict[str, Any]], None] | None = None,
    profile: str | None = None,
    backend: str = "gloo",
) -> dict[str, Any]:
    """Run the benchmark; return the report (its format: :mod:`colltune.cli.bench`).

    Configurations are grouped by world size; each group runs in one launch
    of local ranks (:func:`colltune.offline.launch.run_local`), or, under ``torchrun``,
    in the ranks already started (only the configurations of that world size).

    Args:
        configs: points of the exact grid.
        topk_configs: points of the top-k section.
        contenders: which of :func:`all_contenders` to run (default all).
        plan: warm-up and repeats.
        show: print one table line per configuration as it finishes (rank 0).
        progress: show a progress bar per world size on stderr (rank 0, when it is a terminal).
        timeout: the deadline of each launch, in seconds.
        on_partial: called with the report so far after each world size.
        profile: the profile ``auto`` uses (default: the selector's default).
        backend: the process group's backend: ``gloo`` (CPU tensors) or
            ``nccl`` (each rank's inputs on its GPU; one GPU per rank).

    Raises:
        ColltuneValueError: an unknown contender, ``torch`` on NCCL (which
            has no sparse ``all_reduce``), or (under ``torchrun``) no
            configuration for the running world size.
        colltune.offline.launch.RankError: a rank failed.
    """
    contenders = _checked_contenders(contenders)
    if backend == "nccl" and "torch" in contenders:
        raise ColltuneValueError("the contender 'torch' (PyTorch's sparse all_reduce) runs on gloo only: NCCL has "
                                 "no sparse all_reduce; leave it out of the contenders on NCCL.")
    report = _new_report(plan, contenders)
    sizes = _world_sizes(configs, topk_configs)
    tasks_all: list[tuple[str, Any, tuple[str, ...]]] = [("exact", c, contenders) for c in configs]
    tasks_all += [("topk", c, topk_contenders()) for c in topk_configs]
    started = time.perf_counter()
    for p in sizes:
        tasks = [t for t in tasks_all if t[1].world_size == p]
        if not tasks:
            continue
        prog = (0, len(tasks)) if progress else None  # one bar per world size, counting its own tasks
        if launch.in_torchrun():
            records = launch.run_here(_bench_rank, tasks, contenders, plan, show, prog, None, profile, backend=backend)
            if records is None:  # not rank 0: only rank 0 reports
                return report
            _publish(report, records, started, on_partial)
        else:
            _run_tolerant(tasks, p, contenders, plan, show, prog, timeout,
                          lambda recs: _publish(report, recs, started, on_partial), profile, backend)
    if "auto" in contenders:
        report["profile"] = profile
        report["auto_summary"] = auto_summary(report)
    report["agreement"] = agreement(report)
    return report


def _checked_contenders(contenders: Sequence[str] | None) -> tuple[str, ...]:
    """Return the contenders to run (default all); raise on an unknown one or none."""
    contenders = tuple(all_contenders() if contenders is None else contenders)
    unknown = [c for c in contenders if c not in all_contenders()]
    if unknown or not contenders:
        raise ColltuneValueError(
            f"contenders must be a non-empty subset of {', '.join(all_contenders())}, but got {list(contenders)!r}."
        )
    return contenders


def _new_report(plan: Plan, contenders: tuple[str, ...]) -> dict[str, Any]:
    """Return an empty report: its format, the environment, the plan and the contenders."""
    return {
        "format": "colltune-bench/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": _environment(),
        "plan": asdict(plan),
        "contenders": list(contenders),
        "configs": [],
        "topk": [],
    }


def _world_sizes(configs: Sequence[BenchConfig], topk_configs: Sequence[TopkConfig]) -> list[int]:
    """Return the world sizes to launch: the configurations', or under ``torchrun`` the running one."""
    sizes = sorted({c.world_size for c in configs} | {c.world_size for c in topk_configs})
    if launch.in_torchrun():
        _, here = launch.torchrun_rank()
        if sizes and here not in sizes:
            raise ColltuneValueError(
                f"under torchrun the world size is {here}, but the configurations ask for {sizes}; "
                f"pass --world-size {here} or start torchrun with --nproc-per-node matching."
            )
        sizes = [here]
    return sizes


def _publish(
    report: dict[str, Any],
    records: list[dict[str, Any]],
    started: float,
    on_partial: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Move finished records into the report and hand it to ``on_partial``."""
    for rec in records:
        (report["configs"] if rec.pop("section") == "exact" else report["topk"]).append(rec)
    report["elapsed_s"] = time.perf_counter() - started
    if on_partial is not None and records:
        on_partial(report)


#: Launches of one world size after contender failures, at most.
_MAX_RELAUNCHES = 20


def _run_tolerant(
    tasks: list[tuple[str, Any, tuple[str, ...]]],
    p: int,
    columns: Sequence[str],
    plan: Plan,
    show: bool,
    progress: tuple[int, int] | None,
    timeout: float,
    keep: Callable[[list[dict[str, Any]]], None],
    profile: str | None = None,
    backend: str = "gloo",
) -> list[dict[str, Any]]:
    """Run the tasks of world size ``p`` on local ranks; a contender that raises is dropped from its task.

    A collective that raised on one rank leaves the others stuck, so the
    launch is lost: the tasks finished before it are kept (handed to ``keep``
    at once, so they survive a later hard failure), the failing contender is
    recorded with its error in that task's record, and the remaining tasks
    run in a fresh launch. Failures that name no contender (a crash, the
    deadline) are re-raised.
    """
    state = _Relaunches(tasks, keep, pending=list(range(len(tasks))))
    with tempfile.TemporaryDirectory(prefix="colltune-bench-") as tmp:
        while state.pending:
            state.launches += 1
            journal = os.path.join(tmp, f"journal{state.launches}.jsonl")
            prog = None if progress is None else (progress[0] + len(tasks) - len(state.pending), progress[1])
            failure: launch.RankError | None = None
            try:
                launch.run_local(_bench_rank, p, state.next_tasks(), columns, plan, show, prog, journal, profile,
                                 backend=backend, timeout=timeout)
            except launch.RankError as exc:
                failure = exc
            finished = state.collect(journal)
            if failure is None:
                break
            note = _read_failure(journal, failure.rank)
            if note is None or note["task"] != finished or state.launches >= _MAX_RELAUNCHES:
                raise failure
            state.drop(note, p)
    return state.records


@dataclass
class _Relaunches:
    """The tasks of one world size over successive launches, and the contenders that raised in each task."""

    tasks: list[tuple[str, Any, tuple[str, ...]]]
    keep: Callable[[list[dict[str, Any]]], None]
    pending: list[int]
    records: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[int, dict[str, str]] = field(default_factory=dict)
    launches: int = 0

    def next_tasks(self) -> list[tuple[str, Any, tuple[str, ...]]]:
        """Return the pending tasks, each without the contenders that raised in it."""
        out = []
        for i in self.pending:
            kind, cfg, contenders = self.tasks[i]
            out.append((kind, cfg, tuple(c for c in contenders if c not in self.errors.get(i, {}))))
        return out

    def collect(self, journal: str) -> int:
        """Keep the records a launch finished, with the errors of their dropped contenders; return how many."""
        finished = _read_journal(journal)
        for j, rec in enumerate(finished):
            for name, msg in self.errors.get(self.pending[j], {}).items():
                rec["contenders"][name] = {"error": msg}
        self.records.extend(finished)
        self.keep(finished)
        return len(finished)

    def drop(self, note: Mapping[str, Any], p: int) -> None:
        """Record the contender a failure note names and go on from its task (past it when nothing of it is left)."""
        i = self.pending[note["task"]]
        self.errors.setdefault(i, {})[note["contender"]] = note["error"]
        kind, cfg, _ = self.tasks[i]
        print(
            f"bench: {note['contender']} raised on {kind} config {cfg}: {note['error']}; "
            "recorded, and the benchmark goes on without it for this config",
            file=sys.stderr,
            flush=True,
        )
        self.pending = self.pending[note["task"] :]
        left = tuple(c for c in self.tasks[i][2] if c not in self.errors[i])
        if not left:
            # Nothing of this task can run: record it with its errors only.
            errors = {n: {"error": m} for n, m in self.errors[i].items()}
            stub = {"section": kind, **_stub(kind, cfg, p), "contenders": errors}
            self.records.append(dict(stub))
            self.keep([stub])
            self.pending = self.pending[1:]


def _stub(kind: str, cfg: Any, p: int) -> dict[str, Any]:
    if kind == "exact":
        w = cfg.workload()
        return {
            "n": cfg.n, "density": cfg.density, "world_size": p, "overlap_requested": cfg.overlap,
            "overlap": w.overlap, "k": w.k, "union": w.union, "row_shape": list(w.row_shape),
            "dtype": cfg.dtype, "seed": cfg.seed, "repeats": 0, "reference": None,
        }
    k = colltune.TopkState(density=cfg.density).k_for(cfg.n)
    return {"n": cfg.n, "density": cfg.density, "world_size": p, "k": k, "steps": cfg.steps,
            "bound_words": 6 * k * (p - 1) / p, "lower_bound_words": 2 * k * (p - 1) / p}


def _read_journal(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _read_failure(journal: str, first_rank: int | None) -> dict[str, Any] | None:
    """Return the note of the rank with the first real error (``None`` when it left none).

    Only that rank's note counts: the other ranks' notes may blame the
    contender they were waiting in when the first rank's error cut them off.
    """
    if first_rank is None:
        return None
    try:
        with open(f"{journal}.fail{first_rank}") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- formatting


def _n_name(n: int) -> str:
    e = n.bit_length() - 1
    return f"2^{e}" if n == 1 << e else str(n)


def config_name(c: dict[str, Any]) -> str:
    return f"n={_n_name(c['n'])} density={c['density']:g} P={c['world_size']} overlap={c['overlap']:.2f}"


def _kib(b: float) -> str:
    return f"{b / 1024:.0f}" if b >= 10 * 1024 else f"{b / 1024:.1f}"


def format_header(contenders: Sequence[str] | None = None) -> str:
    """Return the header of the exact table (two lines)."""
    contenders = all_contenders() if contenders is None else contenders
    cols = "".join(f"{name + ' ms':>18}" for name in contenders)
    ours = [c for c in contenders if c != "torch"]
    speed = f"  {'x vs torch (' + '/'.join(_short(c) for c in ours) + ')':<22}" if "torch" in contenders else ""
    kib = "  KiB/rank (" + "/".join(_short(c) for c in contenders) + ")"
    head = f"{'n':>5} {'density':>7} {'P':>2} {'overlap':>7} {'reps':>4}" + cols + speed + kib
    return head + "\n" + "-" * len(head)


def _short(name: str) -> str:
    return {"dense": "dense", "allgather": "ag", "oktopk": "ok", "torch": "torch*", "auto": "auto"}.get(name, name)


def format_row(rec: dict[str, Any], contenders: Sequence[str] | None = None) -> str:
    """Return one table line: medians with IQR, speedups vs torch, bytes per rank."""
    contenders = all_contenders() if contenders is None else contenders
    cs = rec["contenders"]
    cells = ""
    for name in contenders:
        c = cs.get(name)
        if c is None or "median_ms" not in c:
            cells += f"{'failed' if c else '-':>18}"
            continue
        flag = "!" if c.get("agrees") is False else ""
        cells += f"{c['median_ms']:>10.2f} ±{c['iqr_ms']:<5.2f}{flag:1}"
    speed = ""
    if "torch" in contenders:
        s = rec.get("speedup_vs_torch", {})
        speed = "  " + f"{'/'.join(f'{s[c]:.2f}' if c in s else '-' for c in contenders if c != 'torch'):<22}"
    kib = "  " + "/".join(
        _kib(cs[c]["bytes_per_rank"]) if "bytes_per_rank" in cs.get(c, {}) else "-" for c in contenders
    )
    return (
        f"{_n_name(rec['n']):>5} {rec['density']:>7g} {rec['world_size']:>2} {rec['overlap']:>7.2f} "
        f"{rec['repeats']:>4}" + cells + speed + kib
    )


def format_topk(rec: dict[str, Any]) -> str:
    """Return one line of the top-k section."""
    parts = [
        f"top-k n={_n_name(rec['n'])} density={rec['density']:g} P={rec['world_size']} k={rec['k']} "
        f"steps={rec['steps']} bound 6k(P-1)/P={rec['bound_words']:.0f} words:"
    ]
    for name, c in rec["contenders"].items():
        if "median_ms" not in c:
            parts.append(f"  {name}: failed: {c.get('error', '?')}")
            continue
        parts.append(
            f"  {name}: {c['median_ms']:.2f} ±{c['iqr_ms']:.2f} ms, words/rank median {c['words_per_rank_median']:.0f} "
            f"max {c['words_per_rank_max']:.0f} ({c['words_over_bound_max']:.2f} of bound), "
            f"meta words max {c['meta_words_per_rank_max']:.0f}"
        )
    return "\n".join(parts)


def agreement(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Count, per dtype, the results that agree with the exact reference within :func:`tolerance`.

    Returns:
        ``{dtype: {"eps", "results", "agree", "worst", "disagree"}}``: the
        dtype's machine epsilon, the results checked, those within tolerance,
        the largest error as a fraction of its tolerance, and one
        ``{"config", "contender", "error", "tolerance"}`` per disagreeing result.
    """
    out: dict[str, dict[str, Any]] = {}
    for c in report.get("configs", []):
        tol = c.get("tolerance")
        for name, e in c["contenders"].items():
            if tol is None or "max_rel_err" not in e:
                continue  # failed, or a report from before the exact reference
            d = out.setdefault(c["dtype"], {"eps": torch.finfo(_DTYPES[c["dtype"]]).eps, "results": 0, "agree": 0,
                                            "worst": 0.0, "disagree": []})
            d["results"] += 1
            d["worst"] = max(d["worst"], e["max_rel_err"] / tol)
            if e["max_rel_err"] <= tol:
                d["agree"] += 1
            else:
                d["disagree"].append({"config": config_name(c), "contender": name, "error": e["max_rel_err"],
                                      "tolerance": tol})
    return out


def format_agreement(report: dict[str, Any]) -> str:
    """Return the agreement of the results with the exact reference: one line per dtype, one per disagreement."""
    lines = ["results against the exact reference (the float64 sum of every rank's input), within P x eps "
             "of their dtype relative to the sum of magnitudes:"]
    for dtype, a in (report.get("agreement") or agreement(report)).items():
        worst = f"largest error {a['worst']:.2g} of the tolerance" if math.isfinite(a["worst"]) else "indices differ"
        lines.append(f"  {dtype} (eps {a['eps']:.1e}): {a['agree']} of {a['results']} agree; {worst}")
        for d in a["disagree"]:
            lines.append(f"    disagrees (marked !): {d['config']}: {d['contender']}: error {d['error']:.2e} "
                         f"> tolerance {d['tolerance']:.2e}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- auto against the oracle


def _geomean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def auto_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Summarize ``auto`` over the configurations: regret against the oracle and speedups (geometric means).

    Returns:
        ``{"configs", "regret_geomean", "regret_max", "optimal_fraction",
        "choice_regret_geomean", "speedup_geomean": {contender: x}, "chosen": {algorithm: count},
        "verdicts": {verdict: count}, "regret_lo_geomean", "regret_hi_geomean", "slower_max"}``;
        regrets and speedups are ratios of measured medians; the verdicts
        are :func:`paired_ratio`'s, the interval geomeans those of the
        per-configuration intervals' ends, and ``slower_max`` the largest regret
        of a configuration where auto was slower beyond noise (``None`` if
        none was).
    """
    rows = [c["auto"] for c in report.get("configs", []) if "auto" in c]
    if not rows:
        return {"configs": 0}
    names = sorted({a for r in rows for a in r["speedup"]}, key=lambda a: (*fixed_algorithms(), "torch").index(a))
    chosen: dict[str, int] = {}
    verdicts: dict[str, int] = {}
    for r in rows:
        chosen[r["algorithm"]] = chosen.get(r["algorithm"], 0) + 1
        verdicts[r.get("verdict", "few rounds")] = verdicts.get(r.get("verdict", "few rounds"), 0) + 1
    optimal = [c["auto"]["algorithm"] == c["oracle"]["algorithm"] for c in report["configs"] if "auto" in c]
    slower = [r["regret"] for r in rows if r.get("verdict") == "slower"]
    return {
        "configs": len(rows),
        "regret_geomean": _geomean([r["regret"] for r in rows]),
        "regret_max": max(r["regret"] for r in rows),
        "choice_regret_geomean": _geomean([r["choice_regret"] for r in rows if r["choice_regret"] is not None]),
        "optimal_fraction": sum(optimal) / len(optimal),
        "speedup_geomean": {a: _geomean([r["speedup"].get(a) for r in rows]) for a in names},
        "chosen": chosen,
        "verdicts": verdicts,
        "regret_lo_geomean": _geomean([r.get("regret_lo") for r in rows]),
        "regret_hi_geomean": _geomean([r.get("regret_hi") for r in rows]),
        "slower_max": max(slower, default=None),
    }


def _regret_cell(a: dict[str, Any]) -> str:
    """Auto's time over the oracle's in a table cell (reports written before the intervals: the ratio alone)."""
    ratio = a.get("regret_paired") or a["regret"]
    if "verdict" not in a:
        return f"{ratio:.2f}"
    return describe_regret(ratio, a.get("regret_lo"), a.get("regret_hi"), a["verdict"])


def format_auto(report: dict[str, Any]) -> str:
    """Return the decision table: per configuration, what auto ran, the oracle, auto against it and speedups."""
    rows = [c for c in report.get("configs", []) if "auto" in c]
    if not rows:
        return "auto: no configuration timed auto"
    others = [a for a in (*fixed_algorithms(), "torch") if any(a in c["auto"]["speedup"] for c in rows)]
    cells = [_regret_cell(c["auto"]) for c in rows]
    width = max(len("auto / oracle"), *map(len, cells))
    head = (f"{'n':>5} {'density':>7} {'P':>2} {'overlap':>7}  {'auto ran':<10} {'oracle':<10} "
            f"{'auto / oracle':<{width}}  " + " ".join(f"{'x vs ' + _short(a):>11}" for a in others))
    lines = [f"decision table: auto (profile {report.get('profile') or 'default'}) against the oracle "
             "(fastest fixed algorithm, measured) on the same inputs", head, "-" * len(head)]
    for c, cell in zip(rows, cells):
        a = c["auto"]
        mark = " " if a["algorithm"] == c["oracle"]["algorithm"] else "*"
        lines.append(
            f"{_n_name(c['n']):>5} {c['density']:>7g} {c['world_size']:>2} {c['overlap']:>7.2f}  "
            f"{a['algorithm']:<9}{mark} {c['oracle']['algorithm']:<10} {cell:<{width}}  "
            + " ".join(f"{a['speedup'][o]:>11.2f}" if o in a["speedup"] else f"{'-':>11}" for o in others)
        )
    s = report.get("auto_summary") or auto_summary(report)
    sp = ", ".join(f"{v:.2f}x vs {k}" for k, v in s["speedup_geomean"].items() if v is not None)
    lines += ["-" * len(head), _summary_line(s) + "; speedup geomean " + sp,
              "auto / oracle: auto's time over the oracle's in the same round, median over the rounds [its "
              "95% confidence interval; min-max under 6 rounds]; within noise: the interval holds 1"]
    return "\n".join(lines)


def _summary_line(s: dict[str, Any]) -> str:
    """The decision table's summary: how often auto was slower, within noise or faster, and the geomean."""
    head = f"auto over {s['configs']} configurations: "
    if "verdicts" not in s:  # a report written before the intervals
        return (head + f"regret (auto time / oracle time) geomean {s['regret_geomean']:.2f}, max "
                f"{s['regret_max']:.2f}; picked the oracle's algorithm in {100 * s['optimal_fraction']:.0f}%")
    v = s["verdicts"]
    counts = ", ".join(f"{k} in {v[k]}" for k in ("slower", "within noise", "faster", "few rounds") if v.get(k))
    geo = s["regret_geomean"]
    lo, hi = s.get("regret_lo_geomean"), s.get("regret_hi_geomean")
    verdict = "few rounds" if lo is None or hi is None else _verdict(lo, hi)
    worst = (f"; worst regret {s['slower_max']:.2f}" if s.get("slower_max") is not None
             else "; never slower than the oracle beyond noise")
    return (head + counts + "; geomean " + describe_regret(geo, lo, hi, verdict) + worst
            + f"; picked the oracle's algorithm in {100 * s['optimal_fraction']:.0f}% (* marks the others)")
