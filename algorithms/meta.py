"""The small metadata record every call exchanges first.

One ``all_gather`` of a fixed-size int64 record per rank (on NCCL from 32
ranks on, an ``all_reduce`` of the table, whose latency grows with
``log2`` of the nodes instead of ``P``:
:func:`~colltune.algorithms.schedule.record_by_all_reduce`) tells every rank
(1) how many entries each rank holds, which the algorithms need anyway, and
(2) whether all ranks agree on the call: size, row shape, dtype, op,
algorithm and policy digest. Because every rank sees every record, every
rank reaches the same verdict and raises the same error, so a disagreement
never leaves one rank waiting in a collective the others skipped.

Local validation errors ride along too: a rank whose input is invalid still
joins the exchange with its error code set, then raises its own error, while
the others raise :class:`~colltune.algorithms.errors.RemoteInputError` naming it.

The record ends with an *eager slot*. It starts with the payload of the
algorithm likeliest to run, if that algorithm has one (field ``payload``
says how many bytes: Ok-Topk's counts per region, see
:meth:`~colltune.algorithms.base.Algorithm.eager_payload`). A sparse call may put
its entries in the rest; when every rank's entries fit, ``allgather`` needs no second
collective, which decides its speed below a few hundred KiB: on gloo each
collective costs a fixed hand-off (a few hundred microseconds on a loaded
host) whatever its size. The slot is sized per process group from what the
group's recent calls needed (:func:`slot_bytes`, :func:`note_slot_use`):
it starts at :func:`eager_capacity` bytes (1 KiB, shrinking as
``16 KiB / P`` down to 256 B), grows at once to the next power of two that holds the
largest rank's entries of an ``allgather`` call (up to :func:`slot_limit`),
and shrinks back after :data:`SHRINK_AFTER` calls in a row that used less
than a quarter of it. While Ok-Topk runs on the group the slot also holds
its ``P`` counts per region (:func:`note_payload`; ``8 P`` bytes more from
``P = 64`` on, where they no longer fit half the starting slot), so at no
world size do they need a collective of their own. Every rank updates the
size from the same gathered records and the same decision, so all ranks
always agree on the record's size; a rank that disagreed on the call raises
before anything is updated. A training wrapper may add its own check to a call's record (fields
``step`` and ``plan``, :class:`colltune.api.CallerCheck`): its step counter
and a code of how it routes the step's gradients, shared fields like the
others, and an error it found before the call (a gradient of the wrong
layout, a policy that does not load), which travels as an input error. The
sizes are plain arithmetic in
:mod:`colltune.algorithms.sizes`, which the cost model reads too.
"""

from __future__ import annotations

import functools
import zlib
from typing import Callable, Iterator, Mapping, Sequence, overload

import numpy as np

from colltune.algorithms.comm import Comm
from colltune.algorithms.errors import ColltuneTypeError, ColltuneValueError, RankMismatchError, RemoteInputError
from colltune.algorithms.lazy import torch
from colltune.algorithms.sizes import FIELDS, HEADER_BYTES, eager_capacity, payload_reserve, slot_limit
from colltune.algorithms.sparse import upload

__all__ = [
    "FIELDS",
    "HEADER_BYTES",
    "SHARED_FIELDS",
    "name_code",
    "name_of",
    "shape_fields",
    "exchange",
    "Records",
    "eager_capacity",
    "slot_limit",
    "slot_bytes",
    "note_slot_use",
    "note_payload",
    "send_recv_counts",
    "part_bytes",
    "join_slot",
    "SHRINK_AFTER",
    "PAYLOAD_IDLE",
    "FEEDBACK_KEY",
]

_MAGIC = 0x636F6C6C  # "coll"
_VERSION = 8  # the layout of FIELDS and of the slot's payloads; a record of another version is refused

#: The group state under which the upper layer keeps its measurement of the group's last call (an object
#: with ``fields()`` giving ``fb_code`` and ``fb_us``, and ``arrived(codes, times)``): every record carries
#: it, so every rank learns every rank's figure with the next call (``colltune.select.online``).
FEEDBACK_KEY = "meta.feedback"

