"""The hash-partitioned algorithm (``hashpart``) against the reference and allgather.

The parent checks, per case and world size:

* the result against the float64 dense reference (the union, values within
  the dtype's tolerance);
* the same bits as the allgather algorithm's result on the same inputs (the
  exactness check: both sum every index in rank order, in the accumulation
  dtype, and round once);
* the same bits on every rank and every repeat, on the host path and on the
  device path (``device_path()`` on CPU tensors), which give the same bits;
* the device path audited: no atomics, no place written twice, and no more
  host synchronizations than ``HashPart.HOST_SYNCS`` declares;
* top-k mode: TopkA's result (allgather's top-k), bit for bit;
* the owners' balance and the bytes per rank on Zipf-skewed indices.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import colltune
from colltune.algorithms.hashpart import HashPart, hash_owner, hash_owner_host
from colltune.algorithms.sparse import device_path

from harness import pool
from sparse_cases import DTYPES, assert_close_to_reference, case, make_input, raw, reference

SIZES = [1, 2, 3, 4]


# ------------------------------------------------------------------ cases


def _grow(p, base, step=3, empty=()):
    return [0 if r in empty else base + step * r for r in range(p)]


def _explicit(index_lists, seed, row_shape=(), dtype="float32", size=None, op="sum") -> dict:
    """A case of given indices per rank, with random values (deterministic from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    width = int(np.prod(row_shape)) if row_shape else 1
    values = [torch.randn(len(ix) * width, generator=g, dtype=torch.float64).tolist() for ix in index_lists]
    size = size if size is not None else max([max(ix) for ix in index_lists if ix] + [0]) + 1
    return case(pattern="explicit", indices=[list(map(int, ix)) for ix in index_lists], values=values, size=size,
                row_shape=row_shape, dtype=dtype, op=op, seed=seed)


def zipf_ids(n: int, count: int, seed: int, s: float = 1.1) -> list[int]:
    """``count`` ids in ``[0, n)``, Zipf(``s``)-distributed (id 0 the hottest), as ``tools/fused_bench.py`` draws them."""
    u = torch.rand(count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    a = 1.0 - s
    x = ((n + 1) ** a - 1) * u + 1
    return (x ** (1 / a) - 1).long().clamp_(0, n - 1).tolist()


def _zipf(p, n=20_000, count=600, seed=70, **kw) -> dict:
    return _explicit([zipf_ids(n, count + 50 * r, seed * 100 + r) for r in range(p)], seed, size=n, **kw)


def _one_owner(p, size=3000, count=40, seed=80, **kw) -> dict:
    """Every rank's indices drawn among those that hash to owner 0."""
    pool_ = np.flatnonzero(hash_owner_host(np.arange(size), p) == 0)
    rng = np.random.default_rng(seed)
    return _explicit([rng.choice(pool_, count + 5 * r).tolist() for r in range(p)], seed, size=size, **kw)


SCENARIOS = {
    "random_dups": lambda p: case(seed=1, size=50, counts=_grow(p, 40)),
    "random_int32": lambda p: case(seed=2, size=60, counts=_grow(p, 30, 5), index_dtype="int32"),
    "empty_rank0": lambda p: case(seed=3, size=40, counts=_grow(p, 20, empty=(0,))),
    "only_last_rank": lambda p: case(seed=4, size=40, counts=[0] * (p - 1) + [25]),
    "all_empty": lambda p: case(seed=5, size=40, counts=[0] * p),
    "identical_sets": lambda p: case(seed=6, size=100, counts=[30] * p, pattern="identical"),
    "strided_disjoint": lambda p: case(seed=7, size=400, counts=[25] * p, pattern="disjoint"),
    "rows_3x2": lambda p: case(seed=8, size=40, counts=_grow(p, 15, 2), row_shape=(3, 2)),
    "float64": lambda p: case(seed=9, size=50, counts=_grow(p, 35), dtype="float64"),
    "float16": lambda p: case(seed=10, size=50, counts=_grow(p, 35), dtype="float16"),
    "bfloat16": lambda p: case(seed=11, size=50, counts=_grow(p, 35), dtype="bfloat16"),
    "avg_float32": lambda p: case(seed=13, size=50, counts=_grow(p, 30), op="avg"),
    "avg_float16": lambda p: case(seed=12, size=50, counts=_grow(p, 30), op="avg", dtype="float16"),
    "avg_bfloat16_rows": lambda p: case(seed=14, size=30, counts=_grow(p, 20), op="avg", dtype="bfloat16", row_shape=(2,)),
    "wide_rows_float16_avg": lambda p: case(seed=25, size=200, counts=_grow(p, 30), op="avg", dtype="float16", row_shape=(16,)),
    "wide_rows_bfloat16_int32": lambda p: case(seed=26, size=120, counts=_grow(p, 25), dtype="bfloat16", row_shape=(32,), index_dtype="int32"),
    "wide_rows_float64": lambda p: case(seed=27, size=150, counts=_grow(p, 30, empty=(0,)), dtype="float64", row_shape=(8,)),
    "cancel_to_zero_kept": lambda p: case(seed=16, size=30, counts=[12] * p, pattern="cancel"),
    "large_size_sparse": lambda p: case(seed=17, size=200_000, counts=_grow(p, 300, 50)),
    "size_one": lambda p: case(seed=19, size=1, counts=[3] * p),
    "zero_width_rows": lambda p: case(seed=63, size=30, counts=_grow(p, 10), row_shape=(0,)),
    "noncontiguous": lambda p: case(seed=20, size=50, counts=_grow(p, 20), row_shape=(2,), noncontig=True),
    "one_shared_entry": lambda p: case(seed=33, size=4096, counts=[1] * p, pattern="identical"),
    "single_hot_index": lambda p: _explicit([[77] * (5 + r) for r in range(p)], 34, size=1000),
    "hot_index_and_rows": lambda p: _explicit([[9] * 20 + list(range(r, 300, 7)) for r in range(p)], 35, row_shape=(4,), dtype="bfloat16"),
    "all_on_one_owner": lambda p: _one_owner(p),
    "all_on_one_owner_rows_avg": lambda p: _one_owner(p, seed=81, row_shape=(8,), dtype="float16", op="avg"),
    "zipf": lambda p: _zipf(p),
    "zipf_rows_bfloat16": lambda p: _zipf(p, n=5000, count=300, seed=71, row_shape=(16,), dtype="bfloat16"),
}


# ------------------------------------------------------------------ rank functions


def _record(res) -> dict:
    return {"indices": res.indices.clone(), "values": res.values.clone(), "algorithm": res.algorithm,
            "bytes_sent": res.traffic.bytes_sent, "meta_bytes": res.traffic.meta_bytes}


def _both_algorithms(rank, world_size, cases, device, repeat=2, knobs=None):
    """Per case: ``repeat`` hashpart calls and one allgather call on this rank's input."""
    with device_path(device):
        out = []
        for c in cases:
            idx, vals = make_input(c, rank, world_size)
            before = (raw(idx), raw(vals))
            runs = [_record(colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm="hashpart", knobs=knobs))
                    for _ in range(repeat)]
            ref = _record(colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm="allgather"))
            out.append({"hashpart": runs, "allgather": ref, "unchanged": before == (raw(idx), raw(vals))})
        return out


