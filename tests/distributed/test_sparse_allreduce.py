"""Exact sparse allreduce: every algorithm against a float64 dense reference, on gloo ranks.

Each test sends one case to a pool of ranks (tests/harness.py) that stays up
between tests; every rank builds its own input from the case (and the parent
builds the reference from the same case), calls ``colltune.sparse_allreduce``
and returns the result; the parent checks it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colltune.algorithms import registry

from harness import pool
from sparse_cases import (
    ALGORITHMS,
    DTYPES,
    UNIT_ROUNDOFF,
    assert_close_to_reference,
    case,
    make_input,
    overlap,
    raw,
    reference,
)

FAST_SIZES = [1, 2, 3, 4]
ALL_SIZES = FAST_SIZES + [pytest.param(8, marks=pytest.mark.slow)]


# ------------------------------------------------------------------ scenarios (a case per world size)


def _grow(p, base, step=3, empty=()):
    return [0 if r in empty else base + step * r for r in range(p)]


SCENARIOS = {
    "random_dups_int64": lambda p: case(seed=1, size=50, counts=_grow(p, 40)),
    "random_int32": lambda p: case(seed=2, size=60, counts=_grow(p, 30, 5), index_dtype="int32"),
    "empty_rank0": lambda p: case(seed=3, size=40, counts=_grow(p, 20, empty=(0,))),
    "empty_last_rank": lambda p: case(seed=4, size=40, counts=_grow(p, 20, empty=(p - 1,))),
    "all_empty": lambda p: case(seed=5, size=40, counts=[0] * p),
    "identical_sets": lambda p: case(seed=6, size=100, counts=[30] * p, pattern="identical"),
    "disjoint_sets": lambda p: case(seed=7, size=400, counts=[25] * p, pattern="disjoint"),
    "embedding_rows": lambda p: case(seed=8, size=40, counts=_grow(p, 15, 2), row_shape=(3, 2)),
    "float64": lambda p: case(seed=9, size=50, counts=_grow(p, 35), dtype="float64"),
    "float16": lambda p: case(seed=10, size=50, counts=_grow(p, 35), dtype="float16"),
    "bfloat16": lambda p: case(seed=11, size=50, counts=_grow(p, 35), dtype="bfloat16"),
    "float16_rows_int32": lambda p: case(
        seed=12, size=30, counts=_grow(p, 20), dtype="float16", row_shape=(4,), index_dtype="int32"
    ),
    "avg_float32": lambda p: case(seed=13, size=50, counts=_grow(p, 30), op="avg"),
    "avg_bfloat16_rows": lambda p: case(seed=14, size=30, counts=_grow(p, 20), op="avg", dtype="bfloat16", row_shape=(2,)),
    "avg_float64_identical": lambda p: case(seed=15, size=64, counts=[20] * p, op="avg", dtype="float64", pattern="identical"),
    "cancel_to_zero_kept": lambda p: case(seed=16, size=30, counts=[12] * p, pattern="cancel"),
    "large_size_sparse": lambda p: case(seed=17, size=200_000, counts=_grow(p, 300, 50)),
    "tiny_size_many_dups": lambda p: case(seed=18, size=16, counts=[100] * p),
    "size_one": lambda p: case(seed=19, size=1, counts=[3] * p),
    "one_entry_per_rank_float64": lambda p: case(seed=21, size=10, counts=[1] * p, dtype="float64"),
    "one_entry_float64_rows": lambda p: case(seed=22, size=10, counts=[1] * p, dtype="float64", row_shape=(3,)),
    "one_entry_per_rank_float16": lambda p: case(seed=23, size=10, counts=[1] * p, dtype="float16"),
    "noncontiguous_inputs": lambda p: case(seed=20, size=50, counts=_grow(p, 20), row_shape=(2,), noncontig=True),
    "values_require_grad": lambda p: case(seed=61, size=40, counts=_grow(p, 12), requires_grad=True),
    "wide_rows_require_grad": lambda p: case(seed=62, size=300, counts=_grow(p, 40, 7), row_shape=(8,), requires_grad=True),
    "zero_width_rows": lambda p: case(seed=63, size=30, counts=_grow(p, 10), row_shape=(0,)),
    # Rows of 32 bytes or more: oktopk sends indices and rows as separate messages, received in place.
    "wide_rows_float32": lambda p: case(seed=24, size=300, counts=_grow(p, 40, 7), row_shape=(4, 4)),
    "wide_rows_float16_avg": lambda p: case(seed=25, size=200, counts=_grow(p, 30), op="avg", dtype="float16", row_shape=(16,)),
    "wide_rows_bfloat16_int32": lambda p: case(
        seed=26, size=120, counts=_grow(p, 25), dtype="bfloat16", row_shape=(32,), index_dtype="int32"
    ),
    "wide_rows_float64_empty_rank0": lambda p: case(seed=27, size=150, counts=_grow(p, 30, empty=(0,)), dtype="float64", row_shape=(8,)),
    "wide_rows_dense_regions": lambda p: case(seed=28, size=48, counts=[60] * p, row_shape=(8,)),
    "wide_rows_identical_sets": lambda p: case(seed=29, size=400, counts=[50] * p, row_shape=(12,), pattern="identical"),
    "wide_rows_disjoint_sets": lambda p: case(seed=31, size=600, counts=[40] * p, row_shape=(12,), pattern="disjoint"),
    # One shared row: the boundaries collapse onto it, leaving empty regions of no length.
    "wide_rows_one_shared_row": lambda p: case(seed=32, size=4096, counts=[1] * p, row_shape=(64,), pattern="identical"),
    "one_shared_entry": lambda p: case(seed=33, size=4096, counts=[1] * p, pattern="identical"),
}


# ------------------------------------------------------------------ rank functions


def _result_record(res, small: bool) -> dict:
    return {
        "indices": res.indices.clone(),
        "values": res.values.clone(),
        "size": res.size,
        "algorithm": res.algorithm,
        "bytes_sent": res.traffic.bytes_sent,
        "messages": res.traffic.messages,
        "dense": res.to_dense() if small else None,
    }


def _run_sparse(rank, world_size, c, algorithm, repeat=1, fresh_group=False):
    import colltune

    # A fresh group starts with the smallest eager slot, whatever earlier tests ran on the default one.
    group = dist.new_group() if fresh_group and world_size > 1 else None
    idx, vals = make_input(c, rank, world_size)
    idx_before, vals_before = raw(idx), raw(vals)
    out = []
    for _ in range(repeat):
        res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=algorithm, group=group)
        out.append(_result_record(res, small=c["size"] <= 5000))
    return {"results": out, "inputs_unchanged": raw(idx) == idx_before and raw(vals) == vals_before}


def _run_sparse_subgroups(rank, world_size, c, algorithm, groups):
    import colltune

    handles = [dist.new_group(g) for g in groups]  # every rank creates every group, in the same order
    idx, vals = make_input(c, rank, world_size)
    out = {}
    for gi, (members, g) in enumerate(zip(groups, handles)):
        if rank in members:
            res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], group=g, algorithm=algorithm)
            out[gi] = _result_record(res, small=True)
    return out


def _run_async(rank, world_size, c, algorithm):
    import colltune

    idx, vals = make_input(c, rank, world_size)
    h1 = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=algorithm, async_op=True)
    h2 = colltune.sparse_allreduce(idx, vals * 2, c["size"], op=c["op"], algorithm=algorithm, async_op=True)
    completed_type = type(h1.is_completed()).__name__
    r2 = h2.wait()
    r1 = h1.wait()
    fut = h1.get_future()
    fut_res = fut.wait()
    assert h1.is_completed() and h2.is_completed()
    sync = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=algorithm)
    return {
        "completed_type": completed_type,
        "first": _result_record(r1, small=True),
        "second": _result_record(r2, small=True),
        "future": _result_record(fut_res, small=True),
        "sync": _result_record(sync, small=True),
    }


# ------------------------------------------------------------------ checks


def check_results(c: dict, world_size: int, records: list[dict], algorithm: str, ranks=None, check_traffic=True):
    """Check per-rank result records of one call against the reference and across ranks."""
    from colltune import algorithms

    ref = reference(c, world_size, ranks)
    dtype = DTYPES[c["dtype"]]
    row_shape = tuple(c["row_shape"])
    ranks = list(range(world_size)) if ranks is None else ranks
    first = records[0]
    for r, rec in zip(ranks, records):
        where = f"{algorithm} at P={world_size}, rank {r}"
        idx, vals = rec["indices"], rec["values"]
        assert idx.dtype == torch.int64 and idx.dim() == 1, f"{where}: indices {idx.dtype} {tuple(idx.shape)}"
        assert torch.equal(idx, ref["union"]), (
            f"{where}: result indices are not the union of the inputs' indices: "
            f"got {idx.tolist()[:20]}... ({idx.numel()}), expected {ref['union'].tolist()[:20]}... ({ref['union'].numel()})"
        )
        assert vals.dtype == dtype, f"{where}: values dtype {vals.dtype}, expected {dtype}"
        assert tuple(vals.shape) == (idx.numel(),) + row_shape, f"{where}: values shape {tuple(vals.shape)}"
        assert rec["size"] == c["size"]
        if algorithm == "auto":
            assert rec["algorithm"] in algorithms.names(), f"{where}: res.algorithm={rec['algorithm']!r}"
        else:
            assert rec["algorithm"] == algorithm, f"{where}: res.algorithm={rec['algorithm']!r}"
        assert_close_to_reference(vals, idx, ref, dtype, where)
        if rec["dense"] is not None:
            d = rec["dense"]
            assert tuple(d.shape) == (c["size"],) + row_shape and d.dtype == dtype, f"{where}: to_dense {d.shape} {d.dtype}"
            expect = torch.zeros_like(d)
            if idx.numel():
                expect[idx] = vals
            assert raw(d) == raw(expect), f"{where}: to_dense() does not match indices/values"
        # Bitwise identical on every rank.
        assert rec["algorithm"] == first["algorithm"], f"{where}: ranks ran different algorithms"
        assert raw(idx) == raw(first["indices"]), f"{where}: indices differ from rank {ranks[0]}'s bitwise"
        assert raw(vals) == raw(first["values"]), f"{where}: values differ from rank {ranks[0]}'s bitwise"
        if check_traffic:
            has_data = ref["union"].numel() > 0
            if len(ranks) == 1:
                assert rec["bytes_sent"] == 0, f"{where}: a single rank sent {rec['bytes_sent']} bytes"
            elif has_data:
                assert rec["bytes_sent"] > 0, f"{where}: no traffic counted for a call that moved data"


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("world_size", ALL_SIZES)
def test_matches_dense_reference(world_size, scenario, algorithm):
    c = SCENARIOS[scenario](world_size)
    out = pool(world_size).run(_run_sparse, c, algorithm)
    for r, o in enumerate(out):
        assert o["inputs_unchanged"], f"rank {r}: sparse_allreduce modified its inputs"
    check_results(c, world_size, [o["results"][0] for o in out], algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", [3, 4])
def test_repeated_calls_give_the_same_bits(world_size, algorithm):
    # Cached state (Ok-Topk's region boundaries, the selector) must not change the bits.
    c = case(seed=30, size=500, counts=_grow(world_size, 120, 40))
    out = pool(world_size).run(_run_sparse, c, algorithm, 4)
    for o in out:
        for rec in o["results"][1:]:
            assert raw(rec["indices"]) == raw(o["results"][0]["indices"])
            assert raw(rec["values"]) == raw(o["results"][0]["values"])
    check_results(c, world_size, [o["results"][-1] for o in out], algorithm)


def test_scenarios_have_the_overlap_they_claim():
    assert overlap(SCENARIOS["identical_sets"](4), 4) == 1.0
    assert overlap(SCENARIOS["disjoint_sets"](4), 4) == 0.0
    idx, _ = make_input(SCENARIOS["random_dups_int64"](2), 1, 2)
    assert idx.unique().numel() < idx.numel(), "the random scenario should contain duplicates"
    assert not bool((idx[1:] >= idx[:-1]).all()), "the random scenario should be unsorted"
    assert make_input(SCENARIOS["random_int32"](2), 0, 2)[0].dtype == torch.int32


def test_single_rank_without_a_process_group():
    """World size 1 works in a process that never initialized torch.distributed."""
    import colltune

    assert not (dist.is_available() and dist.is_initialized())
    for name in ("random_dups_int64", "embedding_rows", "bfloat16", "avg_float32", "all_empty"):
        c = SCENARIOS[name](1)
        idx, vals = make_input(c, 0, 1)
        for algorithm in ALGORITHMS:
            res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=algorithm)
            rec = _result_record(res, small=True)
            check_results(c, 1, [rec], algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_non_default_subgroups(algorithm):
    groups = [[1, 3], [0, 2, 3], [2]]
    c = case(seed=40, size=80, counts=_grow(4, 25, 5), row_shape=(2,))
    out = pool(4).run(_run_sparse_subgroups, c, algorithm, groups)
    for gi, members in enumerate(groups):
        records = [out[r][gi] for r in members]
        check_results(c, 4, records, algorithm, ranks=members)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", [1, 3])
def test_async_op(world_size, algorithm):
    c = case(seed=50, size=60, counts=_grow(world_size, 30), op="avg")
    out = pool(world_size).run(_run_async, c, algorithm)
    for r, o in enumerate(out):
        assert o["completed_type"] == "bool"
        for key in ("first", "future", "sync"):
            assert raw(o[key]["indices"]) == raw(o["sync"]["indices"]), f"rank {r}: {key} indices differ"
            assert raw(o[key]["values"]) == raw(o["sync"]["values"]), f"rank {r}: {key} values differ"
    check_results(c, world_size, [o["first"] for o in out], algorithm)
    # The second call (values doubled) completed correctly even though it was waited on first.
    for o in out:
        assert torch.equal(o["second"]["indices"], o["first"]["indices"])
        assert torch.allclose(o["second"]["values"], 2 * o["first"]["values"], rtol=1e-6, atol=0)


def _run_gather_modes(rank, world_size, c, modes):
    import colltune

    idx, vals = make_input(c, rank, world_size)
    out = {}
    for mode in modes:
        res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm="oktopk", knobs={"gather_mode": mode})
        out[mode] = _result_record(res, small=True)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("row_shape", [(), (3,), (16,)], ids=["scalar", "narrow", "wide"])
def test_oktopk_gather_modes_give_the_same_bits(world_size, row_shape):
    """Every way of moving the regions (packed or split into index and row messages) gives the same bits."""
    modes = ["auto", "p2p", "pad", "alltoall"]
    c = case(seed=33, size=900, counts=_grow(world_size, 80, 25, empty=(1,)), row_shape=row_shape)
    out = pool(world_size).run(_run_gather_modes, c, modes)
    for mode in modes:
        check_results(c, world_size, [o[mode] for o in out], "oktopk")
        for o in out:
            assert raw(o[mode]["values"]) == raw(out[0]["auto"]["values"]), f"gather_mode={mode}"


def _run_avg_and_sum(rank, world_size, c, algorithm):
    import colltune

    idx, vals = make_input(c, rank, world_size)
    avg = colltune.sparse_allreduce(idx, vals, c["size"], op="avg", algorithm=algorithm)
    total = colltune.sparse_allreduce(idx, vals, c["size"], op="sum", algorithm=algorithm)
    acc = torch.float32 if vals.dtype in (torch.float16, torch.bfloat16) else vals.dtype
    return {"avg": avg.values, "sum": total.values, "acc": acc}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(
    "kw",
    [dict(row_shape=(16,)), dict(row_shape=(16,), dtype="float16"), dict(row_shape=()), dict(size=40, row_shape=(8,))],
    ids=["wide", "wide_float16", "scalar", "dense_regions"],
)
def test_avg_is_the_sum_divided_bitwise(algorithm, kw):
    """``avg`` gives the same bits as the sum divided by P, whether the algorithm or the front door divides."""
    p = 3
    c = case(**{"seed": 34, "size": 500, "counts": [60] * p, **kw})
    for o in pool(p).run(_run_avg_and_sum, c, algorithm):
        dtype = o["avg"].dtype
        # With 16-bit values the sum is rounded to the dtype before division here, so allow that rounding.
        want = (o["sum"].to(o["acc"]) / p).to(dtype)
        if dtype in (torch.float16, torch.bfloat16):
            assert torch.allclose(o["avg"].float(), want.float(), rtol=2e-3, atol=1e-4)
        else:
            assert raw(o["avg"]) == raw(want), f"{algorithm}: avg differs from sum / P"


def test_oktopk_sends_well_below_allgather_at_full_overlap():
    """P=4, identical index sets: Ok-Topk's split-reduce + allgatherv sends about (k + u)(P-1)/P
    entries per rank, allgather (P-1) k: with u = k that is half."""
    p = 4
    c = case(seed=60, size=1_000_000, counts=[4000] * p, pattern="identical")
    got = {}
    for algorithm in ("allgather", "oktopk"):
        out = pool(p).run(_run_sparse, c, algorithm, 1, True)  # repeat once, on a fresh group
        recs = [o["results"][0] for o in out]
        check_results(c, p, recs, algorithm)
        got[algorithm] = [rec["bytes_sent"] for rec in recs]
    entry = 4 + 4  # int32 index on the wire (size < 2**31) + one float32 value
    k = 4000
    assert max(got["oktopk"]) < 0.75 * min(got["allgather"]), got
    # Both near their model: allgather (P-1) k entries, oktopk 2 k (P-1)/P entries (+ metadata, balance slack).
    assert min(got["allgather"]) >= (p - 1) * k * entry, got
    assert max(got["oktopk"]) <= 1.25 * 2 * k * (p - 1) / p * entry + 4096, got


#: The algorithms that never densify: a dense-like one (priced on the whole tensor) allocates every row.
SPARSE = [n for n in registry.names() if registry.get(n).topk_priced_on != "tensor"]


def _run_huge_size(rank, world_size, size, algorithm, width=2):
    import colltune

    g = torch.Generator().manual_seed(70 + rank)
    idx = torch.randint(0, size, (60,), generator=g)
    idx[:6] = torch.arange(6) * (size // 6)  # shared by every rank
    idx[6] = size - 1
    vals = torch.randn(60, width, generator=g)
    res = colltune.sparse_allreduce(idx, vals, size, algorithm=algorithm)
    return {"idx": idx, "vals": vals, "res": _result_record(res, small=False)}


@pytest.mark.parametrize("width", [2, 16])
@pytest.mark.parametrize("algorithm", [*SPARSE, "auto"])
def test_size_beyond_int32_uses_wide_indices(algorithm, width):
    """Rows past 2**31 (int64 indices on the wire); a dense path would need the whole size, so it is left out."""
    p, size = 3, 2**40 + 3
    out = pool(p).run(_run_huge_size, size, algorithm, width)
    all_idx = torch.cat([o["idx"] for o in out])
    all_vals = torch.cat([o["vals"] for o in out]).to(torch.float64)
    union, inverse = torch.unique(all_idx, return_inverse=True)
    ref = torch.zeros((union.numel(), width), dtype=torch.float64).index_add_(0, inverse, all_vals)
    mag = torch.zeros_like(ref).index_add_(0, inverse, all_vals.abs())
    for r, o in enumerate(out):
        rec = o["res"]
        assert torch.equal(rec["indices"], union), f"rank {r}: indices"
        assert rec["algorithm"] in SPARSE, "auto must not densify 2**40 rows"
        err = (rec["values"].to(torch.float64) - ref).abs()
        assert bool((err <= 2e-6 * mag + 1e-300).all()), f"rank {r}: max error {err.max().item()}"
        assert raw(rec["values"]) == raw(out[0]["res"]["values"])


# ------------------------------------------------------------------ the eager slot adapts per group


class _FakeGroup:
    """Stands for a process group: per-group state is held weakly, keyed by the group object."""


def _FakeComm(world_size):
    """A comm layer of ``world_size`` ranks over a stand-in group object (no process group needed)."""
    from colltune.algorithms.comm import Comm

    comm = Comm(_FakeGroup(), torch.device("cpu"))
    comm.world_size = world_size
    return comm


def test_eager_slot_grows_at_once_and_shrinks_only_after_a_run_of_small_calls():
    from colltune.algorithms import meta as _meta

    comm = _FakeComm(4)
    base, limit = _meta.eager_capacity(4), _meta.slot_limit(4)
    assert _meta.slot_bytes(comm) == base == 1024 and limit == 65536
    _meta.note_slot_use(comm, 5000)
    assert _meta.slot_bytes(comm) == 8192  # the next power of two
    _meta.note_slot_use(comm, 10**9)
    assert _meta.slot_bytes(comm) == limit  # never past the limit
    for i in range(_meta.SHRINK_AFTER - 1):
        _meta.note_slot_use(comm, 0)
        if i == 2:
            _meta.note_slot_use(comm, limit // 2)  # a call that used it resets the run
    assert _meta.slot_bytes(comm) == limit
    for _ in range(_meta.SHRINK_AFTER):
        _meta.note_slot_use(comm, 100)
    assert _meta.slot_bytes(comm) == base  # shrinks to what the calls needed, at least the start
    other = _FakeComm(4)
    assert _meta.slot_bytes(other) == base  # state is per group


def _run_slot_sequence(rank, world_size, steps):
    """Run calls of several algorithms and sizes on one fresh group; return results and collective counts."""
    import colltune
    from colltune.algorithms import meta as _meta
    from colltune.algorithms.comm import Comm

    group = dist.new_group()
    out = []
    for c, algorithm in steps:
        idx, vals = make_input(c, rank, world_size)
        res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=algorithm, group=group)
        rec = _result_record(res, small=False)
        rec["collectives"] = sum(v["calls"] for v in res.traffic.by_primitive.values())
        rec["slot"] = _meta.slot_bytes(Comm(group, torch.device("cpu")))
        out.append(rec)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_allgather_becomes_one_collective_once_the_slot_has_grown(world_size):
    big = case(seed=70, size=50_000, counts=_grow(world_size, 600, 40))
    small = case(seed=71, size=50_000, counts=_grow(world_size, 20))
    embed = case(seed=72, size=5_000, counts=_grow(world_size, 90, 7), row_shape=(4,))
    steps = [(big, "allgather"), (big, "allgather"), (small, "oktopk"), (embed, "allgather"), (big, "dense"),
             (big, "allgather"), (small, "allgather")]
    out = pool(world_size).run(_run_slot_sequence, steps)
    for i, (c, algorithm) in enumerate(steps):
        check_results(c, world_size, [o[i] for o in out], algorithm, check_traffic=False)
    first, second = out[0][0], out[0][1]
    assert first["collectives"] == 2, "a first large call: the record, then the rest"
    assert second["collectives"] == 1, "the slot grew: the entries rode in the record"
    assert out[0][5]["collectives"] == 1
    slots = {o[-1]["slot"] for o in out}
    assert len(slots) == 1, f"ranks disagree on the slot size: {slots}"


def _run_slot_then_mismatch(rank, world_size):
    import colltune
    from colltune.algorithms.errors import RankMismatchError

    group = dist.new_group()
    c = case(seed=73, size=50_000, counts=[800] * world_size)
    idx, vals = make_input(c, rank, world_size)
    colltune.sparse_allreduce(idx, vals, c["size"], algorithm="allgather", group=group)
    try:  # ranks now disagree on the algorithm: both must raise, neither may hang or crash
        colltune.sparse_allreduce(idx, vals, c["size"], algorithm="allgather" if rank else "dense", group=group)
    except RankMismatchError as exc:
        return str(exc)
    return None


def test_ranks_that_disagree_after_the_slot_grew_still_raise():
    out = pool(2).run(_run_slot_then_mismatch)
    assert all(o and "algorithm" in o for o in out), out


# ------------------------------------------------------------------ Ok-Topk's counts in the metadata record


def _run_oktopk_refresh_cycle(rank, world_size, calls, refresh):
    import colltune

    group = dist.new_group()  # fresh boundary state
    c = case(seed=75, size=40_000, counts=[600, 0, 900, 300][:world_size], pattern="random")
    idx, vals = make_input(c, rank, world_size)
    out = []
    for _ in range(calls):
        res = colltune.sparse_allreduce(idx, vals, c["size"], algorithm="oktopk", group=group,
                                     knobs={"boundary_refresh": refresh})
        out.append({"primitives": sorted(res.traffic.by_primitive), "indices": res.indices,
                    "values": raw(res.values)})
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_oktopk_counts_ride_in_the_metadata_record_while_boundaries_are_cached(world_size):
    calls, refresh = 6, 3
    out = pool(world_size).run(_run_oktopk_refresh_cycle, calls, refresh)
    for rank, per_call in enumerate(out):
        for i, rec in enumerate(per_call):
            # A refresh call learns the cuts only after the exchange, so it sends the counts itself.
            assert ("all_to_all" in rec["primitives"]) == (i % refresh == 0), (rank, i, rec["primitives"])
            # Same input, same cuts: both ways give the same bits, on every rank.
            assert torch.equal(rec["indices"], out[0][0]["indices"]) and rec["values"] == out[0][0]["values"]


def _run_different_knobs(rank, world_size):
    import colltune

    from harness import expect_error

    c = case(seed=76, size=5_000, counts=[50] * world_size)
    idx, vals = make_input(c, rank, world_size)
    knobs = {"boundary_refresh": 1 + rank}  # ranks would refresh at different calls
    return expect_error(colltune.sparse_allreduce, idx, vals, c["size"], algorithm="oktopk", knobs=knobs)


def test_ranks_that_pass_different_knobs_raise():
    for raised in pool(2).run(_run_different_knobs):
        assert raised.type == "RankMismatchError", raised
        assert "'policy'" in raised.message and "knobs=" in raised.message, raised.message
        assert raised.elapsed < 10  # the bound only catches a hang


# ------------------------------------------------------------------ Ok-Topk's eager gather of the regions


def _eager_cases(world_size):
    # Sizes as a training run sees them: steady, then a jump (regions outgrow their room), a drop, an empty rank.
    scale = [1, 1, 6, 1, 0]
    return [case(seed=77 + i, size=3_000, counts=[(40 + 15 * r) * s for r in range(world_size)], pattern="random")
            for i, s in enumerate(scale)] + [case(seed=90, size=3_000, counts=_grow(world_size, 40, 10, empty=(0,)))]


def _run_eager_sequence(rank, world_size):
    import colltune

    group = dist.new_group()  # no sizes from earlier calls
    out = []
    for c in _eager_cases(world_size):
        idx, vals = make_input(c, rank, world_size)
        res = colltune.sparse_allreduce(idx, vals, c["size"], algorithm="oktopk", group=group)
        ref = colltune.sparse_allreduce(idx, vals, c["size"], algorithm="oktopk", group=group,
                                     knobs={"gather_mode": "pad"})  # sizes first, then one gather
        rec = _result_record(res, small=True)
        rec["pad_values"], rec["pad_indices"] = raw(ref.values), ref.indices
        rec["all_gathers"] = res.traffic.by_primitive.get("all_gather", {}).get("calls", 0)
        out.append(rec)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_oktopk_eager_gather_matches_the_sized_gather_as_sizes_change(world_size):
    cases = _eager_cases(world_size)
    out = pool(world_size).run(_run_eager_sequence)
    for i, c in enumerate(cases):
        recs = [o[i] for o in out]
        check_results(c, world_size, recs, "oktopk")
        for rec in recs:
            assert torch.equal(rec["indices"], rec["pad_indices"]) and raw(rec["values"]) == rec["pad_values"], i
    # The first call gathers the metadata, the sizes and then the packed regions; later calls send the
    # sizes with the entries, point to point, so the metadata record is their only all_gather.
    assert [o[0]["all_gathers"] for o in out] == [3] * world_size
    assert all(rec["all_gathers"] == 1 for o in out for rec in o[1:]), [[r["all_gathers"] for r in o] for o in out]


def _run_auto_oktopk_counts(rank, world_size, calls):
    import colltune
    from colltune.select.selector import Selector

    colltune.configure(selector=Selector(environ={"COLLTUNE_ALGO": "oktopk"}))  # auto, decided as oktopk
    try:
        group = dist.new_group()
        c = case(seed=78, size=30_000, counts=[500, 700, 0, 300][:world_size], pattern="random")
        idx, vals = make_input(c, rank, world_size)
        out = []
        for _ in range(calls):
            res = colltune.sparse_allreduce(idx, vals, c["size"], group=group, name="emb")
            out.append((res.algorithm, sorted(res.traffic.by_primitive), raw(res.values)))
        forced = colltune.sparse_allreduce(idx, vals, c["size"], group=group, algorithm="oktopk")
        return out, raw(forced.values)
    finally:
        colltune.configure()


@pytest.mark.parametrize("world_size", [3, 4])
def test_auto_calls_that_keep_choosing_oktopk_send_its_counts_in_the_record(world_size):
    out = pool(world_size).run(_run_auto_oktopk_counts, 4)
    for calls, forced in out:
        assert all(alg == "oktopk" for alg, _, _ in calls)
        # First call: no decision yet and no boundaries; second: boundaries now cached, and the site chose
        # oktopk, so its counts ride in the record from then on.
        assert ["all_to_all" in prims for _, prims, _ in calls] == [True, False, False, False], calls
        assert all(v == forced for _, _, v in calls)


# ------------------------------------------------------------------ dense: presence in the sign of zero, 16-bit


def _signed_zero_case(p: int, row_shape: tuple[int, ...], dtype: str, sorted_unique: bool) -> dict:
    """Rows that test the union's presence test: -0.0 inputs, sums that cancel to zero, an infinity.

    Every value is a small integer (or -0.0, or inf), so every algorithm's sum is exact and the bits of the
    results can be compared across algorithms whatever order they add in. ``sorted_unique``: each rank's
    indices sorted and unique, which the coalesce passes through with their bits (its -0.0 included).
    """
    width = 1
    for d in row_shape:
        width *= d
    rows: list[list[tuple[int, list[float]]]] = [[] for _ in range(p)]

    def put(rank: int, row: int, first: float, rest: float = 1.0) -> None:
        rows[rank].append((row, ([first] + [rest * (j + 1) for j in range(width - 1)])[:width]))

    put(0, 0, -0.0, -0.0)  # only -0.0 on one rank: present, sums to +0.0
    for r in range(p):
        put(r, 1, -0.0, -0.0)  # -0.0 on every rank: present, +0.0
        put(r, 4, 1.0)  # every rank: P
        put(r, 8, float(r + 1), float(-r))
    put(0, 2, 3.0)
    put(p - 1, 2, -3.0 if p > 1 else 0.0)  # cancels across ranks (at P = 1: 3 + 0)
    put(0, 3, 5.0)
    if not sorted_unique:
        put(0, 3, -5.0)  # duplicates on one rank that cancel
    put(p - 1, 6, float("inf"))
    put(0, 7, -0.0)
    put(p - 1, 7, 0.0)
    put(0, 9, -0.0, 2.0)  # first element -0.0, the rest nonzero
    put(p - 1, 11, -2.0, -0.0)
    # row 5 and 10 are nowhere: not in the union
    if sorted_unique:
        rows = [sorted(rs, key=lambda e: e[0]) for rs in rows]
    idx = [[row for row, _ in rows[r]] for r in range(p)]
    vals = [[v for _, vs in rows[r] for v in vs] for r in range(p)]
    return case(size=12, pattern="explicit", indices=idx, values=vals, row_shape=row_shape, dtype=dtype)


_NEG_ZERO_BITS = {2: -(1 << 15), 4: -(1 << 31), 8: -(1 << 63)}


def _neg_zeros(t: torch.Tensor) -> int:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return int((t.contiguous().view(ints) == _NEG_ZERO_BITS[t.element_size()]).sum())


def _run_signed_zero(rank, world_size, cases):
    import colltune

    out = []
    for c in cases:
        idx, vals = make_input(c, rank, world_size)
        got = {}
        for label, algorithm, knobs in (("dense", "dense", None), ("dense16", "dense", {"wire": "value"}),
                                        ("allgather", "allgather", None)):
            res = colltune.sparse_allreduce(idx, vals, c["size"], algorithm=algorithm, knobs=knobs)
            got[label] = (res.indices.clone(), res.values.clone(), res.traffic.as_dict())
        many = colltune.sparse_allreduce_many([(idx, vals, (c["size"], *c["row_shape"]))] * 2, algorithm="dense")
        got["fused"] = [(r.indices.clone(), r.values.clone()) for r in many]
        out.append(got)
    return out


@pytest.mark.parametrize("world_size", FAST_SIZES)
def test_dense_union_rides_in_the_sign_of_zero(world_size):
    """-0.0 inputs, sums that cancel to exactly zero and -0.0 in a row's first element keep their rows in the
    union; no result is -0.0 (every algorithm sums from +0.0); the bits match allgather's exact sums."""
    cases = [_signed_zero_case(world_size, shape, dtype, sorted_unique)
             for shape in ((), (3,), (0,)) for dtype in ("float32", "bfloat16", "float16", "float64")
             for sorted_unique in (False, True)]
    out = pool(world_size).run(_run_signed_zero, cases)
    for j, c in enumerate(cases):
        ref = reference(c, world_size)
        assert 5 not in ref["union"].tolist() and 0 in ref["union"].tolist()
        ag_idx, ag_vals, _ = out[0][j]["allgather"]
        for r in range(world_size):
            for label in ("dense", "dense16"):
                idx, vals, traffic = out[r][j][label]
                where = f"{label} {c['dtype']} rows {c['row_shape']} at P={world_size}, rank {r}"
                assert torch.equal(idx, ref["union"]), (where, idx.tolist())
                assert vals.dtype == DTYPES[c["dtype"]], where
                assert raw(vals) == raw(ag_vals), (where, vals, ag_vals)
                assert _neg_zeros(vals) == 0, where
                if world_size > 1:  # one collective for values and union: no mask travels
                    assert traffic["by_primitive"]["all_reduce"]["calls"] == 1, (where, traffic)
            for f_idx, f_vals in out[r][j]["fused"]:
                assert torch.equal(f_idx, ref["union"]) and raw(f_vals) == raw(ag_vals), "fused " + str(c["dtype"])


