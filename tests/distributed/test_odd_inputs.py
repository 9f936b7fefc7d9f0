"""Awkward but valid inputs on every algorithm and both code paths, at P = 2.

* zero-width rows (``values`` of shape ``[k, ..., 0, ...]``): nothing to sum,
  but the result still holds the union of the indices;
* values and indices with any strides: one-element views torch calls
  contiguous whatever their stride, odd strides, sliced and expanded
  (stride 0) views;
* top-k mode with NaN and infinities: they are the largest magnitudes, so
  every algorithm delivers them (a NaN in a gradient shows in the result,
  instead of staying in the residual forever).

Each rank builds every rank's input from its rank alone, so the parent
computes the exact float64 reference from all ranks' inputs. The values are
multiples of 1/8, so every sum is exact and the results are compared bit for
bit with the reference, and across ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colltune.algorithms import registry
from colltune.algorithms.sparse import device_path

from harness import pool, run_ranks
from sparse_cases import ALGORITHMS

P = 2
SIZE = 64
PATHS = (False, True)

# ------------------------------------------------------------------ inputs


def _base(rank: int, k: int, width: int) -> torch.Tensor:
    """``[k, width]`` float32 multiples of 1/8, different per rank."""
    return ((torch.arange(k * width, dtype=torch.float32).view(k, width) * 3 + 5 * rank) % 17 - 8) / 8


def _strided_inputs(name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(indices, values)`` for the strided case ``name``.

    The indices are sorted and unique, so the views reach the algorithms as
    they are (coalescing would replace them by fresh sums).
    """
    idx = torch.tensor([1, 5, 33, 60, 61]) + rank
    if name == "one_element_strided_view":
        return torch.tensor([7]), torch.tensor([[0.0, 0.5 + rank]])[:, 1]  # contiguous to torch, stride 2
    if name == "one_row_odd_strides":  # contiguous to torch, last stride 5
        return torch.tensor([7 + rank]), _base(rank, 4, 4).reshape(-1).as_strided((1, 3, 1), (7, 1, 5), 1)
    if name == "rows_of_one_odd_stride":  # contiguous to torch, last stride 7
        return idx, _base(rank, 4, 4).reshape(-1).as_strided((5, 1), (1, 7), 2)
    if name == "one_element_strided_indices":
        return torch.tensor([[3 + rank, 0]])[:, 0], torch.tensor([[1.5, -0.25]])
    if name == "sliced_rows":
        return idx, _base(rank, 5, 6)[:, 1::2]
    if name == "strided_indices_and_transposed_rows":
        return torch.stack((idx, idx), 1)[:, 1], _base(rank, 3, 5).t()
    if name == "expanded_rows":
        return idx, _base(rank, 1, 3).expand(5, 3)
    if name == "expanded_scalars":
        return idx, torch.tensor(0.375 - rank).expand(5)
    if name == "expanded_wide_rows":  # rows of 32 bytes and more travel unpacked
        return idx, _base(rank, 1, 16).expand(5, 16)
    raise ValueError(name)


STRIDED = [
    "one_element_strided_view",
    "one_row_odd_strides",
    "rows_of_one_odd_stride",
    "one_element_strided_indices",
    "sliced_rows",
    "strided_indices_and_transposed_rows",
    "expanded_rows",
    "expanded_scalars",
    "expanded_wide_rows",
]

#: Row shapes with no elements, each with the same indices on every rank and with rank-specific ones.
ZERO_WIDTH = [(shape, shared) for shape in [(0,), (3, 0), (0, 4), (2, 0, 3)] for shared in (True, False)]


