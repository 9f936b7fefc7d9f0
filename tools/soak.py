"""Soak the front door: thousands of mixed calls on local gloo ranks, checked, and each rank's memory over time.

Every rank makes the same sequence of ``--calls`` calls, drawn from one
seeded generator that all ranks share (what to call), on inputs drawn from
a generator of its own (what each rank contributes):

- ``sparse_allreduce`` (about 70 %): every registered algorithm or
  ``auto``; 1,000 to 524,288 rows of shape ``[]``, ``[4]``, ``[3, 5]``,
  ``[7]``, ``[16]`` or ``[128]``; float32, float64, float16 or bfloat16 values; int32 or int64
  indices, unsorted and with duplicates; 0 to 4,096 entries per rank, spread
  over the rows or crowded into a hot range (overlapping ranks); ``sum`` or
  ``avg``; the entries as indices and values, as an uncoalesced sparse COO
  tensor, with strided values, or with values donated to the call;
- ``sparse_allreduce_many`` (about 15 %): one of four fixed lists of
  3 to 5 tables (the embedding tables of a model, named, so their buckets
  reach a steady state), each table's entries drawn as above;
- ``topk_allreduce`` (about 15 %): six gradient tensors, each with a
  :class:`colltune.TopkState` per algorithm and group kept for the whole
  run (half of them with short refresh periods).

On 3 ranks or more, a fifth of the calls run on a subgroup of every rank
but the last (which skips them). A call with an explicit algorithm sets
some of its knobs now and then (:data:`KNOBS`: other gather modes,
boundaries refreshed every call, regions sent dense early). About a third
of the calls are asynchronous, with up to four handles left in flight
after each call. Every result (indices, values and
the algorithm that ran) is hashed on its rank; every ``--every`` calls the
ranks gather the hashes with ``dist.all_gather_object``, so every call's
result is compared bit for bit across ranks, and each rank samples its
resident memory (``/proc/self/statm``). Rank 0 also draws every other
rank's inputs (each rank's generator is seeded from the seed and the rank)
and checks each sparse and fused result against a float64 reference: the
indices must be the union, each value within the bound the random-calls
suite holds (``TOL`` times the summed magnitudes). Top-k results are
checked over the whole run instead (:class:`Conservation`): per state, every
rank's gradients fed in must equal what the calls delivered plus the
residuals the ranks still hold. ``--device-path`` sends
the CPU tensors down the code path CUDA tensors take (one host read per
call, padded coalesces, the payloads of the fused record), which is what
GPU users run.

The report gives each rank's RSS at every sample, then per rank the median
RSS just after warm-up (the first quarter of the samples after the first
``--warmup`` calls), the median over the last quarter of the samples, and
the growth between the two; how many calls differed across ranks, and how
many results the reference found wrong (each named: call, what, why), and
which top-k states broke their error feedback. The exit status is 1 if any
call differed or was wrong, or any state broke. ``--trace-memory FROM TO``
also traces Python's allocations on rank 1 (``tracemalloc``, slower) and
prints the source lines whose allocations grew most between the two calls.

Usage::

    python tools/soak.py                                        # P = 4, 3,000 calls
    python tools/soak.py --ranks 2 --calls 300 --every 25       # a quick look
    python tools/soak.py --ranks 3 --calls 3000 --device-path   # the GPU code path, on CPU tensors
    python tools/soak.py --ranks 4 --calls 6000 --seed 3 --json soak.json
    python tools/soak.py --ranks 3 --calls 12000 --every 500 --trace-memory 4000 12000   # what grows
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
import tracemalloc
import warnings
from collections import Counter, deque
from typing import Any, Callable, Mapping

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
#: Row shapes: scalars, narrow rows (packed with their index), an odd width (whose 16-bit rows leave a
#: packed entry unaligned), 2-D rows, and embedding-wide rows (sent as separate index and row messages).
ROW_SHAPES: tuple[tuple[int, ...], ...] = ((), (4,), (3, 5), (7,), (16,), (128,))
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: Largest rows x row elements of a sparse call (the dense algorithm allocates that much).
MAX_ELEMENTS = 2**19
#: Largest entries a rank contributes to one sparse call.
MAX_K = 4096
#: Tables of the fused calls: four fixed lists of (rows, row shape, dtype), as a model's embedding tables;
#: tables of one size share an index space, and with it Ok-Topk's boundaries.
FUSED_LISTS: tuple[tuple[tuple[int, tuple[int, ...], torch.dtype], ...], ...] = (
    ((1000, (16,), torch.float32), (2**14, (16,), torch.float32), (2**15, (16,), torch.float32)),
    ((1000, (), torch.float32), (5000, (4,), torch.float16), (2**14, (4,), torch.float32), (2**17, (), torch.float64)),
    ((777, (8,), torch.bfloat16), (1000, (8,), torch.bfloat16), (1000, (8,), torch.bfloat16),
     (2**15, (8,), torch.float32), (30_000, (3, 5), torch.float32)),
    ((2000, (128,), torch.float32), (2000, (128,), torch.float32), (500, (128,), torch.bfloat16),
     (3000, (7,), torch.float16)),
)
#: Top-k tensors: shape, dtype, density and refresh periods (local, global and boundary; the defaults, 32, 32
#: and 64, or short ones, so that a state's few calls in a run both reuse and refresh), each with one state
#: per algorithm and group.
TOPK_TENSORS: tuple[tuple[tuple[int, ...], torch.dtype, float, tuple[int, int, int]], ...] = (
    ((256,), torch.float32, 0.05, (32, 32, 64)),
    ((64, 64), torch.float32, 0.01, (3, 2, 4)),
    ((1000, 8), torch.float32, 0.005, (32, 32, 64)),
    ((128, 33), torch.float64, 0.02, (2, 3, 5)),
    ((4096,), torch.bfloat16, 0.01, (4, 4, 1)),
    ((300, 20), torch.float16, 0.02, (32, 32, 64)),
)
#: Most asynchronous handles left in flight after a call (one more while the oldest is waited on).
MAX_IN_FLIGHT = 4
#: How a single call hands its entries over: indices and values; an uncoalesced sparse COO tensor; values
#: that are a strided view (every other element of a wider tensor); values donated to the call (``donate``).
FORMS = ("tuple", "coo", "strided", "donate")
#: Knob values a call with an explicit algorithm draws from (each knob half the time): other gather modes,
#: boundaries refreshed every call, regions sent dense early, one peer in flight. Dense's ``wire`` is left
#: alone: 16 bits on the wire round once per addition, past the reference's bound.
KNOBS: dict[str, dict[str, tuple[Any, ...]]] = {
    "allgather": {"mode": ("auto", "p2p", "pad", "alltoall")},
    "oktopk": {"boundary_refresh": (1, 4, 64), "peers_in_flight": (1, 2, 8), "dense_fallback_ratio": (0.05, 1.0),
               "gather_mode": ("auto", "pad", "alltoall")},
    "hashpart": {"gather_mode": ("auto", "pad", "alltoall")},
}
#: A value's largest error against the float64 reference, relative to its summed magnitudes (the bound
#: ``tests/distributed/test_random_calls.py`` holds): fp32 sums round once per addition, and a hot row here
#: sums up to P x 4096 entries; 16-bit values are summed in fp32 and rounded twice by the sparse algorithms
#: (each rank's sums, then the total), once by dense: two unit roundoffs, 2^-11 for fp16 and 2^-8 for bf16.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2 * 2.0**-11 + 1e-6, torch.bfloat16: 2 * 2.0**-8 + 1e-5}
#: ... plus, for a subnormal fp16 result (an avg), two roundings of half its fixed spacing.
TINY = {torch.float16: 2.0**-24}

#: Unit roundoff of the dtype a top-k residual accumulates in (fp32 for 16-bit and fp32 tensors).
ACC_UNIT = {torch.float64: 2.0**-53}

#: One table of a call: rows, row shape, value dtype, index dtype.
Table = tuple[int, tuple[int, ...], torch.dtype, torch.dtype]
#: What rank 0 checks a tensor's result against: the union, its float64 sums, its summed magnitudes, the dtype.
Reference = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]


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
        "k_max": min(MAX_K, plan.choice((1, 16, 256, 4096))),
        "hot": plan.random() < 0.5,
        "keep": plan.randint(1, MAX_IN_FLIGHT),  # handles left in flight after this call, when it is async
        # On 3 ranks or more, a fifth of the calls go to a group of all ranks but the last: the others skip them.
        "group": "sub" if plan.random() < 0.2 else "world",
    }
    spec["knobs"] = {k: plan.choice(v) for k, v in KNOBS.get(spec["algorithm"], {}).items() if plan.random() < 0.5}
    kind = plan.random()
    if kind < 0.7:
        n = plan.choice(SIZES)
        rows = [r for r in ROW_SHAPES if n * max(1, _numel(r)) <= MAX_ELEMENTS]
        table = (n, plan.choice(rows), plan.choice(DTYPES), plan.choice((torch.int32, torch.int64)))
        spec.update(kind="sparse", tables=[table], form=plan.choice(FORMS))
    elif kind < 0.85:
        j = plan.randrange(len(FUSED_LISTS))
        spec.update(kind="fused", name=f"tables{j}", tables=[(n, r, dt, torch.int64) for n, r, dt in FUSED_LISTS[j]])
    else:
        spec.update(kind="topk", tensor=plan.randrange(len(TOPK_TENSORS)))
    return spec


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def digest(algorithm: str, *tensors: torch.Tensor | None) -> bytes:
    """Hash a result: the algorithm that ran, then each tensor's dtype, shape and bytes."""
    h = hashlib.blake2b(algorithm.encode(), digest_size=8)
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def input_generators(seed: int, rank: int, world_size: int) -> dict[int, torch.Generator]:
    """The generators each rank draws its own inputs from, by rank: rank 0 gets every rank's (to build the
    references), any other rank its own."""
    return {q: torch.Generator().manual_seed(seed * 1_000_003 + q + 1)
            for q in (range(world_size) if rank == 0 else (rank,))}


