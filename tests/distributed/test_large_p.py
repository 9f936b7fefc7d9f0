"""Correctness at larger world sizes: every algorithm at P = 16 (and 32) against the dense reference (slow).

One launch per world size runs, on fresh gloo ranks: every exact scenario of
``test_sparse_allreduce`` with every algorithm, top-k sequences with every
algorithm (checked as ``test_topk`` checks them), and a few calls whose
metadata record is measured: its size at this world size (the header and
the starting eager slot, the slot grown for ``allgather``'s entries, Ok-Topk's
counts riding in it). Each rank reports its peak resident memory, which the
test prints (run with ``-s``) and bounds.
"""

from __future__ import annotations

import resource

import pytest
import torch
import torch.distributed as dist
from test_sparse_allreduce import SCENARIOS, _result_record, check_results
from test_topk import _run_topk, check_topk, topk_cfg

from harness import run_ranks
from sparse_cases import ALGORITHMS, make_input

#: Peak resident memory a rank may reach in this suite (a torch process with gloo takes about 0.3 GiB).
MAX_RSS_GIB = 1.5
#: The exact scenarios run at each world size: all of them at 16; at 32 (two minutes on two cores) a dozen
#: that cover every path (empty ranks, dtypes, avg, wide rows and dense regions, disjoint and identical sets).
EXACT = {
    16: list(SCENARIOS),
    32: ["random_dups_int64", "empty_rank0", "all_empty", "identical_sets", "disjoint_sets", "float16", "avg_float32",
         "large_size_sparse", "wide_rows_float32", "wide_rows_dense_regions", "wide_rows_disjoint_sets",
         "one_shared_entry"],
}
TOPK = [
    dict(seed=3, shape=(64, 64), k=40, steps=20),
    dict(seed=4, shape=(20_000,), k=None, density=0.02, steps=20, small=False,
         state_kw={"local_refresh": 5, "global_refresh": 4, "boundary_refresh": 6}),
]


def _run_large(rank, world_size):
    import colltune

    torch.set_num_threads(1)
    out: dict = {"exact": {}, "topk": [], "records": _run_records(rank, world_size)}
    for name in EXACT[world_size]:
        c = SCENARIOS[name](world_size)
        idx, vals = make_input(c, rank, world_size)
        for algorithm in ALGORITHMS:
            res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=algorithm)
            out["exact"][name, algorithm] = _result_record(res, small=False)
    for kw in TOPK[: 2 if world_size <= 16 else 1]:
        for algorithm in ALGORITHMS:
            out["topk"].append(_run_topk(rank, world_size, topk_cfg(algorithm=algorithm, **kw)))
    out["rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


def _record_bytes(res) -> int:
    """Bytes this rank sent in the call's all_gathers (the record is the only one in the calls below)."""
    return res.traffic.by_primitive.get("all_gather", {}).get("bytes", 0)


def _run_records(rank, world_size):
    """Calls on fresh groups whose only all_gather is the metadata record; return what they sent."""
    import colltune
    from colltune.algorithms import meta
    from colltune.algorithms.comm import Comm

    g = torch.Generator().manual_seed(rank)
    out = {}
    group = dist.new_group()
    idx = torch.randperm(100_000, generator=g)[:40]
    vals = torch.randn(40, generator=g)
    plain = colltune.sparse_allreduce(idx, vals, 100_000, algorithm="allgather", group=group)
    out["allgather_small"] = (_record_bytes(plain), meta.slot_bytes(Comm(group, torch.device("cpu"))))
    big_idx = torch.randperm(100_000, generator=g)[:300]
    colltune.sparse_allreduce(big_idx, torch.randn(300, generator=g), 100_000, algorithm="allgather", group=group)
    grown = colltune.sparse_allreduce(big_idx, torch.randn(300, generator=g), 100_000, algorithm="allgather", group=group)
    out["allgather_grown"] = (_record_bytes(grown), sum(v["calls"] for v in grown.traffic.by_primitive.values()))
    group = dist.new_group()
    calls = [colltune.sparse_allreduce(idx, vals, 100_000, algorithm="oktopk", group=group) for _ in range(3)]
    out["oktopk"] = [(sorted(r.traffic.by_primitive), r.traffic.by_primitive["all_gather"]["calls"]) for r in calls]
    out["oktopk_record"] = _record_bytes(calls[-1])
    group = dist.new_group()
    state = colltune.TopkState(k=50)
    top = colltune.topk_allreduce(torch.randn(4096, generator=g), state, algorithm="dense", group=group)
    out["topk_record"] = _record_bytes(top)
    return out


def _check_records(world_size: int, per_rank: list) -> None:
    from colltune.algorithms import sizes

    p = world_size
    base = sizes.eager_capacity(p)
    for r, o in enumerate(per_rank):
        rec = o["records"]
        assert rec["allgather_small"] == ((p - 1) * (sizes.HEADER_BYTES + base), base), (r, rec)
        # 300 entries of 8 bytes: the slot grows to 4 KiB (within the limit at these P) and the call is one collective.
        assert rec["allgather_grown"] == ((p - 1) * (sizes.HEADER_BYTES + 4096), 1), (r, rec)
        # Ok-Topk: the first call sends its counts (no boundaries yet); then they ride in the record, and the
        # regions' sizes ride with the regions: the record is the call's one all_gather.
        assert ["all_to_all" in prims for prims, _ in rec["oktopk"]] == [True, False, False], (r, rec)
        assert [calls for _, calls in rec["oktopk"]][1:] == [1, 1], (r, rec)
        assert rec["oktopk_record"] == (p - 1) * sizes.record_bytes(p, payload=True), (r, rec)
        assert rec["topk_record"] == (p - 1) * sizes.record_bytes(p), (r, rec)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [16, 32])
def test_every_algorithm_at_large_world_sizes(world_size):
    per_rank = run_ranks(_run_large, world_size, timeout=900)
    for name in EXACT[world_size]:
        c = SCENARIOS[name](world_size)
        for algorithm in ALGORITHMS:
            check_results(c, world_size, [o["exact"][name, algorithm] for o in per_rank], algorithm)
    i = 0
    for kw in TOPK[: 2 if world_size <= 16 else 1]:
        for algorithm in ALGORITHMS:
            check_topk(topk_cfg(algorithm=algorithm, **kw), world_size, [o["topk"][i] for o in per_rank])
            i += 1
    _check_records(world_size, per_rank)
    rss = [o["rss_kib"] / 2**20 for o in per_rank]
    print(f"\nP={world_size}: peak RSS per rank {min(rss):.2f} to {max(rss):.2f} GiB, {sum(rss):.1f} GiB in all")
    assert max(rss) < MAX_RSS_GIB, rss