_SHAPE_DIMS = 4
#: Fields every rank must agree on, with how to say them in an error.
SHARED_FIELDS: tuple[str, ...] = (
    "step", "plan", "kind", "size", "row_numel", "row_shape", "dtype", "op", "algorithm", "policy", "eager", "payload"
)
#: What the eager slot of a record holds after its payload (field ``eager``):
#: nothing, the first entries, or an overlap sketch then entries. Field
#: ``payload`` says how many bytes at the slot's start are an algorithm's
#: own payload (:meth:`~colltune.algorithms.base.Algorithm.eager_payload`).
EAGER_NONE, EAGER_ENTRIES, EAGER_SKETCH = 0, 1, 2

_MAGIC_AT, _VERSION_AT, _ERROR_AT = FIELDS.index("magic"), FIELDS.index("version"), FIELDS.index("error")
_SHARED_AT = [FIELDS.index(f) for f in SHARED_FIELDS]
#: The columns a well-formed exchange has alike on every rank: magic, version, error (0) and the shared fields.
_ALIKE_AT = np.array([_MAGIC_AT, _VERSION_AT, _ERROR_AT, *_SHARED_AT])
_FB_CODE_AT, _FB_US_AT = FIELDS.index("fb_code"), FIELDS.index("fb_us")
_BYTE_AT = {f: 8 * i for i, f in enumerate(FIELDS)}  # each field's byte offset in a record

_ERROR_CODES = {None: 0, "value": 1, "type": 2}
_ERROR_KINDS = {1: "invalid", 2: "wrong type of"}
#: Argument names a record's ``error_arg`` may carry, known to every rank so it can name them.
ARGUMENTS: tuple[str, ...] = (
    "indices", "values", "size", "op", "group", "algorithm", "knobs", "name", "policy", "tensor", "state",
    "async_op", "tensors", "bucket_cap_mb", "gradients", "environment", "donate", "unknown",
)
_HISTORY_HINT = (
    "the ranks hold different histories for this call site (make the same calls, in the same order, "
    "with the same name= and knobs= on every rank)"
)
_names: dict[int, str] = {}
_codes: dict[str, int] = {}
#: The most strings :func:`name_code` remembers (row shapes are the only open-ended ones).
_MAX_NAMES = 65536


def name_code(name: str | None) -> int:
    """Return a stable code for a string (an algorithm name, a row shape), remembering it for messages.

    Only for the few strings a message may need to show: every string is
    kept for the life of the process. Hash anything else with :func:`digest`.
    """
    if name is None:
        return -1
    code = _codes.get(name)
    if code is None:
        code = zlib.crc32(name.encode())
        if len(_codes) < _MAX_NAMES:  # past the bound a message says the code, not the name
            _codes[name] = code
            _names[code] = name
    return code


def name_of(code: int) -> str:
    """Return the string :func:`name_code` gave ``code``, or the code itself when this process never saw it."""
    return _names.get(code, str(code))


def digest(*parts: object) -> int:
    """Return a signed 64-bit code of ``repr(parts)``, the same on every rank, without remembering it.

    For what ranks must agree on but no message shows (knobs, a tensor's
    name): unlike :func:`name_code` it keeps nothing, so calls with ever new
    names do not grow the process.
    """
    raw = repr(parts).encode()
    code = (zlib.crc32(raw) << 32) | zlib.crc32(raw[::-1])
    return code - (1 << 64) if code >= (1 << 63) else code


def shape_fields(shape: tuple[int, ...]) -> dict[str, int]:
    """Return the record fields that carry ``shape`` readably (its hash rides in ``row_shape``)."""
    fields = {"row_shape": name_code(str(tuple(shape))), "shape_ndim": len(shape)}
    for d in range(min(len(shape), _SHAPE_DIMS)):
        fields[f"shape_{d}"] = int(shape[d])
    return fields


