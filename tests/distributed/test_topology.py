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


def _gathers_by_layout(rank: int, world_size: int) -> dict:
    """Run wide-row allgather and Ok-Topk (wide and narrow rows) on both paths, on one node and on "2 nodes"."""
    import socket

    from colltune.algorithms import oktopk
    from colltune.algorithms.comm import Comm, ranks_per_node
    from colltune.algorithms.sparse import device_path

    real = socket.gethostname
    socket.gethostname = lambda: f"node-{rank // 2}"  # two ranks per node: a new group spans two nodes
    try:
        split = dist.new_group(list(range(world_size)))
        colltune.sparse_allreduce(torch.tensor([rank]), torch.ones(1), 8, group=split)  # its layout, learned here
    finally:
        socket.gethostname = real
    colltune.sparse_allreduce(torch.tensor([rank]), torch.ones(1), 8)  # the default group's layout: one node
    out: dict = {"layout": (ranks_per_node(None), ranks_per_node(split))}
    hits: list[str] = []
    rows, eager = Comm.all_gather_rows, oktopk._gather_regions_eager
    Comm.all_gather_rows = lambda self, *a, **k: (hits.append("p2p"), rows(self, *a, **k))[1]  # type: ignore[method-assign]
    oktopk._gather_regions_eager = lambda *a, **k: (hits.append("eager"), eager(*a, **k))[1]
    try:
        g = torch.Generator().manual_seed(rank)
        for where, group in (("one node", None), ("two nodes", split)):
            for algorithm, row in (("allgather", 16), ("oktopk", 16), ("oktopk", 1)):
                size = 20000 + 10 * row + (algorithm == "oktopk")  # a size of its own: Ok-Topk's state per size
                idx = torch.randperm(size, generator=g)[:2000]
                vals = torch.randn(2000, row, generator=g)
                for device in (False, True):
                    with device_path(device):
                        hits.clear()
                        for _ in range(2):  # Ok-Topk's eager gather needs the sizes of a call before
                            res = colltune.sparse_allreduce(idx, vals, size, algorithm=algorithm, group=group)
                        out[where, algorithm, row, device] = (res.indices.clone(), res.values.clone(), sorted(set(hits)))
    finally:
        Comm.all_gather_rows, oktopk._gather_regions_eager = rows, eager  # type: ignore[method-assign]
    return out


def test_auto_gathers_collectively_across_nodes_on_the_device_path() -> None:
    # On the host path, and on one node, auto sends wide rows and Ok-Topk's regions point to point; on the
    # device path (NCCL) across nodes it gathers them collectively. Either way, the same bits.
    out = pool(4).run(_gathers_by_layout, timeout=120)
    for o in out:
        assert o["layout"] == (4, 2)
        for where in ("one node", "two nodes"):
            for algorithm, row in (("allgather", 16), ("oktopk", 16), ("oktopk", 1)):
                host, dev = o[where, algorithm, row, False], o[where, algorithm, row, True]
                assert torch.equal(host[0], dev[0]) and torch.equal(host[1].view(torch.int32), dev[1].view(torch.int32))
                assert torch.equal(dev[0], out[0][where, algorithm, row, True][0])
                point_to_point = ["eager"] if row == 1 else ["p2p"]
                assert host[2] == point_to_point, (where, algorithm, row, host[2])
                assert dev[2] == (point_to_point if where == "one node" else []), (where, algorithm, row, dev[2])
