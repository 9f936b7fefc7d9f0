"""The algorithms' cost schedules and the record's sizes at every world size (no process group).

``tests/distributed/test_scale.py`` checks the priced bytes against the
bytes real calls count at P = 2 to 4; this file checks what needs no call:
the schedules' shape in both modes, the paper's Eq. 3 bound over world sizes
to 1024, the record and eager slot at large world sizes, and the balance
step's plan.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from colltune.algorithms import registry, sizes
from colltune.algorithms.base import Algorithm
from colltune.algorithms.errors import ColltuneValueError
from colltune.algorithms.schedule import Pricing
from colltune.model.features import Features

WORLD_SIZES = (2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _features(p: int, n: int, k: int, union: float | None = None, row: int = 1, dtype: str = "float32") -> Features:
    return Features.build(numel=n, row_numel=row, dtype=dtype, k_per_rank=[k] * p,
                          union=min(n, p * k) if union is None else union)


def _steps(name: str, f: Features, mode: str, **knobs) -> dict:
    algo = registry.get(name)
    return {s.term: s for s in algo.schedule(Pricing(f, mode=mode), {**algo.knobs, **knobs})}


@pytest.mark.parametrize("mode", ["exact", "topk"])
@pytest.mark.parametrize("name", registry.names())
def test_every_schedule_returns_its_terms_in_both_modes(name, mode):
    algo = registry.get(name)
    if type(algo).schedule is Algorithm.schedule and name not in registry.BUILTIN_NAMES:
        pytest.skip(f"algorithm {name!r} has no cost schedule (optional: run by name, never priced)")
    for p in (1, 2, 1024):
        steps = algo.schedule(Pricing(_features(p, 2**20, 1000), mode=mode), algo.knobs)
        assert tuple(s.term for s in steps) == algo.TERMS
        assert all(s.calls >= 0 and s.steps >= 0 and s.nbytes >= 0 for s in steps)
        if p == 1:
            assert all(s.nbytes == 0 for s in steps if s.primitive != "local")


def test_mode_comes_from_the_features_or_the_argument():
    f = _features(4, 2**16, 100)
    assert Pricing(f).mode == "exact" and Pricing(f, mode="topk").topk
    with pytest.raises(ColltuneValueError, match="mode"):
        Pricing(f, mode="approx")


def test_dense_sends_no_mask_in_either_mode():
    p, n = 8, 2**20
    f = _features(p, n, n, union=n)
    for mode in ("exact", "topk"):
        steps = _steps("dense", f, mode)
        assert steps["mask_all_reduce"].nbytes == 0 and steps["mask_all_reduce"].calls == 0, mode
        assert steps["value_all_reduce"].nbytes == pytest.approx(2 * (p - 1) / p * n * 4), mode


@pytest.mark.parametrize("dtype,width", [("bfloat16", 2), ("float16", 2), ("float32", 4), ("float64", 8)])
def test_dense_prices_the_rows_in_the_dtype_they_travel_in(dtype, width):
    p, n, row = 8, 2**20, 64
    f = _features(p, n, n, union=n, row=row, dtype=dtype)
    ring = 2 * (p - 1) / p * n * row
    value = _steps("dense", f, "exact", wire="value")["value_all_reduce"].nbytes
    accum = _steps("dense", f, "exact", wire="accum")["value_all_reduce"].nbytes
    assert value == pytest.approx(ring * width)
    assert accum == pytest.approx(ring * max(width, 4))  # 16-bit rows summed in fp32 move fp32's bytes


def test_dense_local_work_when_every_row_is_present_is_a_share_of_a_pass_and_the_indices():
    p, n, row = 4, 2**16, 64
    full = _steps("dense", _features(p, n, n, union=n, row=row), "exact")["densify_extract"]
    # Every rank holds every row: each fixes the signs of 1/P of its values in place; indices 0..n-1.
    assert full.nbytes == pytest.approx(n * row * 4 * 2 / p + 8 * n) and full.steps == 2
    one = _steps("dense", Features.build(numel=n, row_numel=row, dtype="float32", k_per_rank=[n, n // 2, n // 2, 1],
                                         union=n), "exact")["densify_extract"]
    # One rank holds every row: it fixes all of them; the others fill a buffer and copy theirs in.
    assert one.nbytes == pytest.approx(max(n * row * 4 * 2, n * row * 4 + (2 * n + 1) / 4 * (2 * row * 4 + 8))
                                       + 8 * n)
    sparse = _steps("dense", _features(p, n, n // 2, union=n, row=row), "exact")["densify_extract"]
    assert sparse.nbytes > one.nbytes > full.nbytes and sparse.steps > full.steps  # fill, copy, presence, gather


def test_topka_gathers_every_ranks_k_without_the_slot():
    p, k = 16, 1000
    steps = _steps("allgather", _features(p, 2**20, k), "topk")
    assert steps["entries_gather"].nbytes == (p - 1) * k * 8
    assert steps["metadata"].nbytes == (p - 1) * sizes.record_bytes(p)  # the record carries no entries


@pytest.mark.parametrize("p", [16, 256, 1024])
def test_oktopk_topk_gathers_about_k_not_the_union(p):
    n, k = 2**24, 16_384
    steps = _steps("oktopk", _features(p, n, k, union=p * k), "topk")
    words = steps["union_gather"].nbytes / 4
    assert words <= 2 * k * (p - 1) / p * 1.25  # k entries of 2 words, padded to ceil(k / P) at most
    assert steps["union_gather"].nbytes < 2 * (p - 1) * k * 8 / p  # far below the union's P k entries


def test_oktopk_topk_prices_its_threshold_exchanges():
    p, g = 8, 32
    steps = _steps("oktopk", _features(p, 2**20, 1000), "topk", global_refresh=g)
    radix = steps["threshold_all_reduce"]
    assert radix.calls == pytest.approx(4 / g)  # four all_reduces of 256 int32 counts on refreshes
    assert radix.nbytes == pytest.approx(4 / g * 2 * (p - 1) / p * 1024)
    sizes_ = steps["sizes_all_gather"]
    assert sizes_.calls == 1 and sizes_.nbytes == pytest.approx((p - 1) * 8 * (17 * (1 - 1 / g) + 1 / g))
    assert steps["counts_all_to_all"].calls == pytest.approx(1 / 64)  # in the record between boundary refreshes
    assert steps["balance_p2p"].primitive == "p2p" and steps["balance_p2p"].nbytes > 0
    exact = _steps("oktopk", _features(p, 2**20, 1000), "exact")
    assert exact["threshold_all_reduce"].nbytes == exact["balance_p2p"].nbytes == 0


def test_oktopk_topk_is_never_priced_above_eq3():
    """Over a grid to P = 1024: the data terms of Ok-Topk's top-k schedule stay within 6k(P-1)/P words."""
    algo = registry.get("oktopk")
    worst = 0.0
    for p in WORLD_SIZES:
        for n in (2**16, 2**20, 2**24, 340_000_000):
            for density in (1e-5, 1e-4, 1e-3, 1e-2, 5e-2):
                k = max(1, round(density * n))
                c = Pricing(_features(p, n, k), mode="topk")
                data = sum(s.nbytes for s in algo.schedule(c, algo.knobs)
                           if s.term in ("split_p2p", "balance_p2p", "union_gather"))
                eq3 = 6 * k * (p - 1) / p * (c.e / 2)  # a word: an index or a value, half an entry
                worst = max(worst, data / eq3)
                assert data <= eq3, f"P={p} n={n} density={density}: priced {data:.0f} B of entries > Eq. 3's {eq3:.0f} B"
    assert worst > 1 / 3  # it does price the entries: at least the lower bound, a third of Eq. 3


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_oktopk_exact_counts_ride_in_the_record_at_every_world_size(p):
    steps = _steps("oktopk", _features(p, 2**24, 10_000), "exact", boundary_refresh=64)
    assert steps["counts_all_to_all"].calls == pytest.approx(1 / 64)  # refreshes only, whatever P
    record = sizes.HEADER_BYTES + sizes.eager_capacity(p) + sizes.payload_reserve(p)
    assert steps["metadata"].nbytes == (p - 1) * record


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_oktopk_topk_counts_ride_in_the_record_at_every_world_size(p):
    # The local selection runs before the metadata exchange while the boundaries are cached, so its counts per
    # region ride in the record (grown by 8 P bytes from P = 64 on) and only refreshes send them by all_to_all.
    for refresh in (1, 8, 64):
        steps = _steps("oktopk", _features(p, 2**24, 10_000), "topk", boundary_refresh=refresh)
        assert steps["counts_all_to_all"].calls == pytest.approx(1 / refresh)
        assert steps["counts_all_to_all"].calls == steps["boundaries_all_reduce"].calls
    record = sizes.HEADER_BYTES + sizes.eager_capacity(p) + sizes.payload_reserve(p)
    assert steps["metadata"].nbytes == (p - 1) * record
    # A record of known size (the measured one) is priced as given.
    known = registry.get("oktopk").schedule(Pricing(_features(p, 2**24, 10_000), 1000.0, record_known=True, mode="topk"),
                                            registry.get("oktopk").knobs)
    assert {s.term: s for s in known}["metadata"].nbytes == (p - 1) * 1000.0


