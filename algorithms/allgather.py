"""Allgather: every rank receives every rank's entries and merges them locally.

Best when the entries are few: one collective after the metadata, no
reduction on the way, but each rank receives ``(P-1) k`` entries and merges
``P k``. Indices and values are packed into one byte tensor so one
collective moves both. Unequal counts are either padded to the largest
(``all_gather``) or sent exactly (``all_to_all_single`` with splits); the
``mode`` knob chooses, ``auto`` pads unless padding adds more than a quarter.
Wide rows (embedding rows, :func:`~colltune.algorithms.sparse.split_layout`) are not
packed under ``p2p``, nor under ``auto`` on the host path or inside one node
(:func:`~colltune.algorithms.schedule.p2p_gathers`): each rank sends its
indices and its rows to every peer point to point, and they land in place in
one buffer per kind, already in rank order for the merge. On the device path
(NCCL) across nodes ``auto`` packs them and gathers collectively, as narrow
entries: there NCCL's model prices ``P - 1`` messages per rank well above a
ring ``all_gather``.

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

from colltune.algorithms import sizes
from colltune.algorithms.base import Algorithm, SparseInput, TopkOutput
from colltune.algorithms.comm import Comm
from colltune.algorithms.knobs import GATHER_MODES, Knob
from colltune.algorithms.lazy import torch
from colltune.algorithms.registry import register
from colltune.algorithms.schedule import Pricing, Step
from colltune.algorithms.sparse import (
    SPLIT_MIN_ROW_BYTES,
    Magnitudes,
    Parts,
    accum_dtype,
    entry_bytes,
    fresh,
    gather_mode,
    gather_rows,
    merge_host_pieces,
    merge_runs,
    offsets,
    on_host,
    pack,
    pack_host,
    unpack,
    unpack_host,
    upload,
    wire_index_dtype,
)

__all__ = ["Allgather", "gather_merge", "eager_slot", "slot_need"]



def gather_merge(
    comm: Comm,
    idx: torch.Tensor,
    vals: torch.Tensor,
    counts: list[int],
    size: int,
    wire_dtype: torch.dtype,
    mode: str,
    parts: Parts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather coalesced entries and merge them in rank order (see :func:`merge_sources`; ``parts``: a fused
    call's tensors, whose result sizes the merge reads with its own)."""
    index_dtype = wire_index_dtype(size)
    r = vals.shape[1]
    mode = gather_mode(mode, r, wire_dtype, comm.p2p_gathers)
    if mode == "p2p" and comm.world_size > 1:
        return gather_merge_p2p(comm, idx.to(comm.device), vals.to(comm.device), counts, size, wire_dtype,
                                parts=parts)
    if on_host(comm.device):
        # One gather into one buffer, unpacked and merged in one pass: rank order is buffer order.
        buf = torch.from_numpy(pack_host(idx, vals, index_dtype, wire_dtype))
        flat = comm.all_gather_flat(buf, counts, mode)
        return merge_host_pieces([unpack_host(flat.numpy(), r, index_dtype, wire_dtype)], size)
    # One gather into one buffer in rank order, unpacked once: the ops do not grow with the world size.
    buf = pack(idx.to(comm.device), vals.to(comm.device), index_dtype, wire_dtype)
    all_idx, all_vals = unpack(comm.all_gather_flat(buf, counts, mode), r, index_dtype, wire_dtype)
    return merge_runs(all_idx, all_vals, offsets(counts), size, accum_dtype(wire_dtype), parts)