def _say_shape(rec: dict[str, int]) -> str:
    ndim = rec.get("shape_ndim", -1)
    if 0 <= ndim <= _SHAPE_DIMS:
        return str(tuple(rec[f"shape_{d}"] for d in range(ndim)))
    return "unknown" if ndim < 0 else f"a {ndim}-d shape"


def _say(fieldname: str, value: int) -> str:
    if value == -1:
        return "unknown"
    if fieldname in ("algorithm", "dtype", "op", "row_shape", "kind") and value in _names:
        return _names[value]
    return str(value)


#: Calls in a row that use less than a quarter of the slot before it shrinks.
SHRINK_AFTER = 8


#: Exchanges in a row without Ok-Topk before the slot gives back the room it held for Ok-Topk's counts.
PAYLOAD_IDLE = 32


class _Slot:
    """One group's slot: ``nbytes`` for entries and sketches, plus ``payload`` held for Ok-Topk's counts."""

    __slots__ = ("nbytes", "low", "payload", "idle")

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.low, self.payload, self.idle = nbytes, 0, 0, 0


def _group_slot(comm: Comm) -> _Slot:
    """Return this group's slot size (kept by :meth:`Comm.group_state` for as long as the group lives)."""
    return comm.group_state("meta.slot", lambda: _Slot(eager_capacity(comm.world_size)))  # type: ignore[return-value]


def slot_bytes(comm: Comm) -> int:
    """Return the size in bytes of the eager slot the next exchange on ``comm``'s group carries."""
    if comm.world_size == 1:
        return 0
    st = _group_slot(comm)
    return st.nbytes + st.payload


def note_slot_use(comm: Comm, need: int) -> None:
    """Record what a call needed of the eager slot, which sizes the next call's slot.

    Every rank must call it after the same exchange with the same ``need``
    (derive it from the gathered records and the decision, never from local
    data), so the group's ranks keep agreeing on the record size.

    Args:
        comm: the group.
        need: bytes of the largest rank's entries when the call ran
            ``allgather``, else 0 (the slot was of no use).
    """
    if comm.world_size == 1:
        return
    st = _group_slot(comm)
    st.idle += 1
    if st.payload and st.idle > PAYLOAD_IDLE:
        st.payload = 0
    base, limit = eager_capacity(comm.world_size), slot_limit(comm.world_size)
    if need > st.nbytes and st.nbytes < limit:
        st.nbytes = min(limit, max(base, 1 << (int(need) - 1).bit_length()))
        st.low = 0
    elif 4 * need < st.nbytes and st.nbytes > base:
        st.low += 1
        if st.low >= SHRINK_AFTER:
            st.nbytes = max(base, 1 << max(int(need) - 1, 0).bit_length())
            st.low = 0
    else:
        st.low = 0


def send_recv_counts(gathered: np.ndarray | None, rank: int) -> tuple[list[int], list[int]] | None:
    """Every rank's payload of ``P`` int64 running counts as this rank's ``(send, recv)``: its own count per
    owner, and every rank's count for this rank.

    ``gathered`` is ``[P, 8 P]`` bytes: row ``r`` holds where rank ``r``'s
    entries for each owner end in its sorted entries (owner ``j``'s are
    ``[end[j-1], end[j])``, from 0). The ends travel, not the counts: one
    ``searchsorted`` makes them on the device, where the counts take a
    difference of three more ops; the host takes it here.
    ``None`` when no payload came, or one of another shape (the ranks sent none of counts).
    """
    if gathered is None or gathered.shape[1] != 8 * gathered.shape[0]:
        return None
    table = np.diff(np.ascontiguousarray(gathered).view(np.int64), axis=1, prepend=0)
    return table[rank].tolist(), table[:, rank].tolist()


def part_bytes(part: "np.ndarray | torch.Tensor") -> int:
    """The bytes of one flat ``uint8`` part of a slot (a NumPy array on the host, a tensor on the device)."""
    return int(part.numel() if isinstance(part, torch.Tensor) else part.size)