def test_record_sizes_at_large_world_sizes():
    assert [sizes.eager_capacity(p) for p in (2, 16, 32, 64, 256, 1024)] == [1024, 1024, 512, 256, 256, 256]
    assert sizes.eager_capacity(1024) // 4 == 64  # overlap-sketch hashes per rank at any world size
    # Ok-Topk's P counts fit half the starting slot up to P = 32; from 64 on the slot grows by exactly 8 P.
    assert [sizes.payload_reserve(p) for p in (2, 16, 32, 64, 1024)] == [0, 0, 0, 512, 8192]
    assert sizes.record_bytes(1024) == 192 + 256 and sizes.record_bytes(1024, payload=True) == 192 + 256 + 8192
    assert sizes.slot_limit(1024) == 256 and sizes.slot_limit(4) == 65536


class _Group:
    pass


def _comm(p: int):
    from colltune.algorithms.comm import Comm

    comm = Comm(_Group(), torch.device("cpu"))
    comm.world_size = p
    return comm


def test_the_slot_holds_oktopks_counts_while_oktopk_runs():
    from colltune.algorithms import meta

    comm = _comm(1024)
    assert meta.slot_bytes(comm) == 256
    meta.note_slot_use(comm, 0)
    meta.note_payload(comm)  # an Ok-Topk call ran: the next records carry its 1024 counts
    assert meta.slot_bytes(comm) == 256 + 8192
    for _ in range(meta.PAYLOAD_IDLE):
        meta.note_slot_use(comm, 0)
    assert meta.slot_bytes(comm) == 256 + 8192  # still within the idle allowance
    meta.note_slot_use(comm, 0)
    assert meta.slot_bytes(comm) == 256  # given back after PAYLOAD_IDLE exchanges without Ok-Topk
    small = _comm(16)
    meta.note_payload(small)
    assert meta.slot_bytes(small) == 1024  # 16 counts fit the slot as it is


