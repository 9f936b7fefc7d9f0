"""Ok-Topk (Li and Hoefler, PPoPP'22): split and reduce by balanced regions, then allgather.

Exact mode (``sparse_allreduce``):

1. **Boundaries.** The rows are cut into ``P`` regions that balance the
   ranks' entries, not the coordinates (:class:`~colltune.algorithms.state.BoundaryState`,
   refreshed every ``boundary_refresh`` calls per group and size).
2. **Split and reduce.** Counts go first: while the boundaries are
   cached, every rank's count per region rides in the metadata record
   (:meth:`OkTopk.eager_payload`; calls that name ``oktopk``, and auto calls
   whose site last chose it; from ``P = 64`` on the record's slot grows by
   the ``8 P`` bytes while Ok-Topk runs on the group, see
   :func:`~colltune.algorithms.meta.note_payload`), otherwise (refreshes)
   an ``all_to_all`` of ``P`` integers moves them. Then each rank sends its entries for region ``j`` to rank
   ``j``: at step ``i`` rank ``r`` sends to ``(r+i) % P`` and receives from
   ``(r-i) % P``, ``peers_in_flight`` steps posted at once, so no rank
   receives from many at once. The owner sums what it received, in rank
   order. Rows of 32 bytes or more (embedding rows) travel as two messages
   per peer, indices and rows, received in place into one buffer per kind;
   narrower entries travel packed, received in place into one buffer too.
3. **Allgatherv.** Owners' reduced sizes are all-gathered (``P`` integers),
   then every region travels to every rank. On the host path, or in a group
   inside one node: for wide rows point to point, landing in place in the
   result (which is in index order because the regions are); otherwise
   packed, point to point too, each region with its size when the last
   call's sizes give it room (no exchange of sizes). On the device path
   across nodes, packed in one collective gather, wide rows included: there
   NCCL's model prices ``P - 1`` messages per rank well above its ring
   ``all_gather`` (:func:`~colltune.algorithms.schedule.p2p_gathers`). A region whose reduced
   entries would cost more sparse than dense (SparCML's rule, scaled by
   ``dense_fallback_ratio``) travels dense, as its rows plus a presence
   bitmap, and then every region travels packed. With ``avg`` each owner
   divides its own region before it travels, in the accumulation dtype:
   16-bit values then round once, when they travel, to allgather's bits.

Top-k mode (``topk_allreduce``, Ok-Topk's Algorithm 1 with Algorithm 2's error
feedback done by the caller):

1. Local selection by a threshold: exact (a top-k) every ``local_refresh``
   calls; in between the previous threshold is reused, or the nearest of
   its nudges by ``(1 + nudge) ** j`` (``|j| <= LOCAL_NUDGES``, all counted
   at once) whose count is in the band, with an exact recompute if none
   is.
2. Split and reduce of the selected entries, as above. While the
   boundaries in the :class:`~colltune.algorithms.state.TopkState` are
   cached, the local selection runs before the metadata exchange
   (:meth:`OkTopk.topk_prepare`: calls that name ``oktopk``, and auto calls
   whose site last chose it) and its counts per region ride in the record,
   as in exact mode; on refreshes an ``all_to_all`` moves them. Another
   algorithm chosen meanwhile runs from the same ``acc`` and the selection
   is dropped unused.
3. Global selection: owners keep reduced entries at or above the global
   threshold: exact every ``global_refresh`` calls (a radix select over all
   owners' magnitudes, four ``all_reduce`` calls of 256 counts, no entries
   moved), reused in between. The kept counts are all-gathered before any
   entry moves, and a reused threshold whose total leaves the band is
   replaced by the exact one on the same call, so the gathered volume stays
   inside the band (and within Eq. 3's bound).
4. Balance: the owners' kept entries are evened out into ``P`` equal
   blocks, moving only each owner's surplus (one batch of point-to-point
   messages, :mod:`~colltune.algorithms.balance`), then all-gathered and
   put back in index order. Split, balance and gather together stay within
   Eq. 3's ``6k(P-1)/P`` words.

Every rank ends with the same bits: each region is reduced once, by its
owner, and then copied to everyone.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from typing import Any

import numpy as np

from colltune.algorithms import meta as _meta
from colltune.algorithms.balance import balance_and_gather
from colltune.algorithms.base import Algorithm, Delivered, Prepared, SparseInput, TopkOutput
from colltune.algorithms.comm import Comm
from colltune.algorithms.knobs import GATHER_MODES, Knob
from colltune.algorithms.lazy import torch
from colltune.algorithms.registry import register
from colltune.algorithms.schedule import Pricing, Step
from colltune.algorithms.sparse import (
    SPLIT_MIN_ROW_BYTES,
    Magnitudes,
    Parts,
    count_between,
    entry_bytes,
    fresh,
    gather_mode,
    merge_runs,
    offsets,
    on_host,
    pack,
    read_sizes,
    reinterpret,
    split_layout,
    unpack,
    upload,
    wire_index_dtype,
)
from colltune.algorithms.state import BoundaryState

__all__ = ["OkTopk", "split_reduce", "radix_kth_largest", "TOPK_COUNTS_IN_RECORD"]

#: Top-k mode: select locally before the metadata exchange and send the counts per region in the record
#: while the boundaries are cached (:meth:`OkTopk.topk_prepare`). False sends them with an ``all_to_all`` on
#: every call instead, with the same results (set it alike on every rank: the record's ``payload`` is shared).
TOPK_COUNTS_IN_RECORD = True


class _Selection:
    """Ok-Topk's local selection of a top-k call, made before the metadata exchange (:meth:`OkTopk.topk_prepare`)."""

    __slots__ = ("lidx", "threshold", "step", "local_refresh")

    def __init__(self, lidx: torch.Tensor, threshold: "float | torch.Tensor", step: int, local_refresh: int) -> None:
        self.lidx, self.threshold, self.step, self.local_refresh = lidx, threshold, step, local_refresh


class _ExactState:
    """One group's Ok-Topk state for one size in exact mode; every rank holds the same, having made the same calls."""

    __slots__ = ("bounds", "last")

    def __init__(self, refresh: int) -> None:
        self.bounds = BoundaryState(refresh)
        self.last: list[int] | None = None  # owners' reduced sizes on the last call (room of the eager gather)


#: The most sizes whose state one group keeps; the least recently run is forgotten first (and refreshes
#: its boundaries if it comes back). Every rank runs the same calls, so every rank forgets the same size.
MAX_SIZES = 1024
#: The key of Ok-Topk's per-group state (:meth:`Comm.group_state`): each size's state, least recently run first.
_STATE_KEY = "oktopk.exact"


