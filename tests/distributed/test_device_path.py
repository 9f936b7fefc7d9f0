"""The device (CUDA) code path, run on CPU tensors, against the host (NumPy) path: the same bits.

CUDA tensors take other code than CPU tensors (torch operations where the
CPU runs NumPy, and the backend's own collectives where gloo runs direct).
:func:`colltune.algorithms.sparse.device_path` sends CPU tensors down that code, so
here every rank runs each call twice, once per path, on the same input, and
the parent checks the device path's result against the float64 reference
and bit for bit (values compared as integers, so -0.0 and NaN count)
against the host path's.

One exception: ``dense`` sums with ``all_reduce``, whose order of additions
is the backend's. On the host path gloo groups of 3 or more run it direct
(rank order); on the device path, as on NCCL, the backend's ring adds in
its own order, so with inexact sums the bits differ (both are the same on
every rank). There the device path is checked against the reference and
across ranks; the property test's sums are exact, so it compares ``dense``
bitwise too.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_property import _lay_out, exact_cases
from test_sparse_allreduce import SCENARIOS, _result_record, check_results
from test_topk import check_topk, make_tensor, topk_cfg

from colltune.algorithms import registry
from colltune.algorithms.sparse import (
    Magnitudes,
    coalesce,
    device_path,
    merge_sources,
    on_host,
    pack,
    pack_host,
    set_device_path,
    unpack,
    unpack_host,
)

from harness import pool
from sparse_cases import ALGORITHMS, DTYPES, make_input, reference

_INTS = {
    torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
}


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two tensors hold the same dtype, shape and bits (floats compared as integers: -0.0 and NaN count)."""
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in _INTS:
        return torch.equal(a.contiguous().view(_INTS[a.dtype]), b.contiguous().view(_INTS[b.dtype]))
    return torch.equal(a, b)


def _order_dependent(algorithm: str, world_size: int) -> bool:
    """Whether ``algorithm``'s sums depend on the backend's all_reduce order (see the module docstring)."""
    return algorithm == "dense" and world_size >= 3


# ------------------------------------------------------------------ the switch


def test_switch_sends_cpu_tensors_down_the_device_path():
    cpu = torch.zeros(2)
    with device_path(False):  # whatever COLLTUNE_DEVICE_PATH says in this process
        assert on_host(cpu) and on_host(torch.device("cpu")) and not on_host(torch.device("meta"))
        with device_path():
            assert not on_host(cpu) and not on_host(torch.device("cpu"))
            with device_path(False):
                assert on_host(cpu)
            assert not on_host(cpu)
        assert on_host(cpu)
        assert set_device_path(True) is False and not on_host(cpu)
        assert set_device_path(False) is True and on_host(cpu)


def test_environment_variable_turns_the_device_path_on_at_import():
    code = "import torch; from colltune.algorithms.sparse import on_host; print(on_host(torch.zeros(1)))"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, COLLTUNE_DEVICE_PATH="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "False", out


def _comm_modes(rank, world_size):
    from colltune.algorithms.comm import Comm

    modes = []
    for device in (False, True):
        with device_path(device):
            comm = Comm(None, torch.device("cpu"))
            modes.append((comm.host, comm.direct))
    return modes


def test_device_path_runs_the_backends_own_collectives():
    # gloo groups of 3 run direct on the host path; the device path keeps the backend's calls, as NCCL does.
    for modes in pool(3).run(_comm_modes):
        assert modes == [(True, True), (False, False)], modes


# ------------------------------------------------------------------ helpers, one process


