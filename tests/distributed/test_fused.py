"""The fused call against per-tensor calls, bit for bit, and its errors on every rank.

Every rank builds the same list of cases (mixed sizes, row shapes, dtypes,
empty tensors and empty ranks), reduces them one call each and in one
``sparse_allreduce_many`` call, and returns both; the parent checks that they
are the same bits and close to the float64 dense reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import colltune
from colltune.algorithms.sparse import device_path
from colltune.fused import index_spaces, plan_buckets

from harness import expect_error, pool
from sparse_cases import ALGORITHMS, assert_close_to_reference, case, make_input, raw, reference

ALL_SIZES = [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)]


def _mixed(p: int, op: str = "sum") -> list[dict]:
    """A list of tables as a model has them: scalars and rows, four dtypes, empty tensors and empty ranks."""
    grow = [10 + 7 * r for r in range(p)]
    return [
        case(seed=101, size=50, counts=grow, op=op),
        case(seed=102, size=40, counts=grow, row_shape=(4,), op=op),
        case(seed=103, size=5000, counts=[0] * p, row_shape=(4,), op=op),  # empty everywhere
        case(seed=104, size=300, counts=[0, *grow[1:]], row_shape=(16,), dtype="float16", op=op),  # rank 0 empty
        case(seed=105, size=64, counts=[30] * p, row_shape=(2, 2), pattern="identical", op=op),  # same width as (4,)
        case(seed=106, size=2**20, counts=grow, dtype="bfloat16", row_shape=(8,), index_dtype="int32", op=op),
        case(seed=107, size=7, counts=[20] * p, dtype="float64", op=op),
        case(seed=108, size=1, counts=[3] * p, op=op),
        case(seed=109, size=400, counts=[25] * p, pattern="disjoint", row_shape=(4,), op=op),
    ]


def _inputs(cases: list[dict], rank: int, p: int, as_coo: set[int] = frozenset()) -> list:
    items = []
    for i, c in enumerate(cases):
        idx, vals = make_input(c, rank, p)
        size = (c["size"], *c["row_shape"])
        items.append(torch.sparse_coo_tensor(idx.long().view(1, -1), vals, size) if i in as_coo else (idx, vals, size))
    return items


def _as_dict(res) -> dict:
    return {"indices": res.indices.clone(), "values": res.values.clone(), "algorithm": res.algorithm}


def _run_both(rank, world_size, cases, algorithm, cap_mb, calls=1, device=False):
    with device_path(device):
        return _both(rank, world_size, cases, algorithm, cap_mb, calls)


def _both(rank, world_size, cases, algorithm, cap_mb, calls):
    from colltune.select.selector import Selector

    op = cases[0]["op"]
    items = _inputs(cases, rank, world_size, as_coo={1, 4})
    out = []
    # Online correction off: under auto, measured times could send a bucket and its tensors' own calls to
    # algorithms that round differently, which is not what this test compares.
    sel = Selector(environ={}, online=False)
    for _ in range(calls):
        single = [colltune.sparse_allreduce(*(it if isinstance(it, tuple) else (it,)), op=op, algorithm=algorithm,
                                            policy=sel if algorithm == "auto" else None) for it in items]
        fused = colltune.sparse_allreduce_many(items, op=op, algorithm=algorithm, bucket_cap_mb=cap_mb, name="tables",
                                               policy=sel if algorithm == "auto" else None)
        out.append({"single": [_as_dict(r) for r in single], "fused": [_as_dict(r) for r in fused]})
    return out


def _check(cases, world_size, out):
    for r, calls in enumerate(out):
        for c_i, got in enumerate(calls):
            for t, (s, f) in enumerate(zip(got["single"], got["fused"])):
                what = f"rank {r} call {c_i} tensors[{t}]"
                assert raw(f["indices"]) == raw(s["indices"]), what
                assert f["values"].dtype == s["values"].dtype and f["values"].shape == s["values"].shape, what
                assert raw(f["values"]) == raw(s["values"]), what
                assert raw(f["values"]) == raw(out[0][c_i]["fused"][t]["values"]), what + " differs from rank 0"
    for t, c in enumerate(cases):
        res = out[0][-1]["fused"][t]
        assert_close_to_reference(res["values"], res["indices"], reference(c, world_size), res["values"].dtype, f"[{t}]")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("cap_mb", [25.0, 1e-4])
@pytest.mark.parametrize("world_size", ALL_SIZES)
def test_fused_call_gives_each_tensor_the_bits_of_its_own_call(world_size, cap_mb, algorithm):
    cases = _mixed(world_size)
    _check(cases, world_size, pool(world_size).run(_run_both, cases, algorithm, cap_mb, 2))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size,cap_mb", [(3, 25.0), (4, 25.0), (3, 1e-4)])
def test_fused_call_on_the_device_path(world_size, cap_mb, algorithm):
    # What CUDA tensors run (the backend's own collectives, torch where the host runs NumPy), on CPU tensors.
    # The second call is steady: Ok-Topk's counts per region and hashpart's per owner ride in its record, and
    # reach a bucket only where its space forms one (not with the tiny cap, which gives a bucket per tensor).
    cases = _mixed(world_size)
    _check(cases, world_size, pool(world_size).run(_run_both, cases, algorithm, cap_mb, 2, True))


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_avg(world_size):
    cases = _mixed(world_size, op="avg")
    _check(cases, world_size, pool(world_size).run(_run_both, cases, "auto", 25.0))


def _same_size_spaces(rank, world_size, cases, device):
    items = _inputs(cases, rank, world_size)
    out = []
    with device_path(device):
        for _ in range(5):
            res = colltune.sparse_allreduce_many(items, algorithm="oktopk", knobs={"boundary_refresh": 2})
            out.append([(raw(r.indices), raw(r.values), r.indices, r.values) for r in res])
    return out


@pytest.mark.parametrize("device", [False, True])
def test_spaces_of_one_size_run_on_the_boundaries_their_counts_were_cut_by(device):
    # Ok-Topk keeps its boundaries per size, so these three spaces (three row shapes or dtypes, one size) share
    # them: with a refresh every 2 calls, one bucket's refresh moves them before the next bucket runs, and
    # the counts that bucket's payload carries (cut before the call) no longer hold; it exchanges its own.
    grow = [40, 55, 70]
    cases = [case(seed=400, size=500, counts=grow), case(seed=401, size=500, counts=grow, row_shape=(4,)),
             case(seed=402, size=500, counts=grow, dtype="float64")]
    out = pool(3).run(_same_size_spaces, cases, device)
    for r, calls in enumerate(out):
        for c_i, call in enumerate(calls):
            for t, ((idx_bits, val_bits, idx, vals), c) in enumerate(zip(call, cases)):
                assert (idx_bits, val_bits) == out[0][c_i][t][:2], f"rank {r} call {c_i} tensors[{t}] differs from rank 0"
                assert_close_to_reference(vals, idx, reference(c, 3), vals.dtype, f"call {c_i} [{t}]")


def _run_many_tables(rank, world_size, t, calls):
    # More tensors than the first record's slot holds counts for: a gather of its own, then a grown slot.
    cases = [case(seed=200 + i, size=20 + i, counts=[i % 4 + r for r in range(world_size)]) for i in range(t)]
    items = _inputs(cases, rank, world_size)
    got = []
    for _ in range(calls):
        before = colltune.algorithms.meta.slot_bytes(colltune.algorithms.Comm(None, torch.device("cpu")))
        res = colltune.sparse_allreduce_many(items, algorithm="allgather")
        got.append((before, [raw(r.values) for r in res], [raw(r.indices) for r in res]))
    single = [colltune.sparse_allreduce(*it, algorithm="allgather") for it in items]
    return got, [raw(r.values) for r in single], [raw(r.indices) for r in single]


def test_many_tables_more_than_the_slot_holds():
    out = pool(2).run(_run_many_tables, 300, 3)
    for got, single_vals, single_idx in out:
        assert got[0][0] < 8 * 300 <= got[-1][0], [g[0] for g in got]  # the slot grew to hold the counts
        for _, vals, idx in got:
            assert vals == single_vals and idx == single_idx


def _run_async(rank, world_size):
    cases = _mixed(world_size)
    items = _inputs(cases, rank, world_size)
    handle = colltune.sparse_allreduce_many(items, async_op=True)
    plain = torch.full((4,), float(rank))
    torch.distributed.all_reduce(plain)
    res = handle.wait()
    single = [colltune.sparse_allreduce(*it) for it in items]
    return [raw(r.values) == raw(s.values) for r, s in zip(res, single)], plain.tolist()


def test_async_fused_call_beside_a_plain_collective():
    for same, plain in pool(3).run(_run_async):
        assert all(same) and plain == [3.0] * 4


def _run_disagree(rank, world_size, how):
    cases = _mixed(world_size)
    items = _inputs(cases, rank, world_size)
    kw = {}
    if rank == 1:
        if how == "length":
            items = items[:-1]
        elif how == "size":
            idx, vals, size = items[6]
            items[6] = (idx, vals, (size[0] + 1,))
        elif how == "dtype":
            idx, vals, size = items[2]
            items[2] = (idx, vals.double(), size)
        elif how == "cap":
            kw["bucket_cap_mb"] = 1.0
        elif how == "bad_item":
            items[3] = "not a tensor"
        elif how == "bad_index":
            idx, vals, size = items[0]
            items[0] = (idx + size[0], vals, size)
    return expect_error(colltune.sparse_allreduce_many, items, **kw)


@pytest.mark.parametrize("how, expect", [
    ("length", "the number of tensors"),
    ("size", "tensors[6]"),
    ("dtype", "tensors[2]"),
    ("cap", "bucket_cap_mb"),
])
def test_ranks_that_pass_different_lists_all_raise(how, expect):
    out = pool(3).run(_run_disagree, how)
    for r, o in enumerate(out):
        assert o.isa("RankMismatchError"), (r, o)
        assert expect in o.message, (r, o.message)


@pytest.mark.parametrize("how, expect", [("bad_item", "tensors[3]"), ("bad_index", "tensors[0]")])
def test_a_bad_tensor_on_one_rank_raises_on_every_rank(how, expect):
    out = pool(3).run(_run_disagree, how)
    assert out[1].isa("ColltuneError") and expect in out[1].message, out[1]
    for r in (0, 2):
        assert out[r].isa("RemoteInputError") and "'tensors'" in out[r].message, out[r]
    # The group is still in step: a normal call afterwards works.
    assert all(not o.raised for o in pool(3).run(_run_disagree, "none"))


def test_empty_list_and_bad_arguments_locally():
    assert colltune.sparse_allreduce_many([]) == []
    for bad, arg in (("x", "tensors"), ([(torch.tensor([0]), torch.ones(1))], "tensors")):
        with pytest.raises(colltune.ColltuneError, match="tensors"):
            colltune.sparse_allreduce_many(bad)
    for cap in (0, -1.0, float("nan"), "25", True):
        with pytest.raises(colltune.ColltuneError, match="bucket_cap_mb"):
            colltune.sparse_allreduce_many([], bucket_cap_mb=cap)
    for kw, arg in (({"op": "max"}, "op"), ({"algorithm": "nope"}, "algorithm")):  # checked for an empty list too
        with pytest.raises(colltune.ColltuneError, match=arg):
            colltune.sparse_allreduce_many([], **kw)


def test_plan_buckets():
    keys = [(1, "f"), (4, "f"), (1, "f"), (1, "h"), (1, "f"), (4, "f")]
    nbytes = np.array([[10, 50, 10, 5, 30, 60], [20, 0, 10, 5, 30, 60]], dtype=float)
    # Cap 45: tensors 0 and 2 share one bucket (30 on the larger rank), 4 would make 60; 1 and 5 make 110.
    assert plan_buckets(keys, nbytes, 45) == [[0, 2], [1], [3], [4], [5]]
    assert plan_buckets(keys, nbytes, 1000) == [[0, 2, 4], [1, 5], [3]]
    assert plan_buckets(keys, nbytes, 1) == [[0], [1], [2], [3], [4], [5]]
    assert plan_buckets([], np.zeros((2, 0)), 10) == []


def _greedy(keys, nbytes, cap):
    """The rule plan_buckets documents, tensor by tensor."""
    open_, done = {}, []
    for t, key in enumerate(keys):
        if key in open_ and (open_[key][1] + nbytes[:, t]).max() > cap:
            done.append(open_.pop(key)[0])
        members, load = open_.setdefault(key, ([], np.zeros(nbytes.shape[0])))
        members.append(t)
        load += nbytes[:, t]
    return sorted(done + [m for m, _ in open_.values()], key=lambda m: m[0])


def test_plan_buckets_follows_its_rule_whether_every_key_fits_or_not():
    """One bucket per key where each key's tensors fit together (no pass per tensor), else tensor by tensor."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        t, p = int(rng.integers(1, 30)), int(rng.integers(1, 5))
        keys = [("f", int(k)) for k in rng.integers(0, 3, t)]
        nbytes = rng.integers(0, 100, (p, t)).astype(float)
        for cap in (1, 50, 300, 3000):
            assert plan_buckets(keys, nbytes, cap) == _greedy(keys, nbytes, cap), (keys, nbytes, cap)