def join_slot(parts: "Sequence[np.ndarray | torch.Tensor]", device: "torch.device") -> "np.ndarray | torch.Tensor | None":
    """Lay a slot's parts end to end: on the host when every part is there, else on the device with no read.

    One part goes in as it is; ``None`` when there are none.
    """
    if len(parts) < 2:
        return parts[0] if parts else None
    if all(isinstance(part, np.ndarray) for part in parts):  # the host path, or only host parts
        return np.concatenate(parts)  # type: ignore[arg-type]
    return torch.cat([upload(torch.from_numpy(part), device) if isinstance(part, np.ndarray) else part.reshape(-1)
                      for part in parts])


def note_payload(comm: Comm) -> None:
    """Record that Ok-Topk ran on ``comm``'s group: its ``P`` counts per region ride in the next records.

    Called by every rank from inside the algorithm (the same calls on every
    rank), after :func:`note_slot_use` of the same call. From the next call
    on, the slot holds :func:`~colltune.algorithms.sizes.payload_reserve`
    bytes more where the counts do not fit it, until :data:`PAYLOAD_IDLE`
    exchanges in a row run without Ok-Topk.
    """
    if comm.world_size == 1:
        return
    st = _group_slot(comm)
    st.payload, st.idle = payload_reserve(comm.world_size), 0


def exchange(
    comm: Comm,
    record: dict[str, int],
    local_error: BaseException | None,
    slot: torch.Tensor | np.ndarray | None = None,
    labels: Mapping[str, tuple[str, str]] | None = None,
    device_fields: Mapping[str, torch.Tensor] | None = None,
    deferred_error: Callable[[], BaseException] | None = None,
) -> tuple[Sequence[dict[str, int]], np.ndarray | None]:
    """All-gather ``record`` and check that every rank agrees; return every rank's record and eager slot.

    Args:
        comm: the group.
        record: this rank's values for the fields in :data:`FIELDS` except
            ``magic``, ``version`` and ``error`` (missing ones count as unknown).
        local_error: the validation error of this rank, or ``None``.
        slot: up to :func:`slot_bytes` bytes (``uint8``, a tensor or a
            NumPy array) to deliver to every rank with the record, or ``None``.
        labels: for a call whose fields mean something else than a single
            tensor's (a fused call), what to call a shared field and how to
            fix a disagreement on it, by field name.
        device_fields: fields whose values are still on the device (int64
            tensors, e.g. a count no host read has seen; one of ``m``
            elements fills ``m`` consecutive fields from the one named):
            written into the record there, so they reach the host with the
            gathered table, in its one read. A device tensor ``slot`` is
            placed there too. Ignored with a ``local_error``.
        deferred_error: when this rank's own ``error`` field came from the
            device (set in ``device_fields``), what to raise: called once the
            table shows it, while the other ranks raise :class:`RemoteInputError`.

    Returns:
        ``(records, slots)``: every rank's record (:class:`Records`), and
        every rank's slot as one ``uint8`` NumPy array of shape
        ``[P, slot_bytes]``, a view of the table read
        from the device with the records in one read: host data, which a
        reader takes without another read (``None`` on a single rank,
        where nothing is exchanged).

    Raises:
        The rank's own ``local_error``; :class:`RemoteInputError` if another
        rank's input was invalid; :class:`RankMismatchError` if ranks disagree
        (its ``field`` names the first field they disagree on).
    """
    if comm.world_size == 1:
        if local_error is not None:
            raise local_error
        return _OneRecord(dict(record, magic=_MAGIC, version=_VERSION, error=0)), None
    record = dict(record, kind=_kind_on_path(record.get("kind", -1), comm.host))
    fb = comm.group_state(FEEDBACK_KEY)
    if fb is not None:
        record.update(fb.fields())
    cap = slot_bytes(comm)
    # Fields or a slot still on the device are written into the record there (a host slot joins them).
    on_device = local_error is None and not comm.host and (device_fields or isinstance(slot, torch.Tensor))
    if on_device and isinstance(slot, np.ndarray):
        slot = upload(torch.from_numpy(slot.reshape(-1)), comm.device)
    if on_device and slot is not None and slot.numel() > cap:  # too big: packed on the host, which says so
        on_device = False
    host, local_error = _pack_or_error(record, local_error, None if on_device else slot, cap)
    hbytes = HEADER_BYTES
    row = upload(torch.from_numpy(host), comm.device)
    if on_device and local_error is None:
        _fill_on_device(row, device_fields or {}, slot if isinstance(slot, torch.Tensor) else None)
    with comm.meta():
        table = comm.gather_record(row)
    # One read of the whole table: the slots' readers (counts, sketches, payloads) need no other.
    host_table = table.numpy() if comm.host else table.cpu().numpy()
    records = Records(np.ascontiguousarray(host_table[:, :hbytes]).view(np.int64))
    head = records.table
    # The usual exchange passes in one comparison of the columns every rank has alike; any other is checked
    # column by column (a few NumPy operations whatever P), where the per-rank loops only say what is wrong.
    alike = head[:, _ALIKE_AT]
    if not ((alike == alike[0]).all() and alike[0, :3].tolist() == [_MAGIC, _VERSION, 0] and local_error is None):
        _check_records(comm, records, local_error, labels, deferred_error)
    if fb is not None and fb.code is not None:  # a measurement is held: the records carry every rank's figure
        fb.arrived(head[:, _FB_CODE_AT].tolist(), head[:, _FB_US_AT].tolist())
    return records, host_table[:, hbytes:]


