"""Dense allreduce: densify, ``all_reduce``, extract the union.

Best when the data is dense or the group is large: its cost does not depend
on the number of entries, only on the dense size ``n * row_bytes``.

**Presence rides in the sign of zero.** The dense buffer starts as ``-0.0``
everywhere and this rank's rows are written with every ``-0.0`` turned into
``+0.0`` (``v + 0.0``: every other value keeps its bits, infinities included;
a NaN stays a NaN). In IEEE arithmetic (round to nearest) a sum is ``-0.0``
only when every addend is ``-0.0``: ``x + (-0.0)`` is ``x`` for every ``x``,
``(-0.0) + (+0.0)`` is ``+0.0`` and a nonzero sum that cancels exactly is
``+0.0``. So after the ``SUM`` ``all_reduce``, in whatever order the backend
adds (gloo's ring or direct sum, NCCL's ring or tree), a row is in the union
of the ranks' indices exactly when its first element is not ``-0.0``
(compared as bits), even where its values cancel to zero. One collective
moves the values and the union: no mask travels. The ``-0.0`` addends are
the identity of the sum, so each element of the result has the bits of
``0 + v_1 + v_2 + ...`` over the ranks that hold the row, in the backend's
order, and like every other algorithm's sum it is never ``-0.0``. This
relies on the backend adding in IEEE arithmetic, as gloo's and NCCL's ring
and tree kernels do (in-network reductions, NVLS or SHARP, are not checked
here); a reduction that lost the sign of zero (an accumulator started at
``+0.0``) would return every row. Rows of no elements carry
their presence in a one-element buffer.

**Every row present.** When the metadata record says some rank holds every
row (its coalesced count is ``n``), the union is all rows: no presence
test, no extraction, and the reduced buffer is the result. A rank that holds
every row sends its values as the buffer (its coalesced input is already in
row order), and the ranks that do split the sign fix among them, a slice
each (it only has to keep every sum from being ``-0.0``; see
``_densify``). Where the values are the call's own (the coalesce summed
repeated rows, a fused bucket concatenated tensors, or the caller passed
``donate=True``) that is done in place: at density 1 on every rank each
rank touches ``1/P`` of its values before the ``all_reduce`` and nothing
after it, as close to a plain in-place ``all_reduce`` as a call that checks
its inputs gets. Values the caller keeps are copied first.

**16-bit values** (fp16, bf16) are summed in fp32 by default (knob
``wire="accum"``): each rank's duplicates are summed in fp32 (the coalesce),
the buffer travels in fp32 and the sum is rounded to the value dtype once:
within one unit roundoff of the dtype (2^-8 for bf16, 2^-11 for fp16) of
the summed magnitudes. The sparse algorithms sum in fp32 too but send each
rank's sums in the value dtype (half the bytes), so they round twice:
within two. ``auto``'s choice moves a result within those bounds, never
past the suite's tolerance (``tests/distributed/test_sparse_allreduce.py``
checks both bounds for every algorithm). ``wire="value"`` exchanges the
value dtype instead, as PyTorch's DDP reduces 16-bit gradients: half the
bytes, and the cost model prices half. There each rank's fp32 sums are
rounded to the value dtype and the backend rounds each of its ``P - 1``
additions to it, so an element's error grows with ``P`` (at most about
``P`` unit roundoffs of the magnitudes summed, against one). Measured
against a float64 reference (rows of 16, 200 entries per rank on 64 rows,
40 random cases per world size, sum and avg: ``python
tools/accuracy16.py``) in units of the dense-reference suite's tolerance
(8e-3 of the summed magnitudes for bf16, 1e-3 for fp16), the worst element
is at most 0.49 with fp32 on the wire at P = 2, 3, 4 and 8 (the sparse
algorithms, which send each rank's sums in 16 bits, 0.43 to 0.96), and
0.82 to 1.22 with 16-bit on the wire, past the tolerance at P = 3 (both
dtypes), 4 (bf16) and 8 (fp16). That is why the default keeps fp32.
Either way the result is the backend's ``all_reduce`` result, the same
bits on every rank. With
``wire="value"`` values come back in the value dtype (the front door's cast
is then free; ``avg`` divides them in fp32 and rounds once, as it does the
fp32 sum).
"""

