"""How big the metadata record is at each world size: plain arithmetic, no torch.

The record (:mod:`colltune.algorithms.meta`) is a header of int64 fields and
an *eager slot*. The slot's size is per group and changes with the group's
calls, but it starts at :func:`eager_capacity`, never passes
:func:`slot_limit` for entries, and holds Ok-Topk's counts per region on top
(:func:`payload_reserve`) while Ok-Topk runs on the group. The cost model
reads the same functions (:func:`record_bytes`) to price the record as it
travels at a world size.
"""

from __future__ import annotations

__all__ = [
    "FIELDS",
    "HEADER_BYTES",
    "MIN_SLOT_BYTES",
    "eager_capacity",
    "slot_limit",
    "payload_reserve",
    "record_bytes",
]

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
    "error",  # error then count: a deferred coalesce's [bad, count] fills both with one copy (tuner.api)
    "count",
    "shape_ndim",
    "shape_0",
    "shape_1",
    "shape_2",
    "shape_3",
    "eager",
    "payload",
    "error_arg",
    "step",
    "plan",
    "fb_code",
    "fb_us",
)
#: Bytes of the record's fields (int64 each), before the eager slot.
HEADER_BYTES = 8 * len(FIELDS)
#: The smallest eager slot: 64 overlap-sketch hashes of 4 bytes. With fewer the sketch of a large group
#: misjudges the overlap (4 hashes per rank at P = 1024 are off by up to 0.5 with a band of 0.13), while at
#: P = 1024 the slot's 256 bytes add 0.24 MiB to a gather that pays about a thousand hops of latency anyway.
MIN_SLOT_BYTES = 256


def eager_capacity(world_size: int) -> int:
    """Return the starting (and smallest) size in bytes of the eager slot for a group of ``world_size``.

    1 KiB up to 16 ranks (it holds 128 scalar fp32 entries: the inputs whose
    time is all latency), then ``16 KiB / P``, never below
    :data:`MIN_SLOT_BYTES`. The slot grows only for groups whose calls need
    more (:func:`colltune.algorithms.meta.slot_bytes`).
    """
    return max(MIN_SLOT_BYTES, min(1024, (16384 // max(world_size, 1)) // 8 * 8))


def slot_limit(world_size: int) -> int:
    """Return the largest eager slot for entries, in bytes: 256 KiB over ``P``, at least the start."""
    # Every rank receives P slots per record, so the gathered record stays
    # under 256 KiB; past that the bytes, not the hand-off, dominate a call.
    return max(eager_capacity(world_size), (262144 // max(world_size, 1)) // 8 * 8)


def payload_reserve(world_size: int) -> int:
    """Return the bytes the slot adds for Ok-Topk's counts per region while Ok-Topk runs on a group.

    ``P`` int64 counts ride in the record's slot. While they take at most
    half of the starting slot (``P <= 32``) they fit without growing it;
    past that the slot grows by exactly their ``8 P`` bytes, so the counts
    never cost a collective of their own (an ``all_to_all`` of ``P - 1``
    messages, which at ``P = 1024`` costs more than the 8 MiB the gathered
    records gain).
    """
    need = 8 * world_size
    return 0 if world_size < 2 or 2 * need <= eager_capacity(world_size) else need


def record_bytes(world_size: int, *, payload: bool = False) -> int:
    """Return the bytes one rank's record takes in a group at rest: the header and the starting slot.

    Args:
        world_size: ``P``.
        payload: the group runs Ok-Topk, whose counts ride in the slot
            (:func:`payload_reserve` bytes more where they do not fit it).
    """
    if world_size < 2:
        return 0
    return HEADER_BYTES + eager_capacity(world_size) + (payload_reserve(world_size) if payload else 0)
