"""The collective primitives colltune uses, wrapped to count this rank's traffic.

Only primitives that both gloo and NCCL implement are used: ``all_reduce``,
``all_gather_into_tensor`` (``all_gather_single`` where torch has it),
``all_to_all_single`` and ``batch_isend_irecv``.

Traffic is counted at each call, from the sizes passed to it, under the
textbook schedule of the primitive (the backends do not report what they put
on the wire):

==================  ==============================  ====================
primitive           bytes this rank sends           messages
==================  ==============================  ====================
all_reduce (ring)   ``2 L (P-1) / P``               ``2 (P-1)``
all_gather (ring)   ``(P-1) L`` for an input of L   ``P-1``
all_to_all          the bytes of the splits bound   one per non-empty
                    for other ranks                 split to another rank
send                ``L``                           1
==================  ==============================  ====================

Counting adds a few integer operations per call and nothing when no
:class:`Traffic` is attached.

On gloo, ``all_gather``, ``all_to_all`` and small ``all_reduce`` calls run
*direct*: every rank posts its sends to, and receives from, every peer in
one ``batch_isend_irecv``, instead of gloo's ring, whose ``P - 1`` steps
each wait for a hand-off between processes. The bytes each rank sends are
the same for ``all_gather`` and ``all_to_all`` (a ring all-gather also
sends ``(P-1) L``), so they are counted as above. A direct ``all_reduce``
all-gathers the tensors and sums them on every rank in rank order (the same
bits on every rank); it sends ``(P-1) L``, counted as sent, so it is kept
for tensors up to :data:`DIRECT_ALL_REDUCE_BYTES`. Groups of 2 keep the
backend's calls: there the ring is one exchange already. NCCL keeps its own
collectives, and so does every backend on the device path
(:func:`~colltune.algorithms.sparse.device_path`), which runs what NCCL would. The
README gives the measured effect and its command.

Every collective runs on the group's *private twin* (:func:`private_group`):
a group of the same ranks, backend and timeout that only colltune uses,
made on the first call on that group. The caller's own collectives on the
group (DDP's backward, a plain ``all_reduce``) therefore never pair with
colltune's, whichever thread issues them and whenever; an asynchronous call
may be followed by any of them before its ``wait()``. Making the twin is the
call's first exchange with its peers: when a peer does not join within the
group's timeout, the call raises :class:`~colltune.CollectiveError`, and
later calls on that group raise one at once, without trying again.

On gloo, tensors on a device (CUDA) are *staged* through host memory
(:attr:`Comm.staged`, :func:`stages`). gloo runs ``all_reduce`` on CUDA
memory itself (it copies through host memory on its own), but its TCP
transport hands the device pointer of a point-to-point message to the
kernel (``writev ... Bad address``) and the group dies; ``all_gather`` and
``all_to_all`` are staged too, so that no call depends on which of them a
gloo build runs on CUDA. A staged call copies its inputs into host buffers
(pinned when CUDA is available), runs the collective on them, and copies
what it received into the caller's device tensors (in place where the call
fills a given tensor), so it returns device tensors, as NCCL does. Traffic
is counted from the same sizes. Nothing changes for CPU tensors or NCCL:
the predicate is one attribute, set when the :class:`Comm` is made.
:func:`staging` stages CPU tensors too, so that tests run the staged path
without a GPU, and :func:`staged_calls` counts the calls that were staged.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np

from colltune.algorithms.errors import CollectiveError
from colltune.algorithms.lazy import dist, torch
from colltune.algorithms.schedule import p2p_gathers, record_by_all_reduce
from colltune.algorithms.sparse import fresh, offsets, on_host, upload

__all__ = [
    "Traffic",
    "Comm",
    "private_group",
    "group_device",
    "ranks_per_node",
    "group_serial",
    "group_timeout",
    "live_serials",
    "stages",
    "staging",
    "set_staging",
    "staged_calls",
]

@functools.cache
def _all_gather_single() -> Any:
    """torch's one-tensor all-gather: ``all_gather_single`` where torch has it (newer releases deprecate the other)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


#: Backends whose collectives :class:`Comm` runs direct (see the module docstring).
DIRECT_BACKENDS: tuple[str, ...] = ("gloo",)
#: The largest tensor, in bytes, whose ``all_reduce`` runs direct on those backends.
DIRECT_ALL_REDUCE_BYTES = 65536
#: Backends that cannot take device memory in every collective: :class:`Comm` stages device tensors through
#: host memory on them (see the module docstring).
STAGED_BACKENDS: tuple[str, ...] = ("gloo",)

#: Whether CPU tensors are staged as device tensors are (:func:`staging`, for tests); process-wide.
_staging = False
#: The collectives staged in this process, per primitive (:func:`staged_calls`).
_STAGED: dict[str, int] = {}


def _backend_for(backend: str, device_type: str) -> str:
    """Return the backend that ``backend`` (``dist.get_backend``'s answer) uses for tensors on ``device_type``.

    A plain name (``gloo``) serves every device; a per-device spec
    (``cpu:gloo,cuda:nccl``) names one backend per device type ("" when it names none).
    """
    spec = backend.lower()
    if ":" not in spec:
        return spec.strip()
    for part in spec.split(","):
        kind, _, name = part.partition(":")
        if kind.strip() == device_type:
            return name.strip()
    return ""


