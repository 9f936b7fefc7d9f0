"""The host (NumPy) helpers every CPU path sums through: same bits as plain ``index_add_`` in list order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from colltune.algorithms.sparse import (
    HUGE_PAGES_FROM,
    Magnitudes,
    _from_numpy,
    _increasing,
    _sorted_order,
    cast,
    coalesce,
    fresh,
    merge_host,
    out_buffer,
    row_numbers,
    shares_storage,
    split_layout,
    sum_by_index,
)


def _reference(idx: np.ndarray, vals: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    union, inverse = np.unique(idx, return_inverse=True)
    out = torch.zeros((union.size, vals.shape[1]), dtype=vals.dtype)
    out.index_add_(0, torch.from_numpy(inverse.reshape(-1)), vals)  # adds in list order on the CPU
    return union, out


def _bits(t: torch.Tensor) -> list[int]:
    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return t.contiguous().view(ints[t.dtype]).reshape(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("width", [1, 3, 64])
@pytest.mark.parametrize("high", [50, 2**50], ids=["small_indices", "huge_indices"])
def test_sum_by_index_matches_index_add_bitwise(dtype, width, high):
    g = torch.Generator().manual_seed(width + (high > 100))
    for trial in range(6):
        k = int(torch.randint(1, 2000, (1,), generator=g))
        idx = torch.randint(0, high, (k,), generator=g).numpy()
        idx[: k // 3] = idx[k // 3 : 2 * (k // 3)]  # plenty of duplicates, in scattered order
        scale = 10.0 ** torch.randint(-6, 6, (k, 1), generator=g)
        vals = (torch.randn(k, width, generator=g, dtype=torch.float64) * scale).to(dtype)
        if trial % 2:
            vals[torch.rand(k, width, generator=g) < 0.2] = -0.0  # (0 + -0.0) is +0.0: the sum starts at zero
        if trial == 5:
            vals[0, 0], vals[-1, -1] = float("inf"), float("nan")
        union, sums = sum_by_index(idx, vals)
        ref_union, ref = _reference(idx, vals)
        assert union.tolist() == ref_union.tolist()
        assert sums.dtype == dtype and tuple(sums.shape) == (union.size, width)
        assert _bits(sums) == _bits(ref), f"trial {trial}: sums differ from index_add_ in list order"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 7, 256, 257])
@pytest.mark.parametrize("base", [0, 2**50])
def test_sum_by_index_few_entries_same_bits(dtype, k, base):
    """The NumPy path for a few entries (unique or not) keeps index_add_'s bits, -0.0 and NaN included."""
    g = torch.Generator().manual_seed(k)
    for unique in (True, False):
        idx = torch.randperm(10 * k, generator=g)[:k].numpy() if unique else torch.randint(0, k, (k,), generator=g).numpy()
        idx = idx + base
        vals = torch.randn(k, 3, generator=g, dtype=dtype)
        vals[torch.rand(k, 3, generator=g) < 0.3] = -0.0
        vals[0, 1] = float("nan")
        union, sums = sum_by_index(idx, vals)
        ref_union, ref = _reference(idx, vals)
        assert union.tolist() == ref_union.tolist()
        assert _bits(sums) == _bits(ref)
        assert not np.shares_memory(sums.numpy(), vals.numpy())


def test_sum_by_index_copies_and_handles_empty():
    idx = np.array([3, 1, 3], dtype=np.int64)
    vals = torch.ones(3, 2)
    union, sums = sum_by_index(idx, vals)
    sums += 1
    assert vals.eq(1).all() and union.tolist() == [1, 3]
    u0, s0 = sum_by_index(np.zeros(0, dtype=np.int64), torch.zeros(0, 4))
    assert u0.size == 0 and tuple(s0.shape) == (0, 4)


@pytest.mark.parametrize("high", [10, 2**61])
def test_sorted_order_is_stable(high):
    rng = np.random.default_rng(1)
    idx = rng.integers(0, high, 5000, dtype=np.int64)
    order, keys = _sorted_order(idx)
    assert keys.tolist() == idx[order].tolist() == sorted(idx.tolist())
    assert order.tolist() == np.argsort(idx, kind="stable").tolist()


def test_merge_host_paths_agree_bitwise():
    """The dense-scratch path and the sort path of the host merge give the same bits."""
    rng = np.random.default_rng(2)
    runs = [np.unique(rng.integers(0, 300, n)) for n in (250, 10, 400)]
    idx = np.concatenate(runs).astype(np.int64)
    vals = rng.normal(size=(idx.size, 5)).astype(np.float32)
    scratch = merge_host(idx, vals, 300)  # size <= 3 * entries: dense scratch
    sort = merge_host(idx, vals, 10**9)  # sparse: sort
    assert scratch[0].tolist() == sort[0].tolist()
    assert scratch[1].tobytes() == sort[1].tobytes()