def _zero_width_inputs(case: tuple[tuple[int, ...], bool], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    row_shape, shared = case
    idx = torch.tensor([2, 5, 2] if shared else [2, 5, 2, 40 + rank, 9 * rank])
    return idx, torch.ones((idx.numel(),) + row_shape)


# ------------------------------------------------------------------ rank functions


def _run_sparse_cases(rank, world_size, kind, names):
    import colltune

    out = {}
    for name in names:
        idx, vals = _strided_inputs(name, rank) if kind == "strided" else _zero_width_inputs(name, rank)
        for algorithm in ALGORITHMS:
            for device in PATHS:
                with device_path(device):
                    res = colltune.sparse_allreduce(idx, vals, (SIZE,) + tuple(vals.shape[1:]), algorithm=algorithm)
                out[name, algorithm, device] = (res.indices.clone(), res.values.clone())
    return out


def _run_topk_nan(rank, world_size, algorithm, calls):
    import colltune

    out = {}
    for device in PATHS:
        with device_path(device):
            state = colltune.TopkState(k=4)
            steps = []
            for call in calls:
                t = _base(rank, 1, 128).view(-1) / 64  # small: the specials below are what top-k must take
                for pos, value, on_rank in call:
                    if on_rank == rank:
                        t[pos] = value
                acc = t + state.residual if state.residual is not None else t.clone()
                res = colltune.topk_allreduce(t, state, op="sum", algorithm=algorithm)
                steps.append({"acc": acc, "sent": res.sent_indices.clone(), "indices": res.indices.clone(),
                              "values": res.values.clone(), "residual": state.residual.clone()})
            out[device] = steps
    return out


# ------------------------------------------------------------------ checks


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _check_exact(out: list[dict], key: tuple, inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Check every rank's result for ``key`` against the exact fp64 sum of ``inputs`` (one per rank), bitwise."""
    row_shape = tuple(inputs[0][1].shape[1:])
    dense = torch.zeros((SIZE,) + row_shape, dtype=torch.float64)
    for idx, vals in inputs:
        dense.index_add_(0, idx.to(torch.int64), vals.to(torch.float64))
    union = torch.unique(torch.cat([idx.to(torch.int64) for idx, _ in inputs]))
    want = dense[union].to(torch.float32)
    for r, o in enumerate(out):
        idx, vals = o[key]
        assert torch.equal(idx, union), f"{key} rank {r}: indices {idx.tolist()} != {union.tolist()}"
        assert _same_bits(vals, want), f"{key} rank {r}: values {vals.tolist()} != {want.tolist()}"
        assert torch.equal(idx, out[0][key][0]) and _same_bits(vals, out[0][key][1]), f"{key}: ranks differ"


def test_zero_width_rows_on_every_algorithm():
    out = pool(P).run(_run_sparse_cases, "zero_width", ZERO_WIDTH)
    for case in ZERO_WIDTH:
        inputs = [_zero_width_inputs(case, r) for r in range(P)]
        for algorithm in ALGORITHMS:
            for device in PATHS:
                _check_exact(out, (case, algorithm, device), inputs)


def test_values_and_indices_of_any_strides_on_every_algorithm():
    out = pool(P).run(_run_sparse_cases, "strided", STRIDED)
    for name in STRIDED:
        inputs = [_strided_inputs(name, r) for r in range(P)]
        if "odd_stride" in name or name == "one_element_strided_view":
            assert all(v.is_contiguous() and v.stride(-1) != 1 for _, v in inputs), f"{name}: not the layout it names"
        for algorithm in ALGORITHMS:
            for device in PATHS:
                _check_exact(out, (name, algorithm, device), inputs)


#: Per call, the special values: ``(position, value, rank)``. The first call
#: selects exactly (fresh thresholds), the second reuses the thresholds.
NAN_CALLS = [
    [(3, float("nan"), 0), (7, float("inf"), 1)],
    [(40, float("nan"), 1), (7, float("inf"), 0), (9, -float("inf"), 1), (50, float("nan"), 0), (50, 1.0, 1)],
    [],
]


#: The algorithms that send a selection of each rank's k entries, not the whole tensor as dense does.
SELECTING = [n for n in registry.names() if registry.get(n).topk_priced_on == "selection"]


@pytest.mark.parametrize("algorithm", SELECTING)
def test_topk_delivers_nan_and_infinities(algorithm):
    out = pool(P).run(_run_topk_nan, algorithm, NAN_CALLS)
    for device in PATHS:
        for step, call in enumerate(NAN_CALLS):
            recs = [o[device][step] for o in out]
            where = f"{algorithm} {'device' if device else 'host'} path, call {step}"
            for pos, _, rank in call:
                assert pos in recs[rank]["sent"].tolist(), f"{where}: rank {rank} kept position {pos} back"
            for r, rec in enumerate(recs):
                assert not rec["residual"].isnan().any() and not rec["residual"].isinf().any(), f"{where} rank {r}"
            # The exact reference: the fp64 sum over ranks of what each delivered.
            ref = torch.zeros(128, dtype=torch.float64)
            for rec in recs:
                ref.index_add_(0, rec["sent"], rec["acc"][rec["sent"]].to(torch.float64))
            want = ref[recs[0]["indices"]].to(torch.float32)
            for r, rec in enumerate(recs):
                got = rec["values"]
                assert torch.equal(got.isnan(), want.isnan()), f"{where} rank {r}: NaN at {got.isnan().nonzero()}"
                assert torch.equal(got[~got.isnan()], want[~want.isnan()]), f"{where} rank {r}: {got} != {want}"
                assert torch.equal(rec["indices"], recs[0]["indices"]), f"{where}: ranks differ"
                assert _same_bits(got, recs[0]["values"]), f"{where}: ranks differ"
            specials = {pos for pos, _, _ in call}
            assert specials <= set(recs[0]["indices"].tolist()), f"{where}: {specials} not all delivered"


def _one_entry_sliced(rank, world_size, device_path_on):
    import colltune

    base_i, base_v = torch.tensor([0, 9], dtype=torch.int32), torch.tensor([1.5, 9.0])
    idx, vals = base_i[::2], base_v[::2]  # one entry, stride 2: a view torch calls contiguous
    out = {}
    with device_path(device_path_on):
        for algorithm in ALGORITHMS:
            res = colltune.sparse_allreduce(idx, vals, 1, algorithm=algorithm)
            out[algorithm] = (res.indices.stride(), res.values.stride(), res.indices.view(torch.uint8).numel(),
                              res.to_dense().tolist())
    return out


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("on_device_path", [False, True])
def test_a_one_entry_strided_view_gives_unit_stride_results(world_size, on_device_path):
    """Every row present (size 1) and one rank: dense may hand the coalesced indices back, never a stride-2 view."""
    for out in pool(world_size).run(_one_entry_sliced, on_device_path):
        for algorithm, (istride, vstride, nbytes, dense) in out.items():
            assert istride == (1,) and vstride == (1,) and nbytes == 8, (algorithm, istride, vstride)
            assert dense == [1.5 * world_size], (algorithm, dense)


def _run_zero_width_p2p(rank, world_size, dtype):
    import colltune

    n = 1 << 16
    idx = torch.arange(rank, n, 7 + rank)  # thousands of entries, more on rank 0: past every eager slot
    vals = torch.ones((idx.numel(), 0), dtype=dtype)
    out = {}
    for device in PATHS:
        with device_path(device):
            for _ in range(2):  # the second call's slot is sized from the first's counts
                res = colltune.sparse_allreduce(idx, vals, (n, 0), algorithm="allgather", knobs={"mode": "p2p"})
            out[device] = (res.indices.clone(), tuple(res.values.shape), res.values.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_zero_width_rows_point_to_point_past_the_slot(dtype):
    out = pool(P).run(_run_zero_width_p2p, dtype)
    n = 1 << 16
    union = torch.unique(torch.cat([torch.arange(r, n, 7 + r) for r in range(P)]))
    for r, o in enumerate(out):
        for device in PATHS:
            idx, shape, got = o[device]
            assert torch.equal(idx, union) and shape == (union.numel(), 0) and got == dtype, (r, device)


def _run_one_head_entry(rank, world_size, size, row, dtype):
    import colltune

    # Rank 1's entries pass the slot, so they go point to point; on a fresh group the slot (1024 bytes) holds one.
    # Each path gets a group of its own: a call sizes the group's next slots from its counts.
    idx = torch.arange(size - 5, size) if rank == 1 else torch.zeros(0, dtype=torch.int64)
    vals = torch.full((idx.numel(), row), 1.5, dtype=dtype)
    out = {}
    for device in PATHS:
        group = dist.new_group(list(range(world_size)))
        with device_path(device):
            res = colltune.sparse_allreduce(idx, vals, size, group=group, algorithm="allgather", knobs={"mode": "p2p"})
            out[device] = (res.indices.tolist(), res.values.tolist())
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("size, row, dtype", [
    (1000, 64, torch.float64),  # int32 index and fp64 rows: 516-byte entries, not a multiple of 8
    (1 << 40, 255, torch.float16),  # int64 index and fp16 rows: 518 bytes, not a multiple of 8
])
def test_one_eager_entry_whose_bytes_do_not_align_with_its_dtypes(world_size, size, row, dtype):
    """The peers' eager entries are read through a fresh copy: one row's column keeps the entry's stride, which
    a dtype view refuses (it raised on the ranks that received it, and the call hung on the sender)."""
    for r, out in enumerate(run_ranks(_run_one_head_entry, world_size, size, row, dtype)):
        for device in PATHS:
            assert out[device] == (list(range(size - 5, size)), [[1.5] * row] * 5), (r, device)