def stages(backend: str, device: torch.device) -> bool:
    """Whether a :class:`Comm` on a group of ``backend`` stages its tensors on ``device`` through host memory.

    True for a device other than the CPU (any device, CPU included, inside
    :func:`staging`) when the backend serving that device is one of
    :data:`STAGED_BACKENDS`; False for NCCL and for CPU tensors.

    Example:
        >>> import torch
        >>> stages("gloo", torch.device("cuda")), stages("nccl", torch.device("cuda")), stages("gloo", torch.device("cpu"))
        (True, False, False)
    """
    if device.type == "cpu" and not _staging:
        return False
    return _backend_for(str(backend), device.type) in STAGED_BACKENDS


def set_staging(enabled: bool) -> bool:
    """Stage CPU tensors on :data:`STAGED_BACKENDS` as device tensors are (``True``) or not; return the previous setting.

    Process-wide, for tests; read when a :class:`Comm` is made. Staging
    moves the same data through other buffers, so ranks that differ here
    still run the same collectives.
    """
    global _staging
    before, _staging = _staging, bool(enabled)
    return before


@contextmanager
def staging(enabled: bool = True) -> Iterator[None]:
    """Within the ``with`` block, CPU tensors on gloo take the staged path (with ``enabled=False``, they do not).

    Example:
        >>> import torch
        >>> with staging():
        ...     stages("gloo", torch.device("cpu"))
        True
    """
    before = set_staging(enabled)
    try:
        yield
    finally:
        set_staging(before)


def staged_calls() -> dict[str, int]:
    """Return how many collectives this process has staged, per primitive (a copy: ``{primitive: calls}``)."""
    return dict(_STAGED)


@functools.lru_cache(maxsize=1)
def _pinned() -> bool:
    """Whether host staging buffers are pinned: only where CUDA is available (pinning needs it)."""
    return torch.cuda.is_available()


def _host_empty(like: torch.Tensor) -> torch.Tensor:
    """Return an uninitialised contiguous host tensor with ``like``'s shape and dtype, pinned when CUDA is available."""
    if _pinned():
        try:
            return torch.empty(tuple(like.shape), dtype=like.dtype, pin_memory=True)
        except RuntimeError:  # pinned memory exhausted: pageable memory is slower, but every rank goes on
            pass
    return torch.empty(tuple(like.shape), dtype=like.dtype)


