"""The contract every algorithm implements, and the records that cross it.

Life of one exact sparse allreduce (``sparse_allreduce``):

1. The front door validates the arguments and coalesces the local input
   (:func:`colltune.algorithms.sparse.coalesce`).
2. It exchanges one small metadata record per rank
   (:func:`colltune.algorithms.meta.exchange`), so every rank learns every rank's
   entry count and that all ranks agree on size, dtype, op and algorithm.
3. It calls :meth:`Algorithm.sparse_allreduce` with a :class:`SparseInput`
   that holds the coalesced local entries and those global counts.
4. The algorithm returns the coalesced *sum* in the accumulation dtype
   (or, when it sets :attr:`Algorithm.applies_avg`, the result of
   ``SparseInput.op``); the front door applies ``avg`` where the algorithm
   did not, and casts back to the input dtype. The returned tensors must
   share no memory with the input unless :attr:`SparseInput.owned` says its
   values are the call's own (the front door divides in place).

Life of one top-k allreduce (``topk_allreduce``): the front door forms
``acc = residual + tensor`` before the metadata exchange, asks the algorithm
likeliest to run for a payload (:meth:`Algorithm.topk_prepare`: Ok-Topk's
local selection and its counts per region, while its boundaries are
cached), exchanges the records, calls :meth:`Algorithm.topk_allreduce`
(with what the algorithm prepared, when it is the one that runs), which
returns the global result and which local entries were delivered, then sets
``residual = acc`` with the delivered entries zeroed (error feedback).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from colltune.algorithms.comm import Comm, Traffic
from colltune.algorithms.errors import ColltuneValueError
from colltune.algorithms.knobs import Knob
from colltune.algorithms.lazy import torch
from colltune.algorithms.schedule import Pricing, Step
from colltune.algorithms.sparse import Parts, accum_dtype, wire_index_dtype

__all__ = ["Op", "SparseInput", "SparseResult", "TopkOutput", "Delivered", "Prepared", "Algorithm"]

Op = Literal["sum", "avg"]


@dataclass(frozen=True)
class SparseInput:
    """One rank's coalesced input plus what every rank shares about the call.

    Attributes:
        indices: int64, sorted, unique.
        values: ``[k, r]`` in the accumulation dtype.
        size: number of dense rows ``n``.
        row_shape: shape of one row (``()`` for scalars).
        dtype: the caller's value dtype (the result is cast back to it).
        counts: entries per rank after coalescing, for every rank, in rank order.
        eager: every rank's eager slot from the metadata exchange, one
            ``uint8`` row per rank (``[P, slot_bytes]``, host data: a NumPy
            view of the exchanged table), holding its first entries packed
            as :func:`colltune.algorithms.allgather.eager_slot` packs them, or
            ``None`` when the caller did not fill the slots.
        op: ``sum`` or ``avg``; read only by algorithms that set
            :attr:`Algorithm.applies_avg`.
        payload: every rank's :meth:`Algorithm.eager_payload` from the
            metadata exchange (``[P, payload bytes]`` ``uint8``, host data:
            a NumPy view of the exchanged table), or ``None`` when the ranks
            sent none.
        parts: a fused call's tensors laid end to end in this input; an
            algorithm whose last step reads its result's size from the
            device may read each part's with it (:class:`~colltune.algorithms.sparse.Parts`).
        owned: ``values`` is memory this call may overwrite: the coalesce,
            a cast or a concatenation made it, or the caller donated its
            values (``sparse_allreduce(..., donate=True)``). An algorithm
            may then reduce into it and return it; otherwise ``values``
            may be the caller's own tensor and must keep its bits.
        owned_indices: ``indices`` may be handed back as the result's
            (the coalesce made them, or the caller donated them); otherwise
            they may be the caller's own tensor, which a result never shares.
        work: what this algorithm's :meth:`Algorithm.eager_payload` left for
            its run on this rank (:attr:`Prepared.work`), or ``None``.
    """

    indices: torch.Tensor
    values: torch.Tensor
    size: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    counts: tuple[int, ...]
    eager: np.ndarray | None = None
    op: str = "sum"
    payload: np.ndarray | None = None
    parts: Parts | None = None
    owned: bool = False
    owned_indices: bool = False
    work: Any = None

    @property
    def row_numel(self) -> int:
        return self.values.shape[1]

    @property
    def acc_dtype(self) -> torch.dtype:
        return accum_dtype(self.dtype)

    @property
    def index_dtype(self) -> torch.dtype:
        """The dtype indices travel in: int32 whenever ``size`` allows."""
        return wire_index_dtype(self.size)

    @property
    def k_max(self) -> int:
        return max(self.counts) if self.counts else 0

    @property
    def k_sum(self) -> int:
        return sum(self.counts)


@dataclass
class SparseResult:
    """The reduced sparse tensor, identical on every rank.

    Attributes:
        indices: int64 row indices, sorted and unique: the union of the
            indices of all ranks.
        values: ``[len(indices), *row_shape]`` in the caller's dtype.
        size: number of dense rows.
        algorithm: name of the algorithm that ran.
        traffic: bytes and messages this rank sent during the call.
        decision: why the algorithm was chosen (filled by the selector), or ``None``.
    """

    indices: torch.Tensor
    values: torch.Tensor
    size: int
    algorithm: str
    traffic: Traffic = field(default_factory=Traffic)
    decision: Any = None

    def to_dense(self) -> torch.Tensor:
        """Return the result as a dense tensor of shape ``[size, *row_shape]``."""
        out = torch.zeros((self.size,) + tuple(self.values.shape[1:]), dtype=self.values.dtype, device=self.values.device)
        if self.indices.numel():
            out.index_copy_(0, self.indices, self.values)
        return out

    def to_sparse_coo(self) -> torch.Tensor:
        """Return the result as a coalesced ``torch.sparse_coo_tensor``."""
        shape = (self.size,) + tuple(self.values.shape[1:])
        return torch.sparse_coo_tensor(
            self.indices.view(1, -1), self.values, shape, is_coalesced=True, check_invariants=False
        )


@dataclass
class TopkOutput:
    """What an algorithm returns from one top-k call (sums, before ``avg``).

    Attributes:
        indices: flat int64 indices of the reduced entries, sorted, unique;
            ``None`` when the result is dense (no compression).
        values: the summed values at ``indices`` (or the whole dense sum).
        sent: flat local indices whose accumulated values were delivered,
            or a :class:`Delivered` that says so without compacting them;
            ``None`` means all of them (dense).
        local_count: entries this rank selected locally.
        global_count: entries kept globally.
    """

    indices: torch.Tensor | None
    values: torch.Tensor
    sent: "torch.Tensor | Delivered | None"
    local_count: int
    global_count: int


@dataclass
class Delivered:
    """Which of this rank's selected entries were delivered, kept on the device until someone reads them.

    Attributes:
        indices: flat int64 local indices selected (sorted, unique).
        hit: a bool tensor of the same length: delivered or not.

    Compacting ``indices[hit]`` reads its count on the device (a host
    sync), so the error feedback clears the residual with :meth:`clear`,
    which needs none, and :meth:`compact` runs only for a caller that reads
    the delivered indices.
    """

    indices: torch.Tensor
    hit: torch.Tensor

    def clear(self, residual: torch.Tensor) -> None:
        """Zero ``residual`` (flat) at the delivered indices, in place, with no host sync."""
        flat = residual.view(-1)
        flat[self.indices] = torch.where(self.hit, torch.zeros((), dtype=flat.dtype, device=flat.device),
                                         flat.index_select(0, self.indices))

    def compact(self) -> torch.Tensor:
        """The delivered indices (sorted, unique)."""
        return self.indices[self.hit]


@dataclass
class Prepared:
    """What an algorithm worked out before a call's metadata exchange: its payload for the record, and its own work.

    Top-k calls get it from :meth:`Algorithm.topk_prepare`; exact calls from
    :meth:`Algorithm.eager_payload`, which may return one instead of bare
    bytes (its work then reaches the run as ``SparseInput.work``).

    Attributes:
        payload: this rank's bytes for the record's eager slot (flat
            ``uint8``; on the device path a device tensor, written into the
            record there).
        work: the algorithm's own pre-exchange work (Ok-Topk: the cuts its
            counts were cut by, or in top-k its local selection; hashpart:
            its entries' owners, sorted, with the indices in top-k), handed
            back to it unread by the front door.
        gathered: every rank's payload after the exchange (``[P, payload
            bytes]`` ``uint8``, host data), set by the front door before
            :meth:`Algorithm.topk_allreduce` receives it.
    """

    payload: np.ndarray | torch.Tensor
    work: Any = None
    gathered: np.ndarray | None = None


class Algorithm(abc.ABC):
    """A way to sum sparse data across the ranks of a group.

    Subclasses set :attr:`name`, :attr:`knob_specs` and :attr:`TERMS`,
    implement both calls and :meth:`schedule`, and register with
    :func:`colltune.algorithms.register`.
    Instances hold no per-call state: thresholds and residuals live in
    :class:`colltune.algorithms.state.TopkState`, boundary caches in
    :class:`colltune.algorithms.state.BoundaryState`.

    Every method is called collectively: all ranks of ``comm`` call it with
    the same algorithm, the same shared fields and in the same order, which
    the front door has checked before.
    """

    #: The registry name.
    name: ClassVar[str]
    #: The knobs, each with its default, type, bounds, search range and doc.
    knob_specs: ClassVar[tuple[Knob, ...]] = ()
    #: Derived from :attr:`knob_specs` (call knobs only, not state knobs):
    #: defaults by name. Unknown knobs are rejected.
    knobs: ClassVar[dict[str, Any]] = {}
    #: Derived: allowed values of choice knobs.
    knob_choices: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: Derived: lower bounds of numeric knobs, ``(bound, exclusive)``.
    knob_minimums: ClassVar[dict[str, tuple[float, bool]]] = {}
    #: The names of the terms :meth:`schedule` returns, in order.
    TERMS: ClassVar[tuple[str, ...]] = ()
    #: Host synchronizations of a steady-state call on the device path, by mode (``exact``, ``topk``): what
    #: an NCCL profile's host cost multiplies (its ``host_sync_us``), and the ceiling the sync-budget test
    #: holds the code to; an exact call reaches it (``tests/cli/test_audit_tools.py``), so the model prices
    #: the syncs the code makes.
    HOST_SYNCS: ClassVar[dict[str, int]] = {}
    #: Kernels of a steady-state call on the device path, by mode: what an NCCL profile's ``host_kernel_us``
    #: multiplies. The device-path audit's count at P = 2 (``tools/device_path_audit.py``: aten ops that are
    #: not views), the most over scalars and rows: ``tests/cli/test_audit_tools.py`` holds the code to it and
    #: it to the code (at most 10% above), so the model prices the kernels the code launches. The fit counts
    #: CUDA launches at P = 1 instead (one GPU), which differ per op (a sort launches several):
    #: ``tools/fit_host_cost.py`` prints how far they are from these counts on its file (0.57x to 1.90x on
    #: ``profiles/measurements/h200-per-call.json``, whose launches came from older code than these counts):
    #: an approximation.
    HOST_KERNELS: ClassVar[dict[str, int]] = {}
    #: What the cost model prices the algorithm on in top-k mode (``topk_allreduce``): ``"selection"``,
    #: each rank's ``k`` selected entries (what a sparse algorithm moves), or ``"tensor"``, every element of
    #: the accumulated tensor (what an allreduce of it moves). The selector and ``simulate`` read it.
    topk_priced_on: ClassVar[str] = "selection"
    #: True when :meth:`sparse_allreduce` applies ``SparseInput.op`` itself:
    #: for ``avg`` it divides each summed row by the world size in the
    #: accumulation dtype (the same bits as dividing the returned sum), which
    #: lets an algorithm that reduces only a part of the rows divide only that part.
    applies_avg: ClassVar[bool] = False
    #: True when the algorithm reads every rank's first entries from the
    #: metadata record's eager slot (``SparseInput.eager``): the front door
    #: then fills the slot with this rank's entries, and sizes it to fit them.
    eager_entries: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        call = [k for k in cls.knob_specs if not k.state]
        cls.knobs = {k.name: k.default for k in call}
        cls.knob_choices = {k.name: k.choices for k in call if k.choices}
        cls.knob_minimums = {k.name: (k.minimum, k.exclusive) for k in call if k.minimum is not None}

    @classmethod
    def knob(cls, name: str) -> Knob:
        """Return the :class:`Knob` called ``name`` (call or state knob)."""
        for k in cls.knob_specs:
            if k.name == name:
                return k
        raise KeyError(name)

    def check_knobs(self, knobs: dict[str, Any] | None) -> dict[str, Any]:
        """Return the defaults updated with ``knobs``, rejecting unknown names, wrong types and values out of range."""
        merged = dict(self.knobs)
        for key, value in (knobs or {}).items():
            if key not in self.knobs:
                allowed = ", ".join(sorted(self.knobs)) or "none"
                raise ColltuneValueError(
                    f"knobs[{key!r}] is not a knob of algorithm {self.name!r}; allowed knobs: {allowed}. "
                    "Remove it or set it for the algorithm it belongs to.",
                    argument="knobs",
                )
            merged[key] = self.knob(key).check_type(value, self.name)
        for k in self.knob_specs:
            if not k.state:
                k.check_range(merged[k.name], self.name)
        return merged

    def schedule(self, pricing: Pricing, knobs: dict[str, Any]) -> list[Step]:
        """Return the steps of one call, one per name of :attr:`TERMS`, for the analytic cost model.

        Called with the call's quantities (:class:`Pricing`) and this
        algorithm's checked knobs. An algorithm without a schedule can be
        run by name but is never chosen by ``auto`` on the analytic model.
        """
        raise NotImplementedError(f"algorithm {self.name!r} has no cost schedule")

    def eager_payload(
        self, indices: torch.Tensor, size: int, comm: Comm, knobs: dict[str, Any] | None, capacity: int
    ) -> "np.ndarray | torch.Tensor | Prepared | None":
        """Return bytes to deliver to every rank with the metadata record, or ``None``.

        Called before the metadata exchange of a ``sparse_allreduce`` that
        names this algorithm (with its checked ``knobs``), or of an auto call
        whose site last chose it (``knobs`` is ``None``: the decision comes
        later), with this rank's coalesced indices (on the device path they
        may be padded with ``size``, past every real index). What it returns
        (flat ``uint8``, at most ``capacity`` bytes; a device tensor on the
        device path keeps the record's filling free of host reads) reaches
        :meth:`sparse_allreduce` as ``SparseInput.payload`` if this
        algorithm runs, saving it a collective of its own; it must check
        that the payload still fits the call (another algorithm may have
        been chosen in between). Whether it returns ``None``, and its
        length, must depend only on what every rank shares (the call's
        shared fields and the group's history), never on local data. A
        :class:`Prepared` carries the bytes and this rank's own work, which
        reaches :meth:`sparse_allreduce` as ``SparseInput.work`` on the same
        condition (local: it may differ between ranks).
        """
        return None

    @abc.abstractmethod
    def sparse_allreduce(self, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the coalesced sum over ranks: int64 indices (the union) and ``[u, r]`` values in the accumulation dtype.

        The result must be bitwise identical on every rank.
        """

    def one_off(self, comm: Comm, size: int, knobs: dict[str, Any]) -> bool:
        """Whether the coming exact call pays one-off set-up that its schedule prices only amortized.

        Ok-Topk's boundary refresh (its first call at a size, then every
        ``boundary_refresh`` calls) is one: online correction does not learn
        from such a call's time, which says little of the calls between.
        Asked before the call runs; must depend only on what every rank
        shares (so every rank learns from the same calls). Default: never.
        """
        return False

    def sparse_allreduce_parts(
        self, inp: SparseInput, comm: Comm, knobs: dict[str, Any], bounds: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`sparse_allreduce`, for the tensors of a fused call laid end to end.

        Part ``j`` holds rows ``[bounds[j], bounds[j + 1])`` of ``inp``. Each
        part's rows must come out with the bits :meth:`sparse_allreduce` of
        that part alone gives. An algorithm that sums every row in rank
        order, wherever the row sits, meets that with one call (this
        default); one whose sums depend on where a row sits in a buffer (a
        backend's ``all_reduce``) overrides it.
        """
        return self.sparse_allreduce(inp, comm, knobs)

    def topk_prepare(
        self, acc: torch.Tensor, state: Any, comm: Comm, capacity: int
    ) -> Prepared | None:
        """Return work to do before the metadata exchange of a top-k call, and its payload for the record, or ``None``.

        Called before the exchange of a ``topk_allreduce`` that names this
        algorithm, or of an auto call whose site last chose it, with the
        flat ``acc`` the call will run on. If this algorithm then runs, it
        receives what this returned (with every rank's payload) as
        :meth:`topk_allreduce`'s ``prepared``, saving it a collective of its
        own; if another one runs, it is dropped. So it must leave ``state``
        and ``acc`` as they are (commit in :meth:`topk_allreduce`). Whether
        it returns ``None``, and the payload's length (at most ``capacity``
        bytes), must depend only on what every rank shares (the call's
        shared fields, the state's step, refresh periods and boundaries),
        never on local data.
        """
        return None

    @abc.abstractmethod
    def topk_allreduce(
        self, acc: torch.Tensor, state: Any, comm: Comm, knobs: dict[str, Any], prepared: Prepared | None = None
    ) -> TopkOutput:
        """Select entries of the flat accumulated tensor ``acc`` and sum the selection over ranks.

        ``state`` is the caller's :class:`~colltune.algorithms.state.TopkState`; the
        algorithm may update its thresholds and boundaries but not its residual.
        ``prepared``: what this algorithm's :meth:`topk_prepare` returned for
        this call, with every rank's payload in ``gathered``; passed (as a
        keyword) only when it returned something, so an algorithm without
        a ``topk_prepare`` of its own may leave the parameter out.
        """
