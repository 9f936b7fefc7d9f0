"""Torch's own types at the front door: ``dist.ReduceOp`` and sparse COO tensors.

``op`` takes ``dist.ReduceOp.SUM`` and ``AVG`` as well as their names, and
any other op is refused on every rank with the supported ones listed. A
sparse COO tensor (what ``nn.Embedding(sparse=True)`` leaves in ``.grad``,
uncoalesced) is passed alone; the result equals the one of its indices and
values, and ``to_sparse_coo()`` is coalesced. Passing a COO tensor together
with values or a size raises on every rank, naming what to pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import colltune

from harness import expect_error, pool

ROWS, DIM = 50, 4


def _embedding_grad(rank: int) -> torch.Tensor:
    torch.manual_seed(0)
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    ids = torch.tensor([rank, 7, 7, 3 * rank + 11, 49])
    (emb(ids) * (rank + 1)).sum().backward()
    return emb.weight.grad


def _rank_coo(rank: int, world_size: int, algorithm: str) -> dict:
    grad = _embedding_grad(rank)
    alone = colltune.sparse_allreduce(grad, algorithm=algorithm)
    parts = colltune.sparse_allreduce(grad._indices()[0], grad._values(), grad.shape, algorithm=algorithm)
    avg = colltune.sparse_allreduce(grad, op=dist.ReduceOp.AVG, algorithm=algorithm)
    total = grad.to_dense().clone()
    dist.all_reduce(total)
    coo = alone.to_sparse_coo()
    return {
        "same_as_parts": torch.equal(alone.indices, parts.indices) and torch.equal(alone.values, parts.values),
        "coalesced": coo.is_coalesced() and coo.shape == grad.shape,
        "dense": alone.to_dense(),
        "reference": total,
        "avg": avg.to_dense(),
    }


@pytest.mark.parametrize("algorithm", ["auto", *colltune.algorithms.names()])
def test_sparse_coo_tensor_passed_alone(algorithm: str) -> None:
    out = pool(2).run(_rank_coo, algorithm)
    for o in out:
        assert o["same_as_parts"] and o["coalesced"]
        assert torch.allclose(o["dense"], o["reference"])
        assert torch.allclose(o["avg"], o["reference"] / 2)
    assert torch.equal(out[0]["dense"], out[1]["dense"])


def _rank_ops(rank: int, world_size: int) -> dict:
    idx, vals = torch.tensor([1, 2 + rank]), torch.tensor([1.0, 2.0])
    by_name = colltune.sparse_allreduce(idx, vals, 8, op="sum")
    by_op = colltune.sparse_allreduce(idx, vals, 8, op=dist.ReduceOp.SUM)
    state = colltune.TopkState(k=2)
    topk = colltune.topk_allreduce(torch.arange(8.0), state, op=dist.ReduceOp.AVG, algorithm="allgather")
    return {
        "same": torch.equal(by_name.to_dense(), by_op.to_dense()),
        "topk": topk.to_dense(),
        "max": expect_error(colltune.sparse_allreduce, idx, vals, 8, op=dist.ReduceOp.MAX),
        "max_topk": expect_error(colltune.topk_allreduce, torch.arange(8.0), colltune.TopkState(k=2),
                                 op=dist.ReduceOp.MAX),
    }


def test_reduce_ops_sum_and_avg_accepted_others_refused_on_every_rank() -> None:
    for o in pool(2).run(_rank_ops):
        assert o["same"]
        assert torch.equal(o["topk"], torch.tensor([0, 0, 0, 0, 0, 0, 6.0, 7.0]))
        for key in ("max", "max_topk"):
            raised = o[key]
            assert raised.type == "ColltuneValueError", raised
            assert "ReduceOp.MAX" in raised.message and "dist.ReduceOp.SUM" in raised.message


def _rank_coo_mistakes(rank: int, world_size: int) -> dict:
    grad = _embedding_grad(rank)
    other = torch.tensor([1]), torch.ones(1)
    return {
        "with_size": expect_error(colltune.sparse_allreduce, grad, ROWS),
        "with_values": expect_error(colltune.sparse_allreduce, grad, grad._values()),
        "size_keyword": expect_error(colltune.sparse_allreduce, grad, size=grad.shape),
        "values_coo": expect_error(colltune.sparse_allreduce, grad._indices()[0], grad, ROWS),
        "no_size": expect_error(colltune.sparse_allreduce, *other),
        # one rank's mistake reaches the other rank as RemoteInputError
        "one_rank": expect_error(colltune.sparse_allreduce, grad, ROWS) if rank == 0
        else expect_error(colltune.sparse_allreduce, grad),
    }


def test_coo_mistakes_name_what_to_pass_on_every_rank() -> None:
    out = pool(2).run(_rank_coo_mistakes)
    for o in out:
        for key in ("with_size", "with_values", "size_keyword"):
            assert o[key].type == "ColltuneTypeError", (key, o[key])
            assert "pass it alone, sparse_allreduce(t)" in o[key].message
        assert "values is a sparse COO tensor" in o["values_coo"].message
        assert o["no_size"].type == "ColltuneTypeError" and "size is required" in o["no_size"].message
    assert out[0]["one_rank"].type == "ColltuneTypeError"
    assert out[1]["one_rank"].type == "RemoteInputError" and "rank 0" in out[1]["one_rank"].message
