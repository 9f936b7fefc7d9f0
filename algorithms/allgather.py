"""Allgather: every rank receives every rank's entries and merges them locally.

Best when the entries are few: one collective after the metadata, no
reduction on the way, but each rank receives ``(P-1) k`` entries and merges
``P k``. Indices and values are packed into one byte tensor so one
collective moves both. Unequal counts are either padded to the largest
(``all_gather``) or sent exactly (``all_to_all_single`` with splits); the
``mode`` knob chooses, ``auto`` pads unless padding adds more than a quarter.
Wide rows (embedding rows, :func:`~colltune.algorithms.sparse.split_layout`) are not
packed: under ``auto`` (or ``p2p``) each rank sends its indices and its rows
to every peer point to point, and they land in place in one buffer per kind,
already in rank order for the merge.

Entries travel in the eager slot of the metadata record
(:func:`colltune.algorithms.meta.slot_bytes` per rank, sized from the group's recent
calls): when every rank's entries fit, the whole allreduce is a single
collective.

In top-k mode this is TopkA: each rank sends its exact local top-k.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from colltune.algorithms import meta as _meta
from colltune.algorithms.base import Algorithm, SparseInput, TopkOutput
from colltune.algorithms.comm import Comm
from colltune.algorithms.knobs import Knob
from colltune.algorithms.registry import register
from colltune.algorithms.schedule import Pricing, Step
from colltune.algorithms.sparse import (
    Magnitudes,
    accum_dtype,
    entry_bytes,
    gather_mode,
    merge_host_pieces,
    merge_runs,
    merge_sources,
    offsets,
    on_host,
    pack,
    pack_host,
    unpack,
    unpack_host,
    wire_index_dtype,
)

__all__ = ["Allgather", "gather_merge", "eager_slot", "slot_need"]

_MODES = ("auto", "p2p", "pad", "alltoall")


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
    mode = gather_mode(mode, r, wire_dtype)
    if mode == "p2p" and comm.world_size > 1:
        return gather_merge_p2p(comm, idx.to(comm.device), vals.to(comm.device), counts, size, wire_dtype)
    if on_host(comm.device):
        buf = torch.from_numpy(pack_host(idx, vals, index_dtype, wire_dtype))
        pieces = comm.all_gather_v(buf, counts, mode)
        return merge_host_pieces([unpack_host(piece.numpy(), r, index_dtype, wire_dtype) for piece in pieces], size)
    buf = pack(idx.to(comm.device), vals.to(comm.device), index_dtype, wire_dtype)
    pieces = comm.all_gather_v(buf, counts, mode)
    sources = [unpack(piece, r, index_dtype, wire_dtype) for piece in pieces]
    return merge_sources(sources, size, r, accum_dtype(wire_dtype), comm.device)


def gather_merge_p2p(
    comm: Comm,
    idx: torch.Tensor,
    vals: torch.Tensor,
    counts: list[int],
    size: int,
    wire_dtype: torch.dtype,
    head: list[int] | None = None,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather coalesced entries as separate index and row messages received in place, then merge in rank order.

    ``head[j]`` entries of rank ``j`` already arrived packed in ``slots``
    (``[P, cap]`` bytes, the metadata record's eager slots); only the rest
    travels here. Every rank sends to every peer in one batch.
    """
    p, me = comm.world_size, comm.rank
    r = vals.shape[1]
    index_dtype = wire_index_dtype(size)
    head = head or [0] * p
    at = offsets(counts)  # rank j's entries land at rows [at[j], at[j+1]): its head, then the rest
    all_idx = torch.empty(at[-1], dtype=index_dtype, device=comm.device)
    all_vals = torch.empty((at[-1], r), dtype=wire_dtype, device=comm.device)
    all_idx[at[me] : at[me + 1]] = idx
    all_vals[at[me] : at[me + 1]] = vals
    mu = max(head)
    if mu and slots is not None:
        e = entry_bytes(r, index_dtype, wire_dtype)
        hidx, hvals = unpack(slots[:, : mu * e].reshape(p * mu, e), r, index_dtype, wire_dtype)
        for j in range(p):
            if j != me and head[j]:
                all_idx[at[j] : at[j] + head[j]] = hidx[j * mu : j * mu + head[j]]
                all_vals[at[j] : at[j] + head[j]] = hvals[j * mu : j * mu + head[j]]
    comm.all_gather_rows((all_idx, all_vals), at, max(1, p - 1), head)
    return merge_runs(all_idx.to(torch.int64), all_vals, at, size, accum_dtype(wire_dtype))