def _run_full_rows(rank, world_size, c, knobs):
    import colltune

    idx, vals = make_input(c, rank, world_size)
    if rank == 0:  # rank 0 holds every row, in shuffled order: the record says the union is every row
        g = torch.Generator().manual_seed(5)
        idx = torch.randperm(c["size"], generator=g)
        vals = torch.randn((c["size"], *c["row_shape"]), generator=g).to(DTYPES[c["dtype"]])
        vals[::7] = -0.0
    res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm="dense", knobs=knobs)
    # The same rows without rank 0's last one (n - 1 entries): the presence test finds the union instead.
    keep = idx != c["size"] - 1
    part = colltune.sparse_allreduce(idx[keep] if rank == 0 else idx, vals[keep] if rank == 0 else vals, c["size"],
                                     op=c["op"], algorithm="dense", knobs=knobs)
    return {"idx": res.indices, "vals": res.values, "part_idx": part.indices, "part_vals": part.values,
            "traffic": res.traffic.as_dict()}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,knobs", [("float32", None), ("bfloat16", None), ("bfloat16", {"wire": "value"}),
                                         ("float16", {"wire": "value"})])
def test_dense_with_every_row_present_returns_every_row(world_size, dtype, knobs):
    c = case(seed=71, size=300, counts=[0] + [40] * (world_size - 1), row_shape=(4,), dtype=dtype)
    out = pool(world_size).run(_run_full_rows, c, knobs)
    n = c["size"]
    for r, o in enumerate(out):
        assert torch.equal(o["idx"], torch.arange(n)), r
        assert _neg_zeros(o["vals"]) == 0 and o["vals"].dtype == DTYPES[dtype]
        assert raw(o["vals"]) == raw(out[0]["vals"]) and raw(o["part_vals"]) == raw(out[0]["part_vals"]), r
        # Row n - 1 is in the second call's union only where another rank holds it.
        others = set().union(*(make_input(c, q, world_size)[0].tolist() for q in range(1, world_size)))
        want = [i for i in range(n) if i != n - 1 or (n - 1) in others]
        assert o["part_idx"].tolist() == want, r
        if world_size > 1:
            assert o["traffic"]["by_primitive"]["all_reduce"]["calls"] == 1