def test_oktopk_payload_fits_the_slot_at_1024_ranks():
    from colltune.algorithms import meta
    from colltune.algorithms.oktopk import OkTopk, _ExactState

    comm = _comm(1024)
    algo = OkTopk()
    st = OkTopk._state(comm, 1 << 20, algo.knobs)
    st.bounds.cuts = (torch.arange(1025, dtype=torch.int64) * 1024).tolist()
    st.bounds.size, st.bounds.world_size, st.bounds.calls = 1 << 20, 1024, 1
    assert isinstance(st, _ExactState)
    idx = torch.arange(0, 1 << 20, 97, dtype=torch.int64)
    assert algo.eager_payload(idx, 1 << 20, comm, algo.knobs, meta.slot_bytes(comm)) is None  # no room yet
    meta.note_payload(comm)
    prepared = algo.eager_payload(idx, 1 << 20, comm, algo.knobs, meta.slot_bytes(comm))
    assert prepared is not None and prepared.payload.size == 8 * 1024 and prepared.work == tuple(st.bounds.cuts)
    ends = prepared.payload.view(np.int64)  # running counts: the last is every entry
    assert int(ends[-1]) == idx.numel() and (np.diff(ends, prepend=0) >= 0).all()


def _simulate_balance(sizes_: list[int]) -> list[tuple[int, int]]:
    """Run the balance plan on labelled entries ``(owner, i)``; return the gathered entries in the order it gives."""
    from colltune.algorithms.balance import owner_order, plan

    pl = plan(sizes_)
    blocks = [[(j, i) for i in range(int(pl.keep[j]))] for j in range(len(sizes_))]
    for m in range(pl.count.size):  # in stream order: by source, then position
        a, b = int(pl.src[m]), int(pl.dst[m])
        start = int(pl.keep[a] + pl.sent_before[m])
        assert len(blocks[b]) == int(pl.keep[b] + pl.got_before[m])
        blocks[b] += [(a, i) for i in range(start, start + int(pl.count[m]))]
    assert [len(b) for b in blocks] == pl.target.tolist()
    flat = [e for b in blocks for e in b]
    order = owner_order(pl)
    return flat if order is None else [flat[i] for i in order]