def eager_slot(
    idx: torch.Tensor, vals: torch.Tensor, size: int, dtype: torch.dtype, capacity: int
) -> torch.Tensor | np.ndarray:
    """Pack the first entries that fit in ``capacity`` bytes of the metadata record's eager slot.

    Returns flat ``uint8``: a NumPy array on the host path (the record is
    built on the host), else a tensor on the entries' device.
    """
    m = min(idx.numel(), capacity // entry_bytes(vals.shape[1], wire_index_dtype(size), dtype))
    if on_host(idx):
        return pack_host(idx[:m], vals[:m], wire_index_dtype(size), dtype).reshape(-1)
    return pack(idx[:m], vals[:m], wire_index_dtype(size), dtype).view(-1)


def slot_need(counts: Any, row_numel: int, size: int, dtype: torch.dtype) -> int:
    """Return the bytes of the largest rank's entries packed for the eager slot."""
    return max(counts, default=0) * entry_bytes(row_numel, wire_index_dtype(size), dtype)


@register
class Allgather(Algorithm):
    """Gather every rank's packed entries, then merge them in rank order."""

    name = "allgather"
    knob_specs = (
        Knob("mode", "auto", "`p2p` (indices and rows sent to every peer as separate messages, received in place: no packing), "
             "`pad` (one `all_gather` of packed entries padded to the largest count), `alltoall` (exact sizes), "
             "`auto` (`p2p` for rows of 32 bytes or more, such as embedding rows, else pad unless padding adds "
             "over 25%)", choices=_MODES,
             tune=("exact",)),
    )
    TERMS = ("metadata", "entries_gather", "merge")
    eager_entries = True

    def schedule(self, pricing: Pricing, knobs: dict[str, Any]) -> list[Step]:
        """The record (carrying the entries when they fit its eager slot), the entries' gather, the merge."""
        c = pricing
        gathered = c.p * c.k_max * c.e
        if c.n <= 4 * c.ksum:
            merge_bytes = gathered + c.n * c.rba + c.ksum * c.rba + c.n + c.u * c.out_entry
        else:
            merge_bytes = (gathered + c.ksum * math.log2(max(c.ksum, 2.0)) * 8.0 + c.ksum * (8.0 + c.rba)
                           + c.u * c.out_entry)
        meta = c.metadata()
        if not c.record_known and c.k_max * c.e <= _meta.slot_limit(c.p):
            # Every rank's entries ride in the metadata record's eager slot,
            # grown to fit them (a call site that keeps to allgather): one
            # collective, its record larger by the entries.
            base = _meta.eager_capacity(c.p)
            slot = max(base, 1 << max(int(math.ceil(c.k_max * c.e)) - 1, 0).bit_length())
            meta = c.metadata(c.record_bytes - base + slot)
            entries = c.free("entries_gather", "all_gather")
        elif 4 * c.p * c.k_max <= 5 * c.ksum:  # all_gather_v "auto": pad while padding adds <= 1/4
            entries = c.all_gather("entries_gather", c.k_max * c.e)
        else:  # every rank sends its entries to each peer; the largest rank bounds the time
            entries = c.all_to_all("entries_gather", c.k_max * c.e)
        return [meta, entries, c.local("merge", merge_bytes, 4.0)]

    def sparse_allreduce(self, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        counts = list(inp.counts)
        if inp.eager is None or comm.world_size == 1:
            return gather_merge(comm, inp.indices, inp.values, counts, inp.size, inp.dtype, knobs["mode"])
        # The first entries of every rank already arrived in the eager slots;
        # gather only what did not fit, then merge in rank order as usual.
        p, r, me = comm.world_size, inp.row_numel, comm.rank
        index_dtype = inp.index_dtype
        e = entry_bytes(r, index_dtype, inp.dtype)
        m = inp.eager.shape[1] // e
        head = [min(c, m) for c in counts]
        rest = [c - h for c, h in zip(counts, head)]
        comm.traffic.reclassify((p - 1) * head[me] * e)
        mode = gather_mode(knobs["mode"], r, inp.dtype)
        if any(rest) and mode == "p2p":
            return gather_merge_p2p(
                comm, inp.indices.to(comm.device), inp.values.to(comm.device), counts, inp.size,
                inp.dtype, head, inp.eager.to(comm.device),
            )
        mu = max(head)
        host = on_host(comm.device)
        tail_buf = None
        if any(rest):
            i1, v1 = inp.indices[head[me] :], inp.values[head[me] :]
            tail_buf = (
                torch.from_numpy(pack_host(i1, v1, index_dtype, inp.dtype))
                if host
                else pack(i1.to(comm.device), v1.to(comm.device), index_dtype, inp.dtype)
            )
        if host:
            # Unpack the used part of every slot in one go; keep each rank's first head[p] entries.
            block = inp.eager.numpy()[:, : mu * e].reshape(p * mu, e)
            idx, vals = unpack_host(block, r, index_dtype, inp.dtype)
            if tail_buf is None:
                if min(head) < mu:
                    keep = (np.arange(mu) < np.asarray(head)[:, None]).reshape(-1)
                    idx, vals = idx[keep], vals[keep]
                return merge_host_pieces([(idx, vals)], inp.size)
            tails = [unpack_host(piece.numpy(), r, index_dtype, inp.dtype) for piece in
                     comm.all_gather_v(tail_buf, rest, mode)]
            pieces = []
            for j in range(p):
                pieces.append((idx[j * mu : j * mu + head[j]], vals[j * mu : j * mu + head[j]]))
                pieces.append(tails[j])
            return merge_host_pieces(pieces, inp.size)
        block = inp.eager[:, : mu * e].reshape(p * mu, e)
        idx_all, vals_all = unpack(block, r, index_dtype, inp.dtype)
        idx_all, vals_all = idx_all.view(p, mu), vals_all.view(p, mu, r)
        sources = [(idx_all[j, :h], vals_all[j, :h]) for j, h in enumerate(head)]
        if tail_buf is not None:
            tails_t = [unpack(piece, r, index_dtype, inp.dtype) for piece in comm.all_gather_v(tail_buf, rest, mode)]
            sources = [(torch.cat((i0, i1)), torch.cat((v0, v1))) for (i0, v0), (i1, v1) in zip(sources, tails_t)]
        return merge_sources(sources, inp.size, r, accum_dtype(inp.dtype), comm.device)

    def topk_allreduce(self, acc: torch.Tensor, state: Any, comm: Comm, knobs: dict[str, Any]) -> TopkOutput:
        n = acc.numel()
        k = state.k_for(n)
        idx = Magnitudes(acc).top_k_indices(k)
        vals = acc.index_select(0, idx).view(k, 1)
        gidx, gvals = gather_merge(comm, idx, vals, [k] * comm.world_size, n, acc.dtype, "pad")
        state.last_local_count, state.last_global_count = k, gidx.numel()
        return TopkOutput(indices=gidx, values=gvals.view(-1), sent=idx, local_count=k, global_count=gidx.numel())