def _exact_entry(comm: Comm, size: int, refresh: int | None = None) -> _ExactState | None:
    """Return this group's state for ``size`` (for ``refresh`` calls between boundary refreshes, if given), or ``None``.

    A lookup only: it runs before the metadata exchange, where a rank with
    bad input skips it, so it must not change what the ranks keep.
    """
    sizes: OrderedDict[int, _ExactState] | None = comm.group_state(_STATE_KEY)
    st = None if sizes is None else sizes.get(size)
    if st is None or (refresh is not None and st.bounds.refresh != refresh):
        return None
    return st


@functools.cache
def _bits(device: torch.device) -> torch.Tensor:
    """The eight bit values of a byte, as ``uint8`` on ``device`` (made once per device)."""
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8).to(device)


def _region_payload(idx: torch.Tensor, cuts: list[int]) -> np.ndarray | torch.Tensor:
    """Where this rank's entries for each region end, as the record's payload bytes (``P`` int64 running counts,
    :func:`~colltune.algorithms.meta.send_recv_counts`).

    On the host path a NumPy array; on the device path found there and
    written into the record there, read with it in its one read.
    """
    ends = torch.searchsorted(idx, upload(cuts[1:], idx.device))
    return ends.numpy().view(np.uint8) if on_host(idx) else ends.view(torch.uint8)


