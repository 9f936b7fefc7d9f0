"""Schedules priced as the algorithms run: the cost model's bytes against the bytes the comm layer counts.

Each rank runs a sequence of calls of one algorithm on a fresh group and
returns what :class:`~colltune.algorithms.comm.Traffic` counted per call and
primitive; the parent prices the same calls with the algorithm's own
:meth:`~colltune.algorithms.base.Algorithm.schedule` (the features of the
calls, the mode, the knobs the calls ran with) and compares, averaged over
ranks and over the calls after a warm-up (refresh periods divide the number
of calls, so amortized terms are paid as often as they are priced).

Tolerances: the total within :data:`TOTAL_RTOL`, each primitive within
:data:`PRIMITIVE_RTOL` of the counted bytes or :data:`PRIMITIVE_SLACK` bytes
(terms of a few dozen bytes, such as an amortized boundary refresh, may be a
call off). What the schedules leave to chance (counts per region and per
owner, the balance's moves) comes from random data; the rest is exact.

One adjustment is not a pricing error: on gloo, from 3 ranks on, a small
``all_reduce`` runs direct and is counted as the ``(P - 1) L`` bytes it
sends, where the schedules price the ring's ``2 L (P - 1) / P`` (what NCCL
runs): :func:`counted_bytes` converts.

Ok-Topk top-k's counted entries are also checked against the paper's
Eq. 3 (``6 k (P-1) / P`` words); ``tests/unit/test_schedules.py`` checks
its priced entries over a grid of world sizes to 1024.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from colltune.algorithms import registry

from harness import pool

#: The priced total bytes per rank and call within this fraction of the counted mean.
TOTAL_RTOL = 0.10
#: Each primitive's priced bytes within this fraction of the counted mean, or within PRIMITIVE_SLACK bytes.
PRIMITIVE_RTOL = 0.15
PRIMITIVE_SLACK = 256
#: Comm-layer names of the schedules' primitives.
COMM_NAME = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_to_all": "all_to_all", "p2p": "send"}
#: The largest all_reduce, in bytes, that gloo runs direct (colltune.algorithms.comm.DIRECT_ALL_REDUCE_BYTES).
DIRECT_BYTES = 65536


def _traffic(res) -> dict[str, int]:
    return {name: int(v["bytes"]) for name, v in res.traffic.by_primitive.items()}


def _run_exact(rank, world_size, c):
    import colltune

    group = dist.new_group()  # a fresh slot and fresh boundaries
    g = torch.Generator().manual_seed(c["seed"] * 1000 + rank)
    out = []
    for _ in range(c["calls"]):
        idx = torch.randperm(c["n"], generator=g)[: c["k"]]
        vals = torch.randn((c["k"],) + tuple(c["row"]), generator=g)
        res = colltune.sparse_allreduce(idx, vals, c["n"], algorithm=c["algorithm"], group=group, knobs=c["knobs"])
        out.append({"traffic": _traffic(res), "union": int(res.indices.numel())})
    return out


def _run_topk(rank, world_size, c):
    import colltune

    group = dist.new_group()
    state = colltune.TopkState(k=c["k"], **c["state"])
    g = torch.Generator().manual_seed(c["seed"] * 1000 + rank)
    out = []
    for _ in range(c["calls"]):
        res = colltune.topk_allreduce(torch.randn(c["n"], generator=g), state, algorithm=c["algorithm"], group=group)
        out.append({"traffic": _traffic(res), "global": int(res.global_count), "local": int(res.local_count)})
    return out


def counted_bytes(step, p: int) -> float:
    """Return the bytes the comm layer counts for a priced step on gloo at ``p`` ranks."""
    if step.primitive == "all_reduce" and p > 2 and step.calls > 0:
        per_call = step.nbytes / step.calls * p / (2 * (p - 1))
        if per_call <= DIRECT_BYTES:
            return step.nbytes * p / 2  # direct: (P-1) L instead of 2 L (P-1) / P
    return step.nbytes


def priced(algorithm: str, features, mode: str, knobs: dict) -> dict[str, float]:
    """Return the schedule's bytes per comm-layer primitive (local work left out)."""
    from colltune.algorithms.schedule import Pricing

    algo = registry.get(algorithm)
    steps = algo.schedule(Pricing(features, mode=mode), {**algo.knobs, **knobs})
    out: dict[str, float] = {}
    for s in steps:
        if s.primitive != "local":
            name = COMM_NAME[s.primitive]
            out[name] = out.get(name, 0.0) + counted_bytes(s, features.world_size)
    return out


def measured(per_rank: list, warmup: int) -> dict[str, float]:
    """Return the counted bytes per primitive, averaged over ranks and the calls after ``warmup``."""
    calls = [rec["traffic"] for recs in per_rank for rec in recs[warmup:]]
    names = {n for t in calls for n in t}
    return {n: sum(t.get(n, 0) for t in calls) / len(calls) for n in names}