@pytest.mark.parametrize("seed", range(40))
def test_the_balance_moves_only_the_surplus_and_restores_index_order(seed):
    from colltune.algorithms.balance import plan

    rng = random.Random(seed)
    p = rng.choice([1, 2, 3, 4, 7, 16, 64])
    shape = rng.choice(["even", "skewed", "sparse", "one"])
    if shape == "even":
        s = [rng.randint(90, 110) for _ in range(p)]
    elif shape == "skewed":
        s = [rng.randint(0, 400) if rng.random() < 0.2 else rng.randint(0, 20) for _ in range(p)]
    elif shape == "sparse":
        s = [rng.randint(0, 2) for _ in range(p)]
    else:
        s = [0] * p
        s[rng.randrange(p)] = rng.randint(0, 50)
    got = _simulate_balance(s)
    assert got == [(j, i) for j in range(p) for i in range(s[j])]
    pl = plan(s)
    assert int(pl.count.sum()) == int(np.maximum(np.asarray(s) - pl.target, 0).sum())  # the fewest possible
    pairs = list(zip(pl.src.tolist(), pl.dst.tolist()))
    assert len(pairs) == len(set(pairs)) and all(a != b for a, b in pairs)  # one message per pair at most


def test_the_balance_plan_is_linear_in_p():
    """A plan for 1024 owners takes a few NumPy operations: well under the time of one collective."""
    import time

    from colltune.algorithms.balance import owner_order, plan

    s = np.random.default_rng(0).poisson(50, 1024).tolist()
    t0 = time.perf_counter()
    for _ in range(10):
        owner_order(plan(s))
    assert (time.perf_counter() - t0) / 10 < 0.01
    assert math.isclose(sum(plan(s).target), sum(s))


def _priced(name: str, pricing: Pricing) -> dict:
    algo = registry.get(name)
    return {s.term: s for s in algo.schedule(pricing, algo.knobs)}