class _Staging:
    """Host copies of one staged collective's tensors, and the works that fill them.

    Made before the collective is posted: ``inputs`` hold copies of the
    tensors to send (a blocking copy, so they hold what the device tensors
    held), ``outputs`` are empty host buffers for the tensors to receive
    into. :meth:`wait` waits for ``works`` and copies each output buffer
    into its device tensor; :meth:`Comm.exchange` returns the object itself
    as the one work to wait on when staged.
    """

    __slots__ = ("inputs", "outputs", "targets", "works")

    def __init__(self, primitive: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        _STAGED[primitive] = _STAGED.get(primitive, 0) + 1
        self.inputs = [_host_empty(t).copy_(t) for t in inputs]
        self.outputs = [_host_empty(t) for t in outputs]
        self.targets = list(outputs)
        self.works: list = []

    def wait(self) -> bool:
        """Wait for the collective, then copy what it received into the device tensors; return True (as works do)."""
        for work in self.works:
            work.wait()
        for target, host in zip(self.targets, self.outputs):
            target.copy_(host)
        # Waiting twice copies nothing twice, and the host buffers go now rather than with this object.
        self.inputs, self.outputs, self.targets, self.works = [], [], [], []
        return True


@dataclass
class Traffic:
    """Bytes and messages one rank sent during one call, in total and per primitive.

    Attributes:
        bytes_sent: bytes this rank put on the wire.
        messages: point-to-point messages this rank sent.
        meta_bytes: the part of ``bytes_sent`` that was control data
            (metadata records, counts, sizes, boundaries, threshold histograms).
        by_primitive: ``{primitive: {"calls": c, "bytes": b, "messages": m}}``.
    """

    bytes_sent: int = 0
    messages: int = 0
    meta_bytes: int = 0
    by_primitive: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, primitive: str, nbytes: int, messages: int, meta: bool = False) -> None:
        """Record one call of ``primitive`` that sent ``nbytes`` in ``messages`` messages.

        ``meta`` marks control traffic (counts, sizes, thresholds, boundaries)
        as opposed to the entries themselves; it is included in ``bytes_sent``
        and also summed in ``meta_bytes``.
        """
        self.bytes_sent += nbytes
        self.messages += messages
        if meta:
            self.meta_bytes += nbytes
        slot = self.by_primitive.setdefault(primitive, {"calls": 0, "bytes": 0, "messages": 0})
        slot["calls"] += 1
        slot["bytes"] += nbytes
        slot["messages"] += messages

    def reclassify(self, nbytes: int) -> None:
        """Move ``nbytes`` already counted as control data to payload (an eager slot that carried entries)."""
        moved = min(nbytes, self.meta_bytes)
        self.meta_bytes -= moved

    def as_dict(self) -> dict[str, object]:
        """Return a JSON-ready copy."""
        return {
            "bytes_sent": self.bytes_sent,
            "messages": self.messages,
            "meta_bytes": self.meta_bytes,
            "by_primitive": {k: dict(v) for k, v in self.by_primitive.items()},
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _MetaScope:
    """The ``with`` block of :meth:`Comm.meta` (a plain class: a generator-based one costs a few us per call)."""

    __slots__ = ("comm", "prev")

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.prev = False

    def __enter__(self) -> None:
        self.prev, self.comm._meta = self.comm._meta, True

    def __exit__(self, *exc: object) -> None:
        self.comm._meta = self.prev


T = TypeVar("T")


class _NoGroup:
    """Stands for the group of calls made without a process group (world size 1)."""


_NO_GROUP = _NoGroup()

#: What the algorithms keep per process group, for as long as the group object
#: lives: ``{group: {key: state}}`` (the metadata record's eager-slot size,
#: Ok-Topk's boundaries per size). Weakly keyed, so a destroyed group's state
#: goes with it; every rank of a group changes it at the same calls.
_GROUP_STATE: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_FACTS = "comm.facts"


def group_facts(group: dist.ProcessGroup | None) -> tuple[int, int, str]:
    """Return this rank's rank in ``group`` (``-1`` outside it), its size and its backend in lower case (``None``:
    the default group). Needs an initialized default group.

    The size and backend are read from ``torch.distributed`` once per group
    object (kept as the group's state). The rank of a group passed in is
    asked every time: it is what raises torch's own error for a group
    destroyed since (a default group made anew is another object).
    """
    if group is not None:
        dist.get_rank(group)

    def read() -> tuple[int, int, str]:
        rank = dist.get_rank(group)
        return (rank, dist.get_world_size(group), str(dist.get_backend(group)).lower()) if rank >= 0 else (rank, 0, "")

    return _group_state(group if group is not None else dist.group.WORLD, _FACTS, read)  # type: ignore[return-value]


class Comm:
    """One rank's view of a process group, with traffic counting.

    Args:
        group: the process group, or ``None`` for the default group.
        device: where tensors handed to the backend live (CUDA for NCCL).
        traffic: where to count; a fresh :class:`Traffic` if omitted.
        wire: the group the collectives run on (its :func:`private_group`);
            ``group`` itself when omitted.
        direct: run ``all_gather``, ``all_to_all`` and small ``all_reduce``
            point to point with every peer at once (see the module
            docstring); ``None`` (the default) does so for tensors on the
            host path (:func:`~colltune.algorithms.sparse.on_host`) on
            :data:`DIRECT_BACKENDS` in groups of 3 ranks or more.

    Attributes:
        staged: whether the collectives other than ``all_reduce`` run on
            host copies of the tensors (:func:`stages` of the group's backend
            and ``device``; see the module docstring). Set once, here.
    """

    __slots__ = ("group", "wire", "rank", "world_size", "device", "traffic", "direct", "direct_record", "reduce_record", "staged",
                 "_meta")

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        traffic: Traffic | None = None,
        direct: bool | None = None,
        wire: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.wire = wire if wire is not None else group
        self.staged = False
        #: Whether the metadata record is gathered point to point: by backend and size alone, never by
        #: code path, so that ranks on different paths still exchange records (and raise, not hang).
        self.direct_record = False
        #: Whether the record is summed as a table instead (:func:`record_by_all_reduce`): by backend and size alone.
        self.reduce_record = False
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size, backend = group_facts(group)
            self.direct_record = self.world_size > 2 and backend in DIRECT_BACKENDS
            self.reduce_record = record_by_all_reduce(self.world_size, backend not in DIRECT_BACKENDS)
            if direct is None:
                # At P = 2 the ring is one exchange already, and the backend's own call is cheaper. Host
                # path only: gloo's point-to-point calls hand the backend raw host memory, and the device
                # path runs the collectives NCCL runs.
                direct = self.direct_record and on_host(device)
            if _staging or device.type != "cpu":  # CPU tensors never ask the backend: nothing to stage
                self.staged = stages(backend, device)
        else:
            self.rank, self.world_size = 0, 1
        self.device = device
        self.traffic = traffic if traffic is not None else Traffic()
        self.direct = bool(direct)
        self._meta = False

    @property
    def host(self) -> bool:
        """True when this view's tensors take the host path (:func:`~colltune.algorithms.sparse.on_host` of its device)."""
        return on_host(self.device)

    @property
    def p2p_gathers(self) -> bool:
        """Whether ``auto`` gathers go point to point here (:func:`~colltune.algorithms.schedule.p2p_gathers`).

        True on the host path and in a group inside one node (or whose
        layout is not known yet); False on the device path across nodes.
        The layout is the group's :func:`ranks_per_node`, the same on every
        rank, so every rank resolves the same gather.
        """
        return p2p_gathers(self.world_size, ranks_per_node(self.group), self.host)

    @property
    def group_object(self) -> Any:
        """The object that stands for this group: the group, the default group, or one for no process group."""
        if self.group is not None:
            return self.group
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else _NO_GROUP

    def group_state(self, key: str, factory: Callable[[], T] | None = None) -> T | None:
        """Return the state this group keeps under ``key``; make it with ``factory`` when missing (else ``None``).

        The one owner of per-group state: it lives as long as the group
        object. A lookup without ``factory`` changes nothing, so it may run
        where a rank with bad input skips it.
        """
        return _group_state(self.group_object, key, factory)

    def meta(self) -> _MetaScope:
        """Count the traffic of the calls inside (a ``with`` block) as control data (see :class:`Traffic`)."""
        return _MetaScope(self)

    def _count(self, primitive: str, nbytes: int, messages: int) -> None:
        self.traffic.add(primitive, nbytes, messages, self._meta)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``t`` in place across the group (``op``: ``sum`` or ``max``) and return it."""
        p = self.world_size
        if p == 1:
            return t
        if self.direct and t.is_contiguous() and _nbytes(t) <= DIRECT_ALL_REDUCE_BYTES:
            if op != "max":
                self._direct_sum(t.view(-1))
                return t
            self._count("all_reduce", (p - 1) * _nbytes(t), p - 1)
            torch.amax(self._gather_direct(t.view(1, -1)).view((p,) + tuple(t.shape)), dim=0, out=t)
            return t
        self._count("all_reduce", 2 * _nbytes(t) * (p - 1) // p, 2 * (p - 1))
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.wire)
        return t

    def all_reduce_parts(self, t: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
        """Sum the rows of ``t`` across the group in place, part by part; return ``t``.

        Part ``j`` is rows ``[bounds[j], bounds[j + 1])``, and comes out with
        the bits :meth:`all_reduce` of that part alone gives (a fused call's
        tensors keep their own calls' bits). Parts that :meth:`all_reduce`
        would sum directly, in rank order, travel together, in exchanges of
        up to four direct ``all_reduce``'s bytes (each sends ``P - 1`` times
        its bytes): rank order is the same wherever a row sits. Every other
        part has its own ``all_reduce``, whose order depends on the part's size.
        """
        p = self.world_size
        if p == 1:
            return t
        row_bytes = _nbytes(t[:1]) if t.shape[0] else 0
        parts = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo and row_bytes]
        together = [(lo, hi) for lo, hi in parts if self.direct and (hi - lo) * row_bytes <= DIRECT_ALL_REDUCE_BYTES]
        chunks: list[list[tuple[int, int]]] = [[]]
        size = 0
        for part in together:  # each exchange at most 4 direct all_reduces' worth: it sends (P-1) times its bytes
            nbytes = (part[1] - part[0]) * row_bytes
            if chunks[-1] and size + nbytes > 4 * DIRECT_ALL_REDUCE_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(part)
            size += nbytes
        done: set[tuple[int, int]] = set()
        for chunk in chunks:
            if len(chunk) > 1:
                self._sum_in_rank_order(t, chunk)
                done.update(chunk)
        for lo, hi in parts:
            if (lo, hi) not in done:
                self.all_reduce(t[lo:hi])
        return t

    def _direct_sum(self, flat: torch.Tensor) -> None:
        """Sum the contiguous 1-D ``flat`` across the group in place: gathered directly, added rank by rank.

        Every rank adds in the same order, so every rank gets the same bits,
        and an element's sum does not depend on where it sits in ``flat``.
        """
        p = self.world_size
        self._count("all_reduce", (p - 1) * _nbytes(flat), p - 1)
        rows = self._gather_direct(flat.view(1, -1)).view(p, -1)
        flat.copy_(rows[0])
        for j in range(1, p):
            flat.add_(rows[j])

    def _sum_in_rank_order(self, t: torch.Tensor, parts: list[tuple[int, int]]) -> None:
        """Sum rows ``parts`` of ``t`` across the group in one :meth:`_direct_sum` of their concatenation."""
        flat = torch.cat([t[lo:hi].reshape(-1) for lo, hi in parts])
        self._direct_sum(flat)
        at = 0
        for lo, hi in parts:
            size = (hi - lo) * t[0].numel()
            t[lo:hi].view(-1).copy_(flat[at : at + size])
            at += size

    def all_gather(self, t: torch.Tensor, *, direct: bool | None = None) -> torch.Tensor:
        """Return the concatenation along dimension 0 of ``t`` from every rank, in rank order.

        ``direct`` overrides :attr:`direct` (point to point) for this call.
        """
        p = self.world_size
        if p == 1:
            return t
        t = t.contiguous()
        self._count("all_gather", (p - 1) * _nbytes(t), p - 1)
        if self.direct if direct is None else direct:
            return self._gather_direct(t)
        out = fresh((p * t.shape[0],) + tuple(t.shape[1:]), t.dtype, t.device)
        self._collective("all_gather", lambda o, i: _all_gather_single()(o, i, group=self.wire), out, t)
        return out

    def gather_record(self, row: torch.Tensor) -> torch.Tensor:
        """Return every rank's metadata record ``row`` (1-D ``uint8``), in rank order, as a ``[P, R]`` table.

        Point to point on :data:`DIRECT_BACKENDS` past 2 ranks
        (:attr:`direct_record`); summed as a zeroed table holding this
        rank's row (:attr:`reduce_record`, exact: every byte has one nonzero
        addend); else the backend's ``all_gather``.
        """
        p = self.world_size
        if not self.reduce_record:
            return self.all_gather(row, direct=self.direct_record).view(p, row.numel())
        table = torch.zeros((p, row.numel()), dtype=row.dtype, device=row.device)
        table[self.rank] = row
        return self.all_reduce(table)

    def gather_small(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`all_gather` of a few bytes of control data (sizes, counts), gathered as the record is.

        Where the record is summed as a table (:attr:`reduce_record`: NCCL
        from :data:`~colltune.algorithms.schedule.RECORD_ALL_REDUCE_FROM`
        ranks on), so is ``t``: its bytes in this rank's row of a zeroed
        ``[P, bytes]`` table, all-reduced (exact: every byte has one nonzero
        addend), which NCCL runs as a tree instead of a ring's ``P - 1``
        steps. Elsewhere the backend's ``all_gather``. The rule depends on
        backend and world size only, so every rank takes the same one.
        """
        if not self.reduce_record:
            return self.all_gather(t)
        p, t = self.world_size, t.contiguous()
        rows = self.gather_record(t.view(-1).view(torch.uint8))
        return rows.view(t.dtype).view((p * t.shape[0],) + tuple(t.shape[1:]))

    def _gather_direct(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather contiguous ``t`` point to point, every peer at once (not counted)."""
        p, me = self.world_size, self.rank
        out = fresh((p * t.shape[0],) + tuple(t.shape[1:]), t.dtype, t.device)
        parts = out.view((p,) + tuple(t.shape))
        parts[me] = t
        if t.numel():
            peers = [j for j in range(p) if j != me]
            self._post([(t, j) for j in peers], [(parts[j], j) for j in peers])
        return out

    def _post(self, sends: Sequence[tuple], recvs: Sequence[tuple]) -> None:
        """:meth:`exchange` and wait, not counted (the collective that called it counts itself)."""
        for work in self.exchange(sends, recvs, count=False):
            work.wait()

    def all_to_all(self, t: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        """Send ``send_counts[j]`` rows of ``t`` to rank ``j``; return the rows received, in rank order."""
        p = self.world_size
        out = fresh((int(sum(recv_counts)),) + tuple(t.shape[1:]), t.dtype, t.device)
        if p == 1:
            out.copy_(t)
            return out
        row = _nbytes(t[:1]) if t.shape[0] else t.element_size() * int(torch.Size(t.shape[1:]).numel())
        others = [c for j, c in enumerate(send_counts) if j != self.rank]
        self._count("all_to_all", row * int(sum(others)), sum(1 for c in others if c))
        if self.direct:
            t = t.contiguous()
            so, ro = offsets(send_counts), offsets(recv_counts)
            me = self.rank
            out[ro[me] : ro[me + 1]] = t[so[me] : so[me + 1]]
            peers = [j for j in range(p) if j != me]
            self._post([(t[so[j] : so[j + 1]], j) for j in peers], [(out[ro[j] : ro[j + 1]], j) for j in peers])
            return out
        splits = [int(c) for c in recv_counts], [int(c) for c in send_counts]
        self._collective("all_to_all", lambda o, i: dist.all_to_all_single(o, i, *splits, group=self.wire),
                         out, t.contiguous())
        return out

    def _collective(self, primitive: str, run: Callable[[torch.Tensor, torch.Tensor], Any], out: torch.Tensor,
                    t: torch.Tensor) -> None:
        """Run ``run(out, t)`` on the backend; when :attr:`staged`, on host copies, ``out`` filled from them."""
        if not self.staged:
            run(out, t)
            return
        stage = _Staging(primitive, [t], [out])
        run(stage.outputs[0], stage.inputs[0])
        stage.wait()

    def exchange(self, sends: Sequence[tuple], recvs: Sequence[tuple], count: bool = True) -> list:
        """Post point-to-point sends and receives together; return the works to wait on.

        Each message is ``(tensor, peer)`` or ``(tensor, peer, tag)``; peers
        are ranks of this group. Two messages between the same pair of ranks
        in one call need different tags (the tag pairs a send with its
        receive; NCCL matches in posting order and ignores it). Empty tensors
        are skipped on both sides, so both sides must agree on which messages
        are empty. Receive buffers must be contiguous (a slice along the first
        dimension of a contiguous tensor is): data lands in them in place.
        ``count=False`` leaves the sends out of the traffic (for a collective
        built on this call that counts itself). When :attr:`staged`, the
        messages travel from and into host copies, and the one work returned
        copies the received data into ``recvs``' tensors when waited on.
        """
        if self.staged:
            return self._staged_exchange(sends, recvs, count)
        return self._p2p(sends, recvs, count)

    def _p2p(self, sends: Sequence[tuple], recvs: Sequence[tuple], count: bool) -> list:
        """Post :meth:`exchange`'s messages on the backend, from and into the tensors given."""
        ops = []
        for t, peer, *tag in sends:
            if t.numel():
                if count:
                    self._count("send", _nbytes(t), 1)
                ops.append(dist.P2POp(dist.isend, t.contiguous(), self._global(peer), self.wire, *tag))
        for t, peer, *tag in recvs:
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, self._global(peer), self.wire, *tag))
        if not ops:
            return []
        return dist.batch_isend_irecv(ops)

    def _staged_exchange(self, sends: Sequence[tuple], recvs: Sequence[tuple], count: bool) -> list:
        """:meth:`exchange` through host copies (:class:`_Staging`): one work, whose ``wait()`` lands the receives."""
        sends = [m for m in sends if m[0].numel()]
        recvs = [m for m in recvs if m[0].numel()]
        if not sends and not recvs:
            return []
        stage = _Staging("exchange", [m[0] for m in sends], [m[0] for m in recvs])
        host_sends = [(h, *m[1:]) for h, m in zip(stage.inputs, sends)]
        host_recvs = [(h, *m[1:]) for h, m in zip(stage.outputs, recvs)]
        stage.works = self._p2p(host_sends, host_recvs, count)
        return [stage]

    def rotated_exchange(
        self,
        peers_in_flight: int,
        send_for: Callable[[int], Sequence[tuple[torch.Tensor, int]]],
        recv_for: Callable[[int], Sequence[tuple[torch.Tensor, int]]],
    ) -> None:
        """Exchange with every other rank in rotated order, ``peers_in_flight`` steps posted at once.

        At step ``i`` (``1 .. P-1``) this rank sends ``send_for(dst)`` to
        ``dst = (rank + i) % P`` and receives ``recv_for(src)`` from
        ``src = (rank - i) % P``; both return ``(tensor, tag)`` messages. So
        no rank receives from many at once, and each batch is waited on
        before the next is posted.
        """
        p, me = self.world_size, self.rank
        steps = list(range(1, p))
        for start in range(0, len(steps), peers_in_flight):
            sends, recvs = [], []
            for i in steps[start : start + peers_in_flight]:
                dst, src = (me + i) % p, (me - i) % p
                sends += [(t, dst, tag) for t, tag in send_for(dst)]
                recvs += [(t, src, tag) for t, tag in recv_for(src)]
            for work in self.exchange(sends, recvs):
                work.wait()

    def all_gather_rows(
        self, outs: Sequence[torch.Tensor], at: Sequence[int], peers_in_flight: int, first: Sequence[int] | None = None
    ) -> None:
        """Fill every tensor of ``outs`` in place with every rank's rows, point to point, no packing.

        Rank ``j``'s rows are ``[at[j], at[j+1])`` of each tensor of ``outs``
        (contiguous, the same ``at`` on every rank). This rank's rows must be
        in place before the call, and so must the first ``first[j]`` rows of
        rank ``j`` (rows that already arrived another way); the rest come
        from their owner, one message per tensor (tag = its position in
        ``outs``), in :meth:`rotated_exchange`'s order.
        """
        me = self.rank
        skip = list(first) if first is not None else [0] * self.world_size

        def rows(j: int) -> list[tuple[torch.Tensor, int]]:
            return [(out[at[j] + skip[j] : at[j + 1]], tag) for tag, out in enumerate(outs)]

        self.rotated_exchange(peers_in_flight, lambda dst: rows(me), rows)

    def all_gather_v(self, t: torch.Tensor, counts: Sequence[int], mode: str = "auto") -> list[torch.Tensor]:
        """Gather a different number of rows from every rank; return one tensor per rank, in rank order.

        Args:
            t: this rank's rows; ``t.shape[0]`` must equal ``counts[rank]``.
            counts: the row count of every rank (known to all ranks).
            mode: ``pad`` (pad to the largest count, one ``all_gather``),
                ``alltoall`` (``all_to_all_single`` with splits, no padding on
                the wire) or ``auto`` (``pad`` unless padding would add more
                than a quarter to the bytes moved).
        """
        p = self.world_size
        if p == 1:
            return [t]
        kmax = max(counts)
        tail = tuple(t.shape[1:])
        if kmax == 0:
            return [t.new_empty((0,) + tail) for _ in range(p)]
        if mode == "auto":
            mode = "pad" if kmax * p * 4 <= 5 * sum(counts) else "alltoall"
        if mode == "pad":
            padded = t.new_zeros((kmax,) + tail)
            padded[: t.shape[0]] = t
            out = self.all_gather(padded).view((p, kmax) + tail)
            return [out[j, : counts[j]] for j in range(p)]
        out = self.all_to_all(t.repeat((p,) + (1,) * len(tail)), [t.shape[0]] * p, list(counts))
        return list(torch.split(out, [int(c) for c in counts]))

    def all_gather_flat(self, t: torch.Tensor, counts: Sequence[int], mode: str = "auto") -> torch.Tensor:
        """Gather a different number of rows from every rank; return them concatenated in rank order.

        The same exchange as :meth:`all_gather_v` (same ``mode`` rule, same
        traffic), but one tensor out, made in one operation whatever the
        world size, instead of one view per rank.
        """
        p = self.world_size
        if p == 1:
            return t
        kmax = max(counts)
        tail = tuple(t.shape[1:])
        if kmax == 0:
            return t.new_empty((0,) + tail)
        if mode == "auto":
            mode = "pad" if kmax * p * 4 <= 5 * sum(counts) else "alltoall"
        if mode != "pad":
            return self.all_to_all(t.repeat((p,) + (1,) * len(tail)), [t.shape[0]] * p, list(counts))
        padded = t.new_zeros((kmax,) + tail)
        padded[: t.shape[0]] = t
        out = self.all_gather(padded).view((p, kmax) + tail)
        if min(counts) == kmax:
            return out.view((p * kmax,) + tail)
        # The rows each rank filled, by position (a mask would make the host wait for its count).
        at = np.concatenate([np.arange(c, dtype=np.int64) + j * kmax for j, c in enumerate(counts)])
        return out.view((p * kmax,) + tail).index_select(0, upload(at, t.device))

    def _global(self, peer: int) -> int:
        if self.wire is None or self.wire is dist.group.WORLD:
            return peer
        return dist.get_global_rank(self.wire, peer)