def _run_every_rank_every_row(rank, world_size, n, dtype):
    """Every rank holds every row of small integers (exact sums in any order), -0.0 among them, some rows -0.0 on
    every rank; reduced as the caller's sorted values (kept), donated, shuffled (the coalesce's own copy) and in
    a fused bucket where the ranks do not hold every row of the bucket (every rank fixes its signs there)."""
    import colltune

    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(90 + rank)
    vals = torch.randint(-3, 4, (n, 4), generator=g).to(dt)
    vals[torch.rand(n, 4, generator=g) < 0.3] = -0.0
    vals[::5] = -0.0  # -0.0 on every rank: the sum is +0.0
    idx = torch.arange(n)
    kept = vals.clone()
    out = {"kept": colltune.sparse_allreduce(idx, vals, n, algorithm="dense")}
    out["caller_bits"] = raw(vals) == raw(kept)
    given, given_idx = vals.clone(), idx.clone()
    out["donated"] = colltune.sparse_allreduce(given_idx, given, n, algorithm="dense", donate=True)
    out["in_place"] = (out["donated"].values.data_ptr() == given.data_ptr(),
                       out["donated"].indices.data_ptr() == given_idx.data_ptr(),
                       out["kept"].indices.data_ptr() == idx.data_ptr())
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(7 + rank))
    shuffled = vals[perm]
    out["owned"] = colltune.sparse_allreduce(idx[perm], shuffled, n, algorithm="dense")
    out["shuffled_bits"] = raw(shuffled) == raw(kept[perm])
    out["allgather"] = colltune.sparse_allreduce(idx, vals, n, algorithm="allgather")
    out["avg"] = colltune.sparse_allreduce(idx, vals, n, op="avg", algorithm="dense")
    out["avg_donated"] = colltune.sparse_allreduce(idx, vals.clone(), n, op="avg", algorithm="dense", donate=True)
    few = (torch.arange(3) + rank) % n
    single_few = colltune.sparse_allreduce(few, vals[few], n, algorithm="dense")
    out["fused"] = colltune.sparse_allreduce_many([(idx, vals, (n, 4)), (few, vals[few], (n, 4))], algorithm="dense")
    out["few"] = single_few
    return {k: (v if isinstance(v, (bool, tuple)) else [(r.indices, r.values) for r in v] if isinstance(v, list)
                else (v.indices, v.values)) for k, v in out.items()}