def split_reduce(
    comm: Comm,
    idx: torch.Tensor,
    vals: torch.Tensor,
    cuts: list[int],
    size: int,
    wire_dtype: torch.dtype,
    acc: torch.dtype,
    peers_in_flight: int,
    counts: tuple[list[int], list[int]] | None = None,
    padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each entry to the owner of its region; return this rank's reduced region.

    Args:
        idx: sorted unique int64 indices of this rank.
        vals: ``[k, r]`` values.
        cuts: ``P + 1`` region boundaries.
        wire_dtype: the dtype values travel in.
        acc: the dtype the owner sums in.
        peers_in_flight: rotated steps posted at once.
        counts: ``(send, recv)`` under these cuts, when already known: this
            rank's entry count per region, and every rank's count for this
            rank's region (else this rank cuts its indices and an
            ``all_to_all`` exchanges the counts).
        padded: on the device path, read nothing: the region may come
            padded with zero rows past its ``u`` entries
            (:func:`~colltune.algorithms.sparse.sum_sorted_runs_padded`)
            indexed the region's upper cut, for a caller that selects among
            them by magnitude or counts its entries on the device
            (:func:`_gather_regions`' ``end``).

    Returns:
        The owner's coalesced region: sorted int64 indices and ``[u, r]``
        values in ``acc``, summed over source ranks in rank order (with
        ``padded``, on the device path, followed by pad rows up to the
        entries received).

    Wide rows (:func:`~colltune.algorithms.sparse.split_layout`) travel as two messages per peer, the
    indices and the value rows, each sent from a slice of the input and
    received straight into its place in one buffer per kind: no packing,
    unpacking or concatenation of the rows, which are most of the bytes.
    Narrow entries (top-k's scalars) travel packed, one message per peer,
    received in place into one buffer and unpacked once.
    """
    me = comm.rank
    r = vals.shape[1]
    index_dtype = wire_index_dtype(size)
    off, recv_counts = _split_counts(comm, idx, cuts, counts)
    if split_layout(r, wire_dtype):
        return _split_reduce_soa(
            comm, idx, vals, off, recv_counts, cuts, index_dtype, wire_dtype, acc, peers_in_flight, padded
        )
    buf = pack(idx, vals, index_dtype, wire_dtype)
    at = offsets(recv_counts)  # source j's entries land at rows [at[j], at[j+1]), in rank order
    recv = fresh((at[-1], entry_bytes(r, index_dtype, wire_dtype)), torch.uint8, comm.device)
    recv[at[me] : at[me + 1]] = buf[off[me] : off[me + 1]]
    comm.rotated_exchange(
        peers_in_flight, lambda dst: [(buf[off[dst] : off[dst + 1]], 0)], lambda src: [(recv[at[src] : at[src + 1]], 0)]
    )
    # On the device path from two sources on, the merge gathers the rows by its sort's order: from a strided
    # view of them as well, uncopied.
    ridx, rvals = unpack(recv, r, index_dtype, wire_dtype, strided=not on_host(recv) and len(at) > 2)
    return _merge_region(ridx, rvals, at, cuts[me], cuts[me + 1], acc, padded)


def _merge_region(
    ridx: torch.Tensor, rvals: torch.Tensor, at: list[int], lo: int, hi: int, acc: torch.dtype, padded: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the owner's received runs (int64 or wire indices in ``[lo, hi)``): :func:`merge_runs`, pads indexed ``hi``.

    The host path merges in region-relative coordinates, so a dense scratch
    (when the region is dense enough for one) is sized to the region, not
    the tensor; the device path sorts, whatever the coordinates, so it
    merges the indices as they are (two kernels fewer).
    """
    ridx = ridx.to(torch.int64)
    if not on_host(ridx):
        return merge_runs(ridx, rvals, at, hi, acc, padded=padded)
    uidx, uvals = merge_runs(ridx - lo, rvals, at, hi - lo, acc, padded=padded)
    return uidx + lo, uvals


def _split_counts(
    comm: Comm, idx: torch.Tensor, cuts: list[int], counts: tuple[list[int], list[int]] | None
) -> tuple[list[int], list[int]]:
    """Return where each region starts in this rank's entries, and how many entries each peer sends this rank.

    From ``counts`` when known; else from this rank's cut of its indices
    and an ``all_to_all`` of the counts.
    """
    p = comm.world_size
    if counts is not None:
        return offsets(counts[0]), counts[1]
    # Cut and exchanged on the device; the cut and the counts received come back in one read.
    off = torch.searchsorted(idx, upload(cuts, idx.device))
    with comm.meta():
        recv = comm.all_to_all(torch.diff(off), [1] * p, [1] * p)
    both = torch.cat((off, recv)).tolist()
    return both[: p + 1], both[p + 1 :]


def _split_reduce_soa(
    comm: Comm,
    idx: torch.Tensor,
    vals: torch.Tensor,
    off: list[int],
    recv_counts: list[int],
    cuts: list[int],
    index_dtype: torch.dtype,
    wire_dtype: torch.dtype,
    acc: torch.dtype,
    peers_in_flight: int,
    padded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    me = comm.rank
    r = vals.shape[1]
    widx = idx.to(index_dtype)
    wvals = vals.to(wire_dtype).contiguous()
    at = offsets(recv_counts)  # source j's entries land at rows [at[j], at[j+1]), in rank order
    ridx = fresh((at[-1],), index_dtype, comm.device)
    rvals = fresh((at[-1], r), wire_dtype, comm.device)
    ridx[at[me] : at[me + 1]] = widx[off[me] : off[me + 1]]
    rvals[at[me] : at[me + 1]] = wvals[off[me] : off[me + 1]]
    comm.rotated_exchange(
        peers_in_flight,
        lambda dst: [(widx[off[dst] : off[dst + 1]], 0), (wvals[off[dst] : off[dst + 1]], 1)],
        lambda src: [(ridx[at[src] : at[src + 1]], 0), (rvals[at[src] : at[src + 1]], 1)],
    )
    return _merge_region(ridx, rvals, at, cuts[me], cuts[me + 1], acc, padded)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    pad = (-mask.numel()) % 8
    m = torch.cat((mask, mask.new_zeros(pad))) if pad else mask
    return (m.view(-1, 8).to(torch.uint8) * _bits(m.device)).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    bits = (packed.view(-1, 1) & _bits(packed.device)) != 0
    return bits.view(-1)[:n]


def _gather_regions(
    comm: Comm,
    ridx: torch.Tensor,
    rvals: torch.Tensor,
    cuts: list[int],
    size: int,
    wire_dtype: torch.dtype,
    dense_ratio: float,
    mode: str,
    peers_in_flight: int = 8,
    last: list[int] | None = None,
    parts: Parts | None = None,
    end: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """All-gather every owner's reduced region, each sparse or dense by SparCML's rule; return it and the sizes.

    With ``parts`` (a fused bucket) each owner's count per part travels
    with its size, so ``parts.sizes`` (each tensor's share of the union) is
    known in the read of the sizes and the bucket's cut reads nothing.
    With ``end`` (the region's upper cut) this owner's region may come
    padded past its entries with rows indexed ``end``
    (:func:`split_reduce`'s ``padded``): its count, never read before,
    travels in its size, counted on the device, so the merge reads nothing.

    ``mode``: ``p2p`` sends each region to every peer point to point, its
    indices and rows received straight into their place in the result (no
    padding, packing or concatenation; only when no region travels dense);
    ``pad`` and ``alltoall`` pack the regions and gather them as
    :meth:`Comm.all_gather_v` does. ``auto`` sends point to point only where
    :attr:`Comm.p2p_gathers` allows (the host path, or a group inside one
    node): there it takes ``p2p`` for wide rows
    (:func:`~colltune.algorithms.sparse.split_layout`) when no region is dense,
    and for packed entries, when ``last`` (every owner's size on the group's
    last call) is known and sent no region dense, the eager gather
    (:func:`_gather_regions_eager`: sizes and entries in one exchange). Else,
    and always across nodes on the device path, the sizes are all-gathered
    and then the packed regions, by ``all_gather_v``'s own choice.
    """
    p, me = comm.world_size, comm.rank
    r = rvals.shape[1]
    index_dtype = wire_index_dtype(size)
    ebytes = entry_bytes(r, index_dtype, wire_dtype)
    rowbytes = r * wire_dtype.itemsize
    lengths = [cuts[j + 1] - cuts[j] for j in range(p)]
    point_to_point = comm.p2p_gathers
    if (
        mode == "auto" and p > 1 and point_to_point and last is not None and len(last) == p
        and not split_layout(r, wire_dtype) and not any(_dense_regions(last, lengths, ebytes, rowbytes, dense_ratio))
    ):
        return _gather_regions_eager(comm, ridx, rvals, last, index_dtype, wire_dtype, peers_in_flight, parts, end)
    with comm.meta():
        sizes = read_sizes(comm.gather_small(_size_head(ridx, parts, end)).view(p, -1), parts)
    ridx, rvals = ridx[: sizes[me]], rvals[: sizes[me]]  # the padding, if any, stays here
    dense = _dense_regions(sizes, lengths, ebytes, rowbytes, dense_ratio)
    nbytes = [
        lengths[j] * rowbytes + (lengths[j] + 7) // 8 if dense[j] else sizes[j] * ebytes for j in range(p)
    ]
    mode = gather_mode(mode, r, wire_dtype, point_to_point)
    if mode == "p2p":
        if not any(dense):
            return (*_gather_regions_p2p(comm, ridx, rvals, sizes, index_dtype, wire_dtype, peers_in_flight), sizes)
        mode = "auto"  # a dense region travels with its bitmap, packed
    if not any(dense):  # every region packed: one gather, one unpack (regions are in index order)
        flat = comm.all_gather_flat(pack(ridx, rvals, index_dtype, wire_dtype), sizes, mode)
        return (*unpack(flat, r, index_dtype, wire_dtype), sizes)
    if dense[me]:
        blob = _dense_region_bytes(ridx - cuts[me], rvals, lengths[me], wire_dtype, comm.device)
    else:
        blob = pack(ridx, rvals, index_dtype, wire_dtype).view(-1)
    pieces = comm.all_gather_v(blob, nbytes, mode)
    return (*_unpack_regions(pieces, sizes, dense, cuts, r, index_dtype, wire_dtype, comm.device), sizes)


def _dense_regions(sizes: list[int], lengths: list[int], ebytes: int, rowbytes: int, dense_ratio: float) -> list[bool]:
    """Return, per region, whether it travels dense: its sparse bytes reach ``dense_ratio`` times its dense bytes.

    An empty region (of any length, even none) has nothing to send either way: sparse.
    """
    return [
        sizes[j] > 0 and sizes[j] * ebytes >= dense_ratio * (lengths[j] * rowbytes + (lengths[j] + 7) // 8)
        for j in range(len(sizes))
    ]


def _dense_region_bytes(
    local: torch.Tensor, rvals: torch.Tensor, length: int, wire_dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Return one region sent dense: its rows (zeros where absent) then a bitmap of the present rows."""
    block = torch.zeros((length, rvals.shape[1]), dtype=wire_dtype, device=device)
    present = torch.zeros(length, dtype=torch.bool, device=device)
    block.index_copy_(0, local, rvals.to(wire_dtype))
    present[local] = True
    return torch.cat((block.view(torch.uint8).view(-1), _pack_bits(present)))


def _unpack_regions(
    pieces: list[torch.Tensor],
    sizes: list[int],
    dense: list[bool],
    cuts: list[int],
    r: int,
    index_dtype: torch.dtype,
    wire_dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the gathered regions' entries in owner order: global indices and ``[u, r]`` rows.

    The sparse regions are unpacked together, in one operation; each dense
    region (rows and a bitmap) on its own.
    """
    ebytes = entry_bytes(r, index_dtype, wire_dtype)
    rowbytes = r * wire_dtype.itemsize
    packed = [j for j in range(len(pieces)) if sizes[j] and not dense[j]]
    parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if packed:
        i, v = unpack(torch.cat([pieces[j] for j in packed]).view(-1, ebytes), r, index_dtype, wire_dtype)
        counts = [sizes[j] for j in packed]
        parts = dict(zip(packed, zip(torch.split(i, counts), torch.split(v, counts))))
    for j, piece in enumerate(pieces):
        if sizes[j] and dense[j]:
            length = cuts[j + 1] - cuts[j]
            nb = length * rowbytes
            rows = reinterpret(piece[:nb], wire_dtype).view(length, r)
            local = _unpack_bits(piece[nb:], length).nonzero().view(-1)
            parts[j] = (local + cuts[j], rows.index_select(0, local))
    if not parts:
        return torch.empty(0, dtype=torch.int64, device=device), torch.empty((0, r), dtype=wire_dtype, device=device)
    ordered = [parts[j] for j in sorted(parts)]
    return torch.cat([i for i, _ in ordered]), torch.cat([v for _, v in ordered])


def eager_region_capacity(last_size: int) -> int:
    """Return how many entries an owner's eager message holds, given its size on the last call: 1/16 more, plus 4."""
    return last_size + last_size // 16 + 4


def _gather_regions_eager(
    comm: Comm,
    ridx: torch.Tensor,
    rvals: torch.Tensor,
    last: list[int],
    index_dtype: torch.dtype,
    wire_dtype: torch.dtype,
    peers_in_flight: int,
    parts: Parts | None = None,
    end: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Gather packed regions without a separate exchange of their sizes.

    Owner ``j`` sends every peer one message of a size all ranks know: its
    count (an int64, followed with ``parts`` by its count per part, in the
    first ``h`` rows), then room for :func:`eager_region_capacity` ``(last[j])`` packed entries
    (its first entries, zero-padded). An owner whose region outgrew its
    room sends the rest in a second exchange, which every rank knows of from
    the counts. So a call whose sizes are near the last call's makes one
    exchange instead of two; the padding costs at most a sixteenth of the
    entries plus a few. Every message lands in place in one buffer, whose
    counts and entries are then read in one operation each. A region
    padded past ``end`` (:func:`_gather_regions`) fills the room with its
    padding too, which the receivers skip by the counts.
    """
    p, me = comm.world_size, comm.rank
    r = rvals.shape[1]
    e = entry_bytes(r, index_dtype, wire_dtype)
    head = _size_head(ridx, parts, end)
    h = -(-8 * head.numel() // e)
    caps = [eager_region_capacity(c) for c in last]
    at = offsets([h + c for c in caps])  # owner j's message: rows [at[j], at[j+1])
    blob = pack(ridx, rvals, index_dtype, wire_dtype)
    first = min(blob.shape[0], caps[me])  # padded past ``end``: more rows than entries, skipped by the counts
    msgs = fresh((at[-1], e), torch.uint8, comm.device)
    mine = msgs[at[me] : at[me + 1]]
    mine.zero_()
    mine.view(-1)[: 8 * head.numel()] = head.view(torch.uint8)
    mine[h : h + first] = blob if first == blob.shape[0] else blob[:first]
    comm.rotated_exchange(peers_in_flight, lambda dst: [(mine, 0)], lambda src: [(msgs[at[src] : at[src + 1]], 0)])
    # The heads' byte positions are host figures: made there, they reach the device in one upload.
    heads = np.add.outer(np.asarray(at[:-1], dtype=np.int64) * e, np.arange(8 * head.numel(), dtype=np.int64))
    sizes = read_sizes(msgs.view(-1)[upload(heads, comm.device)].view(torch.int64).view(p, -1), parts)
    rest = [max(0, sizes[j] - caps[j]) for j in range(p)]
    if not any(rest):
        gidx, gvals = unpack(msgs.index_select(0, _entry_rows(at, h, sizes, comm.device)), r, index_dtype, wire_dtype)
        return gidx, gvals, sizes
    tails = {me: blob[first : max(first, sizes[me])]}  # some region outgrew its room: its owner sends the rest
    for j in range(p):
        if j != me:
            tails[j] = torch.empty((rest[j], e), dtype=torch.uint8, device=comm.device)
    comm.rotated_exchange(peers_in_flight, lambda dst: [(tails[me], 1)], lambda src: [(tails[src], 1)])
    pieces = []
    for j in range(p):
        head = msgs[at[j] + h : at[j] + h + min(sizes[j], caps[j])]
        pieces.append(torch.cat((head, tails[j])) if rest[j] else head)
    gidx, gvals = unpack(torch.cat(pieces), r, index_dtype, wire_dtype)
    return gidx, gvals, sizes


def _size_head(ridx: torch.Tensor, parts: Parts | None, end: int | None = None) -> torch.Tensor:
    """An owner's size as it travels (int64 on the device): its count, then with ``parts`` its count per part.

    With ``end`` the region may be padded past its entries with indices
    ``end``: its count is the entries below ``end``, and each part's counts
    only those (bounds past ``end`` are taken at ``end``). No read either way.
    """
    if end is None:
        u = upload([ridx.numel()], ridx.device)
        return u if parts is None else torch.cat((u, count_between(ridx, parts.bounds)))
    bounds = [end] if parts is None else [end, *(min(b, end) for b in parts.bounds)]
    at = torch.searchsorted(ridx, upload(bounds, ridx.device))
    return at if parts is None else torch.cat((at[:1], torch.diff(at[1:])))


def _entry_rows(at: list[int], h: int, sizes: list[int], device: torch.device) -> torch.Tensor:
    """Return the rows of the eager gather's buffer that hold entries, in order: ``[at[j] + h, at[j] + h + sizes[j])``.

    Built on the host from sizes the host holds, so selecting them needs no
    host sync (a boolean mask's selection would read its count).
    """
    starts = np.asarray(at[:-1], dtype=np.int64) + h
    lengths = np.asarray(sizes, dtype=np.int64)
    first = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return upload(torch.from_numpy(first + np.arange(int(lengths.sum()), dtype=np.int64)), device)


def _gather_regions_p2p(
    comm: Comm,
    ridx: torch.Tensor,
    rvals: torch.Tensor,
    sizes: list[int],
    index_dtype: torch.dtype,
    wire_dtype: torch.dtype,
    peers_in_flight: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every owner sends its sparse region to every peer; regions land in place, in rank (= index) order."""
    me = comm.rank
    at = offsets(sizes)
    out_idx = fresh((at[-1],), index_dtype, comm.device)
    out_vals = fresh((at[-1], rvals.shape[1]), wire_dtype, comm.device)
    out_idx[at[me] : at[me + 1]] = ridx
    out_vals[at[me] : at[me + 1]] = rvals
    comm.all_gather_rows((out_idx, out_vals), at, peers_in_flight)
    return out_idx.to(torch.int64), out_vals


def radix_kth_largest(mags: torch.Tensor, k: int, comm: Comm, total_bound: int | None = None) -> torch.Tensor:
    """Return the exact ``k``-th largest of the union of every rank's non-negative ``mags``: a 0-dim float32 tensor.

    A most-significant-digit radix select over the float32 bit patterns
    (which order like the values when non-negative): four rounds, each an
    ``all_reduce`` of a 256-bin histogram of the values that match the
    digits picked so far. The bit patterns are sorted once, so a round's
    histogram is a ``searchsorted`` of its 257 bin edges (no ``bincount``,
    which reads its input's range back on CUDA), and its digit is picked
    where the values are: nothing is read back, the result stays on the
    device. It is 0 when fewer than ``k`` values exist in total.
    ``total_bound``, the same on every rank, bounds the number of values
    over all ranks; below ``2**31`` the histograms travel as int32 (half the
    bytes).
    """
    hist_dtype = torch.int32 if total_bound is not None and total_bound < 2**31 else torch.int64
    bits = mags.to(torch.float32).contiguous().view(torch.int32).to(comm.device).sort().values.to(torch.int64)
    edges = torch.arange(257, dtype=torch.int64, device=comm.device)
    prefix = torch.zeros((), dtype=torch.int64, device=comm.device)
    remaining = torch.full((), k, dtype=torch.int64, device=comm.device)
    enough = None
    for shift in (24, 16, 8, 0):
        # Bin d holds the values in [prefix + d << shift, prefix + (d + 1) << shift): the digit picked so far
        # above, digit d here. Sorted, each bin is a run between two searchsorted positions.
        hist = torch.searchsorted(bits, prefix + (edges << shift)).diff().to(hist_dtype)
        with comm.meta():
            comm.all_reduce(hist)
        counts = hist.flip(0).cumsum(0).to(torch.int64)  # counts[i]: values with digit >= 255 - i
        if enough is None:
            enough = counts[-1] >= k
        pos = torch.searchsorted(counts, remaining).clamp(max=255)  # the first i with counts[i] >= remaining
        below = counts.index_select(0, (pos - 1).clamp(min=0).view(1)).view(())  # not counts[t]: that reads t
        remaining = remaining - torch.where(pos > 0, below, 0)
        prefix = prefix | ((255 - pos) << shift)
    value = prefix.to(torch.int32).view(torch.float32)
    return torch.where(enough, value, torch.zeros((), dtype=torch.float32, device=comm.device))


def _split_step(c: Pricing, per_peer_entries: float, messages_per_peer: float, flight: int) -> Step:
    """The rotated split: ``per_peer_entries`` to each peer, only non-empty messages (about ``1 - e^-x`` of them)."""
    sent = c.p2p_rotated("split_p2p", per_peer_entries * c.e, flight)
    x = per_peer_entries  # a message is empty with probability e^-x (entries spread like Poisson counts)
    busy = 1.0 if x > 20 else -math.expm1(-x) if x > 0 else 0.0
    return Step("split_p2p", "p2p", sent.calls, sent.steps * messages_per_peer * busy, sent.nbytes)


def _region_reduce(c: Pricing, k: float) -> float:
    """Memory traffic of unpacking and merging about ``k`` received entries."""
    return 2 * k * c.e + k * math.log2(max(k, 2.0)) * 8.0 + k * c.rba


def _region_gathers(c: Pricing, knobs: dict[str, Any], region_dense_bytes: float) -> tuple[Step, Step, float]:
    """The sizes' exchange and the regions' gather as :func:`_gather_regions` runs them, and one region's block bytes.

    Regions go point to point only where ``auto`` may (:attr:`Pricing.p2p_gathers`)
    or ``p2p`` asks; else, and whenever a region travels dense, packed in one
    collective gather after the sizes, padded to the largest owner's region
    (about two deviations over the mean, as Poisson counts spread) unless that
    adds over a quarter.
    """
    mode, flight = knobs.get("gather_mode", "auto"), knobs["peers_in_flight"]
    per_owner = c.u / c.p
    sizes_step = c.small_gather("sizes_all_gather", 8.0)
    if math.ceil(per_owner) * c.e >= knobs["dense_fallback_ratio"] * region_dense_bytes:
        # Sizes first, then the regions packed, dense ones with their bitmap.
        return sizes_step, c.all_gather("union_gather", region_dense_bytes), region_dense_bytes
    wide = c.rb >= SPLIT_MIN_ROW_BYTES
    if mode == "auto" and c.p2p_gathers and not wide:
        # Eager gather: each count rides with its region, in room sized from the last call (1/16 more, plus 4).
        block_bytes = (math.ceil(8 / c.e) + eager_region_capacity(math.ceil(per_owner))) * c.e
        return c.free("sizes_all_gather", "all_gather"), c.p2p_rotated("union_gather", block_bytes, flight), block_bytes
    if mode == "p2p" or (mode == "auto" and c.p2p_gathers):  # sizes first, then indices and rows point to point
        union = c.p2p_rotated("union_gather", per_owner * c.e, flight)
        return sizes_step, Step("union_gather", "p2p", union.calls, 2 * union.steps, union.nbytes), per_owner * c.e
    largest = math.ceil(per_owner + 2 * math.sqrt(per_owner))
    if mode == "pad" or (mode == "auto" and 4 * c.p * largest <= 5 * c.u):  # all_gather_v's auto: pad while <= 1/4
        return sizes_step, c.all_gather("union_gather", largest * c.e), largest * c.e
    return sizes_step, c.all_to_all("union_gather", largest * c.e), per_owner * c.e


def _exact_schedule(c: Pricing, knobs: dict[str, Any]) -> list[Step]:
    refresh = 1.0 / knobs["boundary_refresh"]
    flight = knobs["peers_in_flight"]
    region = math.ceil(c.n / c.p)
    wide = c.rb >= SPLIT_MIN_ROW_BYTES
    sizes_gather, union_gather, block_bytes = _region_gathers(c, knobs, float(region * c.rb + math.ceil(region / 8)))
    kavg = c.kavg
    return [
        c.counts_record(),
        c.all_reduce("boundaries_all_reduce", c.p * 8.0, share=refresh),
        c.all_to_all("counts_all_to_all", 8.0, share=refresh),  # in the record between refreshes
        _split_step(c, kavg / c.p, 2.0 if wide else 1.0, flight),
        c.local("region_reduce", _region_reduce(c, kavg), 3.0),
        c.free("threshold_all_reduce", "all_reduce"),
        sizes_gather,
        c.free("balance_p2p", "p2p"),
        union_gather,
        c.local("unpack", c.p * block_bytes + c.u * c.out_entry, 2.0),
    ]


def _moved_share(per_owner: float) -> float:
    """Return the share of the kept entries the balance moves, for owners keeping ``per_owner`` on average.

    The surplus over the block ``ceil(per_owner)`` of owners whose kept
    counts spread like Poisson counts: ``E (x - 1)^+ / c = (c - 1 + e^-c) / c``
    below one entry per owner, about ``0.4 / sqrt(c)`` (a normal's mean
    excess) above.
    """
    c = per_owner
    if c <= 0:
        return 0.0
    if c < 1:
        return (c - 1 + math.exp(-c)) / c
    return min(1.0, 0.4 / math.sqrt(c))


def _topk_schedule(c: Pricing, knobs: dict[str, Any]) -> list[Step]:
    k, p = c.kavg, c.p
    per = k / p
    g = 1.0 / knobs["global_refresh"]
    hist = 256.0 * (4 if c.n < 2**31 else 8)
    radix = c.all_reduce("threshold_all_reduce", hist, share=4 * g)  # four rounds of 256 counts, on refreshes
    # Balanced blocks of ceil(k / P); unbalanced, the largest owner's kept count (about two deviations over).
    block = math.ceil(per) if knobs["balance"] else math.ceil(per + 2 * math.sqrt(per))
    if 4 * p * block <= 5 * k:  # all_gather_v "auto": padded to the largest block while that adds <= 1/4
        gather = c.all_gather("union_gather", block * c.e)
    else:
        gather = c.all_to_all("union_gather", per * c.e)
    moved = _moved_share(per) * per if knobs["balance"] else 0.0
    select = 3 * c.n * c.rba + 2 * c.n * c.rba / knobs["local_refresh"]
    refresh = 1.0 / knobs["boundary_refresh"]
    return [
        c.counts_record(),
        c.all_reduce("boundaries_all_reduce", p * 8.0, share=refresh),
        c.all_to_all("counts_all_to_all", 8.0, share=refresh),  # in the record between refreshes
        _split_step(c, per, 1.0, knobs["peers_in_flight"]),
        c.local("region_reduce", select + _region_reduce(c, k), 6.0),
        radix,
        c.small_gather("sizes_all_gather", 8.0 * ((1 - g) * (2 * GLOBAL_NUDGES + 1) + g)),
        c.p2p("balance_p2p", 1.0, 1.0, moved * c.e) if moved else c.free("balance_p2p", "p2p"),
        gather,
        c.local("unpack", p * block * c.e + k * c.out_entry + (k * c.e if moved else 0.0), 2.0),
    ]


#: Nudged global thresholds tried on each side of a reused one, all counted
#: in one exchange: factors ``(1 + nudge) ** (j / 2)``, ``|j| <= GLOBAL_NUDGES``
#: (+-22% in steps of 2.5% with the default nudge 0.05). Half steps: near
#: the cut of a reduced, error-fed gradient the kept count can halve for a
#: 5% higher threshold, which would step over the band (a factor 1.9 wide).
GLOBAL_NUDGES = 8
#: Nudged local thresholds tried on each side of a reused one, all counted at once (one host read on a
#: device): factors ``(1 + nudge) ** j``, ``|j| <= LOCAL_NUDGES`` (+-22% with the default nudge 0.05); the
#: one in the band nearest the reused threshold wins, else the exact one is computed.
LOCAL_NUDGES = 4


@register
class OkTopk(Algorithm):
    """Split and reduce over balanced regions, then all-gather the reduced regions."""

    name = "oktopk"
    knob_specs = (
        Knob("local_refresh", 32, "top-k mode: compute the exact local threshold every N calls (a `TopkState` field)",
             minimum=1, state=True, tune=("topk",), search=(1, 128, True)),
        Knob("global_refresh", 32, "top-k mode: compute the exact global threshold every N calls (a `TopkState` field)",
             minimum=1, state=True, tune=("topk",), search=(1, 128, True)),
        Knob("boundary_refresh", 64, "recompute region boundaries every N calls (per group and size)", minimum=1,
             tune=("exact", "topk"), search=(1, 256, True)),
        Knob("peers_in_flight", 8, "rotated point-to-point steps posted at once (all peers at once up to 9 ranks)", minimum=1,
             tune=("exact", "topk"), search=(1, None, False)),
        Knob("dense_fallback_ratio", 1.0, "a region travels dense when its sparse bytes reach this fraction of its dense bytes",
             minimum=0.0, exclusive=True, tune=("exact",), search=(0.1, 2.0, True)),
        Knob("gather_mode", "auto", "how the reduced regions are gathered (as `allgather.mode`; `p2p` only when no "
             "region travels dense). On the host path or within one node `auto` sends them point to point (wide "
             "rows unpacked, narrow ones each with its size); on NCCL across nodes packed, in one collective gather. "
             "Rows of 32 bytes or more also travel unpacked in the split-and-reduce step",
             choices=GATHER_MODES),
        Knob("balance", True, "top-k mode: re-balance the kept entries into equal blocks before gathering"),
    )
    TERMS = (
        "metadata", "boundaries_all_reduce", "counts_all_to_all", "split_p2p",
        "region_reduce", "threshold_all_reduce", "sizes_all_gather", "balance_p2p", "union_gather", "unpack",
    )
    #: Exact: the record (the coalesce's count and the region counts ride in it; the slots are read with
    #: it), the reduced regions' sizes (the split's merge reads nothing: the owner's region stays padded on
    #: the device, and its count travels with its size). Top-k: the local selection's counts (every
    #: nudged threshold at once; none when the exact k largest are taken: their threshold stays on the
    #: device, read with the next call's counts), the record, the global selection's counts; the split's
    #: merge reads nothing (the owner's region stays padded, and the selection by magnitude never keeps a
    #: pad). 3 when a nudged global threshold fits; 4 when none does (the exact one is found on the device
    #: and its counts read); 2 on refreshes of both thresholds.
    HOST_SYNCS = {"exact": 2, "topk": 4}
    HOST_KERNELS = {"exact": 42, "topk": 60}
    applies_avg = True  # each owner divides its own region, a P-th of the rows

    def schedule(self, pricing: Pricing, knobs: dict[str, Any]) -> list[Step]:
        """Boundaries and counts on refreshes, the rotated split, the reduce, the regions' gather, the unpack.

        In both modes the counts per region ride in the metadata record
        while the boundaries are cached (the slot makes room for them from
        ``P = 64`` on), so only refreshes send them (in top-k mode the local
        selection runs before the exchange to count them). Top-k mode then
        prices the global threshold (the radix select's four all_reduces on
        refreshes, the 17 candidates' counts in the kept-size exchange
        otherwise), the balance and the gather of about ``k`` entries in all.
        """
        c = pricing
        if c.topk:
            return _topk_schedule(c, {**{k.name: k.default for k in self.knob_specs}, **knobs})
        return _exact_schedule(c, knobs)

    @staticmethod
    def _state(comm: Comm, size: int, knobs: dict[str, Any]) -> _ExactState:
        """Return this (group, size)'s state, made afresh for a new group or another refresh period."""
        refresh = knobs["boundary_refresh"]
        sizes = comm.group_state(_STATE_KEY, OrderedDict)
        assert sizes is not None
        st = sizes.get(size)
        if st is None or st.bounds.refresh != refresh:
            st = sizes[size] = _ExactState(refresh)
            if len(sizes) > MAX_SIZES:
                sizes.popitem(last=False)
        sizes.move_to_end(size)
        return st

    def one_off(self, comm: Comm, size: int, knobs: dict[str, Any]) -> bool:
        """A call that computes the region boundaries (the group's first at this size, then every refresh)."""
        st = _exact_entry(comm, size, knobs["boundary_refresh"])
        return st is None or st.bounds.due(size, comm.world_size)

    def eager_payload(
        self, indices: torch.Tensor, size: int, comm: Comm, knobs: dict[str, Any] | None, capacity: int
    ) -> Prepared | None:
        """Where this rank's entries for each region end (``P`` int64 running counts), while the boundaries are cached.

        On the device path the counts stay on the device (the record is filled
        there); ``indices`` may be padded with the size, past every region.

        Every rank then knows what every rank sends to every owner, and the
        split needs no ``all_to_all`` of counts. ``None`` when the group has
        no boundaries for this size yet (or, with ``knobs``, none for their
        refresh period), when a refresh is due (the cuts are not known
        before it), or when ``P`` counts do not fit. The cuts the counts were
        cut by go with them (:class:`~colltune.algorithms.base.Prepared`'s
        work): a fused call's buckets of one size share the boundaries,
        and one bucket's refresh may move them before another runs.
        """
        p = comm.world_size
        st = _exact_entry(comm, size, None if knobs is None else knobs["boundary_refresh"])
        cuts = None if st is None or 8 * p > capacity else st.bounds.cached(size, p)
        if cuts is None:
            return None
        return Prepared(_region_payload(indices, cuts), tuple(cuts))

    def sparse_allreduce(self, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        st = self._state(comm, inp.size, knobs)
        idx = inp.indices.to(comm.device)
        p = comm.world_size
        with comm.meta():
            cuts = st.bounds.get(idx, inp.size, comm)
        # The payload's counts hold if they were cut by these boundaries (a refresh, or a state made afresh for
        # other knobs, moves them: the counts travel again). The cuts are the same on every rank.
        counts = _meta.send_recv_counts(inp.payload, comm.rank) if inp.work == tuple(cuts) else None
        # On the device path the owner's merge reads nothing: its region stays padded, its count travels
        # with its size in the regions' gather (one read for both).
        padded = not on_host(idx)
        ridx, rvals = split_reduce(
            comm, idx, inp.values.to(comm.device), cuts, inp.size, inp.dtype, inp.acc_dtype, knobs["peers_in_flight"],
            counts, padded,
        )
        _meta.note_payload(comm)  # the counts ride in the next records (the slot makes room for them)
        if inp.op == "avg" and p > 1:
            # The owner's rows only, still in the accumulation dtype: the bits of dividing the gathered sum, and
            # 16-bit values round once more when they travel, to the bits the front door's cast gives.
            rvals.div_(p)
        gidx, gvals, st.last = _gather_regions(
            comm, ridx, rvals, cuts, inp.size, inp.dtype, knobs["dense_fallback_ratio"], knobs["gather_mode"],
            knobs["peers_in_flight"], st.last, inp.parts, cuts[comm.rank + 1] if padded else None,
        )
        return gidx, gvals.to(inp.acc_dtype)

    def topk_prepare(self, acc: torch.Tensor, state: Any, comm: Comm, capacity: int) -> Prepared | None:
        """Select locally now and return where its entries for each region end (``P`` int64 running counts), while
        the boundaries are cached.

        Every rank then knows what every rank sends to every owner, and the
        split needs no ``all_to_all`` of counts. ``None`` (on every rank
        alike: the state's boundaries, step and refresh periods are the same
        on every rank) when a boundary refresh is due (the cuts are not
        known before it), when ``P`` counts do not fit ``capacity``, or with
        :data:`TOPK_COUNTS_IN_RECORD` off. ``state`` is left as it is: the
        selection's threshold is committed only if Ok-Topk runs.
        """
        p, n = comm.world_size, acc.numel()
        if not TOPK_COUNTS_IN_RECORD or p < 2 or 8 * p > capacity:
            return None
        cuts = state.boundaries.cached(n, p)
        if cuts is None:
            return None
        k = state.k_for(n)
        lidx, th = self._local_selection(Magnitudes(acc), state, k, state.band_for(k))
        return Prepared(_region_payload(lidx, cuts), _Selection(lidx, th, state.step, state.local_refresh))

    def topk_allreduce(
        self, acc: torch.Tensor, state: Any, comm: Comm, knobs: dict[str, Any], prepared: Prepared | None = None
    ) -> TopkOutput:
        n = acc.numel()
        k = state.k_for(n)
        band = state.band_for(k)
        # 1. Local selection by threshold: made before the exchange when its counts rode in the record.
        lidx, th, counts = self._prepared(prepared, state, comm, n)
        if lidx is None:
            lidx, th = self._local_selection(Magnitudes(acc), state, k, band)
        state.local_threshold = th
        lvals = acc.index_select(0, lidx).view(-1, 1)
        # 2. Split and reduce the selected entries.
        with comm.meta():
            cuts = state.boundaries.get(lidx, n, comm)
        # The owner's region may come padded with zero rows: selection by magnitude never keeps them.
        ridx, rvals = split_reduce(
            comm, lidx, lvals, cuts, n, acc.dtype, acc.dtype, state.peers_in_flight, counts, padded=True
        )
        _meta.note_payload(comm)  # the counts ride in the next records (the slot makes room for them)
        # 3. Global selection.
        kept, sizes = self._global_selection(comm, Magnitudes(rvals), state, k, band, n)
        total = sum(sizes)
        kidx, kvals = ridx.index_select(0, kept), rvals.index_select(0, kept)
        # 4. Balance, then all-gather.
        gidx, gvals = self._balanced_gather(comm, kidx, kvals, sizes, n, acc.dtype, knobs["balance"])
        state.last_local_count, state.last_global_count = lidx.numel(), total
        # Which of this rank's entries were delivered: those whose index survived globally.
        pos = torch.searchsorted(gidx, lidx).clamp(max=max(gidx.numel() - 1, 0))
        hit = gidx[pos] == lidx if gidx.numel() else torch.zeros_like(lidx, dtype=torch.bool)
        return TopkOutput(indices=gidx, values=gvals.view(-1), sent=Delivered(lidx, hit), local_count=lidx.numel(),
                          global_count=total)

    @staticmethod
    def _prepared(
        prepared: Prepared | None, state: Any, comm: Comm, n: int
    ) -> tuple[torch.Tensor | None, float | None, tuple[list[int], list[int]] | None]:
        """Return the local selection :meth:`topk_prepare` made, its threshold and the counts, if they still hold.

        The counts are ``(send, recv)``: this rank's row of the gathered
        payloads and every rank's count for this rank's region. They hold
        while the boundaries they were cut by are still cached and the
        selection ran under this call's step and local refresh period (an
        auto decision may set another: the same on every rank, so every rank
        drops its payload alike and the counts travel by ``all_to_all``).
        """
        p = comm.world_size
        if prepared is None or prepared.gathered is None or not isinstance(prepared.work, _Selection):
            return None, None, None
        sel = prepared.work
        counts = _meta.send_recv_counts(prepared.gathered, comm.rank)
        if counts is None or state.boundaries.due(n, p) or (sel.step, sel.local_refresh) != (state.step, state.local_refresh):
            return None, None, None
        return sel.lidx, sel.threshold, counts

    @staticmethod
    def _local_selection(
        mag: Magnitudes, state: Any, k: int, band: tuple[int, int]
    ) -> tuple[torch.Tensor, "float | torch.Tensor"]:
        """Return the local entries selected, and their threshold.

        The entries at or above the last threshold nudged into the band,
        else the exact ``k`` largest (:meth:`~Magnitudes.top_k`: on a device
        their threshold stays there, and the next call reads it with its
        counts). Where fewer than ``k`` values are nonzero the ``k`` include
        zeros, as TopkA's selection does: they travel and are summed, and
        the global selection never keeps them (leaving them out would take
        a read of how many there are). ``state`` is only read: the caller
        commits the threshold.
        """
        lo, hi = band
        th = state.local_threshold_held()
        if th is not None and state.step % state.local_refresh != 0:
            factors = [(1 + state.nudge) ** j for j in range(-LOCAL_NUDGES, LOCAL_NUDGES + 1)]
            cands, counts = Magnitudes.read_around(*mag.counts_around(th, factors))  # every candidate in one read
            fits = [j for j, c in enumerate(counts) if lo <= c <= hi]
            if fits:
                best = min(fits, key=lambda j: (abs(j - LOCAL_NUDGES), j))
                return mag.indices(cands[best], counts[best]), cands[best]
        return mag.top_k(k)

    def _global_selection(
        self, comm: Comm, rmag: Magnitudes, state: Any, k: int, band: tuple[int, int], n: int
    ) -> tuple[torch.Tensor, list[int]]:
        """Return the positions of the reduced entries this owner keeps (sorted), and every owner's kept count.

        The kept counts are exchanged before any entry moves. A reused
        threshold is nudged in the same exchange: every rank counts its
        entries at the reused threshold and at GLOBAL_NUDGES nudged ones on
        each side, and one all_gather gives every rank every count; the
        candidate whose total lies in the band, closest to k, wins (the same
        on every rank: the same totals, the same floats). If none does, the
        exact threshold replaces it on this very call, so the gather never
        exceeds the band. The exact one is found on the device
        (:func:`radix_kth_largest`) and stays there: its counts' exchange
        is the one read, and the next call's nudged candidates come back
        with their counts.
        """
        lo, hi = band
        gth, chosen = state.global_threshold_held(), None
        if gth is not None and not state.global_exact_due and state.step % state.global_refresh != 0:
            factors = [(1 + state.nudge) ** (j / 2) for j in range(-GLOBAL_NUDGES, GLOBAL_NUDGES + 1)]
            cands, counts = rmag.counts_around(gth, factors)
            table = self._counts(comm, Magnitudes.around_row(cands, counts))
            cands, _ = Magnitudes.from_row(cands, table[comm.rank])  # the same candidates on every rank
            table = table[:, : len(factors)]
            totals = table.sum(axis=0).tolist()
            fits = [j for j, t in enumerate(totals) if lo <= t <= hi]
            if fits:
                best = min(fits, key=lambda j: (abs(totals[j] - k), abs(j - GLOBAL_NUDGES)))
                chosen = cands[best], table[:, best].tolist()
        if chosen is None:
            # Each owner's region may be padded to the entries it received (zeros, never selected): the values
            # over every owner are at most every rank's selection, at most P n (the same on every rank).
            exact = radix_kth_largest(rmag.tensor(), k, comm, comm.world_size * n)
            gth = float(exact) if on_host(exact) else exact  # a read on the host costs nothing
            chosen = gth, self._counts(comm, rmag.counts([gth]))[:, 0].tolist()
        gth, sizes = chosen
        state.global_exact_due = False
        state.global_threshold = gth
        return rmag.indices(gth, sizes[comm.rank]), sizes

    @staticmethod
    def _counts(comm: Comm, counts: Any) -> np.ndarray:
        """All-gather each rank's ``counts`` (the same length on every rank); return them by rank, ``[P, len]``.

        ``counts``: a list, an int64 array, or an int64 tensor already on the device (then read only once gathered).
        """
        with comm.meta():
            t = upload(counts, comm.device)
            return comm.gather_small(t).view(comm.world_size, len(counts)).cpu().numpy()

    @staticmethod
    def _balanced_gather(
        comm: Comm, kidx: torch.Tensor, kvals: torch.Tensor, sizes: list[int], n: int, dtype: torch.dtype, balance: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return every owner's kept entries, in index order: balanced (:mod:`~colltune.algorithms.balance`), then gathered."""
        index_dtype = wire_index_dtype(n)
        if sum(sizes) == 0:
            return torch.empty(0, dtype=torch.int64, device=comm.device), kvals.new_empty((0, 1))
        flat = balance_and_gather(comm, pack(kidx, kvals, index_dtype, dtype), sizes, balance)
        return unpack(flat, 1, index_dtype, dtype)
