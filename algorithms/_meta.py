"""The small metadata record every call exchanges first.

One ``all_gather`` of a fixed-size int64 record per rank tells every rank
(1) how many entries each rank holds, which the algorithms need anyway, and
(2) whether all ranks agree on the call: size, row shape, dtype, op,
algorithm and policy digest. Because every rank sees every record, every
rank reaches the same verdict and raises the same error, so a disagreement
never leaves one rank waiting in a collective the others skipped.

Local validation errors ride along too: a rank whose input is invalid still
joins the exchange with its error code set, then raises its own error, while
the others raise :class:`~algorithms.errors.RemoteInputError` naming it.
"""

from __future__ import annotations

import zlib

import torch

from algorithms._comm import Comm
from algorithms.errors import ColltuneTypeError, RankMismatchError, RemoteInputError

__all__ = ["FIELDS", "SHARED_FIELDS", "name_code", "exchange"]

_MAGIC = 0x636F6C6C  # "coll"
_VERSION = 1

#: Field order of the record.
FIELDS: tuple[str, ...] = (
    "magic",
    "version",
    "kind",
    "size",
    "row_numel",
    "row_shape",
    "dtype",
    "op",
    "algorithm",
    "policy",
    "count",
    "error",
)
#: Fields every rank must agree on, with how to say them in an error.
SHARED_FIELDS: tuple[str, ...] = ("kind", "size", "row_numel", "row_shape", "dtype", "op", "algorithm", "policy")

_ERROR_CODES = {None: 0, "value": 1, "type": 2}
_names: dict[int, str] = {}


def name_code(name: str | None) -> int:
    """Return a stable code for a string (an algorithm name, a row shape), remembering it for messages."""
    if name is None:
        return -1
    code = zlib.crc32(name.encode())
    _names[code] = name
    return code


def _say(fieldname: str, value: int) -> str:
    if value == -1:
        return "unknown"
    if fieldname in ("algorithm", "dtype", "op", "row_shape", "kind") and value in _names:
        return _names[value]
    return str(value)


def exchange(comm: Comm, record: dict[str, int], local_error: BaseException | None) -> list[dict[str, int]]:
    """All-gather ``record`` and check that every rank agrees; return every rank's record.

    Args:
        comm: the group.
        record: this rank's values for the fields in :data:`FIELDS` except
            ``magic``, ``version`` and ``error`` (missing ones count as unknown).
        local_error: the validation error of this rank, or ``None``.

    Raises:
        The rank's own ``local_error``; :class:`RemoteInputError` if another
        rank's input was invalid; :class:`RankMismatchError` if ranks disagree.
    """
    kind = "type" if isinstance(local_error, TypeError) else ("value" if local_error is not None else None)
    full = dict(record, magic=_MAGIC, version=_VERSION, error=_ERROR_CODES[kind])
    if comm.world_size == 1:
        if local_error is not None:
            raise local_error
        return [full]
    row = torch.tensor([int(full.get(f, -1)) for f in FIELDS], dtype=torch.int64, device=comm.device)
    with comm.meta():
        table = comm.all_gather(row).view(comm.world_size, len(FIELDS)).tolist()
    records = [dict(zip(FIELDS, r)) for r in table]
    for rank, rec in enumerate(records):
        if rec["magic"] != _MAGIC or rec["version"] != _VERSION:
            raise RankMismatchError(
                f"rank {rank} sent a metadata record of another colltune version or another collective "
                f"(magic {rec['magic']:#x}, version {rec['version']}); every rank must run the same "
                "colltune version and issue the same collectives in the same order."
            )
    if local_error is not None:
        raise local_error
    bad = [r for r, rec in enumerate(records) if rec["error"]]
    if bad:
        raise RemoteInputError(
            f"rank(s) {bad} rejected their input to this collective, so rank {comm.rank} abandoned it too; "
            "the error raised on those ranks names the argument to fix."
        )
    for f in SHARED_FIELDS:
        values = [rec[f] for rec in records]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {_say(f, v)}" for r, v in enumerate(values))
            hint = {
                "policy": "load the same policy file and profile on every rank",
                "row_shape": "pass values with the same row shape on every rank",
                "row_numel": "pass values with the same row shape on every rank",
            }.get(f, "pass the same value on every rank")
            raise RankMismatchError(f"ranks disagree on {f!r} ({per_rank}); {hint}.")
    return records


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