def compare(got: dict[str, float], want: dict[str, float], where: str) -> None:
    total_got, total_want = sum(got.values()), sum(want.values())
    assert abs(total_want - total_got) <= TOTAL_RTOL * total_got, (
        f"{where}: priced {total_want:.0f} B per rank and call, counted {total_got:.0f} B\n"
        f"  priced  {dict(sorted((k, round(v)) for k, v in want.items()))}\n"
        f"  counted {dict(sorted((k, round(v)) for k, v in got.items()))}"
    )
    for name in set(got) | set(want):
        g, w = got.get(name, 0.0), want.get(name, 0.0)
        assert abs(w - g) <= max(PRIMITIVE_RTOL * g, PRIMITIVE_SLACK), (
            f"{where}: {name}: priced {w:.0f} B, counted {g:.0f} B (priced {want}, counted {got})"
        )


def _exact_case(algorithm: str, row: tuple[int, ...], k: int) -> dict:
    knobs = {"boundary_refresh": 4} if algorithm == "oktopk" else {}
    return {"seed": 5, "n": 40_000, "k": k, "row": row, "algorithm": algorithm, "calls": 10, "warmup": 2,
            "knobs": knobs}


EXACT = [
    pytest.param(alg, row, k, id=f"{alg}-row{row[0] if row else 1}-k{k}")
    for alg, row, k in [
        ("dense", (), 2000), ("allgather", (), 100), ("allgather", (), 3000), ("allgather", (16,), 400),
        ("allgather", (), 20000), ("allgather", (16,), 2500),  # past the slot's limit: the rest is gathered
        ("oktopk", (), 3000), ("oktopk", (16,), 800),
    ]
]
#: Every registered algorithm with a schedule takes part: those without a case of their own above get one.
SCHEDULED = [n for n in registry.names() if registry.get(n).TERMS]
EXACT += [pytest.param(alg, (), 2000, id=f"{alg}-row1-k2000")
          for alg in SCHEDULED if alg not in {p.values[0] for p in EXACT}]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("algorithm,row,k", EXACT)
def test_exact_schedules_price_the_bytes_the_calls_send(world_size, algorithm, row, k):
    from colltune.model.features import Features

    c = _exact_case(algorithm, row, k)
    per_rank = pool(world_size).run(_run_exact, c, timeout=120)
    unions = [rec["union"] for rec in per_rank[0][c["warmup"] :]]
    f = Features.build(numel=c["n"], row_numel=math.prod(row), dtype="float32", k_per_rank=[k] * world_size,
                       union=sum(unions) / len(unions))
    compare(measured(per_rank, c["warmup"]), priced(algorithm, f, "exact", c["knobs"]),
            f"{algorithm} exact P={world_size} row={row} k={k}")


def _topk_case(algorithm: str, n: int, k: int) -> dict:
    refresh = {"local_refresh": 8, "global_refresh": 8, "boundary_refresh": 8}
    # The second call always computes the global threshold afresh (the first one's error feedback changes the
    # scale), so the calls after two of warm-up pay every refresh as often as the schedule amortizes it.
    return {"seed": 7, "n": n, "k": k, "algorithm": algorithm, "calls": 26, "warmup": 2, "state": refresh}


TOPK = [
    pytest.param(alg, n, k, id=f"{alg}-n{n}-k{k}")
    for alg, n, k in [("dense", 2**16, 600), ("dense", 2**13, 60), ("allgather", 2**16, 600),
                      ("oktopk", 2**16, 600), ("oktopk", 2**18, 5000)]
]
TOPK += [pytest.param(alg, 2**16, 600, id=f"{alg}-n{2**16}-k600")
         for alg in SCHEDULED if alg not in {p.values[0] for p in TOPK}]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("algorithm,n,k", TOPK)
def test_topk_schedules_price_the_bytes_the_calls_send(world_size, algorithm, n, k):
    from colltune.model.features import Features

    c = _topk_case(algorithm, n, k)
    per_rank = pool(world_size).run(_run_topk, c, timeout=120)
    if registry.get(algorithm).topk_priced_on == "tensor":  # the selector's view of dense: the whole tensor
        f = Features.build(numel=n, row_numel=1, dtype="float32", k_per_rank=[n] * world_size, union=n)
    else:
        f = Features.build(numel=n, row_numel=1, dtype="float32", k_per_rank=[k] * world_size,
                           union=min(n, world_size * k))
    compare(measured(per_rank, c["warmup"]), priced(algorithm, f, "topk", c["state"]),
            f"{algorithm} topk P={world_size} n={n} k={k}")
    if algorithm == "oktopk":
        _check_eq3_counted(per_rank, world_size, k)


#: Bytes of one Ok-Topk top-k call that are not entries: the record, the counts, boundaries, histograms and sizes.
def _control_bytes(t: dict[str, int]) -> int:
    return t.get("all_reduce", 0) + t.get("all_to_all", 0)


def _check_eq3_counted(per_rank: list, p: int, k: int) -> None:
    """Counted entries' bytes (split, balance, gather) within Eq. 3's 6k(P-1)/P words of 4 bytes, on average."""
    if p == 1:
        return
    record = 8 * 20 + 1024  # the record's header and its slot at these world sizes
    data = [sum(t.values()) - _control_bytes(t) - (p - 1) * (record + 8 * 17)
            for recs in per_rank for t in (r["traffic"] for r in recs)]
    mean = sum(data) / len(data)
    bound = 6 * k * (p - 1) / p * 4
    assert mean <= bound, f"P={p}: {mean:.0f} B of entries per call on average > Eq. 3's {bound:.0f} B"