def _views(base: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of ``base`` (``[k, r]``, r >= 2) with every kind of stride a caller may pass."""
    k, r = base.shape
    return {
        "plain": base,
        "column_slice": base[:, 1:],  # non-contiguous rows
        "transposed": base.t().contiguous().t(),  # column-major
        "rows_strided": torch.stack((base, base), dim=-1)[..., 1],  # stride 2 along the row
        "one_element": base[:1, 1:2],
        "one_element_odd_strides": base.as_strided((1, 1), (2, 2), 1),  # contiguous to torch, stride 2
        "expanded": base[:1].expand(k, r),  # stride 0 along the rows
        "zero_width": base[:, :0],
        "zero_width_strided": torch.empty((k, 3, 0))[:, 1],
    }


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_pack_takes_any_strides_and_matches_the_host_bytes(value_dtype, index_dtype):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 4, generator=g, dtype=torch.float64)
    base[0, 1], base[1, 2] = -0.0, float("nan")
    idx_base = torch.arange(12, dtype=torch.int64) * 3
    for name, vals in _views(base).items():
        k = vals.shape[0]
        for iname, idx in (("plain", idx_base[:k]), ("strided", idx_base[: 2 * k : 2]),
                           ("one_strided", torch.stack((idx_base[:k], idx_base[:k]), 1)[:, 1])):
            got = pack(idx, vals, index_dtype, value_dtype)
            want = torch.from_numpy(pack_host(idx, vals, index_dtype, value_dtype))
            assert torch.equal(got, want), (name, iname)


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32, torch.int64])
def test_unpack_gives_the_host_entries_and_views_only_aligned_columns(value_dtype, index_dtype):
    g = torch.Generator().manual_seed(9)
    for r in (0, 1, 3, 64):
        idx = torch.randint(0, 2**15 - 1, (7,), generator=g)
        vals = torch.randn(7, r, generator=g).to(value_dtype)
        packed = pack(idx, vals, index_dtype, value_dtype)
        e = packed.shape[1]
        # As received: alone, after one odd byte, and as rows of a wider buffer.
        wide, aligned_wide = torch.zeros((7, e + 3), dtype=torch.uint8), torch.zeros((7, e + 8), dtype=torch.uint8)
        wide[:, :e], aligned_wide[:, :e] = packed, packed
        shifted = torch.cat((torch.zeros(1, dtype=torch.uint8), packed.view(-1)))[1:].view(7, e)
        for name, buf in (("plain", packed), ("shifted", shifted), ("rows of a wider buffer", wide[:, :e]),
                          ("rows of a wider buffer, aligned", aligned_wide[:, :e])):
            want_idx, want_vals = unpack_host(buf.numpy(), r, index_dtype, value_dtype)
            want = torch.from_numpy(want_vals)
            isz, vsz = index_dtype.itemsize, value_dtype.itemsize
            aligned = isz % vsz == 0 and e % vsz == 0 and buf.stride(0) % vsz == 0 and buf.storage_offset() % vsz == 0
            for strided in (False, True):
                got_idx, got_vals = unpack(buf, r, index_dtype, value_dtype, strided=strided)
                where = (name, r, strided)
                assert got_idx.dtype == torch.int64 and got_idx.stride() == (1,), where
                assert got_idx.tolist() == want_idx.tolist(), where
                assert got_vals.shape == (7, r) and got_vals.dtype == value_dtype, where
                assert same_bits(got_vals.to(want.dtype), want), where
                shares = got_vals.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                assert not r or shares == (strided and aligned), where
                if not shares:  # handed out: the strides of a fresh tensor
                    assert got_vals.stride() == torch.empty(7, r).stride(), where
        # One entry: a fresh tensor's strides too (a size-1 dimension keeps any stride torch gives it).
        one_idx, one_vals = unpack(packed[:1], r, index_dtype, value_dtype)
        assert one_idx.stride() == (1,) and one_vals.stride() == torch.empty(1, r).stride(), r


def test_coalesce_and_merge_give_the_host_bits():
    g = torch.Generator().manual_seed(7)
    for trial in range(8):
        k = [1, 2, 5, 40, 300, 7, 3, 600][trial]
        idx = torch.randint(0, 50 if trial % 2 else 10**6, (k,), generator=g)
        if trial == 6:
            idx = torch.tensor([9, 4, 1])  # unsorted, unique: summed from zero on both paths
        vals = torch.randn(k, 3, generator=g, dtype=torch.float32)
        vals[torch.rand(k, 3, generator=g) < 0.3] = -0.0
        if trial == 6:
            vals[:, 1] = -0.0
        if trial % 3 == 0:
            vals[0, 0] = float("nan")
        host = coalesce(idx, vals, torch.float32)
        with device_path():
            dev = coalesce(idx, vals, torch.float32)
        assert torch.equal(host[0], dev[0]) and same_bits(host[1], dev[1]), trial
        sources = [coalesce(torch.randint(0, 64, (m,), generator=g), torch.randn(m, 2, generator=g), torch.float32)
                   for m in (5, 0, 30, 1)]
        size = 64 if trial % 2 else 10**6
        host = merge_sources(sources, size, 2, torch.float32, torch.device("cpu"))
        with device_path():
            dev = merge_sources(sources, size, 2, torch.float32, torch.device("cpu"))
        assert torch.equal(host[0], dev[0]) and same_bits(host[1], dev[1]), trial


def test_sketches_and_embedding_row_sums_give_the_host_bits():
    from colltune.model.features import sketch_hashes
    g = torch.Generator().manual_seed(11)
    for k, high in ((0, 10), (5, 10**12), (3000, 500)):
        idx = torch.randint(0, high, (k,), generator=g)
        vals = torch.randn(k, 4, generator=g)
        vals[torch.rand(k, 4, generator=g) < 0.2] = -0.0
        for capacity in (0, 64, 1024, 65536):
            host = sketch_hashes(idx.unique(), capacity, seed=3)
            with device_path():
                dev = sketch_hashes(idx.unique(), capacity, seed=3)
            assert host.dtype == dev.dtype and host.tolist() == dev.tolist(), (k, capacity)
        host = coalesce(idx, vals, torch.float32)
        with device_path():
            dev = coalesce(idx, vals, torch.float32)
        assert torch.equal(host[0], dev[0]) and same_bits(host[1], dev[1]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_magnitudes_select_the_same_entries_on_both_paths(dtype):
    g = torch.Generator().manual_seed(3)
    acc = torch.randn(4000, generator=g, dtype=dtype).round(decimals=1)  # many ties
    acc[[5, 900, 3999]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    acc[10:20] = -0.0
    host = Magnitudes(acc)
    with device_path():
        dev = Magnitudes(acc)
    assert host.host and not dev.host
    assert same_bits(host.tensor(), dev.tensor())
    factors = [0.5, 0.95, 1.0, 1.05, 2.0]
    for k in (1, 2, 3, 4, 50, 1000, 3985, 4000):  # 3985: fewer than k nonzero values, the k-th largest is 0
        (hidx, th), (didx, held) = host.top_k(k), dev.top_k(k)
        assert isinstance(th, float) and held.shape == () and th == float(held), k  # the device's stays there
        assert torch.equal(hidx, didx) and hidx.numel() == k, k
        assert torch.equal(host.indices(th), dev.indices(th)) and host.count(th) == dev.count(th), k
        assert torch.equal(dev.indices(held, dev.count(th)), dev.indices(th)), k  # compared where it is
        # Nudged from the held threshold, on the device, read once: the host's floats and counts.
        want = Magnitudes.read_around(*host.counts_around(th, factors))
        assert Magnitudes.read_around(*dev.counts_around(held, factors)) == want, k
        assert Magnitudes.read_around(*host.counts_around(held, factors)) == want, k  # the host reads it first
        assert want[1] == [host.count(t) for t in want[0]], k
    # Distinct values: no tie at the cut, the device path takes torch.topk's positions as they are.
    distinct = (torch.randperm(4000, generator=g) + 1).to(dtype)
    host = Magnitudes(distinct)
    with device_path():
        dev = Magnitudes(distinct)
    for k in (1, 7, 1999, 3999):  # below numel: k = numel returns every position without torch.topk
        assert torch.equal(host.top_k_indices(k), dev.top_k_indices(k)), k
    host = Magnitudes(acc)
    # NaN and the infinities are the largest: the first three selected, NaN among them.
    assert host.top_k_indices(3).tolist() == [5, 900, 3999] and host.top_k(3)[1] == math.inf
    assert host.top_k_indices(1).tolist() == [5]  # ties (NaN, +-inf) go to the lowest position


# ------------------------------------------------------------------ sparse allreduce, every scenario, both paths


def _run_scenarios_both_paths(rank, world_size, names):
    import colltune

    out = {}
    for name in names:
        c = SCENARIOS[name](world_size)
        idx, vals = make_input(c, rank, world_size)
        for algorithm in ALGORITHMS:
            for device in (False, True):
                with device_path(device):
                    res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=algorithm)
                out[name, algorithm, device] = _result_record(res, small=c["size"] <= 5000)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_scenarios_give_the_host_bits_on_the_device_path(world_size):
    names = list(SCENARIOS)
    out = pool(world_size).run(_run_scenarios_both_paths, names, timeout=300)
    for name in names:
        c = SCENARIOS[name](world_size)
        for algorithm in ALGORITHMS:
            dev = [o[name, algorithm, True] for o in out]
            check_results(c, world_size, dev, algorithm)
            for r, o in enumerate(out):
                host, d = o[name, algorithm, False], o[name, algorithm, True]
                where = f"{name} {algorithm} P={world_size} rank {r}"
                if host["algorithm"] != d["algorithm"] or _order_dependent(d["algorithm"], world_size):
                    continue  # auto may decide differently on its second call; dense: see the module docstring
                assert torch.equal(host["indices"], d["indices"]), f"{where}: indices differ between the paths"
                assert same_bits(host["values"], d["values"]), f"{where}: values differ between the paths"


# ------------------------------------------------------------------ property cases, both paths


def _run_all_algorithms_both_paths(rank, world_size, c):
    import colltune

    idx, vals = make_input(c, rank, world_size)
    idx, vals = _lay_out(idx, c["layout"]), _lay_out(vals, c["layout"])
    out = {}
    for algorithm in ALGORITHMS:
        for device in (False, True):
            with device_path(device):
                res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=algorithm)
            out[algorithm, device] = (res.indices.clone(), res.values.clone())
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exact_cases())
def test_property_cases_give_the_same_bits_on_both_paths(example):
    world_size, c = example
    out = pool(world_size).run(_run_all_algorithms_both_paths, c, timeout=60)
    ref = reference(c, world_size)
    dtype = DTYPES[c["dtype"]]
    exact = ref["dense"].to(dtype)
    base_idx, base_vals = out[0]["dense", False]
    for r in range(world_size):
        for algorithm in ALGORITHMS:
            for device in (False, True):
                idx, vals = out[r][algorithm, device]
                where = f"{algorithm} {'device' if device else 'host'} path, rank {r}"
                assert torch.equal(idx, ref["union"]), f"{where}: indices {idx.tolist()}"
                if c["op"] == "sum":
                    assert same_bits(vals, exact[idx]), f"{where}: {vals.tolist()} != {exact[idx].tolist()}"
                # Every rank, algorithm and path: the same bits (exact sums leave nothing to the order).
                assert torch.equal(idx, base_idx) and same_bits(vals, base_vals), f"{where}: differs"


# ------------------------------------------------------------------ top-k, both paths


def _run_topk_both_paths(rank, world_size, c):
    import colltune

    out = {}
    for device in (False, True):
        with device_path(device):
            state = colltune.TopkState(k=c["k"], density=c["density"], **c["state_kw"])
            steps = []
            for step in range(c["steps"]):
                t = make_tensor(c, rank, step)
                acc = t.reshape(-1).to(torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype)
                acc = acc + state.residual if state.residual is not None else acc.clone()
                res = colltune.topk_allreduce(t, state, op=c["op"], algorithm=c["algorithm"])
                sent = res.sent_indices
                mask = torch.zeros(acc.numel(), dtype=torch.bool)
                mask[slice(None) if sent is None else sent] = True
                steps.append({
                    "algorithm": res.algorithm,
                    "k": state.k_for(acc.numel()),
                    "local_count": int(res.local_count),
                    "global_count": int(res.global_count),
                    "sent": None if sent is None else sent.clone(),
                    "sent_unique": None if sent is None else int(sent.unique().numel()) == int(sent.numel()),
                    "acc_sent": acc.clone() if sent is None else acc[sent].clone(),
                    "indices": None if res.indices is None else res.indices.clone(),
                    "values": res.values.clone(),
                    "dense": res.to_dense().clone(),
                    "dense_shape": tuple(res.to_dense().shape),
                    "bytes": res.traffic.bytes_sent,
                    "meta_bytes": res.traffic.meta_bytes,
                    "inv_sent_zero": bool((state.residual[mask] == 0).all()),
                    "inv_rest_equal": same_bits(state.residual[~mask], acc[~mask]),
                    "residual_zero": bool((state.residual == 0).all()),
                    "residual": state.residual.clone(),
                    "step_attr": state.step,
                })
            out[device] = steps
    return out


@pytest.mark.parametrize("algorithm", registry.names())
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_topk_gives_the_host_bits_on_the_device_path(world_size, algorithm):
    # Short refresh periods: exact, reused and nudged thresholds and refreshed boundaries all run.
    c = topk_cfg(seed=60 + world_size, algorithm=algorithm, shape=(40, 50), k=30, steps=12, op="avg",
                 state_kw={"local_refresh": 4, "global_refresh": 3, "boundary_refresh": 5})
    out = pool(world_size).run(_run_topk_both_paths, c, timeout=120)
    check_topk(c, world_size, [o[True] for o in out])
    if _order_dependent(algorithm, world_size):
        return
    for r, o in enumerate(out):
        for step, (host, dev) in enumerate(zip(o[False], o[True])):
            where = f"{algorithm} P={world_size} rank {r} step {step}"
            for key in ("indices", "sent", "values", "residual"):
                assert same_bits(host[key], dev[key]), f"{where}: {key} differ between the paths"
            assert host["local_count"] == dev["local_count"] and host["global_count"] == dev["global_count"], where


# ------------------------------------------------------------------ ranks on different paths


def _one_rank_on_the_device_path(rank, world_size):
    import colltune
    from colltune.algorithms.errors import RankMismatchError

    out = []
    with device_path(rank == 1):  # as a CUDA rank among CPU ranks
        for call in (lambda: colltune.sparse_allreduce(torch.tensor([1, 2]), torch.ones(2, 3), size=10),
                     lambda: colltune.sparse_allreduce_many([(torch.tensor([1]), torch.ones(1), 4)])):
            try:
                call()
                out.append("ok")
            except RankMismatchError as exc:
                out.append(str(exc))
    res = colltune.sparse_allreduce(torch.tensor([1, 2]), torch.ones(2, 3), size=10)
    out.append(res.values.sum().item())
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_on_different_paths_raise_instead_of_hanging(world_size):
    for out in pool(world_size).run(_one_rank_on_the_device_path, timeout=60):
        for message in out[:2]:
            assert "on the host path" in message and "rank 1: " in message and "on the device path" in message, message
        assert out[2] == 6.0 * world_size  # the group stays usable
