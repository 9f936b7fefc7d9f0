"""Dense allreduce: densify, ``all_reduce``, extract the union.

Best when the data is dense or the group is large: its cost does not depend
on the number of entries, only on the dense size ``n * row_bytes``.

The union of the ranks' indices travels in a second ``all_reduce`` of a
one-byte-per-row mask (``MAX``), so that the result holds exactly the
indices some rank sent, as every other algorithm's does, even where a sum
cancels to zero. fp16 and bf16 are reduced in fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from colltune.algorithms.base import Algorithm, SparseInput, TopkOutput
from colltune.algorithms.comm import Comm
from colltune.algorithms.registry import register
from colltune.algorithms.schedule import Pricing, Step

__all__ = ["Dense"]


@register
class Dense(Algorithm):
    """Densify, ``all_reduce``, and extract the rows of the union."""

    name = "dense"
    TERMS = ("metadata", "value_all_reduce", "mask_all_reduce", "densify_extract")
    #: The record (the coalesce's count rides in it), the union's size; top-k: the record.
    HOST_SYNCS = {"exact": 2, "topk": 1}
    topk_priced_on = "tensor"  # top-k mode all-reduces the whole accumulated tensor

    def schedule(self, pricing: Pricing, knobs: dict[str, Any]) -> list[Step]:
        """The record, the values' and the mask's all_reduce, then densify and extract the union.

        In top-k mode the accumulated tensor is already dense: its
        all_reduce is the whole call (no mask travels, nothing is densified;
        the local work is the copy reduced in place and the zeroed residual).
        """
        c = pricing
        if c.topk:
            return [
                c.metadata(),
                c.all_reduce("value_all_reduce", c.n * c.rba),
                c.free("mask_all_reduce", "all_reduce"),
                c.local("densify_extract", 3 * c.n * c.rba, 2.0),
            ]
        return [
            c.metadata(),
            c.all_reduce("value_all_reduce", c.n * c.rba),
            c.all_reduce("mask_all_reduce", c.n),
            c.local("densify_extract", c.n * c.rba + 2 * c.n + c.kavg * c.e + c.u * c.out_entry, 4.0),
        ]

    def sparse_allreduce(self, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        buf, mask = self._densify(inp, comm)
        comm.all_reduce(buf)
        with comm.meta():
            comm.all_reduce(mask, op="max")
        union = mask.nonzero().view(-1)
        return union, buf.index_select(0, union)

    def sparse_allreduce_parts(
        self, inp: SparseInput, comm: Comm, knobs: dict[str, Any], bounds: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One buffer and one mask for every part; each part's values summed as its own call sums them.

        A backend's ``all_reduce`` sums an element in an order set by the
        buffer's size and the element's place in it, so each part's values
        go through :meth:`Comm.all_reduce_parts`, which gives every part the
        bits of an ``all_reduce`` of that part alone. The mask's ``MAX`` is
        exact in any order: one ``all_reduce`` for all parts.
        """
        if len(bounds) <= 2:
            return self.sparse_allreduce(inp, comm, knobs)
        buf, mask = self._densify(inp, comm)
        comm.all_reduce_parts(buf, bounds)
        with comm.meta():
            comm.all_reduce(mask, op="max")
        union = mask.nonzero().view(-1)
        return union, buf.index_select(0, union)

    @staticmethod
    def _densify(inp: SparseInput, comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this rank's entries as a dense ``[n, r]`` buffer and a one-byte-per-row mask."""
        buf = torch.zeros((inp.size, inp.row_numel), dtype=inp.acc_dtype, device=comm.device)
        mask = torch.zeros(inp.size, dtype=torch.uint8, device=comm.device)
        idx = inp.indices.to(comm.device)
        if idx.numel():
            buf.index_copy_(0, idx, inp.values.to(comm.device))
            mask[idx] = 1
        return buf, mask

    def topk_allreduce(self, acc: torch.Tensor, state: Any, comm: Comm, knobs: dict[str, Any]) -> TopkOutput:
        total = comm.all_reduce(acc.clone())
        n = acc.numel()
        state.last_local_count = state.last_global_count = n
        return TopkOutput(indices=None, values=total, sent=None, local_count=n, global_count=n)
