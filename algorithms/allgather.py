"""Allgather: every rank receives every rank's entries and merges them locally.

Best when the entries are few: one collective after the metadata, no
reduction on the way, but each rank receives ``(P-1) k`` entries and merges
``P k``. Indices and values are packed into one byte tensor so one
collective moves both. Unequal counts are either padded to the largest
(``all_gather``) or sent exactly (``all_to_all_single`` with splits); the
``mode`` knob chooses, ``auto`` pads unless padding adds more than a quarter.

In top-k mode this is TopkA: each rank sends its exact local top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from algorithms._comm import Comm
from algorithms._sparse import accum_dtype, merge_sources, pack, unpack, wire_index_dtype
from algorithms.base import Algorithm, SparseInput, TopkOutput
from algorithms.errors import ColltuneValueError

__all__ = ["Allgather", "gather_merge"]

_MODES = ("auto", "pad", "alltoall")


def gather_merge(
    comm: Comm,
    idx: torch.Tensor,
    vals: torch.Tensor,
    counts: list[int],
    size: int,
    wire_dtype: torch.dtype,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather coalesced entries and merge them in rank order (see :func:`merge_sources`)."""
    index_dtype = wire_index_dtype(size)
    r = vals.shape[1]
    buf = pack(idx.to(comm.device), vals.to(comm.device), index_dtype, wire_dtype)
    pieces = comm.all_gather_v(buf, counts, mode)
    sources = [unpack(piece, r, index_dtype, wire_dtype) for piece in pieces]
    return merge_sources(sources, size, r, accum_dtype(wire_dtype), comm.device)


class Allgather(Algorithm):
    """Gather every rank's packed entries, then merge them in rank order."""

    name = "allgather"
    knobs: dict[str, Any] = {"mode": "auto"}

    def check_knobs(self, knobs: dict[str, Any] | None) -> dict[str, Any]:
        merged = super().check_knobs(knobs)
        if merged["mode"] not in _MODES:
            raise ColltuneValueError(
                f"knob allgather.mode must be one of {', '.join(_MODES)}, but got {merged['mode']!r}."
            )
        return merged

    def sparse_allreduce(self, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_merge(comm, inp.indices, inp.values, list(inp.counts), inp.size, inp.dtype, knobs["mode"])

    def topk_allreduce(self, acc: torch.Tensor, state: Any, comm: Comm, knobs: dict[str, Any]) -> TopkOutput:
        n = acc.numel()
        k = state.k_for(n)
        idx = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
        vals = acc.index_select(0, idx).view(k, 1)
        gidx, gvals = gather_merge(comm, idx, vals, [k] * comm.world_size, n, acc.dtype, "pad")
        state.last_local_count, state.last_global_count = k, gidx.numel()
        return TopkOutput(indices=gidx, values=gvals.view(-1), sent=idx, local_count=k, global_count=gidx.numel())