def _check(c: dict, world_size: int, per_rank: list, what: str) -> None:
    ref = reference(c, world_size)
    dtype = DTYPES[c["dtype"]]
    first = per_rank[0]["hashpart"][0]
    for r, rec in enumerate(per_rank):
        assert rec["unchanged"], f"{what}, rank {r}: the call modified its inputs"
        for i, got in enumerate(rec["hashpart"]):
            where = f"{what}, rank {r}, call {i}"
            idx, vals = got["indices"], got["values"]
            assert got["algorithm"] == "hashpart", where
            assert idx.dtype == torch.int64 and torch.equal(idx, ref["union"]), f"{where}: not the union"
            assert vals.dtype == dtype and tuple(vals.shape) == (idx.numel(), *c["row_shape"]), where
            assert_close_to_reference(vals, idx, ref, dtype, where)
            # The exactness check: allgather's bits, and the same bits on every rank and every call.
            assert raw(idx) == raw(rec["allgather"]["indices"]), f"{where}: indices differ from allgather's"
            assert raw(vals) == raw(rec["allgather"]["values"]), f"{where}: values differ from allgather's bitwise"
            assert raw(idx) == raw(first["indices"]) and raw(vals) == raw(first["values"]), f"{where}: differs from rank 0"
            if world_size == 1:
                assert got["bytes_sent"] == 0, where
            elif ref["union"].numel():
                assert got["bytes_sent"] > 0, f"{where}: no traffic counted"


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("device", [False, True], ids=["host_path", "device_path"])
@pytest.mark.parametrize("world_size", SIZES)
def test_matches_the_reference_and_allgather_bit_for_bit(world_size, device):
    cases = [make(world_size) for make in SCENARIOS.values()]
    out = pool(world_size).run(_both_algorithms, cases, device, timeout=120)
    for j, (name, c) in enumerate(zip(SCENARIOS, cases)):
        _check(c, world_size, [rank_out[j] for rank_out in out], f"{name} at P={world_size}")