_TWIN_LOCK = threading.Lock()


def _group_state(group: Any, key: str, factory: Callable[[], T] | None = None) -> T | None:
    """Return what ``group`` keeps under ``key``, made by ``factory`` when missing (see :meth:`Comm.group_state`)."""
    states = _GROUP_STATE.get(group)
    if states is None:
        if factory is None:
            return None
        states = _GROUP_STATE[group] = {}
    if key not in states:
        if factory is None:
            return None
        states[key] = factory()
    return states[key]


def group_timeout(group: Any) -> Any:
    """Return ``group``'s timeout (a ``timedelta``) when its backend tells, else ``None`` (the backend default)."""
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for the device, or a torch without these (private) names
            continue
    return None


def _make_twin(group: Any) -> dist.ProcessGroup:
    """Create a group of ``group``'s ranks, in the same order, with its backend and timeout."""
    parent = group if group is not None else dist.group.WORLD
    kwargs: dict[str, Any] = {"backend": dist.get_backend(parent), "timeout": group_timeout(parent)}
    if parent is dist.group.WORLD:
        # Every rank of the job makes calls on the default group, so every rank enters (torch's requirement).
        return dist.new_group(**kwargs)
    ranks = dist.get_process_group_ranks(parent)
    if ranks != sorted(ranks):
        kwargs["sort_ranks"] = False  # group rank r must be the same process in both groups
    # Only the group's members call colltune on it: they alone take part in making its twin. torch names
    # such a group from the count of groups this process belongs to, which differs between ranks of
    # different memberships; the twin is named from its parent's name instead, which its members share.
    c10d = dist.distributed_c10d
    naming = getattr(c10d, "_process_group_name", None)
    with _TWIN_LOCK:
        if naming is not None:
            c10d._process_group_name = lambda *_a, **_k: f"{parent.group_name}:colltune"
        try:
            return dist.new_group(ranks, use_local_synchronization=True, **kwargs)
        finally:
            if naming is not None:
                c10d._process_group_name = naming


