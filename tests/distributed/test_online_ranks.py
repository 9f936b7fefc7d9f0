"""Online correction across ranks: every rank learns the same figures and decides the same, whatever its clock.

Each rank's timer is skewed (rank r's clock reads 1 + 9 r times the real
time), as loaded hosts and unsynchronized clocks would make it. The
measurements ride in the next call's metadata record and every rank takes
the maximum, so the corrections, the explorations and every decision are
identical on every rank, for single calls, fused calls and top-k calls.
A rank with online correction off among ranks with it on raises
``RankMismatchError`` at the record instead of deciding apart.
"""

from __future__ import annotations

import pytest
import torch

import colltune
from colltune.select import online
from colltune.select.selector import Selector

from harness import expect_error, pool

N = 2**14


def _inputs(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * i + rank)
    k = (40, 400, 4000)[i % 3]
    return torch.randint(0, N, (k,), generator=g), torch.randn(k, generator=g)


def _rank_skewed(rank: int, world_size: int, kind: str) -> dict:
    sel = Selector(environ={})
    colltune.configure(selector=sel)
    real = online.Timer.us
    skew = 1.0 + 9.0 * rank

    def skewed(self: online.Timer) -> float | None:
        us = real(self)
        return None if us is None else us * skew

    online.Timer.us = skewed  # type: ignore[method-assign]
    try:
        seen = []
        state = colltune.algorithms.TopkState(density=0.05)
        for i in range(120):
            idx, vals = _inputs(rank, i)
            if kind == "sparse":
                res = [colltune.sparse_allreduce(idx, vals, N, name="s")]
            elif kind == "fused":
                res = colltune.sparse_allreduce_many([(idx, vals, N), (idx % 100, vals, 100)], name="f")
            else:
                res = [colltune.topk_allreduce(torch.randn(N, generator=torch.Generator().manual_seed(i + rank)),
                                               state, name="t")]
            seen.append([(r.algorithm, r.decision.source) for r in res])
        learned = {str(key): sorted(site.measured.items()) for sites in sel._sites.groups.values()
                   for key, site in sites.items() if site.measured}
        return {"seen": seen, "learned": learned}
    finally:
        online.Timer.us = real  # type: ignore[method-assign]
        colltune.configure()


@pytest.mark.parametrize("kind", ["sparse", "fused", "topk"])
def test_ranks_with_skewed_clocks_learn_the_same_and_decide_the_same(kind: str) -> None:
    out = pool(2).run(_rank_skewed, kind)
    assert out[0]["learned"], "the calls measured themselves and every rank learned the figures"
    assert out[1] == out[0]


def _rank_mixed_setting(rank: int, world_size: int) -> object:
    colltune.configure(selector=Selector(environ={}, online=rank == 0))
    try:
        idx, vals = _inputs(rank, 1)
        return expect_error(colltune.sparse_allreduce, idx, vals, N, name="mixed")
    finally:
        colltune.configure()


def test_ranks_that_set_online_correction_apart_raise() -> None:
    for o in pool(2).run(_rank_mixed_setting):
        assert o.type == "RankMismatchError" and "policy" in o.message, o


def _rank_subgroups(rank: int, world_size: int) -> list:
    """Ranks 0, 1 and ranks 2, 3 learn apart on their subgroups (0 and 1 find the algorithm they first chose
    10x slower there than the others find it), then all four decide on the world group."""
    import torch.distributed as dist

    from colltune.api import group_key

    sel = Selector(environ={})
    colltune.configure(selector=sel)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    observe = sel.observe_time
    first: list[str] = []

    def slanted(site_key: tuple, algorithm: str, predicted: float, measured: float, explored: bool = False) -> None:
        first[:] = first or [algorithm]
        if rank < 2 and site_key[-1] == group_key(mine) and algorithm == first[0]:
            measured *= 10.0
        observe(site_key, algorithm, predicted, measured, explored)

    sel.observe_time = slanted  # type: ignore[method-assign]
    try:
        for i in range(150):
            idx, vals = _inputs(rank, i)
            colltune.sparse_allreduce(idx, vals, N, name="pair", group=mine)
        seen = []
        for i in range(60):
            idx, vals = _inputs(rank, i)
            res = colltune.sparse_allreduce(idx, vals, N, name="world")
            seen.append((res.algorithm, res.decision.source))
        return seen
    finally:
        colltune.configure()
        for g in pairs:
            dist.destroy_process_group(g)


def test_ranks_that_learned_apart_on_subgroups_still_decide_alike_on_a_shared_group() -> None:
    out = pool(4).run(_rank_subgroups)
    assert all(o == out[0] for o in out[1:])


def _one_off_calls(rank: int, world_size: int) -> list[bool]:
    from colltune.algorithms import get
    from colltune.api import open_comm

    idx, vals = _inputs(rank, 1)
    algo, knobs = get("oktopk"), {**get("oktopk").knobs, "boundary_refresh": 3}
    out = []
    for _ in range(7):
        out.append(algo.one_off(open_comm(None, vals, None), N, knobs))  # the call's view of the group
        colltune.sparse_allreduce(idx, vals, N, algorithm="oktopk", knobs={"boundary_refresh": 3})
    return out


def test_the_calls_that_refresh_ok_topks_boundaries_are_one_off():
    # Online correction does not learn from them: the first at a size, then every boundary_refresh calls.
    for seen in pool(2).run(_one_off_calls):
        assert seen == [True, False, False, True, False, False, True], seen