def gather_merge_p2p(
    comm: Comm,
    idx: torch.Tensor,
    vals: torch.Tensor,
    counts: list[int],
    size: int,
    wire_dtype: torch.dtype,
    head: list[int] | None = None,
    slots: np.ndarray | None = None,
    parts: Parts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather coalesced entries as separate index and row messages received in place, then merge in rank order.

    ``head[j]`` entries of rank ``j`` already arrived packed in ``slots``
    (``[P, cap]`` bytes, host data: the metadata record's eager slots); only the rest
    travels here. Every rank sends to every peer in one batch.
    """
    p, me = comm.world_size, comm.rank
    r = vals.shape[1]
    index_dtype = wire_index_dtype(size)
    head = head or [0] * p
    at = offsets(counts)  # rank j's entries land at rows [at[j], at[j+1]): its head, then the rest
    all_idx = fresh((at[-1],), index_dtype, comm.device)
    all_vals = fresh((at[-1], r), wire_dtype, comm.device)
    all_idx[at[me] : at[me + 1]] = idx
    all_vals[at[me] : at[me + 1]] = vals
    mu = max(head)
    if mu and slots is not None:
        # The peers' heads, picked out of the slots and put in rank order on the host (the record's read brought
        # them there), reach their rows with one write per tensor, whatever the world size.
        isz = index_dtype.itemsize
        rows, keep = _head_rows(slots, head, entry_bytes(r, index_dtype, wire_dtype), skip=me)
        if rows.shape[0]:
            # Their rows' positions, as gather_rows would give them, built here from the mask the host has.
            # Copies, not ascontiguousarray: a single row's column counts as contiguous in NumPy and would keep the
            # entry's stride, which a dtype view refuses unless it is a multiple of the dtype's size.
            pos = upload((np.asarray(at[:-1])[:, None] + np.arange(mu))[keep], comm.device)
            hidx = upload(torch.from_numpy(rows[:, :isz].copy()), comm.device).view(index_dtype)
            all_idx.index_copy_(0, pos, hidx.view(-1))
            if r:  # rows of width 0 have no bytes to view
                hvals = upload(torch.from_numpy(rows[:, isz:].copy()), comm.device).view(wire_dtype)
                all_vals.index_copy_(0, pos, hvals)
    comm.all_gather_rows((all_idx, all_vals), at, max(1, p - 1), head)
    return merge_runs(all_idx.to(torch.int64), all_vals, at, size, accum_dtype(wire_dtype), parts)


def eager_slot(
    idx: torch.Tensor, vals: torch.Tensor, size: int, dtype: torch.dtype, capacity: int
) -> torch.Tensor | np.ndarray:
    """Pack the first entries that fit in ``capacity`` bytes of the metadata record's eager slot.

    Returns flat ``uint8``: a NumPy array on the host path (the record is
    built on the host), else a tensor on the entries' device.
    """
    m = min(idx.numel(), capacity // entry_bytes(vals.shape[1], wire_index_dtype(size), dtype))
    if m < idx.numel():  # only then: a slice is an op dispatched on the device path
        idx, vals = idx[:m], vals[:m]
    if on_host(idx):
        return pack_host(idx, vals, wire_index_dtype(size), dtype).reshape(-1)
    return pack(idx, vals, wire_index_dtype(size), dtype).view(-1)


def _merge_bytes(c: Pricing) -> float:
    """Memory traffic of merging ``P k_max`` gathered entries: a dense scratch when ``n <= 4 K`` (host path), else a sort.

    The device path always sorts (:func:`~colltune.algorithms.sparse.merge_sources`: no atomics).
    """
    gathered = c.p * c.k_max * c.e
    if c.host and c.n <= 4 * c.ksum:
        return gathered + c.n * c.rba + c.ksum * c.rba + c.n + c.u * c.out_entry
    return gathered + c.ksum * math.log2(max(c.ksum, 2.0)) * 8.0 + c.ksum * (8.0 + c.rba) + c.u * c.out_entry


def _slot_and_rest(c: Pricing) -> tuple[float, float]:
    """Return the eager slot a group settles at for calls like this one, and the entries per rank it carries.

    The slot grows to the next power of two that holds the largest rank's
    entries, up to :func:`~colltune.algorithms.sizes.slot_limit`; ``(0, 0)``
    when the record's size was given (the entries are then priced apart).
    """
    if c.record_known or c.p == 1 or c.e <= 0:
        return 0.0, 0.0
    need = c.k_max * c.e
    limit = sizes.slot_limit(c.p)
    slot = float(limit if need > limit else max(sizes.eager_capacity(c.p), 1 << max(math.ceil(need) - 1, 0).bit_length()))
    return slot, float(math.floor(slot / c.e))


def slot_need(counts: Any, row_numel: int, size: int, dtype: torch.dtype) -> int:
    """Return the bytes of the largest rank's entries packed for the eager slot."""
    return max(counts, default=0) * entry_bytes(row_numel, wire_index_dtype(size), dtype)


def _head_rows(slots: np.ndarray, head: list[int], e: int, skip: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's first ``head[j]`` packed entries of ``e`` bytes from the eager slots (host data), in rank order.

    Returns the rows (``uint8`` ``[K, e]``, a fresh array) and which of the
    ``[P, max(head)]`` places they fill (a bool mask). ``skip``: a rank
    whose entries are left out.
    """
    p, mu = len(head), max(head)
    keep = np.arange(mu) < np.asarray(head)[:, None]
    if skip is not None:
        keep[skip] = False
    return slots[:, : mu * e].reshape(p, mu, e)[keep], keep


def _merge_eager_host(
    inp: SparseInput, head: list[int], rest: list[int], tails: np.ndarray | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's first ``head[j]`` entries (from the eager slots) and its ``rest[j]`` others, in rank order.

    ``tails`` holds the rest of every rank, gathered in rank order (or
    ``None`` when every rank's entries fit the slot). Everything is unpacked
    in one go, then put in rank order: by slices while the ranks hold a few
    hundred entries each, else in one scatter (no per-rank work).
    """
    p, r = len(head), inp.row_numel
    rows, _ = _head_rows(inp.eager, head, entry_bytes(r, inp.index_dtype, inp.dtype))
    idx, vals = unpack_host(rows, r, inp.index_dtype, inp.dtype)
    if tails is None:
        return merge_host_pieces([(idx, vals)], inp.size)
    tidx, tvals = unpack_host(tails, r, inp.index_dtype, inp.dtype)
    if idx.size + tidx.size >= 256 * p:  # a few hundred entries per rank: slices, one concatenation
        hs, ts = offsets(head), offsets(rest)
        pieces = []
        for j in range(p):
            pieces += [(idx[hs[j] : hs[j + 1]], vals[hs[j] : hs[j + 1]]), (tidx[ts[j] : ts[j + 1]], tvals[ts[j] : ts[j + 1]])]
        return merge_host_pieces(pieces, inp.size)
    h, t = np.asarray(head, dtype=np.int64), np.asarray(rest, dtype=np.int64)
    start = np.cumsum(h + t) - (h + t)  # where rank j's entries start in rank order: its head, then its rest
    at_h = np.repeat(start - (np.cumsum(h) - h), h) + np.arange(idx.size)
    at_t = np.repeat(start + h - (np.cumsum(t) - t), t) + np.arange(tidx.size)
    out_idx = np.empty(idx.size + tidx.size, dtype=idx.dtype)
    out_vals = np.empty((out_idx.size,) + vals.shape[1:], dtype=vals.dtype)
    out_idx[at_h], out_idx[at_t] = idx, tidx
    out_vals[at_h], out_vals[at_t] = vals, tvals
    return merge_host_pieces([(out_idx, out_vals)], inp.size)


@register
class Allgather(Algorithm):
    """Gather every rank's packed entries, then merge them in rank order."""

    name = "allgather"
    knob_specs = (
        Knob("mode", "auto", "`p2p` (indices and rows sent to every peer as separate messages, received in place: no packing), "
             "`pad` (one `all_gather` of packed entries padded to the largest count), `alltoall` (exact sizes), "
             "`auto` (`p2p` for rows of 32 bytes or more, such as embedding rows, on the host path or within one "
             "node; otherwise, as on NCCL across nodes, where a ring all_gather beats P-1 messages per rank, pad "
             "unless padding adds over 25%)", choices=GATHER_MODES,
             tune=("exact",)),
    )
    TERMS = ("metadata", "entries_gather", "merge")
    #: The record (the coalesce's count and the eager slot ride in it, filled on the device), the merged
    #: union's size; top-k: the record and the merge (the local top-k reads nothing: :meth:`Magnitudes.top_k`).
    HOST_SYNCS = {"exact": 2, "topk": 2}
    HOST_KERNELS = {"exact": 29, "topk": 37}
    eager_entries = True

    def schedule(self, pricing: Pricing, knobs: dict[str, Any]) -> list[Step]:
        """The record (carrying the entries, or their first part, in its eager slot), the rest's gather, the merge.

        In top-k mode (TopkA) the record carries no entries: every rank's
        exact top-k is all-gathered, padded (all ranks hold ``k``), after a
        local top-k selection.
        """
        c = pricing
        if c.topk:
            k = c.kavg
            select = 4 * c.n * c.rba + k * math.log2(max(k, 2.0)) * 8.0
            return [c.metadata(), c.all_gather("entries_gather", k * c.e), c.local("merge", select + _merge_bytes(c), 5.0)]
        slot, rest = _slot_and_rest(c)
        meta = c.metadata(c.record_bytes - sizes.eager_capacity(c.p) + slot) if slot else c.metadata()
        rest_max = max(0.0, c.k_max - rest)  # entries beyond the slot, of the largest rank
        if rest_max == 0:
            entries = c.free("entries_gather", "all_gather")
        elif knobs["mode"] == "p2p" or (knobs["mode"] == "auto" and c.p2p_gathers and c.rb >= SPLIT_MIN_ROW_BYTES):
            # Indices and rows to every peer, in one batch, received in place: this rank's own rest only.
            entries = c.p2p("entries_gather", 1.0, 2 * (c.p - 1.0), (c.p - 1) * max(0.0, c.kavg - rest) * c.e)
        elif 4 * c.p * rest_max <= 5 * max(c.ksum - c.p * rest, rest_max):  # all_gather_v "auto": pad while it adds <= 1/4
            entries = c.all_gather("entries_gather", rest_max * c.e)
        else:  # every rank sends its rest to each peer; the largest rank bounds the time
            entries = c.all_to_all("entries_gather", rest_max * c.e)
        return [meta, entries, c.local("merge", _merge_bytes(c), 4.0)]

    def sparse_allreduce(self, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        counts = list(inp.counts)
        if inp.eager is None or comm.world_size == 1:
            return gather_merge(comm, inp.indices, inp.values, counts, inp.size, inp.dtype, knobs["mode"], inp.parts)
        # The first entries of every rank already arrived in the eager slots;
        # gather only what did not fit, then merge in rank order as usual.
        p, r, me = comm.world_size, inp.row_numel, comm.rank
        index_dtype = inp.index_dtype
        e = entry_bytes(r, index_dtype, inp.dtype)
        m = inp.eager.shape[1] // e
        head = [min(c, m) for c in counts]
        rest = [c - h for c, h in zip(counts, head)]
        comm.traffic.reclassify((p - 1) * head[me] * e)
        mode = gather_mode(knobs["mode"], r, inp.dtype, comm.p2p_gathers)
        if any(rest) and mode == "p2p":
            return gather_merge_p2p(
                comm, inp.indices.to(comm.device), inp.values.to(comm.device), counts, inp.size,
                inp.dtype, head, inp.eager, inp.parts,
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
            tails = None if tail_buf is None else comm.all_gather_flat(tail_buf, rest, mode).numpy()
            return _merge_eager_host(inp, head, rest, tails)
        if tail_buf is None:  # every entry came in the slots, which the record's read brought to the host:
            # picked out and put in rank order there, they reach the device in one copy, as they travel.
            got = upload(torch.from_numpy(_head_rows(inp.eager, head, e)[0]), comm.device)
            idx_all, vals_all = unpack(got, r, index_dtype, inp.dtype, strided=True)  # the merge gathers its rows
            return merge_runs(idx_all, vals_all, offsets(counts), inp.size, accum_dtype(inp.dtype), inp.parts)
        # Every rank's head (row j * mu of the slots' block) and rest (after the block, in rank order), put in
        # rank order by one gather index: the ops do not grow with the world size.
        block = torch.cat((upload(torch.from_numpy(inp.eager[:, : mu * e]), comm.device).reshape(p * mu, e),
                           comm.all_gather_flat(tail_buf, rest, mode)))
        idx_all, vals_all = unpack(block, r, index_dtype, inp.dtype, strided=True)  # rows gathered below
        tails_at = [p * mu + a for a in offsets(rest)[:-1]]
        starts = [s for j in range(p) for s in (j * mu, tails_at[j])]
        rows = gather_rows(starts, [n for pair in zip(head, rest) for n in pair], comm.device)
        idx_all, vals_all = idx_all.index_select(0, rows), vals_all.index_select(0, rows)
        return merge_runs(idx_all, vals_all, offsets(counts), inp.size, accum_dtype(inp.dtype), inp.parts)

    def topk_allreduce(self, acc: torch.Tensor, state: Any, comm: Comm, knobs: dict[str, Any]) -> TopkOutput:
        n = acc.numel()
        k = state.k_for(n)
        idx = Magnitudes(acc).top_k_indices(k)
        vals = acc.index_select(0, idx).view(k, 1)
        gidx, gvals = gather_merge(comm, idx, vals, [k] * comm.world_size, n, acc.dtype, "pad")
        state.last_local_count, state.last_global_count = k, gidx.numel()
        return TopkOutput(indices=gidx, values=gvals.view(-1), sent=idx, local_count=k, global_count=gidx.numel())