@pytest.mark.slow
def test_eight_ranks():
    cases = [SCENARIOS[name](8) for name in ("random_dups", "all_on_one_owner", "zipf", "wide_rows_float16_avg", "float16")]
    for device in (False, True):
        out = pool(8).run(_both_algorithms, cases, device, timeout=300)
        for j, c in enumerate(cases):
            _check(c, 8, [rank_out[j] for rank_out in out], f"case {j} at P=8, device path {device}")


def test_the_host_and_device_paths_give_the_same_bits():
    cases = [SCENARIOS[name](3) for name in ("random_dups", "bfloat16", "zipf_rows_bfloat16", "cancel_to_zero_kept")]
    host = pool(3).run(_both_algorithms, cases, False, 1)
    dev = pool(3).run(_both_algorithms, cases, True, 1)
    for r in range(3):
        for j in range(len(cases)):
            a, b = host[r][j]["hashpart"][0], dev[r][j]["hashpart"][0]
            assert raw(a["indices"]) == raw(b["indices"]) and raw(a["values"]) == raw(b["values"]), (r, j)
            assert a["bytes_sent"] == b["bytes_sent"], (r, j, a["bytes_sent"], b["bytes_sent"])


@pytest.mark.parametrize("gather_mode", ["pad", "alltoall"])
def test_every_gather_mode_gives_the_same_bits(gather_mode):
    cases = [SCENARIOS[name](3) for name in ("random_dups", "empty_rank0", "all_on_one_owner_rows_avg", "zipf")]
    for device in (False, True):
        out = pool(3).run(_both_algorithms, cases, device, 1, {"gather_mode": gather_mode})
        for j, c in enumerate(cases):
            _check(c, 3, [rank_out[j] for rank_out in out], f"case {j}, gather_mode {gather_mode}, device path {device}")


def _audited(rank, world_size, row_shape, k):
    from dispatch_audit import audit

    g = torch.Generator().manual_seed(rank)
    n = 1 << 14
    idx = torch.randint(0, n, (k,), generator=g)
    vals = torch.randn((k, *row_shape), generator=g)
    with device_path():
        earlier = [raw(colltune.sparse_allreduce(idx, vals, size=n, algorithm="hashpart", name="hashpart-budget").values)
                   for _ in range(3)]
        with audit() as a:  # raises on atomics and on places written twice
            res = colltune.sparse_allreduce(idx, vals, size=n, algorithm="hashpart", name="hashpart-budget")
    return a.n_syncs, dict(a.syncs), raw(res.values), earlier


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("row_shape,k", [((), 40), ((16,), 900)])
def test_the_device_path_is_deterministic_and_within_its_host_syncs(world_size, row_shape, k):
    out = pool(world_size).run(_audited, row_shape, k)
    for syncs, which, bits, earlier in out:
        assert syncs <= HashPart.HOST_SYNCS["exact"], which
        assert bits == out[0][2] and all(b == bits for b in earlier)  # every rank, every call


def _topk(rank, world_size, dtype, device):
    from colltune.algorithms.state import TopkState

    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(3000, generator=g).round(decimals=1).to(DTYPES[dtype]) for _ in range(4)]  # ties included
    out = {}
    with device_path(device):
        for algorithm in ("hashpart", "allgather"):
            state = TopkState(density=0.02)
            steps = []
            for grad in grads:
                res = colltune.topk_allreduce(grad, state, algorithm=algorithm)
                steps.append((res.indices.clone(), raw(res.values), res.sent_indices.clone(), res.global_count))
            out[algorithm] = steps
    return out


@pytest.mark.parametrize("world_size,dtype,device", [(1, "float32", False), (3, "float32", False), (2, "bfloat16", False),
                                                     (3, "float16", True), (4, "float64", True)])
def test_topk_mode_is_topka_bit_for_bit(world_size, dtype, device):
    out = pool(world_size).run(_topk, dtype, device)
    for r, rank_out in enumerate(out):
        for step, (mine, theirs) in enumerate(zip(rank_out["hashpart"], rank_out["allgather"])):
            assert torch.equal(mine[0], theirs[0]) and mine[1] == theirs[1], (r, step)
            assert torch.equal(mine[2], theirs[2]) and mine[3] == theirs[3], (r, step)
            assert mine[1] == out[0]["hashpart"][step][1], (r, step)