from __future__ import annotations

from typing import Any

from colltune.algorithms.base import Algorithm, SparseInput, TopkOutput
from colltune.algorithms.comm import Comm
from colltune.algorithms.knobs import Knob
from colltune.algorithms.lazy import torch
from colltune.algorithms.registry import register
from colltune.algorithms.schedule import Pricing, Step
from colltune.algorithms.sparse import (
    cast,
    fresh,
    mask_positions,
    out_buffer,
    read_part_counts,
    row_numbers,
    upload,
)

__all__ = ["Dense"]

#: The dtypes dense's 16-bit values may travel in: the accumulation dtype (``accum``) or their own (``value``).
WIRES = ("accum", "value")

#: The bits of ``-0.0`` per element size, as the signed integer a ``view`` of that size reads.
_NEG_ZERO = {2: -(1 << 15), 4: -(1 << 31), 8: -(1 << 63)}
_INT_OF_SIZE = {2: "int16", 4: "int32", 8: "int64"}


def _handed_back(inp: SparseInput, comm: Comm) -> bool:
    """Whether the input's coalesced indices may be the result's as they are: the call's own (made or
    donated), on the call's device, and of unit stride (a one-element view may carry another)."""
    return inp.owned_indices and inp.indices.device == comm.device and inp.indices.stride(0) == 1