def test_auto_gathers_point_to_point_on_the_host_path_or_one_node_only():
    from colltune.algorithms.schedule import p2p_gathers
    from colltune.algorithms.sparse import gather_mode

    assert p2p_gathers(64, 8, host=True) and p2p_gathers(8, 8, host=False) and p2p_gathers(64, None, host=False)
    assert not p2p_gathers(16, 8, host=False)
    unknown = _features(64, 2**20, 1000)  # no layout in the features: the model's own (its network's) counts
    assert Pricing(unknown, host=False).p2p_gathers and not Pricing(unknown, host=False, ranks_per_node=8).p2p_gathers
    assert gather_mode("auto", 16, torch.float32, True) == "p2p" and gather_mode("auto", 16, torch.float32, False) == "auto"
    assert gather_mode("auto", 1, torch.float32, True) == "auto" and gather_mode("p2p", 1, torch.float32, False) == "p2p"
    for p in (8, 64):
        wide = Features.build(numel=2**20, row_numel=16, dtype="float32", k_per_rank=[5000] * p, union=3000 * p,
                              ranks_per_node=8)
        narrow = Features.build(numel=2**24, row_numel=1, dtype="float32", k_per_rank=[5000] * p, union=3000 * p,
                                ranks_per_node=8)
        for host in (True, False):
            point_to_point = host or p == 8
            ag = _priced("allgather", Pricing(wide, host=host))
            assert ag["entries_gather"].primitive == ("p2p" if point_to_point else "all_gather"), (p, host)
            for f in (wide, narrow):
                ok = _priced("oktopk", Pricing(f, host=host))
                assert ok["union_gather"].primitive == ("p2p" if point_to_point else "all_gather"), (p, host, f.row_numel)
                assert ok["sizes_all_gather"].calls == (0 if point_to_point and f is narrow else 1)


def test_the_record_is_summed_as_a_table_on_the_device_path_from_32_ranks():
    from colltune.algorithms.schedule import RECORD_ALL_REDUCE_FROM, record_by_all_reduce
    from colltune.model.profile import load_profile
    from colltune.select.selector import model_for_profile, shipped_profile

    assert RECORD_ALL_REDUCE_FROM == 32 and record_by_all_reduce(32, True) and not record_by_all_reduce(31, True)
    assert not record_by_all_reduce(1024, False)  # gloo gathers records point to point
    for p in (16, 32, 1024):
        f = _features(p, 2**24, 10_000)
        record = sizes.record_bytes(p)
        device, host = _priced("dense", Pricing(f, host=False)), _priced("dense", Pricing(f, host=True))
        assert host["metadata"].primitive == "all_gather" and host["metadata"].nbytes == (p - 1) * record
        if p < 32:
            assert device["metadata"] == host["metadata"]
        else:  # a ring all_reduce of the P x R table: 2 (P - 1) / P of it sent
            assert device["metadata"].primitive == "all_reduce"
            assert device["metadata"].nbytes == pytest.approx(2 * (p - 1) / p * p * record)
    # The bound: the record costs at most 0.3 ms at 1024 ranks (128 DGX H100 nodes) in NCCL's model,
    # Ok-Topk's counts in the slot included; gathered by NCCL's ring it cost 1.27 ms.
    model = model_for_profile(load_profile(shipped_profile("nccl")), "analytic-nccl.yaml")
    small = Features.uniform(numel=2**20, row_numel=1, dtype="float32", k=10, world_size=1024, union=10240,
                             ranks_per_node=8)
    terms = model.analytic.terms(small)
    assert max(t["metadata"] for t in terms.values()) <= 300.0, {a: t["metadata"] for a, t in terms.items()}