def test_index_spaces_never_pass_int64():
    f32 = (1, torch.float32)
    big = 2**62
    assert index_spaces([f32, f32, f32], [big, big, 10]) == [(*f32, 0), (*f32, 1), (*f32, 1)]
    assert index_spaces([f32, (4, torch.float32), f32], [big, big, big - 1]) == [
        (*f32, 0), (4, torch.float32, 0), (*f32, 0)]  # 2^63 - 1 rows in one space: the most int64 indexes
    assert index_spaces([f32], [2**63 - 1]) == [(*f32, 0)]


def _rank_huge_tables(rank: int, world_size: int, device: bool, algorithm: str) -> list:
    big = 2**62
    tensors = [
        (torch.tensor([5, big - 1 - rank]), torch.full((2,), 1.0 + rank), big),
        (torch.tensor([rank, 7]), torch.full((2,), 2.0), big),
        (torch.tensor([3]), torch.ones(1), 10),
    ]
    with device_path(device):
        return [(r.indices.tolist(), r.values.tolist()) for r in
                colltune.sparse_allreduce_many(tensors, algorithm=algorithm)]


@pytest.mark.parametrize("device", [False, True])
@pytest.mark.parametrize("algorithm", ["auto", "allgather", "oktopk"])
def test_tables_whose_index_spaces_together_pass_int64_are_reduced_exactly(device, algorithm):
    big, p = 2**62, 2
    out = pool(p).run(_rank_huge_tables, device, algorithm)
    first = sorted({5, *(big - 1 - r for r in range(p))})
    want = [
        (first, [float(sum(1 + r for r in range(p)))] + [float(1 + r) for r in reversed(range(p))]),
        (sorted({*range(p), 7}), [2.0] * p + [2.0 * p]),
        ([3], [float(p)]),
    ]
    assert out[0] == out[1] == want


