"""Hash-partitioned reduce-scatter, then allgather (the partition of ZEN, OSDI'25).

Exact mode (``sparse_allreduce``):

1. **Owners.** Every row index has an owner rank, :func:`hash_owner`: a
   SplitMix64 mix of the index, reduced to ``[0, P)`` by a multiply-shift.
   It is a function of the index and ``P`` alone, in int64 operations that
   give the same bits in NumPy, on the CPU and on CUDA: every rank agrees on
   every owner without exchanging anything, and there are no boundaries to
   compute, cache or refresh (Ok-Topk's regions need all three).
2. **Counts.** Every rank's count per owner (``P`` int64) rides in the
   metadata record (:meth:`HashPart.eager_payload`), as Ok-Topk's counts per
   region do (from ``P = 64`` on the slot grows by ``8 P`` bytes while the
   group runs this algorithm, see
   :func:`~colltune.algorithms.meta.note_payload`); when they do not fit the
   slot an ``all_to_all`` of ``P`` integers moves them.
3. **Reduce-scatter.** Each rank orders its packed entries by owner and
   sends each owner its share in one ``all_to_all`` with variable splits.
   Each owner receives its entries in rank order and sums each index's rows
   ``((0 + v_0) + v_1) + ...`` in rank order, in the accumulation dtype
   (the merge the allgather algorithm runs: the same helpers, the same bits).
   With ``avg`` the owner divides its own sums, in the accumulation dtype
   (the bits the front door's division gives).
4. **Allgather.** The owners' reduced sizes are all-gathered (``P``
   integers), then the shares, packed, in one ``all_gather`` (padded) or
   ``all_to_all`` (exact sizes), as ``gather_mode`` says; every rank sorts
   the union (``P`` sorted runs of disjoint indices) by index.

Values travel in the caller's dtype both ways, as in allgather and Ok-Topk:
16-bit values are summed in fp32 and rounded twice, each rank's sums on
their way to the owners and the owners' sums when the shares travel (the
second is the rounding the front door's cast back would make). The owners
add in rank order, as allgather's merge does, so the result is the
allgather algorithm's, bit for bit, on every rank.

Why a hash balances under skew: after the local coalesce each rank holds
an index at most once, so however hot an index is (a Zipf head), it puts at
most ``P`` entries on its owner and one row in the owner's share; what
stays skewed is *where* the entries lie: hot ids cluster (low ids, blocks
of one table, one field's range), and every rank holds the same hot ones.
Equal ranges put the cluster on one owner; Ok-Topk's ranges balanced on
counts fix that only as of their last refresh. A full-avalanche hash sends
every index to an owner independently of its neighbours and of the layout,
so each owner receives about ``K / P`` entries and returns about ``u / P``
rows, whatever the layout (the spread is that of a sum of ``u / P``
independent weights of 1 to ``P``: about ``sqrt(P K) / P`` entries). A
plain ``index % P`` would not do: strided sets (one rank's ids
``r, r + P, ...``) would all land on one owner.

Top-k mode (``topk_allreduce``): each rank selects its exact local top-k
(as TopkA, the allgather algorithm's top-k mode, does); the selections are
summed by owner and the union gathered as above, so every rank receives the
``u`` reduced entries instead of ``P k``. The owners' sums travel in the
accumulation dtype there (the front door divides and casts them), so the
result is TopkA's, bit for bit.

Host synchronizations on the device path (:attr:`HashPart.HOST_SYNCS`):
the record (the coalesce's count rides in it, and the counts per owner, as
running counts, in its slot, read with it), and the owners' reduced
sizes. The owner's merge reads nothing (its unique count travels, still on
the device, in the sizes' gather). Top-k mode: the record and the sizes (the
local selection, made before the record, which carries its counts per
owner, reads nothing: :meth:`HashPart.topk_prepare`); an ``all_to_all`` of
the counts (a third read) only where ``8 P`` bytes do not fit the slot.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from colltune.algorithms import meta as _meta
from colltune.algorithms.base import Algorithm, Prepared, SparseInput, TopkOutput
from colltune.algorithms.comm import Comm
from colltune.algorithms.knobs import Knob
from colltune.algorithms.lazy import torch
from colltune.algorithms.registry import register
from colltune.algorithms.schedule import Pricing, Step
from colltune.algorithms.sparse import (
    Batch,
    Magnitudes,
    Parts,
    accum_dtype,
    count_between,
    merge_host_pieces,
    on_host,
    pack,
    pack_host,
    read_sizes,
    unpack,
    unpack_host,
    wire_index_dtype,
)

__all__ = ["HashPart", "hash_owner", "hash_owner_host", "hash_reduce"]


def _signed(c: int) -> int:
    """Return the 64-bit pattern ``c`` as a signed int64 (torch and NumPy take no larger Python ints)."""
    return c - (1 << 64) if c >= 1 << 63 else c


#: SplitMix64 (Steele, Lea and Flood, OOPSLA'14): the golden-ratio increment and the two multipliers of its
#: finalizer, a bijection of 64-bit words with full avalanche. Multiplications wrap modulo 2^64.
_GAMMA = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
#: ``(z >> s) & _LOW[s]`` is the logical shift ``z >>> s`` of an int64 (``>>`` shifts in the sign).
_LOW = {s: (1 << (64 - s)) - 1 for s in (27, 30, 31, 32)}


def hash_owner(indices: torch.Tensor, world_size: int) -> torch.Tensor:
    """Return the owner rank of every index: int64 in ``[0, world_size)``, the same on every device.

    ``z = splitmix64(index)``, then ``((z >>> 32) * P) >>> 32``: the top 32
    bits scaled to ``[0, P)`` (Lemire's multiply-shift, no division). Only
    int64 additions, wrapping multiplications, shifts and masks: the same
    bits on the CPU and CUDA, and as :func:`hash_owner_host` in NumPy.

    Example:
        >>> import torch
        >>> hash_owner(torch.arange(8), 4).tolist() == hash_owner_host(np.arange(8), 4).tolist()
        True
    """
    z = indices.to(torch.int64) + _GAMMA
    z = (z ^ ((z >> 30) & _LOW[30])) * _M1
    z = (z ^ ((z >> 27) & _LOW[27])) * _M2
    z = z ^ ((z >> 31) & _LOW[31])
    return (((z >> 32) & _LOW[32]) * world_size) >> 32


def hash_owner_host(indices: np.ndarray, world_size: int) -> np.ndarray:
    """:func:`hash_owner` of a NumPy array of indices (the same bits)."""
    z = indices.astype(np.int64, copy=True)
    z += np.int64(_GAMMA)
    z ^= (z >> 30) & np.int64(_LOW[30])
    z *= np.int64(_M1)
    z ^= (z >> 27) & np.int64(_LOW[27])
    z *= np.int64(_M2)
    z ^= (z >> 31) & np.int64(_LOW[31])
    return (((z >> 32) & np.int64(_LOW[32])) * np.int64(world_size)) >> 32


def hash_reduce(
    comm: Comm,
    idx: torch.Tensor,
    vals: torch.Tensor,
    size: int,
    wire_dtype: torch.dtype,
    *,
    counts: tuple[list[int], list[int]] | None = None,
    divide: bool = False,
    share_dtype: torch.dtype | None = None,
    mode: str = "auto",
    owners: tuple[torch.Tensor, torch.Tensor] | None = None,
    parts: Parts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum coalesced entries over the group, each index by its owner; return the sorted union and its sums.

    Args:
        comm: the group.
        idx: this rank's sorted unique int64 indices.
        vals: ``[k, r]`` rows (in any dtype; they travel in ``wire_dtype``).
        size: the number of rows ``n``.
        wire_dtype: the dtype entries travel in to their owners.
        counts: ``(send, recv)`` when known: this rank's entry count per
            owner, and every rank's count for this rank (else they are
            counted here and exchanged in an ``all_to_all``).
        divide: the owners divide their sums by ``P`` (``avg``).
        share_dtype: the dtype the owners' sums travel in (``wire_dtype``
            when ``None``).
        mode: how the shares are gathered: ``pad``, ``alltoall`` or ``auto``
            (:meth:`Comm.all_gather_flat`).
        owners: on the device path, :func:`sorted_owners` of ``idx`` (or of
            ``idx`` followed by padding), when already computed.
        parts: a fused call's tensors laid end to end in ``idx``: on the
            device path each one's share of the union comes with the owners'
            sizes, in their one read (``parts.sizes``).

    Returns:
        Sorted unique int64 indices (the union over ranks) and ``[u, r]``
        sums in the accumulation dtype of ``wire_dtype``, bitwise identical
        on every rank.
    """
    share = wire_dtype if share_dtype is None else share_dtype
    if on_host(comm.device):
        return _hash_reduce_host(comm, idx, vals, size, wire_dtype, counts, divide, share, mode)
    return _hash_reduce_device(comm, idx, vals, size, wire_dtype, counts, divide, share, mode, owners, parts)


def sorted_owners(indices: torch.Tensor, size: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner of every index, sorted stably, and the order that sorts them (device path).

    Indices equal to ``size`` (padding, past every real index) get owner
    ``P``, past every real owner, so the first ``k`` of both belong to the
    first ``k`` indices whatever padding follows them.
    """
    return torch.sort(torch.where(indices < size, hash_owner(indices, world_size), world_size), stable=True)


def owner_counts(owner: torch.Tensor, world_size: int) -> torch.Tensor:
    """How many entries each rank owns, from the sorted owners (``P`` int64, no atomics, no read)."""
    return torch.diff(torch.searchsorted(owner, torch.arange(world_size + 1, device=owner.device)))


def owner_ends(owner: torch.Tensor, world_size: int) -> torch.Tensor:
    """Where each rank's entries end in the sorted owners (``P`` int64 running counts; padding, owned by no
    rank, past the last), no atomics, no read: the record's payload (:func:`~colltune.algorithms.meta.send_recv_counts`)."""
    return torch.searchsorted(owner, torch.arange(1, world_size + 1, device=owner.device))


def _exchange_counts(comm: Comm, send: torch.Tensor) -> tuple[list[int], list[int]]:
    """All-to-all this rank's count per owner; return it and every rank's count for this rank, in one read."""
    p = comm.world_size
    with comm.meta():
        recv = comm.all_to_all(send, [1] * p, [1] * p)
    both = torch.cat((send, recv)).tolist()
    return both[:p], both[p:]


def _hash_reduce_host(
    comm: Comm,
    idx: torch.Tensor,
    vals: torch.Tensor,
    size: int,
    wire_dtype: torch.dtype,
    counts: tuple[list[int], list[int]] | None,
    divide: bool,
    share_dtype: torch.dtype,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hash_reduce` in NumPy: packing, ordering, merging and sorting on host arrays."""
    p = comm.world_size
    r = vals.shape[1]
    index_dtype = wire_index_dtype(size)
    buf = pack_host(idx, vals, index_dtype, wire_dtype)
    if p > 1:
        owner = hash_owner_host(idx.numpy(), p)
        order = np.argsort(owner, kind="stable")  # by owner; each owner's entries stay in index order
        buf = buf[order]
        if counts is None:
            counts = _exchange_counts(comm, torch.from_numpy(np.bincount(owner, minlength=p).astype(np.int64)))
    send, recv = counts if counts is not None else ([idx.numel()], [idx.numel()])
    got = comm.all_to_all(torch.from_numpy(buf), send, recv)  # source j's entries in rows [at[j], at[j+1])
    ridx, rvals = unpack_host(got.numpy(), r, index_dtype, wire_dtype)
    uidx, uvals = merge_host_pieces([(ridx, rvals)], size)  # rank order is buffer order: allgather's merge
    if divide and p > 1:
        uvals.div_(p)
    with comm.meta():
        shares = comm.gather_small(torch.tensor([uidx.numel()], dtype=torch.int64)).tolist()
    flat = comm.all_gather_flat(torch.from_numpy(pack_host(uidx, uvals, index_dtype, share_dtype)), shares, mode)
    gidx, gvals = unpack_host(flat.numpy(), r, index_dtype, share_dtype)
    order = np.argsort(gidx, kind="stable")  # P sorted runs of disjoint indices: timsort merges them
    return torch.from_numpy(gidx[order]), torch.from_numpy(gvals[order])


def _hash_reduce_device(
    comm: Comm,
    idx: torch.Tensor,
    vals: torch.Tensor,
    size: int,
    wire_dtype: torch.dtype,
    counts: tuple[list[int], list[int]] | None,
    divide: bool,
    share_dtype: torch.dtype,
    mode: str,
    owners: tuple[torch.Tensor, torch.Tensor] | None = None,
    parts: Parts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hash_reduce` in torch operations that run on CUDA: no atomics, one host read (the sizes)."""
    p, me, dev = comm.world_size, comm.rank, comm.device
    idx, vals = idx.to(dev), vals.to(dev)
    r = vals.shape[1]
    index_dtype = wire_index_dtype(size)
    acc = accum_dtype(wire_dtype)
    buf = pack(idx, vals, index_dtype, wire_dtype)
    if p > 1:
        k = idx.numel()
        owner, order = sorted_owners(idx, size, p) if owners is None else (owners[0][:k], owners[1][:k])
        buf = buf.index_select(0, order)
        if counts is None:
            counts = _exchange_counts(comm, owner_counts(owner, p))
    send, recv = counts if counts is not None else ([idx.numel()], [idx.numel()])
    got = comm.all_to_all(buf, send, recv)
    ridx, rvals = unpack(got, r, index_dtype, wire_dtype, strided=True)  # the batch sorts its rows
    # The owner's merge, padded to what it received so that nothing is read: a stable sort keeps each index's
    # rows in rank order, each run summed from +0 (the bits of merge_sources); the unique count stays on the
    # device until the sizes' gather reads every owner's at once.
    pidx, psums, stats = Batch([(ridx, rvals, size)], acc).padded()  # every run summed from +0
    head = stats[1:]
    if parts is not None:  # each part's count in this owner's merge (padding lies past every part)
        head = torch.cat((head, count_between(pidx, parts.bounds)))
    if divide and p > 1:
        psums.div_(p)
    with comm.meta():
        shares = read_sizes(comm.gather_small(head).view(p, head.numel()), parts)
    u = shares[me]
    flat = comm.all_gather_flat(pack(pidx[:u], psums[:u], index_dtype, share_dtype), shares, mode)
    gidx, gvals = unpack(flat, r, index_dtype, share_dtype)
    gidx, order = torch.sort(gidx)  # unique indices: any sort gives the same order
    return gidx, gvals.index_select(0, order).to(acc)


def _share_schedule(c: Pricing, mode: str, entry: float) -> tuple[Step, float]:
    """The shares' gather as :meth:`Comm.all_gather_flat` runs it, and the largest share's bytes.

    Owners hold about ``u / P`` rows each (the hash spreads them like
    Poisson counts: the largest about two deviations over the mean); ``pad``
    gathers that many from everyone, ``alltoall`` each owner's own.
    """
    per_owner = c.u / c.p
    largest = math.ceil(per_owner + 2 * math.sqrt(per_owner)) if per_owner > 0 else 0
    if mode == "pad" or (mode == "auto" and 4 * c.p * largest <= 5 * c.u):  # all_gather_flat's auto rule
        return c.all_gather("union_gather", largest * entry), largest * entry
    return c.all_to_all("union_gather", largest * entry), largest * entry


@register
class HashPart(Algorithm):
    """Reduce-scatter by hash owner in one ``all_to_all``, then all-gather the owners' sums."""

    name = "hashpart"
    knob_specs = (
        Knob("gather_mode", "auto", "how the owners' sums are gathered: `pad` (one `all_gather` padded to the largest "
             "share), `alltoall` (exact sizes), `auto` (pad unless padding adds over 25%)",
             choices=("auto", "pad", "alltoall"), tune=("exact", "topk")),
    )
    TERMS = (
        "metadata", "counts_all_to_all", "split_all_to_all", "owner_reduce", "sizes_all_gather", "union_gather",
        "unpack_sort",
    )
    #: Exact: the record (the coalesce's count and the counts per owner ride in it, read together), the owners'
    #: sizes (the merge's unique count travels in their gather); top-k: the record (carrying the local
    #: selection's counts per owner; the selection reads nothing) and the sizes.
    HOST_SYNCS = {"exact": 2, "topk": 2}
    HOST_KERNELS = {"exact": 67, "topk": 77}
    applies_avg = True  # each owner divides its own sums, a P-th of the rows

    def schedule(self, pricing: Pricing, knobs: dict[str, Any]) -> list[Step]:
        """The record (with the counts per owner), the split, the owners' merge, the sizes, the shares' gather, the sort.

        In top-k mode every rank sends its ``k`` selected entries by owner,
        after a local top-k selection made before the record (which carries
        their counts); the shares travel in the accumulation dtype.
        """
        c = pricing
        mode = {**self.knobs, **knobs}["gather_mode"]
        # The counts per owner ride in the record (top-k mode selects before it).
        meta = c.counts_record()
        counts = c.free("counts_all_to_all", "all_to_all")
        if c.topk:
            k_local = k_owner = c.kavg
            select = 4 * c.n * c.rba + k_local * math.log2(max(k_local, 2.0)) * 8.0
            share_entry = c.e - c.rb + c.rba
        else:
            k_local, k_owner = c.k_max, c.kavg  # the largest rank bounds the split; the hash evens the owners
            select, share_entry = 0.0, c.e
        split = c.all_to_all("split_all_to_all", k_local / c.p * c.e)
        # Hash and order by owner, pack; unpack what arrived, stable sort, sum the runs.
        local = (
            select + k_local * (24.0 + 2 * c.e + math.log2(max(k_local, 2.0)) * 8.0)
            + k_owner * (2 * c.e + math.log2(max(k_owner, 2.0)) * 8.0 + 2 * c.rba)
        )
        gather, block = _share_schedule(c, mode, share_entry)
        unpack_sort = c.p * block + c.u * math.log2(max(c.p, 2.0)) * 8.0 + c.u * c.out_entry
        return [
            meta,
            counts,
            split,
            c.local("owner_reduce", local, 8.0 if c.topk else 7.0),
            c.small_gather("sizes_all_gather", 8.0),
            gather,
            c.local("unpack_sort", unpack_sort, 3.0),
        ]

    def eager_payload(
        self, indices: torch.Tensor, size: int, comm: Comm, knobs: dict[str, Any] | None, capacity: int
    ) -> np.ndarray | Prepared | None:
        """Where this rank's entries for each owner end (``P`` int64 running counts), for the record; ``None``
        when ``8 P`` bytes do not fit.

        The owners depend on the indices and ``P`` alone, so the counts hold
        on any call. On the device path they are counted there (sorted
        owners, no atomics, no read), and the sorted owners stay with the
        counts (:class:`Prepared`) for the run, which sends the entries in
        that order; ``indices`` may be padded with ``size``, past every real
        index: padding counts for no owner.
        """
        p = comm.world_size
        if p < 2 or 8 * p > capacity:
            return None
        if on_host(indices):  # the host path coalesces before the record: never padded
            counts = np.bincount(hash_owner_host(indices.numpy(), p), minlength=p)
            return np.cumsum(counts, dtype=np.int64).view(np.uint8)  # running counts, as the payload travels
        owners = sorted_owners(indices, size, p)  # kept for the run: its entries go to their owners in this order
        return Prepared(owner_ends(owners[0], p).view(torch.uint8), owners)

    def sparse_allreduce(self, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        p, me = comm.world_size, comm.rank
        counts = _meta.send_recv_counts(inp.payload, me) if p > 1 else None
        out = hash_reduce(
            comm, inp.indices, inp.values, inp.size, inp.dtype, counts=counts, divide=inp.op == "avg",
            mode=knobs["gather_mode"], owners=inp.work, parts=inp.parts,
        )
        _meta.note_payload(comm)  # the counts ride in the next records (from P = 64 the slot makes room for them)
        return out

    def topk_prepare(self, acc: torch.Tensor, state: Any, comm: Comm, capacity: int) -> Prepared | None:
        """Select the local top-k now, and put where its entries for each owner end (``P`` int64 running counts)
        in the record.

        The owners depend on the indices and ``P`` alone, so every rank then
        knows what every rank sends to every owner, and the split needs no
        ``all_to_all`` of counts. ``None`` when ``8 P`` bytes do not fit.
        """
        idx = Magnitudes(acc).top_k_indices(state.k_for(acc.numel()))
        payload = self.eager_payload(idx, acc.numel(), comm, None, capacity)
        if payload is None:
            return None
        got, owners = (payload.payload, payload.work) if isinstance(payload, Prepared) else (payload, None)
        return Prepared(got, (idx, owners))  # the owners on the device path, sorted, for the run

    def topk_allreduce(
        self, acc: torch.Tensor, state: Any, comm: Comm, knobs: dict[str, Any], prepared: Prepared | None = None
    ) -> TopkOutput:
        n = acc.numel()
        k = state.k_for(n)
        me = comm.rank
        counts = None if prepared is None else _meta.send_recv_counts(prepared.gathered, me)
        idx, owners = (Magnitudes(acc).top_k_indices(k), None) if counts is None else prepared.work
        vals = acc.index_select(0, idx).view(k, 1)
        gidx, gvals = hash_reduce(
            comm, idx, vals, n, acc.dtype, counts=counts, share_dtype=accum_dtype(acc.dtype),
            mode=knobs["gather_mode"], owners=owners,
        )
        _meta.note_payload(comm)  # the counts ride in the next records (from P = 64 the slot makes room for them)
        state.last_local_count, state.last_global_count = k, gidx.numel()
        return TopkOutput(indices=gidx, values=gvals.view(-1), sent=idx, local_count=k, global_count=gidx.numel())

