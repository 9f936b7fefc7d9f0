"""The group's layout on nodes, learned once per group at its first call and handed to the cost model."""

from __future__ import annotations

import torch
import torch.distributed as dist

import colltune

from harness import pool


def _rank_layout(rank: int, world_size: int) -> dict:
    from colltune import api
    from colltune.algorithms.comm import Comm

    sub = dist.new_group([0, 1]) if world_size > 2 else None
    res = colltune.sparse_allreduce(torch.tensor([rank]), torch.ones(1), 8)
    got = {"world": Comm(None, torch.device("cpu")).group_state(api._RANKS_PER_NODE), "algorithm": res.algorithm}
    if sub is not None and rank < 2:
        colltune.sparse_allreduce(torch.tensor([rank]), torch.ones(1), 8, group=sub)
        got["sub"] = Comm(sub, torch.device("cpu")).group_state(api._RANKS_PER_NODE)
    return got


def test_local_ranks_share_one_node() -> None:
    out = pool(3).run(_rank_layout)
    for r, o in enumerate(out):
        assert o["world"] == 3
        if r < 2:
            assert o["sub"] == 2
