"""The group's layout on nodes, learned once per group at its first call and handed to the cost model."""

from __future__ import annotations

import torch
import torch.distributed as dist

import colltune

from harness import pool


def _rank_layout(rank: int, world_size: int) -> dict:
    from colltune.algorithms.comm import ranks_per_node

    sub = dist.new_group([0, 1]) if world_size > 2 else None
    before = ranks_per_node(sub) if sub is not None and rank < 2 else None
    res = colltune.sparse_allreduce(torch.tensor([rank]), torch.ones(1), 8)
    got = {"world": ranks_per_node(None), "algorithm": res.algorithm, "before": before}
    if sub is not None and rank < 2:
        colltune.sparse_allreduce(torch.tensor([rank]), torch.ones(1), 8, group=sub)
        got["sub"] = ranks_per_node(sub)
    return got


def test_local_ranks_share_one_node() -> None:
    out = pool(3).run(_rank_layout)
    for r, o in enumerate(out):
        assert o["world"] == 3
        if r < 2:
            assert o["before"] is None and o["sub"] == 2