def _check_records(comm: Comm, records: Records, local_error: BaseException | None,
                   labels: Mapping[str, tuple[str, str]] | None, deferred_error: Callable[[], BaseException] | None) -> None:
    """Raise what an exchange whose records are not all alike and well formed says, in this order: another
    version, this rank's error, another rank's error, a disagreement on a shared field."""
    head = records.table
    if not ((head[:, _MAGIC_AT] == _MAGIC) & (head[:, _VERSION_AT] == _VERSION)).all():
        _check_versions(list(records))
    if local_error is None and deferred_error is not None and head[comm.rank, _ERROR_AT]:
        local_error = deferred_error()
    if local_error is not None:
        raise local_error
    if head[:, _ERROR_AT].any():
        _check_remote_errors(list(records), comm.rank)
    if (head[:, _SHARED_AT] != head[:1, _SHARED_AT]).any():
        _check_shared(list(records), labels or {})


@functools.lru_cache(maxsize=256)
def _kind_on_path(kind: int, host: bool) -> int:
    """The record's ``kind`` with the code path in it: a rank with CPU tensors (host path) and one with CUDA
    tensors (device path) run different collectives, so they raise at the record instead of hanging.
    Both paths' names are made, so that a message can name a peer's."""
    name = name_of(kind)
    codes = {path: name_code(f"{name} on the {path} path") for path in ("host", "device")}
    return codes["host" if host else "device"]