#: Per-group state keys of the private twin, of the group's ranks per node, and of a failed set-up of the twin.
_TWIN, _RANKS_PER_NODE, _TWIN_FAILED = "comm.private_group", "comm.ranks_per_node", "comm.private_group.failed"


def private_group(group: dist.ProcessGroup | None,
                  before_setup: Callable[[], None] | None = None) -> dist.ProcessGroup | None:
    """Return the private twin of ``group`` (``None``: the default group) that colltune's collectives run on.

    Made on the first call on the group, on the calling thread, so that
    every rank makes it at the same point of its sequence of calls on the
    group (as every collective must); kept for as long as ``group`` lives.
    Right after it is made, one 8-byte host id per rank is gathered on it,
    once, for :func:`ranks_per_node`. ``None`` without a process group, for
    a single rank, or on a rank outside ``group`` (which raises before any
    collective). Later calls cost one dictionary lookup.

    Making the twin is a rendezvous of every rank of ``group``, bounded by
    the group's timeout. When it fails (a peer never made its first
    colltune call on the group, or died), the failure is remembered for
    the group, and every later call on it raises at once, naming the
    earlier failure, instead of waiting the whole timeout again. colltune
    does not try again, for the reason NCCL asks for a communicator whose
    initialisation failed to be aborted and made anew by every rank: the
    rank that gave up can no longer meet its peers' half of the set-up
    (they may be in it now, join later, or never come; the default group's
    twin is also named from a count of groups that has moved on this rank
    only). The group's own collectives are not affected. A group made
    again (``dist.new_group``, or ``dist.init_process_group`` for the
    default group) is a new group and gets a fresh set-up. The error is
    raised by the call itself, ``async_op=True`` included (as PyTorch
    raises NCCL's set-up errors), not by ``wait()``.
    ``before_setup``, when given, runs first whenever the twin is to be
    made: the caller's chance to let collectives it queued on other twins
    go first.

    Raises:
        CollectiveError: the set-up failed in the backend now (``__cause__``
            is the backend's error), or failed on an earlier call on this
            group. The message names the group, its timeout and what the
            backend said. Any other error of the set-up is raised as it
            came, and remembered in the same way.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    parent = group if group is not None else dist.group.WORLD
    states = _GROUP_STATE.get(parent)
    if states is not None:
        if _TWIN in states:
            return states[_TWIN]
        if _TWIN_FAILED in states:
            raise _failed_before(parent, *states[_TWIN_FAILED])
    if dist.get_rank(parent) < 0:
        return None
    twin = None
    if dist.get_world_size(parent) > 1:
        if before_setup is not None:
            before_setup()
        try:
            twin = _make_twin(parent)
            weakref.finalize(parent, _destroy, twin)  # a destroyed group takes its twin along
            _group_state(parent, _RANKS_PER_NODE, lambda: _gather_layout(twin))
        except Exception as exc:
            err = _setup_error(parent, exc) if isinstance(exc, RuntimeError) else None
            # Text only: the exception's frames hold the group, which this weakly keyed record must not keep alive.
            failure = (f"{type(err or exc).__name__}: {_said(exc)}", time.monotonic())
            _group_state(parent, _TWIN_FAILED, lambda: failure)
            if err is None:
                raise
            raise err from exc
    _group_state(parent, _TWIN, lambda: twin)
    return twin


def _said(exc: BaseException) -> str:
    """Return the first sentence of what ``exc`` says, without gloo's source location, at most 300 characters."""
    lines = str(exc).strip().splitlines()
    said = lines[0] if lines else type(exc).__name__
    if said.startswith("[") and "] " in said:
        said = said.split("] ", 1)[1]
    return said.split(". ", 1)[0].rstrip(".")[:300]