def test_split_layout_threshold():
    assert split_layout(64, torch.float32) and split_layout(16, torch.float16) and split_layout(4, torch.float64)
    assert not split_layout(1, torch.float32) and not split_layout(7, torch.float32) and not split_layout(15, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_top_k_selection_matches_torch_topk(dtype):
    """The host selection (NumPy) and torch.topk agree: the same k-th value, the same selected values."""
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 1000, 65537):
        mag = torch.randn(n, generator=g, dtype=torch.float64).abs().to(dtype)
        if n > 10:
            mag[: n // 4] = 0.0  # ties (at zero) below and at the cut
            mag[n // 2 : n // 2 + 5] = mag[n // 2 + 5]
        for k in sorted(k for k in {1, 2, n // 3 + 1, n // 2, n - 1, n} if 1 <= k <= n):
            ref = torch.topk(mag, k, sorted=False)
            idx, th = Magnitudes(mag).top_k(k)
            assert float(th) == float(ref.values.min())
            assert idx.dtype == torch.int64 and idx.numel() == k
            assert bool((idx[1:] > idx[:-1]).all()), "positions must come sorted and unique"
            assert torch.equal(mag[idx].sort().values, ref.values.sort().values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_counts_at_many_thresholds_equal_one_count_each(dtype, monkeypatch):
    """The device path compares every threshold at once: the counts are those of one comparison each, ties,
    thresholds between two values of the dtype (rounded as a comparison rounds them), NaN and infinities
    included, in one pass or in several."""
    import colltune.algorithms.sparse as sparse

    g = torch.Generator().manual_seed(4)
    vals = torch.randn(5000, generator=g, dtype=torch.float64).to(dtype)
    vals[:7] = float("nan")
    vals[7:9] = float("inf")
    vals[9:500] = vals[500]  # a tie at a threshold below
    ths = [float(vals[500].abs()), 0.1, 0.1000001, 0.3333333333, 1.0, 1e-30, float(vals[600].abs()) * (1 + 1e-9), 3.5]
    with sparse.device_path():
        mag = Magnitudes(vals)
        want = [mag.count(t) for t in ths]
        for mask_bytes in (64 << 20, 3 * 5000, 1):  # one pass, three thresholds a pass, one a pass
            monkeypatch.setattr(sparse, "_COUNTS_MASK_BYTES", mask_bytes)
            got = mag.counts(ths)
            assert got.dtype == torch.int64 and got.tolist() == want, (mask_bytes, got.tolist(), want)
        # 0 selects the nonzero values (NaN counts as infinite): against counts made without the class.
        assert mag.counts([0.0, 1.0]).tolist() == [int((vals != 0).sum()), int((vals.abs() >= 1).sum()) + 7]


@pytest.mark.parametrize("indices, n, bad", [
    ([3, 1, 3], 8, 0), ([7], 8, 0), ([0, 7, 7], 8, 0), ([], 8, 0), ([2**62 - 1, 0], 2**62, 0),
    ([-1, 2], 8, 1), ([0, 8], 8, 1), ([8], 8, 1), ([-5], 8, 1), ([0], 0, 1), ([5, 2**62, 1], 2**62, 1),
    ([-(2**63), 3], 8, 1),
])
def test_a_batch_flags_an_index_out_of_range_with_its_count(indices, n, bad):
    """The coalesce's stats ``[bad, count]``: the range flag (from the first and last sorted index) is exactly 0 or 1,
    as the record's error field takes it, and the count is the number of distinct indices."""
    import colltune.algorithms.sparse as sparse

    with sparse.device_path():
        idx = torch.tensor(indices, dtype=torch.int64)
        stats = sparse.Batch([(idx, torch.ones(len(indices), 2), n)], torch.float32).stats
    assert stats.dtype == torch.int64 and stats.tolist() == [bad, len(set(indices))]


def test_top_k_selection_takes_tensors_that_require_grad():
    mag = torch.rand(100, requires_grad=True)
    idx, th = Magnitudes(mag).top_k(7)
    assert th == float(torch.topk(mag.detach(), 7).values.min())
    assert idx.tolist() == sorted(torch.topk(mag.detach(), 7).indices.tolist())


def test_a_boundary_state_with_cuts_past_its_size_is_refused():
    from colltune.algorithms.errors import ColltuneValueError
    from colltune.algorithms.state import BoundaryState

    st = BoundaryState()
    good = {"refresh": 64, "cuts": [0, 40, 100], "calls": 3, "size": 100, "world_size": 2}
    st.load_state_dict(good)
    assert st.cuts == [0, 40, 100] and st.state_dict() == good
    for cuts in ([0, 40, 101], [5, 40, 100], [0, 60, 40, 100], []):
        with pytest.raises(ColltuneValueError, match="rise from 0 to its size 100"):
            BoundaryState().load_state_dict(dict(good, cuts=cuts))


@pytest.mark.parametrize("width", [1, 5])
@pytest.mark.parametrize("high", [3, 50, 10_000])
def test_padded_run_sums_are_the_exact_sums_then_zero_pads(width, high):
    from colltune.algorithms.sparse import device_path, merge_runs, sum_sorted_runs, sum_sorted_runs_padded

    g = torch.Generator().manual_seed(high)
    idx, _ = torch.sort(torch.randint(0, high, (300,), generator=g))
    vals = torch.randn(300, width, generator=g)
    vals[::7] = -0.0
    uniq, sums = sum_sorted_runs(idx, vals)
    pidx, psums = sum_sorted_runs_padded(idx, vals, high)
    u = uniq.numel()
    assert pidx.shape == (300,) and psums.shape == (300, width)
    assert torch.equal(pidx[:u], uniq) and torch.equal(psums[:u].view(torch.int32), sums.view(torch.int32))
    assert bool((pidx[u:] == high).all()) and torch.equal(psums[u:], torch.zeros(300 - u, width))
    # Three sources end to end: the padded merge and the exact one give the same bits, on the device path too.
    a, b, c = (torch.unique(torch.randint(0, high, (60,), generator=g)) for _ in range(3))
    at = [0, a.numel(), a.numel() + b.numel(), a.numel() + b.numel() + c.numel()]
    buf, rows = torch.cat([a, b, c]), torch.randn(at[-1], width, generator=g)
    with device_path():
        ei, ev = merge_runs(buf, rows, at, high, torch.float32)
        pi, pv = merge_runs(buf, rows, at, high, torch.float32, padded=True)
    u = ei.numel()
    assert torch.equal(pi[:u], ei) and torch.equal(pv[:u].view(torch.int32), ev.view(torch.int32))
    assert bool((pi[u:] == high).all()) and not pv[u:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool])
@pytest.mark.parametrize("large", [False, True])
def test_fresh_gives_a_writable_tensor_of_the_shape_and_dtype(dtype, large):
    rows = HUGE_PAGES_FROM // (16 * dtype.itemsize) + 1 if large else 3
    assert _from_numpy((rows, 16), dtype, torch.device("cpu")) == large  # the large one comes from NumPy
    t = fresh((rows, 16), dtype, "cpu")
    assert t.shape == (rows, 16) and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    t.fill_(1)
    assert bool((t == 1).all())
    assert not shares_storage(t, fresh((rows, 16), dtype, "cpu"))


@pytest.mark.parametrize("n", [0, 1, 5, HUGE_PAGES_FROM // 8 + 3])
def test_row_numbers_are_arange(n):
    got = row_numbers(n, "cpu")
    assert got.dtype == torch.int64 and torch.equal(got, torch.arange(n))


def test_increasing_finds_a_step_down_anywhere_even_on_a_chunk_edge():
    from colltune.algorithms.sparse import _CHUNK

    k = 3 * _CHUNK + 17
    a = np.arange(k, dtype=np.int64) * 2
    assert _increasing(a) and _increasing(a[:1]) and _increasing(a[:0])
    for at in (1, _CHUNK - 1, _CHUNK, _CHUNK + 1, 2 * _CHUNK, k - 1):
        b = a.copy()
        b[at] = b[at - 1]  # a duplicate: not strictly increasing
        assert not _increasing(b), at
        b[at] = b[at - 1] - 1
        assert not _increasing(b), at


def test_sorted_unique_input_passes_through_the_host_coalesce_without_a_copy():
    idx, vals = torch.arange(0, 3 * (1 << 17), 3), torch.randn(1 << 17, 2)
    got_idx, got_vals = coalesce(idx, vals, torch.float32)
    assert got_idx is idx and got_vals is vals
    idx[7] = idx[6]
    got_idx, got_vals = coalesce(idx, vals, torch.float32)
    assert got_idx.numel() == idx.numel() - 1 and not shares_storage(got_vals, vals)


@pytest.mark.parametrize("rows", [3, HUGE_PAGES_FROM // 32 + 1])
def test_cast_and_out_buffer(rows):
    t = torch.randn(rows, 16)
    assert cast(t, torch.float32) is t
    half = cast(t, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, t.to(torch.bfloat16))
    wide = cast(t, torch.float64)  # the large one into memory from NumPy
    assert wide.dtype == torch.float64 and torch.equal(wide, t.double())
    assert _from_numpy(wide.shape, torch.float64, wide.device) == (rows * 128 >= HUGE_PAGES_FROM)
    out = out_buffer((rows, 16), torch.float32, "cpu")
    assert (out is None) == (rows * 64 < HUGE_PAGES_FROM)
    got = torch.add(t, 0.0, out=out)
    assert torch.equal(got, t + 0.0) and (out is None or got.data_ptr() == out.data_ptr())
    assert out_buffer((rows, 16), torch.float32, "meta") is None  # elsewhere the op allocates as usual