def _traced_rank(world_size: int) -> int:
    """The rank ``--trace-memory`` traces: rank 1, which builds no references (rank 0 alone at P = 1)."""
    return min(1, world_size - 1)


def _hash_result(res: Any) -> bytes:
    """Hash a call's result: one ``SparseResult``, or a fused call's list of them."""
    if isinstance(res, list):
        return digest(res[0].algorithm if res else "", *(t for r in res for t in (r.indices, r.values)))
    return digest(res.algorithm, res.indices, res.values)


def _entries(table: Table, spec: dict[str, Any], data: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's entries of one table: unsorted indices with duplicates, over the rows or a hot range."""
    n, row_shape, dtype, index_dtype = table
    k = int(torch.randint(0, spec["k_max"] + 1, (1,), generator=data))
    span = min(n, 4 * spec["k_max"]) if spec["hot"] else n  # a hot range makes the ranks overlap
    idx = torch.randint(0, span, (k,), generator=data).to(index_dtype)
    return idx, torch.randn((k,) + row_shape, generator=data).to(dtype)


def reference(parts: list[tuple[torch.Tensor, torch.Tensor]], table: Table, op: str) -> Reference:
    """The union of every rank's ``parts`` of ``table``, its float64 sums and summed magnitudes (``avg``: / P)."""
    idx = torch.cat([i.long() for i, _ in parts])
    vals = torch.cat([v.double() for _, v in parts])
    union, inverse = torch.unique(idx, return_inverse=True)
    sums = torch.zeros((union.numel(), *table[1]), dtype=torch.float64).index_add_(0, inverse, vals)
    mags = torch.zeros_like(sums).index_add_(0, inverse, vals.abs())
    if op == "avg":
        sums, mags = sums / len(parts), mags / len(parts)
    return union, sums, mags, table[2]


def wrong(results: list[Any], refs: list[Reference]) -> str | None:
    """Say how the first result off its reference is wrong (``None``: all right; a NaN is never right)."""
    if len(results) != len(refs):
        return f"{len(results)} results for {len(refs)} tensors"
    for t, (res, (union, sums, mags, dtype)) in enumerate(zip(results, refs)):
        if not torch.equal(res.indices.long(), union):
            return f"tensor {t}: {res.indices.numel()} indices, not the union of {union.numel()}"
        if res.values.dtype != dtype or res.values.shape != sums.shape:
            return f"tensor {t}: values {res.values.dtype} {tuple(res.values.shape)}, not {dtype} {tuple(sums.shape)}"
        err = (res.values.double() - sums).abs()
        off = ~(err <= TOL[dtype] * mags + TINY.get(dtype, 0.0))
        if bool(off.any()):
            return f"tensor {t}: {int(off.sum())} values off the reference (largest error {float(err.max()):.3g})"
    return None


class Conservation:
    """Top-k's error feedback checked over the whole run, per state (tensor, algorithm, group), on rank 0.

    Each call delivers, from every member rank, its selected entries of
    ``residual + gradient`` and keeps the rest as its residual, so over any
    number of calls what the ranks fed in equals what was delivered plus what
    they still hold: ``sum of every rank's gradients == sum of (result x
    P for avg) + sum of the ranks' residuals``, per element. Rank 0 draws
    every member's gradients (as for the sparse calls' references) and sums
    them and its results in float64; the residuals (and their magnitudes)
    come in one ``all_reduce`` per check (:meth:`check`). A value delivered
    twice or lost, a residual not kept or kept twice, or a wrong sum breaks
    it, whichever algorithm ran, across switches of ``auto``, asynchronous
    and subgroup calls alike.

    Rounding moves the two sides apart a little, so each check bounds how far
    they moved since the last one, not since the start (a bound that grows
    with the run would miss a late loss): the magnitudes a window's calls can
    deliver are the residuals held at its start and the gradients fed in it;
    each call rounds them once in the residual's dtype (it adds the gradient
    to the residual), and each delivered value rounds once to the tensor's
    dtype after a sum over the ranks in the accumulation dtype, which the
    reference's ``TOL`` covers (every value is delivered at most once).

    Args:
        spec: a state's key -> its tensor's element count and dtype; by
            default the key's first item names one of :data:`TOPK_TENSORS`
            (a training wrapper's ledger keys its parameters by name).
    """

    def __init__(self, spec: Callable[[Any], tuple[int, torch.dtype]] | None = None) -> None:
        self.spec = spec or (lambda key: (_numel(TOPK_TENSORS[key[0]][0]), TOPK_TENSORS[key[0]][1]))
        #: Per state (keyed as ``spec`` takes it), float64 sums since the start: every member's gradients, and
        #: what the calls delivered.
        self.fed: dict[Any, torch.Tensor] = {}
        self.delivered: dict[Any, torch.Tensor] = {}
        #: Per state, since the last check: the gradients' magnitudes and the calls.
        self.fresh: dict[Any, torch.Tensor] = {}
        self.calls: Counter[Any] = Counter()
        #: Per state, the ranks that take part in its calls (its group's size).
        self.members: dict[Any, int] = {}
        #: Per state, at the last check: how far the sides were apart, and the residuals' summed magnitudes.
        self.last: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        #: States already found broken: each is said once.
        self.broken: set[Any] = set()
        #: The largest error of an unbroken check as a fraction of its bound: how much room rounding left.
        self.worst = 0.0

    def feed(self, key: Any, grads: list[torch.Tensor]) -> None:
        """Add every member's gradient of a call on state ``key``."""
        total = torch.zeros(grads[0].numel(), dtype=torch.float64)
        mags = torch.zeros_like(total)
        for g in grads:
            total += g.double().reshape(-1)
            mags += g.double().reshape(-1).abs()
        self.feed_sums(key, total, mags, len(grads))

    def feed_sums(self, key: Any, total: torch.Tensor, mags: torch.Tensor, members: int) -> None:
        """Add a call on state ``key`` by its members' gradients' float64 sum and summed magnitudes (flat)."""
        fed = self.fed.setdefault(key, torch.zeros(total.numel(), dtype=torch.float64))
        fresh = self.fresh.setdefault(key, torch.zeros(total.numel(), dtype=torch.float64))
        fed += total
        fresh += mags
        self.calls[key] += 1
        self.members[key] = members

    def deliver(self, key: Any, res: Any, op: str) -> None:
        """Add the result of a call on state ``key`` (fed first): times the members for ``avg``, what they
        delivered in all."""
        got = res.to_dense().double().reshape(-1) * (self.members[key] if op == "avg" else 1)
        self.delivered[key] = self.delivered.get(key, torch.zeros_like(got)) + got

    def check(self, keys: list[Any], states: Mapping[Any, Any], rank: int, reduce: Any = dist.all_reduce) -> list[str]:
        """Sum every rank's residuals of ``keys`` and their magnitudes (the same list on every rank; a state a
        rank lacks, or one with no residual, counts zero) in one float64 ``reduce`` (a sum over the ranks, in
        place); on rank 0 return what each state newly breaks (empty: nothing). ``states`` holds, per key, a
        :class:`~colltune.TopkState` or anything else with its ``residual``."""
        flat = []
        for key in keys:
            state = states.get(key)
            held = None if state is None else state.residual
            flat.append(torch.zeros(self.spec(key)[0], dtype=torch.float64) if held is None
                        else held.double().reshape(-1))
        if not flat:
            return []
        total = torch.cat(flat + [f.abs() for f in flat])
        reduce(total)
        if rank != 0:
            return []
        out, at, half = [], 0, total.numel() // 2
        for key, part in zip(keys, flat):
            numel = part.numel()
            held, mags, at = total[at : at + numel], total[half + at : half + at + numel], at + numel
            if not self.calls[key]:  # no call since the last check: nothing moved
                continue
            apart = self.fed[key] - self.delivered.get(key, 0.0) - held
            before, held_before = self.last.get(key, (torch.zeros_like(apart), torch.zeros_like(apart)))
            dtype, calls = self.spec(key)[1], self.calls[key]
            err = (apart - before).abs()
            bound = ((TOL[dtype] + calls * ACC_UNIT.get(dtype, 2.0**-24)) * (held_before + self.fresh[key])
                     + calls * self.members[key] * TINY.get(dtype, 0.0))
            off = ~(err <= bound)
            if not bool(off.any()):
                some = bound > 0
                self.worst = max(self.worst, float((err[some] / bound[some]).max()) if bool(some.any()) else 0.0)
            elif key not in self.broken:
                self.broken.add(key)
                out.append(f"top-k state {key!r}: {int(off.sum())} of {numel} elements fed in != delivered + held "
                           f"after {calls} more calls (largest error {float(err.max()):.3g})")
            self.last[key] = (apart, mags)
            self.fresh[key].zero_()
            self.calls[key] = 0
        return out


def _call(spec: dict[str, Any], data: dict[int, torch.Generator], rank: int, group: Any,
          states: dict[tuple[int, str, str], colltune.TopkState],
          ledger: Conservation) -> tuple[Any, list[Reference] | tuple[tuple[int, str, str], str] | None]:
    """Make the call ``spec`` describes on ``group`` (``None``: the default one) on this rank's own random
    inputs; given the generators of ``group``'s other ranks (rank 0), also return what its result is checked
    against: the references of a sparse or fused call; for a top-k call its state and op (for the
    ``ledger``, which is fed every member's gradient here)."""
    algorithm, async_op, op, knobs = spec["algorithm"], spec["async"], spec["op"], spec["knobs"]
    if spec["kind"] == "topk":
        shape, dtype, density, (local, global_, boundary) = TOPK_TENSORS[spec["tensor"]]
        key = (spec["tensor"], algorithm, spec["group"])
        state = states.get(key)
        if state is None:
            state = states[key] = colltune.TopkState(density=density, local_refresh=local, global_refresh=global_,
                                                     boundary_refresh=boundary)
        grads = {q: torch.randn(shape, generator=g).to(dtype) for q, g in data.items()}  # every generator moves on
        res = colltune.topk_allreduce(grads[rank], state, op=op, group=group, algorithm=algorithm,
                                      async_op=async_op, name=f"grad{spec['tensor']}")
        if rank != 0:
            return res, None
        ledger.feed(key, [grads[q] for q in sorted(grads)])
        return res, (key, op)
    tables = spec["tables"]
    entries = {q: [_entries(t, spec, g) for t in tables] for q, g in data.items()}
    refs = None
    if len(data) > 1:
        refs = [reference([entries[q][j] for q in sorted(data)], t, op) for j, t in enumerate(tables)]
    if spec["kind"] == "sparse":
        (idx, vals), = entries[rank]
        n, form = tables[0][0], spec["form"]
        if form == "coo":  # the entries as one tensor: what an nn.Embedding(sparse=True) gradient is
            coo = torch.sparse_coo_tensor(idx.long().view(1, -1), vals, (n, *vals.shape[1:]), check_invariants=True)
            return colltune.sparse_allreduce(coo, op=op, group=group, algorithm=algorithm, async_op=async_op,
                                             knobs=knobs), refs
        if form == "strided":
            vals = torch.empty((*vals.shape, 2), dtype=vals.dtype).select(-1, 0).copy_(vals)
        return colltune.sparse_allreduce(idx, vals, n, op=op, group=group, algorithm=algorithm, async_op=async_op,
                                         knobs=knobs, donate=form == "donate"), refs
    items = [(i, v, t[0]) for (i, v), t in zip(entries[rank], tables)]
    return colltune.sparse_allreduce_many(items, op=op, group=group, algorithm=algorithm, async_op=async_op,
                                          name=spec["name"], knobs=knobs), refs


def _rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from colltune.algorithms.sparse import device_path

    warnings.filterwarnings("ignore", category=FutureWarning)
    with device_path(cfg["device_path"]):
        return _calls(rank, world_size, cfg)


def _calls(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    plan = random.Random(cfg["seed"])
    # Rank 0 draws every rank's inputs, each from the generator that rank draws its own from, to check results.
    data = input_generators(cfg["seed"], rank, world_size)
    sub = dist.new_group(list(range(world_size - 1))) if world_size >= 3 else None
    states: dict[tuple[int, str, str], colltune.TopkState] = {}
    ledger = Conservation()
    topk_keys: dict[tuple[int, str, str], None] = {}  # every top-k state the plan named, in order: alike on all ranks
    in_flight: deque[tuple[int, Any, Any]] = deque()
    digests: dict[int, bytes] = {}
    kinds: Counter[str] = Counter()
    mismatches: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    broken: list[dict[str, Any]] = []  # top-k states whose error feedback broke, each said once (rank 0)
    specs: dict[int, str] = {}
    checked = 0
    samples = [{"calls": 0, "seconds": 0.0, "rss": _rss_bytes()}]
    start = time.perf_counter()

    def done(i: int, res: Any, refs: Any) -> None:
        nonlocal checked
        digests[i] = _hash_result(res)
        if isinstance(refs, tuple):  # a top-k call's (state, op): checked over many calls
            ledger.deliver(refs[0], res, refs[1])
        elif refs is not None:
            checked += 1
            why = wrong(res if isinstance(res, list) else [res], refs)
            if why is not None:
                errors.append({"call": i, "what": specs[i], "why": why})

    def finish_oldest() -> None:
        j, handle, refs = in_flight.popleft()
        done(j, handle.wait(), refs)

    def make(i: int, spec: dict[str, Any], on_sub: bool) -> None:
        kinds[f"{spec['kind']}/{spec['algorithm']}" + (" async" if spec["async"] else "")
              + (f" on ranks 0-{world_size - 2}" if on_sub else "")] += 1
        specs[i] = (f"{spec['kind']}/{spec['algorithm']} {spec['op']}" + (f" {spec['knobs']}" if spec["knobs"] else "")
                    + (f" {spec['form']} {spec['tables']}" if spec["kind"] == "sparse" else "")
                    + (" on the subgroup" if on_sub else ""))
        members = {q: g for q, g in data.items() if not (on_sub and q == world_size - 1)}
        out, refs = _call(spec, members, rank, sub if on_sub else None, states, ledger)
        if spec["async"]:
            in_flight.append((i, out, refs))
            if len(in_flight) > spec["keep"]:
                finish_oldest()
        else:
            done(i, out, refs)

    trace = cfg.get("trace_memory") if rank == _traced_rank(world_size) else None
    snapshots: list[Any] = []
    if trace:
        tracemalloc.start()
    for i in range(cfg["calls"]):
        if trace and i in trace:
            snapshots.append(tracemalloc.take_snapshot())
        spec = _draw(plan)
        on_sub = sub is not None and spec["group"] == "sub"
        if spec["kind"] == "topk":
            topk_keys[(spec["tensor"], spec["algorithm"], spec["group"])] = None
        if not (on_sub and rank == world_size - 1):  # a non-member skips it: only the members' generators move on
            make(i, spec, on_sub)
        if (i + 1) % cfg["every"] == 0 or i + 1 == cfg["calls"]:
            while in_flight:
                finish_oldest()
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, digests)
            for j in sorted(digests):
                if any(other.get(j, digests[j]) != digests[j] for other in gathered):  # among the ranks it ran on
                    mismatches.append({"call": j, "what": specs[j]})
            digests.clear()
            specs.clear()
            broken.extend({"call": i + 1, "why": why} for why in ledger.check(list(topk_keys), states, rank))
            samples.append({"calls": i + 1, "seconds": time.perf_counter() - start, "rss": _rss_bytes()})
    growth_lines = []
    if trace:
        if len(snapshots) == 1:  # TO is the last call
            snapshots.append(tracemalloc.take_snapshot())
        tracemalloc.stop()
        diff = snapshots[1].compare_to(snapshots[0], "lineno")
        growth_lines = [(f"{d.traceback[0].filename.replace(_ROOT + os.sep, '')}:{d.traceback[0].lineno}",
                         d.size_diff) for d in diff[:12]]
    return {"samples": samples, "mismatches": mismatches, "kinds": dict(kinds), "wrong": errors, "checked": checked,
            "topk_states": len(ledger.fed), "topk_broken": broken, "topk_worst": ledger.worst,
            "memory_lines": growth_lines}


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


def run(world_size: int, calls: int, every: int, seed: int, warmup: int | None = None,
        device_path: bool = False, trace_memory: tuple[int, int] | None = None) -> dict[str, Any]:
    """Run the soak on fresh local ranks and return the report (see the module docstring)."""
    warmup = calls // 5 if warmup is None else warmup
    cfg = {"calls": calls, "every": every, "seed": seed, "device_path": device_path, "trace_memory": trace_memory}
    start = time.perf_counter()
    per_rank = launch.run_local(_rank, world_size, cfg, backend="gloo", timeout=3600)
    wall = time.perf_counter() - start
    return {
        "world_size": world_size,
        "calls": calls,
        "every": every,
        "seed": seed,
        "device_path": device_path,
        "warmup_calls": warmup,
        "wall_s": wall,
        "kinds": per_rank[0]["kinds"],
        "trace_memory": trace_memory,
        "memory_lines": per_rank[_traced_rank(world_size)]["memory_lines"],
        "mismatches": per_rank[0]["mismatches"],
        "checked": per_rank[0]["checked"],
        "topk_states": per_rank[0]["topk_states"],
        "topk_broken": per_rank[0]["topk_broken"],
        "topk_worst": per_rank[0]["topk_worst"],
        "wrong": per_rank[0]["wrong"],
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
    path = "device" if report["device_path"] else "host"
    print(f"P={p}, {report['calls']} calls (seed {report['seed']}, the {path} path), {report['wall_s']:.0f} s; "
          "RSS in MiB")
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
    print(f"results checked against the float64 reference: {report['checked']} calls, {len(report['wrong'])} wrong")
    for w in report["wrong"][:10]:
        print(f"  call {w['call']} ({w['what']}): {w['why']}")
    print(f"top-k error feedback checked every {report['every']} calls: {report['topk_states']} states, "
          f"{len(report['topk_broken'])} broken (elsewhere the largest error was {report['topk_worst']:.2g} of its bound)")
    for b in report["topk_broken"][:10]:
        print(f"  by call {b['call']}: {b['why']}")
    if report["trace_memory"]:
        a, b = report["trace_memory"]
        print(f"Python allocations that grew most on rank {_traced_rank(p)} from call {a} to call {b} (tracemalloc):")
        for where, grew in report["memory_lines"]:
            print(f"  {grew / 1024:+9.1f} KiB  {where}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", "-P", type=int, default=4, help="local gloo ranks (default 4)")
    ap.add_argument("--calls", type=int, default=3000, help="calls per rank (default 3000)")
    ap.add_argument("--every", type=int, default=100,
                    help="compare results and sample RSS every this many calls (default 100)")
    ap.add_argument("--warmup", type=int, default=None, help="calls before the baseline (default a fifth of --calls)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the call sequence and inputs (default 0)")
    ap.add_argument("--device-path", action="store_true",
                    help="send the CPU tensors down the code path CUDA tensors take")
    ap.add_argument("--trace-memory", type=int, nargs=2, metavar=("FROM", "TO"),
                    help="on rank 1, trace Python's allocations and print the lines that grew most from call FROM "
                         "to call TO (slower)")
    ap.add_argument("--json", metavar="FILE", help="write the report here")
    args = ap.parse_args(argv)
    if args.trace_memory and not 0 <= args.trace_memory[0] < args.trace_memory[1] <= args.calls:
        ap.error("--trace-memory FROM TO needs 0 <= FROM < TO <= --calls")
    if args.ranks < 2 or args.calls < 1 or args.every < 1 or (args.warmup is not None and args.warmup < 0):
        ap.error("need --ranks >= 2, --calls >= 1, --every >= 1 and --warmup >= 0")
    report = run(args.ranks, args.calls, args.every, args.seed, args.warmup, args.device_path,
                 tuple(args.trace_memory) if args.trace_memory else None)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if report["mismatches"] or report["wrong"] or report["topk_broken"] else 0


if __name__ == "__main__":
    sys.exit(main())