def test_small_gathers_of_control_data_are_summed_as_the_record_is():
    """Owners' sizes (Ok-Topk, hashpart) and top-k's kept counts: gathered where the record is gathered, a table
    all-reduced where it is summed; at 1024 ranks on NCCL's model Ok-Topk's sizes cost 0.1 ms, not 1.2."""
    from colltune.model.profile import load_profile
    from colltune.select.selector import model_for_profile, shipped_profile

    for p in (16, 32, 1024):
        f = _features(p, 2**24, 10_000)
        for algorithm, mode in (("oktopk", "exact"), ("hashpart", "exact"), ("oktopk", "topk")):
            device = _priced(algorithm, Pricing(f, host=False, mode=mode, ranks_per_node=8))["sizes_all_gather"]
            host = _priced(algorithm, Pricing(f, host=True, mode=mode))["sizes_all_gather"]
            assert host.primitive == "all_gather", (p, algorithm, mode)
            if p < 32:
                assert device.primitive == "all_gather", (p, algorithm, mode)
            else:
                assert device.calls >= 1 and device.primitive == "all_reduce", (p, algorithm, mode)
    model = model_for_profile(load_profile(shipped_profile("nccl")), "analytic-nccl.yaml")
    f = Features.uniform(numel=2**24, row_numel=64, dtype="float32", k=167_772, world_size=1024, union=2**23,
                         ranks_per_node=8)
    assert model.analytic.terms(f)["oktopk"]["sizes_all_gather"] <= 100.0


@pytest.mark.parametrize("p", [8, 16, 64, 1024])
def test_dense_at_density_1_costs_at_most_1_1x_its_all_reduce_on_large_tensors(p):
    """The issue's bound on NCCL's model: 4 GiB of fp32 rows of 64 held by every rank (values the call owns)."""
    from colltune.model.profile import load_profile
    from colltune.select.selector import model_for_profile, shipped_profile

    model = model_for_profile(load_profile(shipped_profile("nccl")), "analytic-nccl.yaml")
    n = 2**24
    f = Features.build(numel=n, row_numel=64, dtype="float32", k_per_rank=[n] * p, union=n, ranks_per_node=8)
    terms = model.analytic.terms(f)["dense"]
    assert sum(terms.values()) <= 1.1 * terms["value_all_reduce"], terms


@pytest.mark.parametrize("device_path", [False, True])
def test_the_counts_payloads_travel_as_running_counts(device_path):
    """Ok-Topk's counts per region and hashpart's per owner travel as where each rank's entries end;
    ``send_recv_counts`` gives back the counts, padding (indexed ``size``, the device path's) counted for no one."""
    from colltune.algorithms import meta
    from colltune.algorithms.hashpart import HashPart, hash_owner_host
    from colltune.algorithms.oktopk import OkTopk
    from colltune.algorithms.sparse import device_path as on_device_path

    p, n = 4, 1000
    comm = _comm(p)
    algo = OkTopk()
    st = OkTopk._state(comm, n, algo.knobs)
    st.bounds.cuts = [0, 100, 450, 451, n]
    st.bounds.size, st.bounds.world_size, st.bounds.calls = n, p, 1
    g = torch.Generator().manual_seed(3)
    ranks = [torch.unique(torch.randint(0, n, (k,), generator=g)) for k in (50, 0, 300, 7)]
    for r, idx in enumerate(ranks):  # ranks of other sizes; one with none
        want_regions = np.histogram(idx.numpy(), bins=st.bounds.cuts)[0].tolist()
        want_owners = np.bincount(hash_owner_host(idx.numpy(), p), minlength=p).tolist()
        with on_device_path(device_path):
            padded = torch.cat((idx, torch.full((5,), n))) if device_path else idx
            regions = algo.eager_payload(padded, n, comm, algo.knobs, 1024).payload
            owners = HashPart().eager_payload(padded, n, comm, None, 1024)
        owners = owners.payload if not isinstance(owners, np.ndarray) else owners
        table = np.zeros((p, 8 * p), dtype=np.uint8)
        for row, payload in enumerate((regions, owners)):
            table[row] = payload.numpy() if isinstance(payload, torch.Tensor) else payload
            send, _ = meta.send_recv_counts(table, row)
            assert send == (want_regions, want_owners)[row], (r, row)
