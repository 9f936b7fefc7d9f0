"""Tests of colltune.model.features: the Features record, overlap, hashing and linear counting."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from colltune.algorithms.errors import ColltuneError, ColltuneTypeError, ColltuneValueError
from colltune.model.features import (
    DTYPE_BYTES,
    MAX_WORLD_SIZE,
    Features,
    bitmap_indices,
    choose_bitmap_bits,
    estimate_overlap,
    hash_positions_torch_compatible,
    index_bytes_for,
    linear_count,
    make_bitmap,
    normalize_dtype,
    overlap_from_union,
)

M64 = (1 << 64) - 1


def _reference_hash(x: int, m: int, seed: int = 0) -> int:
    """splitmix64's finalizer in Python integers: the definition the NumPy code must match."""
    z = (x + (seed + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z = z ^ (z >> 31)
    return z & (m - 1)


def _rank_sets(p: int, k: int, overlap: float, seed: int) -> list[np.ndarray]:
    """Index sets of p ranks with k entries each and the given exact overlap.

    Each rank holds s = overlap * k shared indices and k - s of its own, so
    u = s + p (k - s) and (K - u) / (K - k) = s / k.
    """
    rng = np.random.default_rng(seed)
    s = int(round(overlap * k))
    pool = rng.choice(2**40, size=s + p * (k - s), replace=False)
    shared, own = pool[:s], pool[s:]
    return [np.concatenate([shared, own[r * (k - s) : (r + 1) * (k - s)]]) for r in range(p)]


# -- Features -----------------------------------------------------------------


def test_build_fills_derived_fields() -> None:
    f = Features.build(numel=1000, row_numel=16, dtype="float16", k_per_rank=[10, 20, 30, 40], union=70.0)
    assert (f.world_size, f.k_max, f.k_sum) == (4, 40, 100)
    assert f.value_bytes == 2 and f.index_bytes == 4 and f.dtype == "float16"
    assert f.density == pytest.approx(100 / (4 * 1000))
    assert f.row_bytes == 32 and f.entry_bytes == 36 and f.dense_bytes == 32000
    assert f.accum_bytes == 4 and f.k_avg == 25.0
    assert f.overlap == pytest.approx((100 - 70) / (100 - 40))


def test_build_clips_an_estimated_union_into_the_feasible_range() -> None:
    low = Features.build(numel=10**6, row_numel=1, dtype="float32", k_per_rank=[100, 100], union=90.0)
    high = Features.build(numel=10**6, row_numel=1, dtype="float32", k_per_rank=[100, 100], union=250.0)
    assert (low.union, low.overlap) == (100.0, 1.0)
    assert (high.union, high.overlap) == (200.0, 0.0)


@pytest.mark.parametrize("numel", [1, 1000, 2**24, 2**31])
@pytest.mark.parametrize("p", [1, 2, 7, 64])
@pytest.mark.parametrize("mode", ["exact", "topk"])
def test_uniform_equals_build_with_one_count_per_rank(numel: int, p: int, mode: str) -> None:
    for k in {0, 1, min(numel, 37), numel}:
        for union in (0.0, float(k), k + 0.3 * (p * k - k), float(p * k), 2.0 * numel):
            kw = dict(numel=numel, row_numel=3, dtype="bfloat16", union=union, ranks_per_node=4, mode=mode)
            assert Features.uniform(k=k, world_size=p, **kw) == Features.build(k_per_rank=[k] * p, **kw)


def test_uniform_prices_the_largest_world_in_constant_space() -> None:
    f = Features.uniform(numel=2**24, row_numel=1, dtype="float32", k=1000, world_size=MAX_WORLD_SIZE,
                         union=0.5 * 1000 * MAX_WORLD_SIZE, ranks_per_node=8)
    assert (f.world_size, f.k_sum, f.union, f.nodes) == (MAX_WORLD_SIZE, 1000 * MAX_WORLD_SIZE, 2**24, 2**28)
    assert f.overlap == pytest.approx(1.0, abs=1e-5)


def test_index_bytes_switch_at_two_to_the_31() -> None:
    assert index_bytes_for(2**31 - 1) == 4
    assert index_bytes_for(2**31) == 8
    f = Features.build(numel=2**31, row_numel=1, dtype="float64", k_per_rank=[1], union=1)
    assert f.index_bytes == 8 and f.entry_bytes == 16 and f.accum_bytes == 8


@pytest.mark.parametrize("given, expected", [("torch.bfloat16", "bfloat16"), ("float32", "float32"), ("half", "float16")])
def test_dtype_names_are_normalized(given: str, expected: str) -> None:
    assert normalize_dtype(given) == expected
    f = Features(numel=8, row_numel=1, value_bytes=DTYPE_BYTES[expected], index_bytes=4, world_size=1,
                 k_max=1, k_sum=1, union=1.0, overlap=0.0, dtype=given)
    assert f.dtype == expected


@pytest.mark.parametrize(
    "change, error",
    [
        ({"k_sum": 50}, ColltuneValueError),          # above world_size * k_max
        ({"k_sum": 5}, ColltuneValueError),           # below k_max
        ({"k_max": 2000, "k_sum": 4000}, ColltuneValueError),  # k_max > numel
        ({"numel": 0}, ColltuneValueError),
        ({"overlap": 1.5}, ColltuneValueError),
        ({"union": float("nan")}, ColltuneValueError),
        ({"value_bytes": 8}, ColltuneValueError),     # not the size of float32
        ({"index_bytes": 2}, ColltuneValueError),
        ({"dtype": "int32"}, ColltuneValueError),
        ({"world_size": True}, ColltuneTypeError),
        ({"numel": 10.0}, ColltuneTypeError),
    ],
)
def test_features_reject_inconsistent_values(change: dict, error: type) -> None:
    fields = dict(numel=1000, row_numel=1, value_bytes=4, index_bytes=4, world_size=2, k_max=10, k_sum=15,
                  union=12.0, overlap=0.6, dtype="float32")
    fields.update(change)
    with pytest.raises(error) as info:
        Features(**fields)
    assert isinstance(info.value, ColltuneError)
    assert next(iter(change)) in str(info.value) or "k_" in str(info.value)


def test_features_are_frozen_and_hashable() -> None:
    f = Features.build(numel=100, row_numel=1, dtype="float32", k_per_rank=[5, 5], union=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.numel = 3  # type: ignore[misc]
    assert {f: 1}[Features.build(numel=100, row_numel=1, dtype="float32", k_per_rank=[5, 5], union=8)] == 1


# -- overlap --------------------------------------------------------------------


@pytest.mark.parametrize(
    "ks, union, expected",
    [
        ([10, 10, 10], 30, 0.0),      # disjoint
        ([10, 10, 10], 10, 1.0),      # identical
        ([10, 10], 15, 0.5),
        ([10, 4], 12, 2 / 4),         # (14 - 12) / (14 - 10)
        ([7, 0, 0], 7, 0.0),          # one nonempty rank: nothing to overlap
        ([0, 0], 0, 0.0),
        ([10, 10], 5, 1.0),           # estimate below max(k): clipped
        ([10, 10], 25, 0.0),          # estimate above K: clipped
    ],
)
def test_overlap_from_union(ks: list[int], union: float, expected: float) -> None:
    assert overlap_from_union(ks, union) == pytest.approx(expected)


@pytest.mark.parametrize("ks, union", [([], 1.0), ([3, -1], 2.0), ([3, 3], -1.0), ([3, 3], float("nan"))])
def test_overlap_from_union_rejects_bad_input(ks: list[int], union: float) -> None:
    with pytest.raises(ColltuneValueError):
        overlap_from_union(ks, union)


# -- hashing --------------------------------------------------------------------


def test_hash_matches_the_reference_definition_and_golden_values() -> None:
    xs = [0, 1, 2, 3, 2**31, 2**62, 2**63 + 5, M64]
    m = 2**20
    got = bitmap_indices(np.array(xs, dtype=np.uint64), m)
    assert got.tolist() == [_reference_hash(x, m) for x in xs]
    # Pinned: a change here changes every bitmap and must be deliberate.
    assert bitmap_indices([0, 1, 2, 3, 2**31, 2**62], 2**20).tolist() == [904623, 154817, 480974, 102381, 357228, 1026539]
    assert bitmap_indices([0, 1, 2, 3], 2**20, seed=7).tolist() == [437052, 492917, 255363, 365078]


def test_hash_positions_are_in_range_and_independent_of_input_dtype() -> None:
    idx = np.arange(0, 5000, 3)
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        pos = bitmap_indices(idx.astype(dtype), 4096, seed=3)
        assert pos.dtype == np.int64 and pos.min() >= 0 and pos.max() < 4096
        np.testing.assert_array_equal(pos, bitmap_indices(idx, 4096, seed=3))
    assert not np.array_equal(bitmap_indices(idx, 4096, seed=0), bitmap_indices(idx, 4096, seed=1))
    assert bitmap_indices([], 1024).shape == (0,)


def test_int64_formulation_matches_uint64_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    idx = np.concatenate([rng.integers(0, 2**63 - 1, 20000, dtype=np.int64), np.arange(1000)])
    for seed in (0, 1, 99):
        for m in (1024, 2**20, 2**40):
            np.testing.assert_array_equal(hash_positions_torch_compatible(idx, m, seed), bitmap_indices(idx, m, seed))


def test_documented_torch_formula_matches() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    idx = rng.integers(0, 2**62, 5000, dtype=np.int64)
    seed, m = 5, 2**16
    off = ((seed + 1) * 0x9E3779B97F4A7C15) & M64
    signed = lambda c: c - (1 << 64) if c >= (1 << 63) else c  # noqa: E731

    def lsr(z, s):
        return (z >> s) & ((1 << (64 - s)) - 1)

    z = torch.from_numpy(idx) + signed(off)
    z = (z ^ lsr(z, 30)) * signed(0xBF58476D1CE4E5B9)
    z = (z ^ lsr(z, 27)) * signed(0x94D049BB133111EB)
    z = z ^ lsr(z, 31)
    np.testing.assert_array_equal((z & (m - 1)).numpy(), bitmap_indices(idx, m, seed))


@pytest.mark.parametrize(
    "indices, m, error",
    [([1, -2], 1024, ColltuneValueError), ([1.5], 1024, ColltuneTypeError), ([1], 1000, ColltuneValueError)],
)
def test_hash_rejects_bad_input(indices: list, m: int, error: type) -> None:
    with pytest.raises(error):
        bitmap_indices(np.asarray(indices), m)


# -- linear counting ------------------------------------------------------------


def test_choose_bitmap_bits() -> None:
    assert choose_bitmap_bits(2000) == 16384
    assert choose_bitmap_bits(8000) == 65536
    assert choose_bitmap_bits(0) == 1024
    assert choose_bitmap_bits(10**9) == 2**22
    assert choose_bitmap_bits(1000, bits_per_entry=4, min_bits=64) == 4096
    for k in (1, 77, 5000, 123456):
        m = choose_bitmap_bits(k)
        assert m & (m - 1) == 0 and (m >= 8 * k or m == 2**22)
    with pytest.raises(ColltuneValueError):
        choose_bitmap_bits(10, min_bits=1000)


def test_linear_count_edge_cases_and_packed_form() -> None:
    m = 4096
    assert linear_count(np.zeros(m, dtype=np.uint8), m) == 0.0
    assert linear_count(np.ones(m, dtype=bool), m) == pytest.approx(m * math.log(m))
    bitmap = make_bitmap(np.arange(300), m)
    packed = np.packbits(bitmap.astype(bool), bitorder="little")
    assert packed.size == m // 8
    assert linear_count(packed, m) == linear_count(bitmap, m) == linear_count(bitmap.astype(bool), m)
    assert abs(linear_count(bitmap, m) - 300) < 15
    with pytest.raises(ColltuneValueError, match="m_bits"):
        linear_count(np.zeros(100, dtype=np.uint8), m)


def test_duplicates_do_not_count_twice() -> None:
    m = 8192
    once = make_bitmap(np.arange(500), m)
    twice = make_bitmap(np.concatenate([np.arange(500), np.arange(500)]), m)
    np.testing.assert_array_equal(once, twice)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("k", [1000, 4000])
def test_estimated_overlap_is_within_005(p: int, overlap: float, k: int) -> None:
    for seed in range(3):
        sets = _rank_sets(p, k, overlap, seed=seed * 31 + p)
        ks = [len(s) for s in sets]
        exact_union = len(np.unique(np.concatenate(sets)))
        exact = overlap_from_union(ks, exact_union)
        assert exact == pytest.approx(overlap, abs=1e-9)
        m = choose_bitmap_bits(sum(ks))
        # all_reduce(MAX) over per-rank uint8 bitmaps is an OR.
        combined = np.maximum.reduce([make_bitmap(s, m, seed=seed) for s in sets])
        estimated = estimate_overlap(ks, combined, m)
        assert abs(estimated - exact) < 0.05, (p, overlap, k, seed, estimated, exact)
        assert abs(linear_count(combined, m) - exact_union) < 0.03 * exact_union


def test_consecutive_indices_count_as_well_as_random_ones() -> None:
    # Embedding rows are often contiguous ranges; the hash must spread them.
    for start in (0, 2**31 - 3000, 2**40):
        idx = np.arange(start, start + 3000)
        m = choose_bitmap_bits(idx.size)
        assert abs(linear_count(make_bitmap(idx, m), m) - 3000) < 0.03 * 3000


# --------------------------------------------------------------------------- the sketch in the metadata record


def test_sketch_hash_is_the_same_in_numpy_and_torch() -> None:
    import torch

    from colltune.model.features import _hash32_host, _hash32_torch

    idx = np.random.default_rng(9).integers(0, 2**62, 5000)
    for seed in (0, 7):
        np.testing.assert_array_equal(_hash32_torch(torch.from_numpy(idx), seed).numpy(), _hash32_host(idx, seed))


def test_sketch_keeps_the_smallest_hashes_in_order() -> None:
    import torch

    from colltune.model.features import _hash32_host, sketch_hashes

    idx = np.arange(0, 30000, 7)
    got = sketch_hashes(torch.from_numpy(idx), 1024)
    assert got.dtype == np.uint32 and got.size == 256
    np.testing.assert_array_equal(got, np.sort(_hash32_host(idx, 0))[:256])
    assert sketch_hashes(torch.arange(10), 1024).size == 10
    assert sketch_hashes(torch.empty(0, dtype=torch.int64), 1024).size == 0


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("k", [1000, 10000])
def test_sketch_overlap_is_close_and_its_band_holds_the_exact_one(p: int, k: int) -> None:
    import torch

    from colltune.model.features import overlap_from_sketches, sketch_hashes

    errors, misses = [], 0
    for overlap in (0.0, 0.25, 0.5, 0.75, 1.0):
        for seed in range(4):
            sets = _rank_sets(p, k, overlap, seed=seed * 17 + p)
            ks = [len(s) for s in sets]
            exact = overlap_from_union(ks, len(np.unique(np.concatenate(sets))))
            sketches = [sketch_hashes(torch.from_numpy(np.asarray(s, dtype=np.int64)), 1024) for s in sets]
            union, est, half = overlap_from_sketches(ks, sketches)
            errors.append(abs(est - exact))
            misses += abs(est - exact) > half
            if overlap in (0.0, 1.0):
                assert est == pytest.approx(exact, abs=1e-9)  # disjoint and identical sets come out exact
            assert 0 < half <= 0.2
    assert max(errors) < 0.08 and float(np.mean(errors)) < 0.03, errors
    assert misses <= 1, misses


def test_sketch_overlap_is_exact_when_every_rank_fits() -> None:
    import torch

    from colltune.model.features import overlap_from_sketches, sketch_hashes

    sets = [np.arange(0, 200), np.arange(100, 300), np.arange(150, 250)]
    sketches = [sketch_hashes(torch.from_numpy(s), 1024) for s in sets]
    union, est, half = overlap_from_sketches([200, 200, 100], sketches)
    assert (union, half) == (300.0, 0.0)
    assert est == overlap_from_union([200, 200, 100], 300)
    assert overlap_from_sketches([50, 0], [sketches[0][:50], sketches[0][:0]])[1:] == (0.0, 0.0)