def _fill_on_device(row: torch.Tensor, fields: Mapping[str, torch.Tensor], slot: torch.Tensor | None) -> None:
    """Write device-held fields and a device slot into an uploaded record, on the device (no host read).

    A field's value is an int64 tensor of ``m`` elements: it fills ``m``
    consecutive fields from the one named, with one copy.
    """
    for name, value in fields.items():
        at, flat = _BYTE_AT[name], _flat(value)
        if at + 8 * flat.numel() > HEADER_BYTES:  # shapes only: no host read
            raise ValueError(f"device field {name!r}: {flat.numel()} values run past the record's last field")
        row[at : at + 8 * flat.numel()].view(torch.int64).copy_(flat)
    if slot is not None:  # its size was checked against the room
        flat = _flat(slot)
        row[HEADER_BYTES : HEADER_BYTES + flat.numel()] = flat


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as 1-D: itself when it already is (a reshape is an op dispatched even when it changes nothing)."""
    return t if t.dim() == 1 else t.reshape(-1)


class Records(Sequence[dict[str, int]]):
    """Every rank's record, as gathered: item ``r`` is rank ``r``'s fields, a fresh ``dict`` on each access.

    The records stay one int64 table (``[P, len(FIELDS)]``) until read, so
    a call at ``P = 1024`` makes no thousand dictionaries it does not need;
    :meth:`column` reads one field of every rank as a list.
    """

    __slots__ = ("table",)

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    def __len__(self) -> int:
        return int(self.table.shape[0])

    @overload
    def __getitem__(self, i: int) -> dict[str, int]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, int]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, int] | list[dict[str, int]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return dict(zip(FIELDS, self.table[i].tolist()))

    def __iter__(self) -> Iterator[dict[str, int]]:
        for row in self.table.tolist():
            yield dict(zip(FIELDS, row))

    def column(self, name: str) -> list[int]:
        """Return field ``name`` of every rank, in rank order."""
        return self.table[:, FIELDS.index(name)].tolist()


class _OneRecord(Records):
    """The records of a call on a single rank, where nothing is gathered: its own record, kept as the dict it is
    (a field it lacks reads -1, as a packed one does); :attr:`table` is made only if something asks for it."""

    __slots__ = ("record",)

    def __init__(self, record: dict[str, int]) -> None:
        self.record = record

    @property  # type: ignore[override]
    def table(self) -> np.ndarray:
        return np.array([[int(self.record.get(f, -1)) for f in FIELDS]], dtype=np.int64)

    def column(self, name: str) -> list[int]:
        return [int(self.record.get(name, -1))]


def _pack_or_error(
    record: dict[str, int], local_error: BaseException | None, slot: object, cap: int
) -> tuple[np.ndarray, BaseException | None]:
    """Return the packed record and the rank's error; a record that cannot be built travels as an error alone.

    A field that does not fit in int64 or a slot that does not fit its room:
    the record still travels, with the error set and nothing else, so no
    rank is left waiting.
    """
    try:
        return _pack(record, local_error, slot, cap), local_error
    except Exception as exc:  # noqa: BLE001 - whatever it is, the other ranks must hear of it
        local_error = local_error or ColltuneValueError(
            f"the metadata record of this call could not be built ({type(exc).__name__}: {exc}); "
            "check that every size and count fits in int64."
        )
        local_error.__cause__ = local_error.__cause__ or exc
        return _pack({"kind": record.get("kind", -1)}, local_error, None, cap), local_error


def _check_versions(records: list[dict[str, int]]) -> None:
    """Raise :class:`RankMismatchError` if a rank sent another colltune version's record or another collective."""
    for rank, rec in enumerate(records):
        if rec["magic"] != _MAGIC or rec["version"] != _VERSION:
            raise RankMismatchError(
                f"rank {rank} sent a metadata record of another colltune version or another collective "
                f"(magic {rec['magic']:#x}, version {rec['version']}); every rank must run the same "
                "colltune version and issue the same collectives in the same order."
            )


def _check_remote_errors(records: list[dict[str, int]], me: int) -> None:
    """Raise :class:`RemoteInputError` naming the ranks that rejected their input and the arguments."""
    bad = [r for r, rec in enumerate(records) if rec["error"]]
    if bad:
        what = "; ".join(
            f"rank {r}: {_ERROR_KINDS.get(records[r]['error'], 'invalid')} argument "
            f"{_names.get(records[r]['error_arg'], 'unknown')!r}" for r in bad
        )
        raise RemoteInputError(
            f"rank(s) {bad} rejected their input to this collective ({what}), so rank {me} "
            "abandoned it too; the error raised on those ranks says what to fix."
        )


#: What to do when ranks disagree on a shared field (default: pass the same value on every rank).
_SHARED_HINTS: dict[str, str] = {
    "policy": "load the same policy file and profile, set the same COLLTUNE_ALGO, "
    "and pass the same name= and knobs= on every rank",
    "row_shape": "pass values with the same row shape on every rank",
    "row_numel": "pass values with the same row shape on every rank",
    "kind": "make the same call (sparse_allreduce, topk_allreduce or sparse_allreduce_many) on every rank, "
    "with its tensors on the same kind of device everywhere (all CPU or all CUDA) and the same "
    "COLLTUNE_DEVICE_PATH setting",
    "eager": _HISTORY_HINT,
    "payload": _HISTORY_HINT,
}