def test_dense_parts_summed_together_in_chunks_keep_their_bits():
    # Twelve tables of 40 KB each: every one an all_reduce sums directly (rank order), together more than
    # one exchange may carry, so they travel in several chunks; each still has its own call's bits.
    cases = [case(seed=300 + i, size=10_000, counts=[500 + 50 * r for r in range(3)]) for i in range(12)]
    _check(cases, 3, pool(3).run(_run_both, cases, "dense", 25.0))


def _run_dense_parts(rank, world_size, cases, knobs, device):
    items = _inputs(cases, rank, world_size)
    if rank == 0:  # rank 0 holds every row of table 0: that table's union is all its rows
        n, shape = cases[0]["size"], cases[0]["row_shape"]
        items[0] = (torch.arange(n), torch.randn((n, *shape), generator=torch.Generator().manual_seed(3)), (n, *shape))
    with device_path(device):
        single = [colltune.sparse_allreduce(*it, algorithm="dense", knobs=knobs) for it in items]
        fused = colltune.sparse_allreduce_many(items, algorithm="dense", knobs=knobs)
        every = colltune.sparse_allreduce_many(items[:1] * 3, algorithm="dense", knobs=knobs)  # every row present
    return [{"single": [_as_dict(r) for r in single], "fused": [_as_dict(r) for r in fused]},
            {"single": [_as_dict(single[0])] * 3, "fused": [_as_dict(r) for r in every]}]


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("knobs", [None, {"wire": "value"}], ids=["accum", "wire16"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_dense_parts_with_16_bit_wire_and_every_row_present_keep_their_bits(world_size, knobs, device):
    grow = [30 + 5 * r for r in range(world_size)]
    cases = [
        case(seed=310, size=200, counts=grow, row_shape=(4,)),
        case(seed=311, size=120, counts=grow, row_shape=(8,), dtype="bfloat16"),
        case(seed=312, size=90, counts=[0, *grow[1:]], row_shape=(8,), dtype="float16"),
        case(seed=313, size=60, counts=grow, row_shape=(8,), dtype="bfloat16", pattern="cancel"),
    ]
    out = pool(world_size).run(_run_dense_parts, cases, knobs, device)
    for r, calls in enumerate(out):
        for got in calls:
            for t, (s, f) in enumerate(zip(got["single"], got["fused"])):
                assert raw(f["indices"]) == raw(s["indices"]) and raw(f["values"]) == raw(s["values"]), (r, t)
                assert f["values"].dtype == s["values"].dtype, (r, t)
        assert torch.equal(calls[1]["fused"][0]["indices"], torch.arange(cases[0]["size"]))
        assert raw(calls[0]["fused"][1]["values"]) == raw(out[0][0]["fused"][1]["values"]), r
