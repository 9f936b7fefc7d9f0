"""Ok-Topk's balance step: even out the owners' kept entries with the fewest entries moved, then all-gather them.

After the global selection, owner ``j`` holds ``sizes[j]`` kept entries of
its region, and the regions are in index order. An ``all_gather`` needs
equal blocks: block ``j`` holds ``target[j]`` entries, ``ceil(total / P)``
each but the last ones. Re-cutting the concatenation into blocks (Ok-Topk's
reference code) moves every entry whose position drifted out of its owner's
block, which for ``P`` much larger than the entries per block is nearly all
of them. Here an owner keeps its first ``min(sizes[j], target[j])``
entries and moves only its surplus, in index order, to the owners short of
their target, in rank order (:func:`plan`): the fewest entries any balance
can move. The gathered blocks are then put back in owner order
(:func:`owner_order`), so every rank ends with the kept entries in index
order, the same bits as gathering the owners' regions directly.

Every rank computes the same plan from the same ``sizes`` (all-gathered
before), with NumPy in ``O(P log P)``, and takes part only in its own moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colltune.algorithms.comm import Comm
from colltune.algorithms.lazy import torch
from colltune.algorithms.sparse import upload

__all__ = ["Plan", "plan", "owner_order", "balance_and_gather"]


@dataclass(frozen=True)
class Plan:
    """The moves of one balance step.

    Attributes:
        target: entries of each block after the balance.
        keep: entries each owner keeps in place (its first ones).
        src, dst, count: move ``m`` sends ``count[m]`` entries from owner
            ``src[m]`` to owner ``dst[m]``, in the order of the surplus
            stream: by source rank, then by position.
        sent_before: per move, the source's surplus entries moved before it.
        got_before: per move, the destination's entries received before it.
    """

    target: np.ndarray
    keep: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    count: np.ndarray
    sent_before: np.ndarray
    got_before: np.ndarray


def plan(sizes: list[int] | np.ndarray) -> Plan:
    """Return the balance of ``sizes`` into equal blocks that moves the fewest entries.

    The owners' surpluses, in rank order, form one stream; so do the
    deficits. Both cover ``[0, M)``, ``M`` the entries moved; cutting at
    every owner's boundary in either stream gives the moves.
    """
    s = np.asarray(sizes, dtype=np.int64)
    p, total = s.size, int(s.sum())
    block = -(-total // p) if p else 0
    edges = np.minimum(np.arange(p + 1, dtype=np.int64) * block, total)
    target = np.diff(edges)
    keep = np.minimum(s, target)
    surplus, deficit = s - keep, target - keep
    cs, cd = np.cumsum(surplus), np.cumsum(deficit)
    ends = np.unique(np.concatenate((cs[surplus > 0], cd[deficit > 0])))
    starts = np.concatenate((np.zeros(1, dtype=np.int64), ends[:-1])) if ends.size else ends
    src = np.searchsorted(cs, starts, side="right")
    dst = np.searchsorted(cd, starts, side="right")
    return Plan(target, keep, src, dst, ends - starts, starts - (cs - surplus)[src], starts - (cd - deficit)[dst])


def owner_order(pl: Plan) -> np.ndarray | None:
    """Return the rows of the gathered blocks in owner (= index) order, or ``None`` when nothing moved.

    Block ``j`` holds owner ``j``'s kept entries, then what it received in
    stream order; owner ``a``'s entries are its kept ones, then its moved
    ones in stream order.
    """
    if pl.count.size == 0:
        return None
    at = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(pl.target)))[:-1]
    p = pl.keep.size
    owner = np.concatenate((np.arange(p), pl.src))
    kind = np.concatenate((np.zeros(p, dtype=np.int64), np.ones(pl.src.size, dtype=np.int64)))
    pos = np.concatenate((np.zeros(p, dtype=np.int64), pl.sent_before))
    where = np.concatenate((at, at[pl.dst] + pl.keep[pl.dst] + pl.got_before))
    length = np.concatenate((pl.keep, pl.count))
    seg = np.lexsort((pos, kind, owner))
    where, length = where[seg], length[seg]
    first = np.cumsum(length) - length  # where each segment starts in owner order
    return np.repeat(where - first, length) + np.arange(int(length.sum()), dtype=np.int64)


def balance_and_gather(comm: Comm, buf: torch.Tensor, sizes: list[int], balance: bool) -> torch.Tensor:
    """Return every owner's rows of ``buf`` (``[sizes[rank], e]``), gathered in owner order.

    With ``balance``, the blocks are evened out first (:func:`plan`; one
    batch of point-to-point messages), then all-gathered; otherwise the
    owners' rows are gathered as they are (:meth:`Comm.all_gather_flat`,
    ``auto``).
    """
    if comm.world_size == 1 or not balance:
        return comm.all_gather_flat(buf, sizes, "auto")
    pl = plan(sizes)
    me = comm.rank
    keep = int(pl.keep[me])
    block = torch.empty((int(pl.target[me]),) + tuple(buf.shape[1:]), dtype=buf.dtype, device=buf.device)
    block[:keep] = buf[:keep]
    sends, recvs = [], []
    for m in np.flatnonzero(pl.src == me).tolist():
        a = keep + int(pl.sent_before[m])
        sends.append((buf[a : a + int(pl.count[m])], int(pl.dst[m])))
    for m in np.flatnonzero(pl.dst == me).tolist():
        a = keep + int(pl.got_before[m])
        recvs.append((block[a : a + int(pl.count[m])], int(pl.src[m])))
    for work in comm.exchange(sends, recvs):
        work.wait()
    flat = comm.all_gather_flat(block, pl.target.tolist(), "auto")
    order = owner_order(pl)
    return flat if order is None else flat.index_select(0, upload(order, flat.device))