def _group_words(group: Any) -> str:
    """Name ``group`` for an error message: which group, and its (global) ranks."""
    which = "the default process group" if group is dist.group.WORLD else f"process group {group.group_name!r}"
    ranks = [str(r) for r in dist.get_process_group_ranks(group)]
    shown = ", ".join(ranks if len(ranks) <= 8 else [*ranks[:6], "...", ranks[-1]])
    return f"{which} (ranks {shown})"


def _timeout_words(group: Any) -> str:
    timeout = group_timeout(group)
    return "the backend's default" if timeout is None else f"{timeout.total_seconds():g} s"


def _setup_error(group: Any, exc: BaseException) -> CollectiveError:
    """Return the error of a twin's set-up that failed in the backend with ``exc``."""
    return CollectiveError(
        f"colltune could not set up its private copy of {_group_words(group)} on rank {dist.get_rank()} at its "
        f"first colltune call on this group: a peer rank did not join within the group's timeout "
        f"({_timeout_words(group)}), or died. The backend said: {_said(exc)}. Every rank of the group must make "
        "the same colltune calls on it, in the same order: look for a rank that has not called colltune on this "
        "group, or for the first error in the other ranks' logs. colltune cannot use this group any more (later "
        "calls on it raise at once): re-create the group or restart the job. To give slow peers longer, pass "
        "timeout=datetime.timedelta(seconds=...) where the group is made (dist.init_process_group, dist.new_group)."
    )


