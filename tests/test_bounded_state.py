"""Per-process state stays bounded: many names, sizes and groups do not grow a rank without limit."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from harness import pool


def _rank_many_names(rank: int, world_size: int, names: int, cap: int) -> dict:
    import tuner
    from tuner import selector

    sel = selector.Selector()
    old, selector.MAX_SITES = selector.MAX_SITES, cap
    try:
        sums = []
        for i in range(names):
            res = tuner.sparse_allreduce(torch.tensor([i % 7, 9]), torch.ones(2), 16, name=f"table{i}", policy=sel)
            sums.append(float(res.values.sum()))
        # The first name again, long forgotten: it decides afresh, the same way on every rank.
        again = tuner.sparse_allreduce(torch.tensor([1, 9]), torch.ones(2), 16, name="table0", policy=sel)
    finally:
        selector.MAX_SITES = old
    return {"sites": len(sel._sites), "sums": sums, "again": again.to_dense()}


def test_decision_cache_forgets_the_least_recently_used_site():
    out = pool(2).run(_rank_many_names, 20, 8)
    for o in out:
        assert o["sites"] == 8
        assert o["sums"] == [4.0] * 20
    assert torch.equal(out[0]["again"], out[1]["again"])
    assert out[0]["again"][9] == 2.0 and out[0]["again"][1] == 2.0


def _rank_group_lifetime(rank: int, world_size: int) -> dict:
    import tuner
    from algorithms import _meta

    before = len(_meta._slot_state)
    for _ in range(3):
        group = dist.new_group(list(range(world_size)))
        tuner.sparse_allreduce(torch.tensor([rank]), torch.ones(1), 4, group=group, algorithm="allgather")
        during = len(_meta._slot_state)
        dist.destroy_process_group(group)
        del group
    gc.collect()
    return {"before": before, "during": during, "after": len(_meta._slot_state)}


def test_eager_slot_state_lives_as_long_as_its_group():
    for o in pool(2).run(_rank_group_lifetime):
        assert o["during"] == o["before"] + 1
        assert o["after"] == o["before"], o


def test_name_codes_stop_growing_at_their_bound(monkeypatch):
    from algorithms import _meta

    monkeypatch.setattr(_meta, "_MAX_NAMES", len(_meta._codes) + 5)
    codes = [_meta.name_code(f"shape-{i}") for i in range(50)]
    assert len(_meta._codes) == _meta._MAX_NAMES
    assert codes == [_meta.name_code(f"shape-{i}") for i in range(50)]  # still stable past the bound
