"""The metadata record summed as a table (NCCL from 32 ranks) gives what the gather gives, on every rank.

The small gathers of control data (``Comm.gather_small``: owners' sizes, counts) follow the same rule.

gloo gathers records point to point, so the test switches the rule on for
its ranks (``comm.record_by_all_reduce``, read when a call's ``Comm`` is
made) and compares every algorithm's bits, the records' verdicts and the
traffic with the same calls on the gathered record.
"""

from __future__ import annotations

import pytest
import torch

import colltune
from colltune.algorithms.errors import RemoteInputError
from colltune.algorithms.registry import BUILTIN_NAMES

from harness import expect_error, run_ranks

ALGORITHMS = (*BUILTIN_NAMES, "auto")


def _calls(rank: int, world_size: int, summed: bool) -> dict:
    from colltune.algorithms import comm

    if summed:
        comm.record_by_all_reduce = lambda world_size, collective: True  # type: ignore[assignment]
    g = torch.Generator().manual_seed(7 + rank)
    out: dict = {}
    for algorithm in ALGORITHMS:
        for row in (1, 8):
            idx = torch.randint(0, 5000, (300 + 50 * rank,), generator=g)
            vals = torch.randn((idx.numel(), row) if row > 1 else (idx.numel(),), generator=g)
            res = colltune.sparse_allreduce(idx, vals, 5000, algorithm=algorithm)
            out[(algorithm, row)] = (res.indices, res.values, res.traffic.meta_bytes, dict(res.traffic.by_primitive))
    tensors = [(torch.tensor([rank, 9]), torch.ones(2), 40), (torch.arange(rank + 1), torch.ones(rank + 1, 4), 50)]
    out["fused"] = [(r.indices, r.values) for algorithm in ("auto", "oktopk", "hashpart")
                    for r in colltune.sparse_allreduce_many(tensors, algorithm=algorithm)]
    for algorithm in ("oktopk", "hashpart"):  # top-k: the kept counts are gathered small too
        state = colltune.TopkState(density=0.01)
        for step in range(4):
            grad = torch.randn(4000, generator=torch.Generator().manual_seed(100 * step + rank))
            res = colltune.topk_allreduce(grad, state, algorithm=algorithm)
        out[f"topk {algorithm}"] = (res.indices, res.values)
    bad = torch.tensor([99]) if rank == 1 else torch.tensor([0])  # out of range on rank 1 only
    out["error"] = expect_error(colltune.sparse_allreduce, bad, torch.ones(1), 10).type
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_summed_record_gives_the_gathered_records_bits_and_verdicts(world_size: int) -> None:
    gathered = run_ranks(_calls, world_size, False)
    summed = run_ranks(_calls, world_size, True)
    for rank in range(world_size):
        g, s = gathered[rank], summed[rank]
        for key in g:
            if key in ("fused", "error") or str(key).startswith("topk"):
                continue
            assert torch.equal(g[key][0], s[key][0]) and torch.equal(g[key][1], s[key][1]), (rank, key)
            assert torch.equal(s[key][1], summed[0][key][1]), (rank, key)  # every rank the same bits
            calls = {prim: (g[key][3].get(prim, {}).get("calls", 0), s[key][3].get(prim, {}).get("calls", 0))
                     for prim in ("all_gather", "all_reduce")}
            # The record, and the small gathers of control data (owners' sizes, counts), summed instead of
            # gathered: one all_reduce more for each all_gather less, the record at least.
            summed_now = calls["all_reduce"][1] - calls["all_reduce"][0]
            assert summed_now == calls["all_gather"][0] - calls["all_gather"][1] >= 1, (key, calls)
            if key[0] in ("oktopk", "hashpart"):
                assert summed_now == 2, (key, calls)  # the record and the owners' sizes
        for (gi, gv), (si, sv) in zip(g["fused"], s["fused"]):
            assert torch.equal(gi, si) and torch.equal(gv, sv)
        assert g["error"] == s["error"]
        for key in ("topk oktopk", "topk hashpart"):
            assert all(torch.equal(a, b) for a, b in zip(g[key], s[key])), key
        assert s["error"] == ("ColltuneValueError" if rank == 1 else RemoteInputError.__name__)
