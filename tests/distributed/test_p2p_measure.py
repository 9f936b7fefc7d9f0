"""``colltune.offline.p2p``: the point-to-point figures a profile carries, measured on the group's ranks."""

from __future__ import annotations

import socket

import pytest

from colltune.model import nccl
from colltune.offline.p2p import partners

from harness import run_ranks


def test_partners_pair_ranks_within_nodes_and_nodes_by_local_index() -> None:
    two_by_four = [7, 7, 7, 7, 9, 9, 9, 9]
    assert [partners(two_by_four, r) for r in range(8)] == [
        (1, 4), (0, 5), (3, 6), (2, 7), (5, 0), (4, 1), (7, 2), (6, 3)]
    assert [partners([5, 5, 5], r) for r in range(3)] == [(1, None), (0, None), (None, None)]  # one node, odd
    assert [partners([1, 2, 3], r) for r in range(3)] == [(None, 1), (None, 0), (None, None)]  # one rank per node
    assert partners([4, 4, 6], 2) == (None, 0) and partners([4, 4, 6], 1) == (0, None)  # uneven nodes


def _measure(rank: int, world_size: int, per_node: int) -> dict:
    from colltune.offline.p2p import measure_p2p

    real = socket.gethostname
    socket.gethostname = lambda: f"node-{rank // per_node}"  # type: ignore[assignment]
    try:
        return measure_p2p(large_bytes=1 << 16)
    finally:
        socket.gethostname = real  # type: ignore[assignment]


@pytest.mark.parametrize(("world_size", "per_node", "levels"), [
    (2, 2, {"intra_node"}), (2, 1, {"inter_node"}), (4, 2, {"intra_node", "inter_node"})])
def test_every_rank_gets_the_same_figures_for_the_levels_the_group_has(world_size, per_node, levels) -> None:
    got = run_ranks(_measure, world_size, per_node)
    assert all(g == got[0] for g in got)
    assert set(got[0]) == levels
    for figures in got[0].values():
        assert figures["latency_us"] > 0 and figures["bandwidth_GBps"] > 0
    nccl.P2P.from_meta(got[0])  # what a profile's meta.p2p takes
