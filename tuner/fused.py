"""The fused front door: ``sparse_allreduce_many``, many sparse tensors in one call.

A step of a recommendation model holds one sparse gradient per embedding
table: DLRM on Criteo has 26. Reduced one call at a time, each pays its own
metadata exchange, its own decision and its own collectives, and on small
tables those fixed costs are most of the time. The fused call

1. validates every tensor and coalesces it, as ``sparse_allreduce`` does;
2. exchanges one metadata record per rank for the whole list: the list's
   length and a digest of every tensor's size, row shape and dtype (ranks
   that disagree all raise, naming the first tensor that differs), the op,
   the algorithm, the policy and the bucket capacity; every rank's entry
   count per tensor rides in the record's slot (a gather of its own only
   when ``8 T`` bytes exceed the largest slot the group allows), then, for
   each index space (below), the payload of the algorithm likeliest to
   reduce it, as a single call's record carries it (Ok-Topk's counts per
   region, hashpart's per owner);
3. groups the tensors into buckets, in list order, from data every rank
   holds: tensors of one row width and dtype share a bucket until its
   largest rank's entries would exceed ``bucket_cap_mb``, or its index
   space int64 (sizes summed past ``2^63 - 1``);
4. reduces each bucket as one sparse tensor whose index space is its
   tensors' index spaces laid end to end, with the algorithm chosen for the
   bucket's own features (size, density, counts, overlap);
5. cuts each bucket's result back into one result per tensor.

Each tensor's result is bit for bit what its own ``sparse_allreduce``
returns with the algorithm its bucket ran: allgather and Ok-Topk sum each
index in rank order, whatever else travels with it, and dense gives each
tensor the ``all_reduce`` its own call would run. Under ``auto`` a bucket
may choose another algorithm than a tensor alone would; then the result is
the same sum up to rounding (dense adds in the backend's order), still
identical on every rank.

Example:
    >>> import torch, colltune
    >>> a = (torch.tensor([3, 1, 3]), torch.ones(3), 8)
    >>> b = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 4), (5, 4), check_invariants=True)
    >>> ra, rb = colltune.sparse_allreduce_many([a, b])
    >>> ra.indices.tolist(), ra.values.tolist(), rb.indices.tolist()
    ([1, 3], [1.0, 2.0], [0, 2])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from colltune.algorithms import get as get_algorithm
from colltune.algorithms import meta as _meta
from colltune.algorithms.base import Algorithm, Prepared, SparseInput, SparseResult
from colltune.algorithms.comm import Comm, ranks_per_node
from colltune.algorithms.errors import ColltuneError, ColltuneTypeError, ColltuneValueError, RankMismatchError
from colltune.algorithms.sizes import payload_reserve, slot_limit
from colltune.algorithms.sparse import (
    Batch,
    Parts,
    accum_dtype,
    cast,
    offsets,
    on_host,
    shares_storage,
    upload,
)
from colltune.api import (
    MAX_SIZE,
    AsyncHandle,
    CallerCheck,
    argument_error,
    canonical_op,
    check_dense_fits,
    check_op_and_algorithm,
    check_sparse_tensor,
    coalesce_checked,
    decided_knobs,
    deferred_fields,
    first_range_error,
    group_backend,
    group_key,
    input_error,
    is_sparse_coo,
    open_comm,
    outside_compile,
    resolve_request,
    run_sparse,
    submit_call,
    unpack_coo,
)
from colltune.select import online

__all__ = ["sparse_allreduce_many", "submit_many", "DEFAULT_BUCKET_CAP_MB", "plan_buckets", "index_spaces"]

#: The default bucket capacity, in MiB of one rank's entries (indices and rows), as DDP's ``bucket_cap_mb``.
DEFAULT_BUCKET_CAP_MB = 25.0

_KIND_FUSED = "fused"
_meta.name_code(_KIND_FUSED)
#: ``eager`` of a fused record: whether the slot carries the entry counts.
_COUNTS_NONE, _COUNTS_IN_SLOT = 0, 1
_SAME_LIST = "pass the same list of tensors, in the same order, on every rank"
#: What the shared fields of a fused record mean, for the error that names a disagreement.
_LABELS = {
    "size": ("the number of tensors", _SAME_LIST),
    "row_shape": ("the tensors' sizes, row shapes and dtypes", _SAME_LIST),
    "row_numel": ("bucket_cap_mb (in bytes)", "pass the same bucket_cap_mb on every rank"),
}


@outside_compile
def sparse_allreduce_many(
    tensors: Sequence[Any],
    op: str | dist.ReduceOp = "sum",
    group: dist.ProcessGroup | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
    *,
    knobs: dict[str, Any] | None = None,
    name: str | None = None,
    policy: Any = None,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> list[SparseResult] | AsyncHandle:
    """Sum many sparse tensors over the ranks of ``group`` in one call; one result per tensor.

    Args:
        tensors: a list; each item a sparse COO tensor with sparse rows
            (``nn.Embedding(sparse=True)``'s gradient) or a tuple
            ``(indices, values, size)`` as :func:`colltune.sparse_allreduce`
            takes them. Sizes, row shapes and dtypes may differ between
            items; the list must be the same on every rank (entries differ).
        op: ``sum`` or ``avg``, or ``dist.ReduceOp.SUM`` / ``AVG``.
        group: the process group; ``None`` for the default group.
        algorithm: ``auto`` (chosen per bucket), ``dense``, ``allgather`` or ``oktopk``.
        async_op: return an :class:`~colltune.AsyncHandle` whose ``wait()`` returns the list.
        knobs: as :func:`colltune.sparse_allreduce`, applied to every bucket.
        name: the call's name: policy rules match it, and each bucket's
            decisions are cached under it. The same on every rank.
        policy: as :func:`colltune.sparse_allreduce`.
        bucket_cap_mb: the most MiB of one rank's entries (indices and rows)
            a bucket holds before the next tensor opens a new one; a tensor
            larger than that is a bucket of its own. The same on every rank.

    Returns:
        One :class:`~colltune.SparseResult` per tensor, in order, each bit
        for bit what ``sparse_allreduce`` of that tensor alone returns with
        the same algorithm (see the module docstring for ``auto``). Its
        ``algorithm`` and ``decision`` are its bucket's; its ``traffic`` is
        the whole call's.

    Raises:
        As :func:`colltune.sparse_allreduce`. A tensor's own error names it
        (``tensors[3]: ...``); ranks whose lists differ raise
        :class:`~colltune.RankMismatchError` naming the first tensor that differs.

    Example:
        >>> grads = [emb.weight.grad for emb in tables]  # doctest: +SKIP
        >>> for emb, res in zip(tables, colltune.sparse_allreduce_many(grads, op="avg")):  # doctest: +SKIP
        ...     emb.weight.grad = res.to_sparse_coo()
    """
    return submit_many(tensors, op, group, algorithm, async_op, knobs=knobs, name=name, policy=policy,
                       bucket_cap_mb=bucket_cap_mb)


def submit_many(
    tensors: Sequence[Any],
    op: Any,
    group: dist.ProcessGroup | None,
    algorithm: str,
    async_op: bool,
    *,
    knobs: dict[str, Any] | None,
    name: str | None,
    policy: Any,
    bucket_cap_mb: float,
    check: CallerCheck | None = None,
) -> list[SparseResult] | AsyncHandle:
    """:func:`sparse_allreduce_many` with a training wrapper's :class:`~colltune.api.CallerCheck` in its record.

    With ``check.error`` set, this rank's tensors are not looked at: the
    call carries the error to the other ranks and raises it.
    """
    op = canonical_op(op)
    return submit_call(
        lambda wire: _fused(tensors, op, group, algorithm, knobs, name, policy, bucket_cap_mb, wire, check),
        async_op, group, getattr(_first_tensor(tensors), "device", None), tensors,
    )


def _fused(tensors: Any, op: Any, group: Any, algorithm: Any, knobs: Any, name: Any, policy: Any,
           cap_mb: Any, wire: Any, check: CallerCheck | None = None) -> list[SparseResult]:
    """Run one fused call on this rank: prepare, exchange, plan the buckets, reduce each, cut the results."""
    comm = open_comm(group, _first_tensor(tensors), wire)
    call = _FusedCall(comm)
    error: Exception | None = None
    if check is not None:
        call.record.update(check.fields())
        error = check.error
    if error is None:
        try:
            call.prepare(tensors, op, group, algorithm, knobs, name, policy, cap_mb)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of any failure before the exchange
            error = exc
    if error is not None:
        error, call.slot = input_error(error), None
    call.timer = online.start(comm, call.sel)
    counts = call.exchange(error)
    if call.timer is not None:
        call.timer.mark()  # the exchange, which every bucket's measurement includes (its prediction does)
    results: list[SparseResult | None] = [None] * len(call.desc)
    for members in plan_buckets(call.spaces, call.entry_bytes * counts, call.cap):
        for t, res in zip(members, call.run_bucket(members, counts, algorithm, op, name)):
            results[t] = res
    if call.measured is not None:  # the record carries one figure: the bucket predicted to take longest
        online.hold(comm, *call.measured[1:])
    return results  # type: ignore[return-value]


def _first_tensor(tensors: Any) -> Any:
    """Return a tensor of the list that tells the call's device (``None`` when there is none)."""
    if isinstance(tensors, (list, tuple)) and tensors:
        item = tensors[0]
        if isinstance(item, (list, tuple)) and len(item) >= 2:
            return item[1]
        return item
    return None


def plan_buckets(keys: Sequence[Any], nbytes: np.ndarray, cap: int) -> list[list[int]]:
    """Group tensors into buckets; every rank gets the same buckets from the same arguments.

    Args:
        keys: per tensor, what tensors of one bucket share (row width, dtype and
            index space: :func:`index_spaces`).
        nbytes: ``[P, T]``: the bytes of every rank's entries of every tensor.
        cap: the most bytes of one rank's entries a bucket holds.

    Returns:
        The buckets, each a list of tensor positions in list order, ordered
        by their first tensor. A tensor joins the open bucket of its key
        while that bucket's largest rank stays within ``cap``; a bucket with
        no tensor yet takes any tensor, however large.
    """
    by_key: dict[Any, list[int]] = {}
    for t, key in enumerate(keys):
        by_key.setdefault(key, []).append(t)
    # Every key's tensors within the cap together (the usual case): one bucket per key, no pass per tensor.
    if all(float(nbytes[:, members].sum(axis=1).max()) <= cap for members in by_key.values()):
        return list(by_key.values())  # in order of their first tensor, as dicts keep insertion order
    open_: dict[Any, tuple[list[int], np.ndarray]] = {}
    done: list[list[int]] = []
    for t, key in enumerate(keys):
        col = nbytes[:, t]
        got = open_.get(key)
        if got is not None and float((got[1] + col).max()) > cap:
            done.append(got[0])
            got = None
        if got is None:
            open_[key] = ([t], col.astype(np.float64))
        else:
            got[0].append(t)
            got[1][:] += col
    done += [members for members, _ in open_.values()]
    return sorted(done, key=lambda members: members[0])


def index_spaces(keys: Sequence[tuple[int, torch.dtype]], sizes: Sequence[int]) -> list[tuple[int, torch.dtype, int]]:
    """Return per tensor its key and the number of the index space it is laid in, so that no space passes int64.

    Tensors of one key are laid end to end, in list order, in one space
    until the next would take its summed sizes past ``2^63 - 1``; it opens
    the key's next space. Every rank gets the same spaces from the same list.
    """
    used: dict[tuple[int, torch.dtype], tuple[int, int]] = {}  # per key: its open space and the rows there
    out: list[tuple[int, torch.dtype, int]] = []
    for key, n in zip(keys, sizes):
        space, rows = used.get(key, (0, 0))
        if rows and rows + n > MAX_SIZE:
            space, rows = space + 1, 0
        used[key] = (space, rows + n)
        out.append((*key, space))
    return out


def _check_cap(cap_mb: Any) -> int:
    """Return ``bucket_cap_mb`` in bytes, or raise naming it."""
    ok = isinstance(cap_mb, (int, float)) and not isinstance(cap_mb, bool)
    if not ok or not math.isfinite(cap_mb) or cap_mb <= 0:
        raise argument_error(ColltuneValueError if ok else ColltuneTypeError, "bucket_cap_mb",
                             f"bucket_cap_mb must be a positive number of MiB (the default is {DEFAULT_BUCKET_CAP_MB:g}), "
                             f"but got {cap_mb!r:.60}.")
    return max(1, int(cap_mb * 2**20))


def _item(tensors: Sequence[Any], i: int) -> tuple[Any, Any, Any]:
    """Return item ``i`` of the list as ``(indices, values, size)``, checked as ``sparse_allreduce`` checks them."""
    item = tensors[i]
    if isinstance(item, (list, tuple)) and len(item) == 3:
        return unpack_coo(*item)
    if is_sparse_coo(item):
        return unpack_coo(item, None, None)
    raise argument_error(ColltuneTypeError, "tensors",
                         f"each item must be a sparse COO tensor or a tuple (indices, values, size), but got "
                         f"{type(item).__name__}{f' of length {len(item)}' if isinstance(item, (list, tuple)) else ''}.")


def _named(exc: Exception, i: int) -> Exception:
    """Return ``exc`` as an error about ``tensors[i]`` (its own message after the position)."""
    if isinstance(exc, ColltuneError) and exc.argument in ("indices", "values", "size", "tensors", None):
        out = type(exc)(f"tensors[{i}]: {exc}", argument="tensors")
        out.__cause__ = exc
        return out
    return exc


class _FusedCall:
    """One rank's side of a fused call: every tensor coalesced, the record, then the buckets."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        #: Each tensor's coalesced indices and rows, on the host path; on the device path each tensor is a span
        #: of its batch's union (:attr:`batched`), where :meth:`run_bucket` takes its buckets from.
        self.idx: list[torch.Tensor] = []
        self.vals: list[torch.Tensor] = []
        #: Per tensor, whether its coalesced values and indices are the call's own (share no memory with the
        #: caller's): a bucket of that tensor alone may then be reduced into them (``SparseInput.owned``).
        self.own: list[tuple[bool, bool]] = []
        self.desc: list[tuple[int, tuple[int, ...], torch.dtype]] = []
        self.keys: list[tuple[int, torch.dtype]] = []
        #: Per tensor, its key and the number of its index space: tensors of one space may share a batch and a
        #: bucket, laid end to end in int64 indices (:func:`index_spaces`).
        self.spaces: list[tuple[int, torch.dtype, int]] = []
        self.entry_bytes = np.zeros(0)
        self.counts = np.zeros(0, dtype=np.int64)
        self.cap = 1
        self.record: dict[str, int] = {"kind": _meta.name_code(_KIND_FUSED)}
        self.slot: np.ndarray | torch.Tensor | None = None
        #: Per space likely to run as one bucket (its tensors' positions): the algorithm whose payload rides in
        #: the record for it, where it lies in the slot, and that algorithm's own work (:meth:`bucket_payloads`).
        self.payloads: dict[tuple[int, ...], tuple[str, int, int, Any]] = {}
        self.slots: np.ndarray | None = None
        #: On the host path, a space's coalesced indices laid end to end for its payload, kept for its bucket.
        self.joined: dict[tuple[int, ...], torch.Tensor] = {}
        self.knobs: Any = None
        self.sel: Any = None
        self.backend: str | None = None
        self.group: Any = None
        self.name: str | None = None
        #: On the device path, per tensor: its coalesce batch and its place there.
        self.batched: dict[int, tuple[Batch, int]] = {}
        #: A deferred coalesce (device path, P > 1): the batches, finished once the record tells the counts.
        self.pending: list[tuple[list[int], Batch]] | None = None
        self.device_fields: dict[str, torch.Tensor] | None = None
        self.deferred_error: Any = None
        #: Online correction: the call's timer (its exchange), and the bucket to report: (predicted, timer, ...).
        self.timer: Any = None
        self.measured: tuple | None = None

    def prepare(self, tensors: Any, op: Any, group: Any, algorithm: Any, knobs: Any, name: Any, policy: Any,
                cap_mb: Any) -> None:
        """Validate and coalesce every tensor, resolve the algorithm, fill the record and the counts."""
        if not isinstance(tensors, (list, tuple)):
            raise argument_error(ColltuneTypeError, "tensors",
                                 f"tensors must be a list of sparse COO tensors or (indices, values, size) tuples, but got "
                                 f"{type(tensors).__name__}; for one tensor call colltune.sparse_allreduce.")
        check_op_and_algorithm(op, algorithm)  # also for an empty list
        backend = group_backend(group)  # a bad group is the group's error, not the first tensor's
        cap, self.group, self.name = _check_cap(cap_mb), group, name
        checked: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for i in range(len(tensors)):
            try:
                idx, vals, n, row_shape = check_sparse_tensor(*_item(tensors, i), group, backend)
            except Exception as exc:  # noqa: BLE001 - re-raised naming the tensor
                raise _named(exc, i)
            if vals.device != self.comm.device:
                raise argument_error(ColltuneValueError, "tensors",
                                     f"tensors[{i}] is on {vals.device}, but the call runs on {self.comm.device} (where "
                                     "tensors[0] is); a fused call's tensors share one device: move them there, or reduce "
                                     "the tensors of each device in a call of their own.")
            self.desc.append((n, row_shape, vals.dtype))
            self.keys.append((vals.shape[1], vals.dtype))
            checked.append((idx, vals, n))
        self.spaces = index_spaces(self.keys, [n for n, _, _ in self.desc])
        self.coalesce(checked)
        self.knobs, self.sel, self.backend, code = resolve_request(algorithm, knobs, policy, group, name)
        if algorithm == "dense":  # the largest bucket it may build: every tensor of one row width and dtype
            rows: dict[tuple[int, torch.dtype, int], int] = {}
            for (n, _, _), space in zip(self.desc, self.spaces):
                rows[space] = rows.get(space, 0) + n
            for (r, dtype, _), n in rows.items():
                check_dense_fits(n, r, dtype, self.comm.device)
        self.cap, self.entry_bytes = cap, np.array(
            [8 + r * dtype.itemsize for r, dtype in self.keys], dtype=np.float64)
        self.fill_record(op, algorithm, code)

    def coalesce(self, checked: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Coalesce every tensor; on the device path with one host read for the whole list.

        There the tensors of one row width and dtype go as one
        :class:`~colltune.algorithms.sparse.Batch` (kernels that do not grow
        with the number of tensors), and every batch's stats come back in one
        read, which also tells whether an index is out of range: then the
        first bad tensor in list order raises, naming itself.
        """
        if not checked or on_host(checked[0][1]):
            done = []
            for t, (i, v, n) in enumerate(checked):
                try:
                    done.append(coalesce_checked(i, v, n, accum_dtype(v.dtype)))
                except Exception as exc:  # noqa: BLE001 - re-raised naming the tensor
                    raise _named(exc, t)
            self.idx, self.vals = [i for i, _ in done], [v for _, v in done]
            self.own = [(not shares_storage(cv, v), not shares_storage(ci, i)) for (ci, cv), (i, v, _) in zip(done, checked)]
            self.counts = np.array([i.numel() for i in self.idx], dtype=np.int64)
            return
        batches = [(members, Batch([checked[t] for t in members], accum_dtype(dtype)))
                   for (_, dtype, _), members in self.space_members().items()]
        if self.comm.world_size > 1:
            self.defer(batches, checked)
            return
        stats = (batches[0][1].stats if len(batches) == 1 else torch.cat([b.stats for _, b in batches])).tolist()
        at = offsets([b.stats.numel() for _, b in batches])
        if any(stats[a] for a in at[:-1]):
            raise first_range_error(checked, _named)
        self.finish(batches, [stats[a + 1 : b] for a, b in zip(at, at[1:])])

    def finish(self, batches: list[tuple[list[int], Batch]], counts: list[list[int]]) -> None:
        """Finish every batch with its tensors' unique counts; each tensor is then a span of its batch's union
        (:meth:`run_bucket` takes its buckets from there) and its count is in :attr:`counts`."""
        self.counts = np.zeros(len(self.desc), dtype=np.int64)
        for (members, batch), per in zip(batches, counts):
            batch.finish(per)
            self.counts[members] = per
            for j, t in enumerate(members):
                self.batched[t] = (batch, j)

    def defer(self, batches: list[tuple[list[int], Batch]], checked: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Leave the counts on the device: they ride in the record's slot (with their sum and the range check in
        its fields), read with it in its one read; :meth:`settle` then finishes the batches."""
        if len(batches) == 1:  # one row width and dtype (the usual case): the stats in list order already
            self.device_counts, bad = batches[0][1].stats[1:], batches[0][1].stats[0]
        else:
            order = [t for members, _ in batches for t in members]
            where = np.empty(len(order), dtype=np.int64)
            where[order] = np.arange(len(order))
            self.device_counts = torch.cat([b.stats[1:] for _, b in batches]).index_select(
                0, upload(where, self.comm.device))
            bad = torch.stack([b.stats[0] for _, b in batches]).amax()
        self.device_fields = deferred_fields(torch.stack((bad, self.device_counts.sum())), self.record, "tensors")
        self.pending = batches
        self.counts = np.zeros(len(self.desc), dtype=np.int64)  # placeholders until settle() finishes the batches
        self.deferred_error = lambda: first_range_error(checked, _named)

    def settle(self, mine: np.ndarray) -> None:
        """After the exchange: finish a deferred coalesce with this rank's counts per tensor (no read)."""
        if self.pending is None:
            return
        self.finish(self.pending, [[int(mine[t]) for t in members] for members, _ in self.pending])
        self.pending = None

    def fill_record(self, op: str, algorithm: str, code: int) -> None:
        """Fill the record's fields and, where they fit, every tensor's entry count in the slot, then payloads."""
        t, comm = len(self.desc), self.comm
        cap = _meta.slot_bytes(comm)
        in_slot = 8 * t <= cap
        parts: list[np.ndarray | torch.Tensor] = []
        if in_slot and comm.world_size > 1:
            parts = [self.counts.view(np.uint8) if self.pending is None else self.device_counts.view(torch.uint8),
                     *self.bucket_payloads(algorithm, 8 * t, cap)]
        self.record.update(
            size=t,
            row_shape=_meta.digest([(n, shape, _meta.dtype_name(d)) for n, shape, d in self.desc]),
            row_numel=self.cap,
            op=_meta.name_code(op),
            algorithm=_meta.name_code(algorithm),
            policy=code,
            count=int(self.counts.sum()),
            eager=_COUNTS_IN_SLOT if in_slot else _COUNTS_NONE,
            payload=sum(_meta.part_bytes(part) for part in parts),
        )
        self.slot = _meta.join_slot(parts, comm.device)

    def bucket_payloads(self, algorithm: str, start: int, cap: int) -> list[np.ndarray | torch.Tensor]:
        """Return each space's record payload from the algorithm likeliest to reduce it, laid from byte ``start``.

        A space's tensors make one bucket whenever they fit the cap
        (:func:`plan_buckets`, the usual case). For each space, the algorithm
        the caller named or its bucket's site last chose gives its
        :meth:`~colltune.algorithms.base.Algorithm.eager_payload` (Ok-Topk's
        counts per region, hashpart's per owner) from the space's union,
        while it fits the slot; it reaches the run only if that bucket forms
        and runs that algorithm (:meth:`run_bucket`), saving it a collective
        and a read of its own. What is carried depends only on what every
        rank shares (the list, the group's history, the slot's size), so
        every rank lays the same payloads.
        """
        out: list[np.ndarray | torch.Tensor] = []
        for members, idx in self.space_indices():
            size = sum(self.desc[t][0] for t in members)
            likely = algorithm if self.sel is None else self.sel.last_choice(self.site(members, size))
            algo = None if likely is None else get_algorithm(likely)
            if algo is None or algo.eager_entries or type(algo).eager_payload is Algorithm.eager_payload:
                continue  # no payload to make: the union's indices are not laid out for nothing
            own = algo.eager_payload(
                idx(), size, self.comm, None if self.sel is not None else self.knobs, cap - start)
            work = None
            if isinstance(own, Prepared):
                own, work = own.payload, own.work
            if own is None:
                continue
            nbytes = _meta.part_bytes(own)
            self.payloads[tuple(members)] = (likely, start, start + nbytes, work)
            out.append(own)
            start += nbytes
        return out

    def space_indices(self) -> list[tuple[list[int], Any]]:
        """Per index space, its tensors and a function giving their union's sorted indices in the space.

        On the device path the batch's union padded with the space's size
        (the counts are not read yet); on the host path the coalesced tensors
        laid end to end, kept for the bucket's run (:attr:`joined`).
        """
        if self.pending is not None:
            return [(members, batch.padded_indices) for members, batch in self.pending]
        return [(members, lambda members=members: self.laid(members)) for members in self.space_members().values()]

    def space_members(self) -> dict[tuple[int, torch.dtype, int], list[int]]:
        """Each index space's tensors, in list order (spaces in order of their first tensor)."""
        spaces: dict[tuple[int, torch.dtype, int], list[int]] = {}
        for t, space in enumerate(self.spaces):
            spaces.setdefault(space, []).append(t)
        return spaces

    def laid(self, members: list[int]) -> torch.Tensor:
        """On the host path: the coalesced indices of ``members`` laid end to end in their space, made once a call."""
        if len(members) == 1:
            return self.idx[members[0]]
        idx = self.joined.get(tuple(members))
        if idx is None:
            at = offsets([self.desc[t][0] for t in members])
            idx = self.joined[tuple(members)] = torch.cat([self.idx[t] + at[j] for j, t in enumerate(members)])
        return idx

    def exchange(self, error: BaseException | None) -> np.ndarray:
        """Exchange the records; return every rank's entry count per tensor (``[P, T]`` int64)."""
        comm = self.comm
        try:
            records, slots = _meta.exchange(comm, self.record, error, self.slot, labels=_LABELS,
                                            device_fields=self.device_fields, deferred_error=self.deferred_error)
        except RankMismatchError as exc:
            if exc.field == "row_shape":  # the same length, other tensors: say which one
                _name_the_difference(comm, self.desc)
            raise
        t = len(self.desc)
        if comm.world_size == 1:
            return self.counts.reshape(1, t)
        if records[0]["eager"] == _COUNTS_IN_SLOT:
            counts = np.ascontiguousarray(slots[:, : 8 * t]).view(np.int64)  # type: ignore[index]
            self.slots = slots
        else:
            with comm.meta():
                row = upload(self.counts, comm.device) if self.pending is None else self.device_counts
                counts = comm.gather_small(row).view(comm.world_size, t).cpu().numpy()
        self.settle(counts[comm.rank])
        # Room for the counts in the next records, where the slot may grow to hold them (else no use).
        # The counts and the payloads that rode with them, less the room the group holds for payloads already.
        need = 8 * t + max(0, records[0]["payload"] - 8 * t - payload_reserve(comm.world_size))
        limit = slot_limit(comm.world_size)
        _meta.note_slot_use(comm, min(need, limit) if 8 * t <= limit else 0)
        return counts

    def run_bucket(self, members: list[int], counts: np.ndarray, algorithm: str, op: str,
                   name: Any) -> list[SparseResult]:
        """Reduce the tensors of one bucket as one sparse tensor; return one result per tensor."""
        comm = self.comm
        at = offsets([self.desc[t][0] for t in members])
        r, dtype = self.keys[members[0]]
        if members[0] in self.batched:  # the bucket is a run of one batch's tensors (plan_buckets keeps key order)
            batch, first = self.batched[members[0]]
            idx, vals = batch.span(first, first + len(members) - 1)
        elif len(members) == 1:
            idx, vals = self.idx[members[0]], self.vals[members[0]]
        else:
            idx, vals = self.laid(members), torch.cat([self.vals[t] for t in members])
        bucket_counts = tuple(int(c) for c in counts[:, members].sum(axis=1))
        knobs, decision = self.knobs, None
        if self.sel is not None:
            site = self.site(members, at[-1])
            decision = self.sel.decide_sparse(
                site, comm=comm, backend=self.backend, name=name, size=at[-1], row_numel=r, dtype=dtype,
                counts=bucket_counts, indices=idx, ranks_per_node=ranks_per_node(comm.group))
            algorithm, knobs = decision.algorithm, decided_knobs(decision, self.knobs)
        parts = Parts(at) if len(members) > 1 else None
        if parts is not None and comm.world_size == 1:  # one rank: each tensor's result is its own coalesced rows
            parts.sizes = [int(c) for c in counts[0, members]]
        # Laid end to end, or taken from a batch: new memory; a host-path tensor alone: as its coalesce left it.
        owned, owned_indices = self.own[members[0]] if len(members) == 1 and self.own else (True, True)
        # The payload belongs to the algorithm that made it, for the bucket it was made for.
        carried = self.payloads.get(tuple(members))
        mine = carried is not None and carried[0] == algorithm and self.slots is not None
        inp = SparseInput(idx, vals, at[-1], (r,), dtype, bucket_counts, None, op,
                          self.slots[:, carried[1] : carried[2]] if mine else None,  # type: ignore[index]
                          parts, owned, owned_indices, work=carried[3] if mine else None)  # type: ignore[index]
        # The call's measurement is its bucket predicted slowest: only that bucket's run is timed.
        predicted = None if decision is None else (decision.predicted_us or {}).get(decision.algorithm)
        timed = (self.timer is not None and predicted is not None
                 and (self.measured is None or predicted > self.measured[0])
                 and not get_algorithm(algorithm).one_off(comm, at[-1], knobs))  # one-off set-up teaches nothing
        timer = self.timer.fork() if timed else None  # type: ignore[union-attr]
        if timer is not None:
            timer.mark()
        out_idx, out_vals = run_sparse(inp, comm, algorithm, knobs, op, at)
        if timer is not None:
            timer.mark()
            self.measured = (predicted, timer, self.sel, site, decision)
        if self.sel is not None:
            self.sel.observe_sparse(site, bucket_counts, out_idx.numel())
        return self.cut(members, at, out_idx, out_vals, algorithm, decision, parts)

    def site(self, members: list[int], size: int) -> tuple:
        """Return a bucket's site, as (kind, name, n, row, dtype, P, group): the bucket's tensors name it."""
        name = self.name
        label = f"{name or 'fused'}[{members[0]}..{members[-1]}]" if len(members) > 1 else f"{name or 'fused'}[{members[0]}]"
        r, dtype = self.keys[members[0]]
        return (_KIND_FUSED, (label, tuple(members)), size, r, dtype, self.comm.world_size, group_key(self.group))

    def cut(self, members: list[int], at: list[int], out_idx: torch.Tensor, out_vals: torch.Tensor,
            algorithm: str, decision: Any, parts: Parts | None = None) -> list[SparseResult]:
        """Cut a bucket's result at its tensors' offsets into one result per tensor (views of two tensors).

        Each tensor's size comes from ``parts`` when the algorithm read them
        with its result's own size, else from one read here.
        """
        device = out_idx.device
        if len(members) > 1:
            if parts is not None and parts.sizes is not None:
                sizes = parts.sizes
                both = upload([*at[:-1], *sizes], device)  # each tensor's offset, then its share: one copy
                starts, per = both[: len(sizes)], both[len(sizes) :]
            else:
                bounds = upload(at, device)
                per = torch.diff(torch.searchsorted(out_idx, bounds))
                sizes = per.tolist()
                starts = bounds[:-1]
            shift = torch.repeat_interleave(starts, per, output_size=out_idx.numel())
            idxs = torch.split(out_idx - shift, sizes)
        else:
            sizes, idxs = [out_idx.numel()], (out_idx,)
        dtype = self.desc[members[0]][2]
        vals = torch.split(cast(out_vals, dtype), sizes)
        out: list[SparseResult] = []
        for j, t in enumerate(members):
            n, row_shape, _ = self.desc[t]
            v = vals[j] if vals[j].shape[1:] == row_shape else vals[j].reshape((sizes[j],) + row_shape)
            out.append(SparseResult(idxs[j], v, n, algorithm, self.comm.traffic, decision))
        return out


def _name_the_difference(comm: Comm, desc: list[tuple[int, tuple[int, ...], torch.dtype]]) -> None:
    """Gather every rank's tensor descriptions and raise :class:`RankMismatchError` naming the first that differs.

    Called by every rank together: all of them saw the same records disagree.
    Each tensor travels as a record does (:func:`~colltune.algorithms.meta.shape_fields`):
    its size, dtype, the shape's code and its first dimensions, readable.
    """
    columns = ("row_shape", "shape_ndim", "shape_0", "shape_1", "shape_2", "shape_3")
    mine = np.full((len(desc), 2 + len(columns)), -1, dtype=np.int64)
    for t, (n, shape, dtype) in enumerate(desc):
        fields = _meta.shape_fields(shape)
        mine[t] = (n, _meta.name_code(_meta.dtype_name(dtype)), *(fields.get(c, -1) for c in columns))
    with comm.meta():
        row = upload(mine.reshape(-1), comm.device)
        table = comm.gather_small(row).view(comm.world_size, len(desc), mine.shape[1]).cpu().numpy()
    t = int(np.argmax((table != table[:1]).any(axis=(0, 2))))

    def say(row: np.ndarray) -> str:
        ndim = int(row[3])
        shape = tuple(int(d) for d in row[4 : 4 + ndim]) if ndim <= 4 else f"of {ndim} dimensions"
        return f"size {int(row[0])}, row shape {shape}, {_meta.name_of(int(row[1]))}"

    per_rank = "; ".join(f"rank {r}: {say(table[r, t])}" for r in range(comm.world_size))
    err = RankMismatchError(f"ranks disagree on tensors[{t}] ({per_rank}); {_SAME_LIST}.")
    err.field = "row_shape"
    raise err