def _fused(rank, world_size):
    from test_fused import _both, _mixed

    return _both(rank, world_size, _mixed(world_size, "avg"), "hashpart", 0.001, 1)


def test_a_fused_call_gives_the_per_tensor_bits():
    from test_fused import _check as check_fused
    from test_fused import _mixed

    out = pool(3).run(_fused)
    check_fused(_mixed(3, "avg"), 3, out)


# ------------------------------------------------------------------ the hash, the schedule, the balance, the bytes


@pytest.mark.parametrize("mode", ["exact", "topk"])
@pytest.mark.parametrize("world_size", [1, 4, 64])
def test_the_schedule_prices_every_term(mode, world_size):
    from colltune.model.cost_model import DEFAULT_PRIMITIVES, AnalyticModel
    from colltune.model.features import Features

    ks = [500 + 10 * r for r in range(world_size)]
    f = Features.build(numel=2**20, row_numel=16, dtype="float16", k_per_rank=ks, union=1.5 * max(ks), mode=mode)
    terms = AnalyticModel(DEFAULT_PRIMITIVES).terms(f)
    assert list(terms["hashpart"]) == list(HashPart.TERMS)
    assert all(t >= 0 for t in terms["hashpart"].values()), terms["hashpart"]
    if world_size == 1:
        assert sum(v for k, v in terms["hashpart"].items() if k not in ("owner_reduce", "unpack_sort")) == 0


def test_the_hash_is_the_same_in_numpy_and_torch_and_mixes_strided_sets():
    mask = (1 << 64) - 1

    def splitmix_owner(i: int, p: int) -> int:  # the reference, in Python's unbounded integers
        z = (i + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return (((z ^ (z >> 31)) >> 32) * p) >> 32

    rng = np.random.default_rng(0)
    idx = np.concatenate([np.arange(300), rng.integers(0, 2**63 - 1, 300), [2**31 - 1, 2**31, 2**63 - 1]])
    for p in (1, 2, 3, 8, 1000, 2**20):
        host, dev = hash_owner_host(idx, p), hash_owner(torch.from_numpy(idx), p).numpy()
        assert host.tolist() == dev.tolist() == [splitmix_owner(int(i), p) for i in idx], p
    for p in (4, 8):
        for ids in (np.arange(40_000), np.arange(3, 40_000 * p, p), np.arange(0, 2**40, 2**24)):
            load = np.bincount(hash_owner_host(ids, p), minlength=p)
            assert load.max() <= 1.05 * load.mean(), (p, load)


def _traffic(rank, world_size, c):
    import torch.distributed as dist

    idx, vals = make_input(c, rank, world_size)
    out = {}
    for algorithm in ("hashpart", "oktopk", "allgather"):
        group = dist.new_group()  # its own eager slot, sized by its own calls only
        for _ in range(3):  # steady state: Ok-Topk's boundaries and the eager slot settled
            res = colltune.sparse_allreduce(idx, vals, c["size"], algorithm=algorithm, group=group)
        out[algorithm] = {"bytes": res.traffic.bytes_sent, "meta": res.traffic.meta_bytes,
                          "by_primitive": res.traffic.by_primitive}
        dist.destroy_process_group(group)
    return out


def test_zipf_skew_is_balanced_over_owners_and_moves_fewer_bytes_than_allgather():
    p = 4
    c = _zipf(p, n=100_000, count=4000, seed=90)
    # Owner loads: each rank's coalesced indices, by owner.
    sets = [np.unique(np.asarray(ix)) for ix in c["indices"]]
    received = sum(np.bincount(hash_owner_host(s, p), minlength=p) for s in sets)
    union = np.unique(np.concatenate(sets))
    shares = np.bincount(hash_owner_host(union, p), minlength=p)
    assert received.max() <= 1.1 * received.mean() and shares.max() <= 1.1 * shares.mean(), (received, shares)
    out = pool(p).run(_traffic, c)
    most = {a: max(rank_out[a]["bytes"] for rank_out in out) for a in ("hashpart", "oktopk", "allgather")}
    # The busiest rank bounds the call: Ok-Topk's regions, balanced on entries, reduce to unequal sizes under skew.
    assert most["hashpart"] < most["allgather"] and most["hashpart"] < most["oktopk"], most
