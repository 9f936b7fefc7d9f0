"""Allgather: every rank receives every rank's entries and merges them locally.

Best when the entries are few: one collective after the metadata, no
reduction on the way, but each rank receives ``(P-1) k`` entries and merges
``P k``. Indices and values are packed into one byte tensor so one
collective moves both. Unequal counts are either padded to the largest
(``all_gather``) or sent exactly (``all_to_all_single`` with splits); the
``mode`` knob chooses, ``auto`` pads unless padding adds more than a quarter.

Entries travel in the eager slot of the metadata record
(:func:`algorithms._meta.slot_bytes` per rank, sized from the group's recent
calls): when every rank's entries fit, the whole allreduce is a single
collective.

In top-k mode this is TopkA: each rank sends its exact local top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from algorithms._comm import Comm
from algorithms._sparse import accum_dtype, entry_bytes, merge_sources, pack, unpack, wire_index_dtype
from algorithms.base import Algorithm, SparseInput, TopkOutput

__all__ = ["Allgather", "gather_merge", "eager_slot", "slot_need"]

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


def eager_slot(idx: torch.Tensor, vals: torch.Tensor, size: int, dtype: torch.dtype, capacity: int) -> torch.Tensor:
    """Pack the first entries that fit in ``capacity`` bytes of the metadata record's eager slot, as flat ``uint8``."""
    m = min(idx.numel(), capacity // entry_bytes(vals.shape[1], wire_index_dtype(size), dtype))
    return pack(idx[:m], vals[:m], wire_index_dtype(size), dtype).view(-1)


def slot_need(counts: Any, row_numel: int, size: int, dtype: torch.dtype) -> int:
    """Return the bytes of the largest rank's entries packed for the eager slot."""
    return max(counts, default=0) * entry_bytes(row_numel, wire_index_dtype(size), dtype)


class Allgather(Algorithm):
    """Gather every rank's packed entries, then merge them in rank order."""

    name = "allgather"
    knobs: dict[str, Any] = {"mode": "auto"}
    knob_choices = {"mode": _MODES}

    def sparse_allreduce(self, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        counts = list(inp.counts)
        if inp.eager is None or comm.world_size == 1:
            return gather_merge(comm, inp.indices, inp.values, counts, inp.size, inp.dtype, knobs["mode"])
        # The first entries of every rank already arrived in the eager slots;
        # gather only what did not fit, then merge in rank order as usual.
        r, me = inp.row_numel, comm.rank
        index_dtype = inp.index_dtype
        e = entry_bytes(r, index_dtype, inp.dtype)
        m = inp.eager[0].numel() // e
        head = [min(c, m) for c in counts]
        rest = [c - h for c, h in zip(counts, head)]
        comm.traffic.reclassify((comm.world_size - 1) * head[me] * e)
        # Unpack the used part of every slot in one go, then keep each rank's first head[p] entries.
        mu = max(head)
        block = torch.stack([s[: mu * e] for s in inp.eager]).view(len(counts) * mu, e)
        idx_all, vals_all = unpack(block, r, index_dtype, inp.dtype)
        idx_all, vals_all = idx_all.view(len(counts), mu), vals_all.view(len(counts), mu, r)
        sources = [(idx_all[p, :h], vals_all[p, :h]) for p, h in enumerate(head)]
        if any(rest):
            buf = pack(inp.indices[head[me] :].to(comm.device), inp.values[head[me] :].to(comm.device), index_dtype, inp.dtype)
            pieces = comm.all_gather_v(buf, rest, knobs["mode"])
            tails = [unpack(piece, r, index_dtype, inp.dtype) for piece in pieces]
            sources = [(torch.cat((i0, i1)), torch.cat((v0, v1))) for (i0, v0), (i1, v1) in zip(sources, tails)]
        return merge_sources(sources, inp.size, r, accum_dtype(inp.dtype), comm.device)

    def topk_allreduce(self, acc: torch.Tensor, state: Any, comm: Comm, knobs: dict[str, Any]) -> TopkOutput:
        n = acc.numel()
        k = state.k_for(n)
        idx = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
        vals = acc.index_select(0, idx).view(k, 1)
        gidx, gvals = gather_merge(comm, idx, vals, [k] * comm.world_size, n, acc.dtype, "pad")
        state.last_local_count, state.last_global_count = k, gidx.numel()
        return TopkOutput(indices=gidx, values=gvals.view(-1), sent=idx, local_count=k, global_count=gidx.numel())
