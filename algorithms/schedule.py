"""What an algorithm's call costs, as steps the cost model prices.

Each algorithm describes its own call as a list of :class:`Step` (one per
named term: a collective, point-to-point rounds, or local work) in
:meth:`~colltune.algorithms.base.Algorithm.schedule`. The analytic cost
model (:class:`colltune.model.cost_model.AnalyticModel`) prices a step as
``calls * launch + steps * alpha + nbytes * beta`` of its primitive.

:class:`Pricing` holds the call's quantities in the units the schedules use
and builds the steps of the standard collectives (ring all_reduce, all_gather,
all_to_all, rotated point-to-point) at the call's world size. Its ``mode``
says which call is priced: ``exact`` (``sparse_allreduce``: ``k_sum`` and
``union`` are the ranks' coalesced entries) or ``topk`` (``topk_allreduce``:
every rank selects about ``k = k_sum / P`` of the ``n`` values of a flat
tensor, and ``n`` rows of one value each are what dense moves).

This module needs no torch: the features it reads are plain numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from colltune.algorithms import sizes
from colltune.algorithms.errors import ColltuneValueError

__all__ = ["Step", "Pricing", "p2p_gathers", "record_by_all_reduce", "RECORD_ALL_REDUCE_FROM"]

#: The world size from which a collective backend (NCCL) gathers the metadata record by an ``all_reduce``
#: (:func:`record_by_all_reduce`).
RECORD_ALL_REDUCE_FROM = 32


def record_by_all_reduce(world_size: int, collective: bool) -> bool:
    """Whether the metadata record travels as an ``all_reduce`` of a table with one row per rank.

    Each rank writes its record in its own row of a zeroed ``[P, R]`` table
    and the table is summed: every byte has one nonzero addend, so the sum
    is the gathered table exactly, on every rank. NCCL's ``all_gather``
    runs only as a ring, whose latency grows with ``P`` (``P - 1`` steps),
    while its ``all_reduce`` can run as a tree, whose latency grows with
    the nodes' ``log2``. NCCL 2.21.5's tuning model
    (:mod:`colltune.model.nccl`, DGX H100 nodes) prices the record at rest
    (:func:`~colltune.algorithms.sizes.record_bytes`) gathered and summed:
    16 ranks (2 x 8) 23.8 and 26.6 us, 32 ranks (4 x 8) 43.8 and 38.4 us,
    128 (16 x 8) 162 and 63 us, 1024 (128 x 8) 1268 and 157 us; at one rank
    per node the crossover is at 32 ranks too (91.4 and 63.3 us). So a
    collective backend sums the record from :data:`RECORD_ALL_REDUCE_FROM`
    ranks on.

    ``collective`` is True for a backend whose collectives run as the
    backend runs them (NCCL; not :data:`~colltune.algorithms.comm.DIRECT_BACKENDS`,
    whose records travel point to point). A group has one backend, so
    every rank resolves the same exchange whatever its tensors' path. The
    cost model prices the device path (an NCCL profile) so.
    """
    return collective and world_size >= RECORD_ALL_REDUCE_FROM


def p2p_gathers(world_size: int, ranks_per_node: int | None, host: bool) -> bool:
    """Whether an ``auto`` gather may send its entries point to point: on the host path, or inside one node.

    The gathers of ``allgather`` (wide rows) and of Ok-Topk's regions can
    send every peer its own messages instead of running a collective
    gather. The host path (gloo, CPU tensors) keeps them at any layout:
    there the collectives of groups of 3 or more run point to point too
    (:class:`~colltune.algorithms.comm.Comm`'s direct mode), and separate
    messages save the packing. On the device
    path (NCCL) they stay point to point only inside one node: across
    nodes NCCL's model (:mod:`colltune.model.nccl`) prices ``P - 1``
    messages per rank, each a network step on NICs shared by the node's
    ranks, well above its ring ``all_gather`` of the same bytes, so
    ``auto`` gathers collectively there. A layout not known yet
    (``ranks_per_node`` ``None``) counts as one node. Every rank of a group
    holds the same arguments, so every rank resolves the same gather.
    """
    return host or ranks_per_node is None or ranks_per_node >= world_size


@dataclass(frozen=True)
class Step:
    """One priced term of an algorithm's schedule.

    Attributes:
        term: the term's name (a key of the algorithm's ``TERMS``).
        primitive: ``all_reduce``, ``all_gather``, ``all_to_all``, ``p2p`` or ``local``.
        calls: primitive calls (each pays the launch latency).
        steps: latency-bound steps (each pays alpha).
        nbytes: bytes this rank sends (or, for ``local``, touches).
    """

    term: str
    primitive: str
    calls: float
    steps: float
    nbytes: float


class Pricing:
    """A call's quantities and the steps of the standard collectives at its world size.

    Args:
        features: the call's global statistics (a
            :class:`colltune.model.features.Features`: ``world_size``,
            ``numel``, ``row_numel``, ``entry_bytes``, ``row_bytes``,
            ``accum_bytes``, ``k_sum``, ``k_max``, ``union``; and ``mode``
            when it has one).
        record_bytes: bytes per rank of the metadata record every call
            exchanges, or ``None`` for the real record at this world size
            (:func:`~colltune.algorithms.sizes.record_bytes`: the header and the
            starting eager slot; an algorithm whose payload rides in the
            slot adds what that takes).
        record_known: whether ``record_bytes`` was given (an algorithm whose
            entries can ride in the record's eager slot prices that only for
            the real record).
        mode: ``exact`` or ``topk``; ``None`` takes ``features.mode``, else ``exact``.
        host: whether the priced call runs on the host path (gloo, CPU
            tensors) rather than the device path (NCCL).
        ranks_per_node: the group's ranks per node when ``features`` do not
            say (``features.ranks_per_node`` is ``None``); ``None``: one node.

    Attributes:
        p: world size. n: rows. e: bytes of one packed entry (index and row).
        rb: bytes of one row. rba: bytes of one row in the accumulation dtype.
        ksum: entries over all ranks. kavg: entries per rank on average (in
        top-k mode, ``k``). u: rows of the union. out_entry: bytes of one
        output entry (int64 index and a row). mode: ``exact`` or ``topk``.
        p2p_gathers: whether ``auto`` gathers go point to point
        (:func:`p2p_gathers` of the call's layout and path).
    """

    def __init__(
        self,
        features: Any,
        record_bytes: float | None = None,
        *,
        record_known: bool = False,
        mode: str | None = None,
        host: bool = True,
        ranks_per_node: int | None = None,
    ) -> None:
        f = features
        self.p = int(f.world_size)
        self.n = float(f.numel)
        self.e = float(f.entry_bytes)
        self.rb = float(f.row_bytes)
        self.rba = float(f.row_numel * f.accum_bytes)
        self.ksum = float(f.k_sum)
        self.kavg = self.ksum / self.p
        self.k_max = float(f.k_max)
        self.u = float(f.union)
        self.out_entry = 8.0 + self.rb
        self.mode = str(mode or getattr(f, "mode", None) or "exact")
        if self.mode not in ("exact", "topk"):
            raise ColltuneValueError(f"`mode` must be 'exact' or 'topk', but got {self.mode!r}.")
        self.record_known = record_known
        #: Whether the priced call runs on the host path (its merges may use a dense scratch; the device
        #: path always sorts).
        self.host = host
        self.record_bytes = float(sizes.record_bytes(self.p) if record_bytes is None else record_bytes)
        rpn = getattr(f, "ranks_per_node", None) or ranks_per_node
        self.p2p_gathers = p2p_gathers(self.p, rpn, host)

    @property
    def topk(self) -> bool:
        """True when the priced call is a ``topk_allreduce``."""
        return self.mode == "topk"

    def metadata(self, record_bytes: float | None = None) -> Step:
        """The exchange of the metadata record every call starts with: an all_gather, or from
        :data:`RECORD_ALL_REDUCE_FROM` ranks on the device path an all_reduce of the table
        (:func:`record_by_all_reduce`)."""
        return self.small_gather("metadata", self.record_bytes if record_bytes is None else record_bytes)

    def counts_record(self) -> Step:
        """:meth:`metadata` carrying every rank's ``P`` counts per owner in its slot (Ok-Topk's and
        hashpart's payload): the real record grows by :func:`~colltune.algorithms.sizes.payload_reserve`."""
        return self.metadata(self.record_bytes + (0 if self.record_known else sizes.payload_reserve(self.p)))

    def small_gather(self, term: str, nbytes: float) -> Step:
        """An all_gather of a few bytes of control data per rank, summed as a table where the record is
        (:meth:`~colltune.algorithms.comm.Comm.gather_small`)."""
        if record_by_all_reduce(self.p, not self.host):
            return self.all_reduce(term, self.p * nbytes)
        return self.all_gather(term, nbytes)

    def all_reduce(self, term: str, nbytes: float, share: float = 1.0) -> Step:
        """A ring all_reduce of ``nbytes``, paid on a ``share`` of the calls."""
        p = self.p
        if p == 1:
            return Step(term, "all_reduce", 0.0, 0.0, 0.0)
        return Step(term, "all_reduce", share, share * 2 * (p - 1), share * 2 * (p - 1) / p * nbytes)

    def all_gather(self, term: str, nbytes_in: float) -> Step:
        """An all_gather of ``nbytes_in`` from every rank."""
        p = self.p
        if p == 1:
            return Step(term, "all_gather", 0.0, 0.0, 0.0)
        return Step(term, "all_gather", 1.0, p - 1.0, (p - 1) * nbytes_in)

    def all_to_all(self, term: str, nbytes_per_peer: float, share: float = 1.0) -> Step:
        """An all_to_all of ``nbytes_per_peer`` to each peer, paid on a ``share`` of the calls."""
        p = self.p
        if p == 1:
            return Step(term, "all_to_all", 0.0, 0.0, 0.0)
        return Step(term, "all_to_all", share, share * (p - 1.0), share * (p - 1) * nbytes_per_peer)

    def p2p_rotated(self, term: str, nbytes_per_step: float, peers_in_flight: int) -> Step:
        """P - 1 point-to-point steps in rotated order, ``peers_in_flight`` posted per call."""
        p = self.p
        if p == 1:
            return Step(term, "p2p", 0.0, 0.0, 0.0)
        calls = float(math.ceil((p - 1) / peers_in_flight))
        return Step(term, "p2p", calls, p - 1.0, (p - 1) * nbytes_per_step)

    def p2p(self, term: str, calls: float, messages: float, nbytes: float) -> Step:
        """Point-to-point messages: ``calls`` batches posted, ``messages`` sent, ``nbytes`` in all."""
        if self.p == 1:
            return Step(term, "p2p", 0.0, 0.0, 0.0)
        return Step(term, "p2p", calls, messages, nbytes)

    @staticmethod
    def local(term: str, nbytes: float, kernels: float) -> Step:
        """Local work touching ``nbytes`` in ``kernels`` passes."""
        return Step(term, "local", 0.0, kernels, nbytes)

    @staticmethod
    def free(term: str, primitive: str) -> Step:
        """A term that costs nothing in this call (its data rides elsewhere)."""
        return Step(term, primitive, 0.0, 0.0, 0.0)
