"""The collective primitives of :class:`colltune.algorithms.comm.Comm`: direct (point to point) against the backend's own.

On gloo, groups of 3 or more ranks run ``all_gather``, ``all_to_all`` and
small ``all_reduce`` calls direct; these tests check that both ways give the
same data (integers: exact; floats: the same bits on every rank, and close to
the backend's sum), and that traffic is counted as the module documents.
"""

from __future__ import annotations

import pytest
import torch

from harness import pool


def _run_primitives(rank, world_size):
    from colltune.algorithms.comm import DIRECT_ALL_REDUCE_BYTES, Comm

    p = world_size
    out = {"default_direct": Comm(None, torch.device("cpu")).direct}
    for direct in (False, True):
        comm = Comm(None, torch.device("cpu"), direct=direct)
        g = torch.Generator().manual_seed(rank)
        rec = {}
        rec["gather_2d"] = comm.all_gather(torch.arange(6, dtype=torch.int64).view(3, 2) + 100 * rank)
        rec["gather_empty"] = comm.all_gather(torch.empty((0, 3)))
        send = [(rank + j) % 3 for j in range(p)]  # zeros included
        t = torch.arange(sum(send), dtype=torch.int32) + 1000 * rank
        recv = [(j + rank) % 3 for j in range(p)]  # what rank j sends this rank
        rec["a2a"] = comm.all_to_all(t, send, recv)
        rec["sum_int"] = comm.all_reduce(torch.full((5,), rank + 1, dtype=torch.int64))
        rec["max_u8"] = comm.all_reduce((torch.arange(16) % (rank + 2) == 0).to(torch.uint8), op="max")
        rec["sum_f32"] = comm.all_reduce(torch.randn(33, generator=g))
        before = comm.traffic.bytes_sent
        comm.all_reduce(torch.zeros(DIRECT_ALL_REDUCE_BYTES // 4 + 1))  # too big to go direct
        rec["big_bytes"] = comm.traffic.bytes_sent - before
        rec["by_primitive"] = comm.traffic.as_dict()["by_primitive"]
        out[direct] = rec
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_direct_primitives_match_the_backend(world_size):
    from colltune.algorithms.comm import DIRECT_ALL_REDUCE_BYTES

    p = world_size
    out = pool(p).run(_run_primitives)
    for rank, o in enumerate(out):
        assert o["default_direct"] == (p > 2), "gloo groups of 3 or more run direct by default"
        ring, direct = o[False], o[True]
        for key in ("gather_2d", "gather_empty", "a2a", "sum_int", "max_u8"):
            assert torch.equal(ring[key], direct[key]), (rank, key)
        want_gather = torch.cat([torch.arange(6).view(3, 2) + 100 * j for j in range(p)])
        assert torch.equal(direct["gather_2d"], want_gather), rank
        # Rank j sends (j + k) % 3 values to rank k, numbered on from 1000 j; this rank gets its slice of each.
        parts = []
        for j in range(p):
            start = sum((j + k) % 3 for k in range(rank))
            parts.append(torch.arange(start, start + (j + rank) % 3, dtype=torch.int32) + 1000 * j)
        want_a2a = torch.cat(parts)
        assert torch.equal(direct["a2a"], want_a2a), rank
        assert torch.equal(direct["sum_int"], torch.full((5,), p * (p + 1) // 2))
        assert torch.allclose(direct["sum_f32"], ring["sum_f32"], rtol=1e-5, atol=1e-6)
        # Bytes: gathers and exchanges as the module documents; a direct all_reduce sends (P-1) L.
        assert direct["by_primitive"]["all_gather"]["bytes"] == ring["by_primitive"]["all_gather"]["bytes"]
        assert direct["by_primitive"]["all_to_all"] == ring["by_primitive"]["all_to_all"]
        assert ring["big_bytes"] == direct["big_bytes"] == 2 * (DIRECT_ALL_REDUCE_BYTES + 4) * (p - 1) // p
    # Every rank holds the same float sum, bit for bit.
    for direct in (False, True):
        sums = [o[direct]["sum_f32"] for o in out]
        assert all(torch.equal(s.view(torch.int32), sums[0].view(torch.int32)) for s in sums), direct