def _failed_before(group: Any, earlier: str, at: float) -> CollectiveError:
    """Return the error of a call on ``group`` after its twin's set-up failed (``earlier``, at ``time.monotonic()`` ``at``)."""
    return CollectiveError(
        f"colltune cannot use {_group_words(group)}: setting up its private copy of the group failed on an earlier "
        f"call on rank {dist.get_rank()}, {time.monotonic() - at:.1f} s ago ({earlier}). This call raises at once "
        f"instead of waiting the group's timeout ({_timeout_words(group)}) again: a rank that gave up the set-up "
        "cannot meet its peers' any more, so colltune does not try again. Re-create the group "
        "(dist.new_group; dist.init_process_group for the default group) or restart the job."
    )


def _gather_layout(twin: dist.ProcessGroup) -> int:
    """Return the largest count of the group's ranks sharing a host (host names hashed and gathered on ``twin``)."""
    digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest()
    device = group_device(twin)
    mine = upload([int.from_bytes(digest, "big", signed=True)], device)
    hosts = torch.empty(dist.get_world_size(twin), dtype=torch.int64, device=device)
    _all_gather_single()(hosts, mine, group=twin)
    ids = hosts.tolist()
    return max(ids.count(h) for h in set(ids))


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s collectives take tensors: on NCCL the GPU the group is bound to, else the CPU.

    The bound GPU is the ``device_id`` given to ``init_process_group`` (a
    group made later, such as colltune's twin, takes the default group's),
    else the current CUDA device: a rank that bound its GPU but never called
    ``torch.cuda.set_device`` would otherwise gather on GPU 0 with its peers.
    """
    if dist.is_available() and dist.is_initialized() and str(dist.get_backend(group)).lower() == "nccl":
        for pg in (group, dist.group.WORLD):
            bound = getattr(pg, "bound_device_id", None)
            if bound is not None:
                return bound
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ranks_per_node(group: dist.ProcessGroup | None) -> int | None:
    """Return how many of ``group``'s ranks share a node (``P`` for a group inside one), or ``None`` before its first call."""
    parent = group if group is not None else (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
    return None if parent is None else _group_state(parent, _RANKS_PER_NODE)


def _destroy(group: dist.ProcessGroup) -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - already gone with the default group, or torch shutting down
        pass


_SERIALS = itertools.count(1)


def live_serials() -> set[int]:
    """Return the :func:`group_serial` of every group that still lives in this process (0, no group, included)."""
    return {0, *(states["comm.serial"] for states in list(_GROUP_STATE.values()) if "comm.serial" in states)}


def group_serial(group: Any) -> int:
    """Return a number that stands for ``group`` in this process while it lives, and is never reused (0 for ``None``).

    Caches keyed by it cannot meet a later group that happens to reuse a
    destroyed group's memory (and so its ``id()``), which differs between
    ranks, since each collects garbage at its own pace.
    """
    return 0 if group is None else _group_state(group, "comm.serial", lambda: next(_SERIALS))  # type: ignore[return-value]