@pytest.mark.parametrize("world_size", FAST_SIZES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_when_every_rank_holds_every_row_kept_donated_or_owned(world_size, dtype):
    """The holders split the sign fix: the same bits as allgather's exact sums, no -0.0, kept values untouched,
    donated ones reduced in place (fp32: no cast between) and donated indices handed back, and a fused bucket
    whose ranks fix every row they hold gives each tensor its own call's bits."""
    n = 37
    out = pool(world_size).run(_run_every_rank_every_row, n, dtype)
    ref_idx, ref_vals = out[0]["allgather"]
    for r, o in enumerate(out):
        assert o["caller_bits"] and o["shuffled_bits"], r
        # Donated fp32 values are reduced in place (bf16 ones are summed in an fp32 copy); donated indices are
        # handed back as the result's, and kept ones never are.
        assert o["in_place"] == (dtype == "float32", True, False), r
        for label in ("kept", "donated", "owned", "allgather"):
            idx, vals = o[label]
            assert torch.equal(idx, torch.arange(n)) and raw(vals) == raw(ref_vals), (label, r)
            assert _neg_zeros(vals) == 0, (label, r)
        assert raw(o["avg"][1]) == raw(o["avg_donated"][1]) and raw(o["avg"][1]) == raw(out[0]["avg"][1]), r
        (f_idx, f_vals), (g_idx, g_vals) = o["fused"]
        assert torch.equal(f_idx, ref_idx) and raw(f_vals) == raw(ref_vals), r
        assert torch.equal(g_idx, o["few"][0]) and raw(g_vals) == raw(o["few"][1]), r


def _run_donated_layouts(rank, world_size):
    """Every rank holds every row; its values donated as a strided view, a transposed tensor, an expanded one and an
    inference tensor, or kept as a transposed tensor: each call reduces them as their contiguous copy, with no error."""
    import colltune

    n, r = 24, 4
    g = torch.Generator().manual_seed(rank)
    base = torch.randint(-3, 4, (n, 2 * r), generator=g).float()
    with torch.inference_mode():
        frozen = base[:, :r].clone()
    layouts = {
        "strided": base[:, :r],
        "transposed": base[:, :r].t().contiguous().t(),
        "expanded": base[:1, :r].expand(n, r),
        "inference": frozen,
    }
    out = {}
    for label, vals in layouts.items():
        want = vals.contiguous().clone()
        for donate in (True, False):
            res = colltune.sparse_allreduce(torch.arange(n), vals, n, algorithm="dense", donate=donate)
            ref = want.clone()
            torch.distributed.all_reduce(ref)
            out[(label, donate)] = torch.equal(res.indices, torch.arange(n)) and torch.equal(res.values, ref)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_donated_values_of_any_layout_are_reduced_exactly(world_size):
    for r, o in enumerate(pool(world_size).run(_run_donated_layouts)):
        assert all(o.values()), (r, o)


def _run_donate_argument(rank, world_size):
    import colltune
    from colltune.algorithms.errors import ColltuneTypeError, RemoteInputError

    try:
        colltune.sparse_allreduce(torch.arange(4), torch.ones(4), 4, donate="yes" if rank == 0 else False)
    except (ColltuneTypeError, RemoteInputError) as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("world_size", [1, 3])
def test_donate_must_be_a_bool_on_every_rank(world_size):
    out = pool(world_size).run(_run_donate_argument)
    assert out[0][0] == "ColltuneTypeError" and "donate must be True or False" in out[0][1]
    for name, msg in out[1:]:
        assert name == "RemoteInputError" and "donate" in msg


def _run_wire(rank, world_size, c):
    import colltune

    idx, vals = make_input(c, rank, world_size)
    out = {}
    for wire in ("accum", "value"):
        for op in ("sum", "avg"):
            res = colltune.sparse_allreduce(idx, vals, c["size"], op=op, algorithm="dense", knobs={"wire": wire})
            out[wire, op] = (res.indices, res.values, res.traffic.as_dict())
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dense_16_bit_wire_moves_half_the_bytes_with_the_same_bits_everywhere(world_size, dtype):
    c = case(seed=72, size=400, counts=_grow(world_size, 300, 20), row_shape=(16,), dtype=dtype)
    out = pool(world_size).run(_run_wire, c)
    dt = DTYPES[dtype]
    ref = reference(c, world_size)
    for r, o in enumerate(out):
        for key, (idx, vals, traffic) in o.items():
            assert torch.equal(idx, ref["union"]) and vals.dtype == dt, (r, key)
            assert raw(vals) == raw(out[0][key][1]), f"rank {r} {key}: not rank 0's bits"
        # fp32 on the wire: the suite's tolerance (one rounding); 16-bit: a rounding per rank and per addition.
        assert_close_to_reference(o["accum", "sum"][1], o["accum", "sum"][0], ref, dt, f"accum, rank {r}")
        idx, vals, _ = o["value", "sum"]
        got = torch.zeros_like(ref["dense"])
        got.index_copy_(0, idx, vals.double())
        assert bool(((got - ref["dense"]).abs() <= world_size * UNIT_ROUNDOFF[dt] * ref["magnitude"]).all()), r
        # avg divides the 16-bit sum in fp32 and rounds once: the same bits as dividing the returned sum.
        assert raw(o["value", "avg"][1]) == raw((vals.float() / world_size).to(dt)), r
        sent = {w: o[w, "sum"][2]["by_primitive"]["all_reduce"]["bytes"] for w in ("accum", "value")}
        assert sent["value"] * 2 == sent["accum"], sent


def _run_every_algorithm_16_bit(rank, world_size, c):
    import colltune

    idx, vals = make_input(c, rank, world_size)
    out = {}
    for a in registry.names():
        res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=a)
        out[a] = (res.indices, res.values)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_16_bit_error_bounds_of_every_algorithm(world_size, dtype, op):
    """16-bit rows are summed in fp32 everywhere; what differs is what travels. Dense's fp32 buffer rounds once:
    within u of the summed magnitudes. The sparse algorithms send each rank's fp32 sums in the value dtype (half
    the bytes) and round the total again: within 2u. Both hold whatever the order of the additions. With avg the
    total is divided in fp32 before that rounding (an Ok-Topk or hashpart owner divides its own sums before they
    travel), so every sparse algorithm gives allgather's bits, for sum and avg alike."""
    c = case(seed=73, size=64, counts=_grow(world_size, 200, 20), row_shape=(16,), dtype=dtype, op=op)
    dt = DTYPES[dtype]
    ref = reference(c, world_size)
    out = pool(world_size).run(_run_every_algorithm_16_bit, c)
    u = UNIT_ROUNDOFF[dt]
    worst = {}
    for algorithm, (idx, vals) in out[0].items():
        assert torch.equal(idx, ref["union"]), algorithm
        assert all(raw(o[algorithm][1]) == raw(vals) for o in out), algorithm  # the same bits on every rank
        if algorithm != "dense":
            assert raw(vals) == raw(out[0]["allgather"][1]), algorithm
        got = torch.zeros_like(ref["dense"])
        got.index_copy_(0, ref["union"], vals.double())
        worst[algorithm] = float(((got - ref["dense"]).abs() / ref["magnitude"].clamp_min(1e-300)).max()) / u
        # The last rounding also scales the error before it: u (1 + u) for dense's one 16-bit rounding of an
        # fp32 sum, 2 u + u^2 for two; fp32's own additions add far less than that u^2.
        bound = 1 if algorithm == "dense" else 2
        assert worst[algorithm] <= bound + u, (algorithm, worst)
    assert worst["dense"] < max(w for a, w in worst.items() if a != "dense"), worst  # the bounds differ in fact