#: What the fields of a caller's check (:class:`colltune.api.CallerCheck`) mean, for the error that names a
#: disagreement: a training wrapper puts its step counter and its routing plan in the record of each step's
#: first call, so that a rank that skipped, repeated or routed a step differently never mixes with the others.
_CALLER_LABELS: dict[str, tuple[str, str]] = {
    "step": (
        "the training wrapper's step (its synchronizations so far)",
        "a rank skipped or repeated a synchronization (it raised, or retried a step, where the others did not), "
        "so its gradients would mix with another step's; load the same checkpoint (load_state_dict) on every "
        "rank, or build the wrapper again on every rank",
    ),
    "plan": (
        "how the training wrapper routes the gradients",
        "give every rank the same model, options, policy file and environment (COLLTUNE_ALGO, COLLTUNE_POLICY), "
        "and SparseGradSync.synchronize() the same async_op (under Join a rank that has had no batch shadows "
        "in the mode attach_to_backward set, else synchronously)",
    ),
}


def _check_shared(records: list[dict[str, int]], labels: Mapping[str, tuple[str, str]]) -> None:
    """Raise :class:`RankMismatchError` on the first shared field the ranks disagree on, with every rank's value."""
    for f in SHARED_FIELDS:
        values = [rec[f] for rec in records]
        if len(set(values)) > 1:
            if f == "row_shape" and f not in labels:
                per_rank = ", ".join(f"rank {r}: {_say_shape(rec)}" for r, rec in enumerate(records))
            else:
                per_rank = ", ".join(f"rank {r}: {_say(f, v)}" for r, v in enumerate(values))
            what, hint = labels.get(f) or _CALLER_LABELS.get(f) or (
                repr(f), _SHARED_HINTS.get(f, "pass the same value on every rank"))
            err = RankMismatchError(f"ranks disagree on {what} ({per_rank}); {hint}.")
            err.field = f
            raise err


def _pack(record: dict[str, int], local_error: BaseException | None, slot: object, cap: int) -> np.ndarray:
    """Return this rank's record and eager slot as one host buffer of ``HEADER_BYTES + cap`` bytes.

    One buffer (one small copy to the device): on tiny inputs a call's time
    is its number of operations. Raises ``OverflowError`` for a field outside
    int64 and ``ValueError`` for a slot larger than ``cap``.
    """
    kind = "type" if isinstance(local_error, TypeError) else ("value" if local_error is not None else None)
    full = dict(record, magic=_MAGIC, version=_VERSION, error=_ERROR_CODES[kind])
    if local_error is not None:
        full["error_arg"] = name_code(getattr(local_error, "argument", None) or "unknown")
    hbytes = HEADER_BYTES
    host = np.zeros(hbytes + cap, dtype=np.uint8)
    host[:hbytes] = np.array([int(full.get(f, -1)) for f in FIELDS], dtype=np.int64).view(np.uint8)
    if slot is not None:
        data = slot if isinstance(slot, np.ndarray) else slot.cpu().numpy()  # type: ignore[attr-defined]
        if data.size > cap:
            raise ValueError(f"an eager slot of {data.size} bytes does not fit the record's {cap}")
        host[hbytes : hbytes + data.size] = data.reshape(-1)
    return host


def dtype_name(dtype: torch.dtype) -> str:
    """Return ``float32`` for ``torch.float32`` and so on."""
    return str(dtype).replace("torch.", "")


def check_index_dtype(name: str, t: torch.Tensor) -> None:
    """Raise a clear error unless ``t`` holds int32 or int64 indices."""
    if t.dtype not in (torch.int32, torch.int64):
        raise ColltuneTypeError(
            f"{name} must be an int32 or int64 tensor, but got dtype {dtype_name(t.dtype)}; "
            f"convert it with {name}.long()."
        )


for _argument in ARGUMENTS:
    name_code(_argument)
