"""Property-based tests of the exact sparse allreduce (hypothesis).

Each example is a whole call on P = 1..4 ranks: per-rank index lists (any
order, duplicates, empty ranks), small integer values (so every sum is exact
in every dtype, bf16 included: |sum| <= 3 * 20 * 4 < 256), a row shape, a dtype, an index
dtype, an op and the memory layout the tensors arrive in (contiguous, a
strided slice of a larger tensor, transposed rows, or a one-element view
whose stride torch does not check). One round trip to a pool of ranks that stays
up runs all four algorithms on it, so an example costs milliseconds, not a
process launch.

Properties:
* indices are the sorted union of the inputs' indices (int64);
* with ``sum`` the values equal the exact reference bit for bit, with ``avg``
  within one rounding;
* every rank holds the same bits, and every algorithm gives the same bits
  (the sums are exact, so there is nothing for the order of additions to change).
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import pool
from sparse_cases import ALGORITHMS, DTYPES, assert_close_to_reference, case, make_input, raw, reference

MAX_K = 20
MAX_ABS = 3


@st.composite
def exact_cases(draw):
    world_size = draw(st.integers(1, 4))
    size = draw(st.one_of(st.integers(1, 64), st.sampled_from([1000, 1 << 20])))
    row_shape = draw(st.sampled_from([(), (2,), (2, 3), (9,)]))  # 36-byte rows take the p2p gathers
    rn = math.prod(row_shape)
    indices, values = [], []
    for _ in range(world_size):
        idx = draw(st.lists(st.integers(0, size - 1), max_size=MAX_K))
        vals = draw(st.lists(st.integers(-MAX_ABS, MAX_ABS), min_size=len(idx) * rn, max_size=len(idx) * rn))
        indices.append(idx)
        values.append(vals)
    c = case(
        pattern="explicit",
        size=size,
        row_shape=row_shape,
        indices=indices,
        values=values,
        dtype=draw(st.sampled_from(list(DTYPES))),
        index_dtype=draw(st.sampled_from(["int32", "int64"])),
        op=draw(st.sampled_from(["sum", "avg"])),
    )
    c["layout"] = draw(st.sampled_from(LAYOUTS))
    return world_size, c


#: How the example's tensors are laid out in memory (the values are the same).
LAYOUTS = ("contiguous", "sliced", "transposed", "offset")


def _lay_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Return ``t``'s values in the memory layout ``layout`` (a view of a new tensor, never ``t`` itself)."""
    if layout == "sliced":  # every other element of a tensor twice as long
        big = torch.zeros((2 * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)
        big[::2] = t
        return big[::2]
    if layout == "transposed" and t.dim() == 2:  # rows stored column-major
        return t.t().contiguous().t()
    if layout == "offset":  # a view that starts inside its storage, whose last stride may be anything
        big = torch.zeros((t.numel() + 3,), dtype=t.dtype)
        big[3:] = t.reshape(-1)
        view = big[3:].view(t.shape)
        return view.as_strided(view.shape, tuple(st if n > 1 else 7 for st, n in zip(view.stride(), view.shape)),
                               view.storage_offset())
    return t


def _run_all_algorithms(rank, world_size, c):
    import colltune

    idx, vals = make_input(c, rank, world_size)
    idx, vals = _lay_out(idx, c["layout"]), _lay_out(vals, c["layout"])
    out = {}
    for algorithm in ALGORITHMS:
        res = colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=algorithm)
        out[algorithm] = (res.indices.clone(), res.values.clone())
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exact_cases())
def test_exact_sparse_allreduce_properties(example):
    world_size, c = example
    out = pool(world_size).run(_run_all_algorithms, c, timeout=60)
    ref = reference(c, world_size)
    dtype = DTYPES[c["dtype"]]
    row_shape = tuple(c["row_shape"])
    exact = ref["dense"].to(dtype)  # exactly representable: small integers (sum) or one rounding (avg)
    base_idx, base_vals = out[0]["dense"]
    for r in range(world_size):
        for algorithm in ALGORITHMS:
            idx, vals = out[r][algorithm]
            where = f"{algorithm} rank {r}"
            assert idx.dtype == torch.int64 and torch.equal(idx, ref["union"]), f"{where}: indices {idx.tolist()}"
            assert vals.dtype == dtype and tuple(vals.shape) == (idx.numel(),) + row_shape, f"{where}: {vals.dtype} {vals.shape}"
            if c["op"] == "sum":
                assert raw(vals) == raw(exact[idx]), f"{where}: {vals.tolist()} != {exact[idx].tolist()}"
            else:
                assert_close_to_reference(vals, idx, ref, dtype, where)
            # Same bits on every rank and from every algorithm.
            assert raw(idx) == raw(base_idx) and raw(vals) == raw(base_vals), f"{where}: differs from dense on rank 0"


def test_property_strategy_covers_edge_cases():
    """The strategy can produce the cases the properties are about (guards against a silently narrow strategy)."""
    seen = {"empty_rank": False, "dups": False, "unsorted": False, "rows": False, "int32": False, "big": False,
            "four_ranks": False, **{layout: False for layout in LAYOUTS}}

    @settings(max_examples=300, deadline=None, database=None)
    @given(exact_cases())
    def probe(example):
        world_size, c = example
        for r in range(world_size):
            idx = c["indices"][r]
            seen["empty_rank"] |= not idx
            seen["dups"] |= len(set(idx)) < len(idx)
            seen["unsorted"] |= idx != sorted(idx)
        seen["rows"] |= c["row_shape"] != ()
        seen["int32"] |= c["index_dtype"] == "int32"
        seen["big"] |= c["size"] >= 1000
        seen["four_ranks"] |= world_size == 4
        seen[c["layout"]] = True
        make_input(c, 0, world_size)

    probe()
    assert all(seen.values()), seen