@register
class Dense(Algorithm):
    """Densify, ``all_reduce``, and extract the rows of the union."""

    name = "dense"
    knob_specs = (
        Knob("wire", "accum", "the dtype fp16 and bf16 rows travel and are summed in: `accum` (fp32, rounded once "
             "at the end; the sparse algorithms send 16 bits and round twice) or `value` (their own, as DDP reduces "
             "them: half the bytes, but each of the P-1 additions rounded to 16 bits); 32- and 64-bit rows always "
             "travel in their own dtype",
             choices=WIRES),
    )
    #: ``mask_all_reduce`` stays a term (priced free) so that learned models keep their feature layout.
    TERMS = ("metadata", "value_all_reduce", "mask_all_reduce", "densify_extract")
    #: The record (the coalesce's count rides in it), the union's size (none when every row is present);
    #: top-k: the record.
    HOST_SYNCS = {"exact": 2, "topk": 1}
    HOST_KERNELS = {"exact": 21, "topk": 8}
    topk_priced_on = "tensor"  # top-k mode all-reduces the whole accumulated tensor

    def schedule(self, pricing: Pricing, knobs: dict[str, Any]) -> list[Step]:
        """The record, the values' all_reduce in the wire dtype, then densify and extract the union.

        Local work of the slowest rank, ``k`` entries per rank, ``w`` wire
        bytes per row, values the call owns (see the module docstring; a
        caller's coalesced values it keeps add one copy, ``n w`` read and
        written, on a rank that holds every row):

        - no rank holds every row: each rank's values normalized into the
          wire dtype, their signs fixed (read ``k * rba``, write ``k * w``),
          the buffer filled with ``-0.0`` (``n * w``) and the rows copied in
          (``k * (w + 8)`` read, ``k * w`` written); the presence test reads
          each row's first element (a cache line of it at most) and writes
          a byte per row, the union's positions are found and its rows
          gathered (``u * (8 + 2 w)``);
        - some rank holds every row: the ``h`` holders fix the signs of
          ``1/h`` of the rows each, in place (``2 n w / h``; ``h = P`` when
          every rank holds every row, else counted as 1), after 16-bit rows
          are rounded to a narrower wire (``n * (rba + w)``); a rank without
          every row fills and copies as above; the indices ``0..n-1`` are
          written (``8 n``).

        16-bit rows summed in fp32 are rounded to their dtype at the end
        (``u * (w + rb)``). In top-k mode the accumulated tensor is already
        dense: its all_reduce is the whole call (no presence test, nothing is
        densified; the local work is the copy reduced in place and the
        zeroed residual).
        """
        c = pricing
        if c.topk:
            return [
                c.metadata(),
                c.all_reduce("value_all_reduce", c.n * c.rba),
                c.free("mask_all_reduce", "all_reduce"),
                c.local("densify_extract", 3 * c.n * c.rba, 2.0),
            ]
        w = c.rb if knobs.get("wire", "accum") == "value" else c.rba
        narrowed = w < c.rba  # the cast and the sign fix are two kernels
        fill = c.n * w + c.kavg * (2 * w + 8)  # the -0.0 buffer, and the rows copied in
        if c.k_max < c.n:
            nbytes = c.kavg * (c.rba + w) + fill + c.n * (min(w, 64.0) + 2) + c.u * (8 + 2 * w)
            kernels = (2.0 if narrowed else 1.0) + 2 + 3
        else:
            cast_row = c.rba + w if narrowed else 0.0  # per row, before the fix
            holders = c.p if c.kavg >= c.n else 1
            holder = 2 * c.n * w / holders + c.n * cast_row
            nbytes = (holder if c.kavg >= c.n else max(holder, fill + c.kavg * cast_row)) + 8 * c.n
            kernels = (1.0 if narrowed else 0.0) + (1.0 if c.kavg >= c.n else 2.0) + 1
        if w != c.rb:  # the front door rounds the fp32 sums of 16-bit rows to their dtype
            nbytes += c.u * (w + c.rb)
            kernels += 1
        return [
            c.metadata(),
            c.all_reduce("value_all_reduce", c.n * w),
            c.free("mask_all_reduce", "all_reduce"),
            c.local("densify_extract", nbytes, kernels),
        ]

    def sparse_allreduce(self, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self._densify(inp, comm, knobs)
        comm.all_reduce(buf)
        return self._extract(inp, buf, comm)

    def sparse_allreduce_parts(
        self, inp: SparseInput, comm: Comm, knobs: dict[str, Any], bounds: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One buffer for every part; each part's values summed as its own call sums them.

        A backend's ``all_reduce`` sums an element in an order set by the
        buffer's size and the element's place in it, so each part's values
        go through :meth:`Comm.all_reduce_parts`, which gives every part the
        bits of an ``all_reduce`` of that part alone. Presence rides in the
        values of every part alike, and a part's result does not depend on
        whether the shortcut for every row present applies (the ``-0.0``
        addends are the sum's identity), so each part has its own call's bits.
        """
        if len(bounds) <= 2:
            return self.sparse_allreduce(inp, comm, knobs)
        buf = self._densify(inp, comm, knobs)
        comm.all_reduce_parts(buf, bounds)
        return self._extract(inp, buf, comm)

    @staticmethod
    def _wire_dtype(inp: SparseInput, knobs: dict[str, Any]) -> torch.dtype:
        """The dtype the buffer travels in: 16-bit values' own with ``wire="value"``, else the accumulation dtype."""
        if inp.dtype in (torch.float16, torch.bfloat16) and knobs.get("wire", "accum") == "value":
            return inp.dtype
        return inp.acc_dtype

    @classmethod
    def _densify(cls, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> torch.Tensor:
        """Return this rank's entries as a dense ``[n, max(r, 1)]`` buffer: ``-0.0`` where absent, no ``-0.0`` where present.

        Rows of no elements get one element, ``+0.0`` where present. A rank
        that holds every row (its sorted unique indices are ``0..n-1``)
        writes its values as the buffer, in place when they are the call's
        own (:attr:`SparseInput.owned`), else in one copy.

        When the record shows ranks holding every row, no presence test
        follows, and those ranks share the sign fix: the ``j``-th of ``h``
        fixes the ``j``-th of ``h`` equal slices of the rows, the others
        fix nothing. One ``+0.0``-or-nonzero addend per element keeps every
        sum from being ``-0.0``, and a ``±0.0`` addend changes no other bit
        of a sum, so the result has the bits it has when every rank fixes
        every row (a fused bucket's part gets its own call's bits either
        way). When every rank holds every row of values it owns, each
        touches ``1/P`` of them before the ``all_reduce``.
        """
        wire = cls._wire_dtype(inp, knobs)
        n, r = inp.size, inp.row_numel
        src = inp.values.detach() if inp.values.requires_grad else inp.values  # a donated leaf is still written
        vals = src.to(comm.device)
        owned = inp.owned or vals is not src  # a copy to another device is the call's own
        holders = [q for q, c in enumerate(inp.counts) if c == n]
        if not holders:
            lo, hi = 0, vals.shape[0]
        elif comm.rank in holders:
            j = holders.index(comm.rank)
            lo, hi = j * n // len(holders), (j + 1) * n // len(holders)
        else:
            lo = hi = 0
        if r == 0:
            vals = torch.zeros((vals.shape[0], 1), dtype=wire, device=comm.device)
        elif vals.dtype != wire:
            vals = cast(vals, wire)
            vals[lo:hi].add_(0.0)  # the sign fix after the rounding: a tiny negative rounds to -0.0
        elif hi > lo and not owned:
            # A copy, so the input keeps its bits: fixing every row costs it nothing more.
            vals = torch.add(vals, 0.0, out=out_buffer(vals.shape, wire, comm.device))
        elif hi > lo:
            vals[lo:hi].add_(0.0)
        if vals.shape[0] == n:  # the buffer itself; a collective takes it contiguous (a copy keeps a permuted input's strides)
            if (vals is src and not owned) or not vals.is_contiguous():
                vals = fresh(vals.shape, wire, comm.device).copy_(vals)
            return vals
        shape = (n, vals.shape[1])
        buf = torch.full(shape, -0.0, dtype=wire, device=comm.device, out=out_buffer(shape, wire, comm.device))
        if vals.shape[0]:
            buf.index_copy_(0, inp.indices.to(comm.device), vals)
        return buf

    @staticmethod
    def _extract(inp: SparseInput, buf: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the union (rows whose first element is not ``-0.0``) and its rows of the reduced ``buf``."""
        n, r = inp.size, inp.row_numel
        if max(inp.counts) == n:  # the record says every row is present
            if inp.parts is not None:
                inp.parts.sizes = [b - a for a, b in zip(inp.parts.bounds, inp.parts.bounds[1:])]
            # A rank holding every row holds the indices 0..n-1: its own, where the call may hand them back.
            union = inp.indices if inp.indices.shape[0] == n and _handed_back(inp, comm) else row_numbers(n, comm.device)
            return union, buf if r else buf[:, :0]
        if comm.world_size == 1:  # one rank: the union is its own coalesced indices (sorted, unique), no read
            union = inp.indices if _handed_back(inp, comm) else inp.indices.to(
                comm.device, copy=True, memory_format=torch.contiguous_format)
        else:
            size = buf.element_size()
            present = buf[:, 0].view(getattr(torch, _INT_OF_SIZE[size])) != _NEG_ZERO[size]
            if inp.parts is None:
                union = present.nonzero().view(-1)
            else:  # a fused bucket: the union's size and every tensor's in one read, so the cut reads nothing
                u = read_part_counts(present, upload(inp.parts.bounds, comm.device), inp.parts)
                union = mask_positions(present, u)
        if not r:
            return union, buf[: union.numel(), :0]
        return union, torch.index_select(buf, 0, union, out=out_buffer((union.numel(), r), buf.dtype, buf.device))

    def topk_allreduce(self, acc: torch.Tensor, state: Any, comm: Comm, knobs: dict[str, Any]) -> TopkOutput:
        total = comm.all_reduce(acc.clone())
        n = acc.numel()
        state.last_local_count = state.last_global_count = n
        return TopkOutput(indices=None, values=total, sent=None, local_count=n, global_count=n)
