"""Per-process state stays bounded: many names, sizes and groups do not grow a rank without limit."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from harness import pool


def _rank_many_names(rank: int, world_size: int, names: int, cap: int) -> dict:
    import colltune
    from colltune.select import selector

    sel = selector.Selector()
    old, selector.MAX_SITES = selector.MAX_SITES, cap
    try:
        sums = []
        for i in range(names):
            res = colltune.sparse_allreduce(torch.tensor([i % 7, 9]), torch.ones(2), 16, name=f"table{i}", policy=sel)
            sums.append(float(res.values.sum()))
        # The first name again, long forgotten: it decides afresh, the same way on every rank.
        again = colltune.sparse_allreduce(torch.tensor([1, 9]), torch.ones(2), 16, name="table0", policy=sel)
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
    import colltune
    from colltune.algorithms import comm

    def slots() -> int:
        return sum("meta.slot" in states for states in comm._GROUP_STATE.values())

    gc.collect()  # groups of earlier calls in this pool that are already destroyed go first
    before = slots()
    groups_before = len(dist.distributed_c10d._world.pg_map)
    for _ in range(3):
        group = dist.new_group(list(range(world_size)))
        colltune.sparse_allreduce(torch.tensor([rank]), torch.ones(1), 4, group=group, algorithm="allgather")
        during = slots()
        dist.destroy_process_group(group)
        del group
    gc.collect()
    groups_after = len(dist.distributed_c10d._world.pg_map)  # private twins included
    return {"before": before, "during": during, "after": slots(), "groups": (groups_before, groups_after)}


def test_eager_slot_state_lives_as_long_as_its_group():
    for o in pool(2).run(_rank_group_lifetime):
        assert o["during"] == o["before"] + 1
        assert o["after"] == o["before"], o
        assert o["groups"][0] == o["groups"][1], o  # a destroyed group took its private twin along


def test_name_codes_stop_growing_at_their_bound(monkeypatch):
    from colltune.algorithms import meta as _meta

    monkeypatch.setattr(_meta, "_MAX_NAMES", len(_meta._codes) + 5)
    codes = [_meta.name_code(f"shape-{i}") for i in range(50)]
    assert len(_meta._codes) == _meta._MAX_NAMES
    assert codes == [_meta.name_code(f"shape-{i}") for i in range(50)]  # still stable past the bound


def _rank_oktopk_sizes(rank: int, world_size: int, sizes: int, cap: int) -> dict:
    import colltune
    from colltune.algorithms import comm, oktopk

    before = len(comm._GROUP_STATE)
    group = dist.new_group(list(range(world_size)))
    old, oktopk.MAX_SIZES = oktopk.MAX_SIZES, cap
    try:
        dense = []
        for n in range(100, 100 + sizes):
            res = colltune.sparse_allreduce(torch.tensor([rank, n - 1]), torch.ones(2), n, group=group, algorithm="oktopk")
            dense.append(res.to_dense())
        kept = len(comm._GROUP_STATE[group][oktopk._STATE_KEY])
        # The first size again, long forgotten: it refreshes its boundaries, the same way on every rank.
        again = colltune.sparse_allreduce(torch.tensor([rank, 99]), torch.ones(2), 100, group=group, algorithm="oktopk")
    finally:
        oktopk.MAX_SIZES = old
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return {"kept": kept, "dense": dense, "again": again.to_dense(), "before": before,
            "after": len(comm._GROUP_STATE)}


def test_oktopk_keeps_state_for_a_bounded_number_of_sizes_per_living_group():
    out = pool(2).run(_rank_oktopk_sizes, 12, 4)
    for o in out:
        assert o["kept"] == 4
        for i, d in enumerate(o["dense"]):
            want = torch.zeros(100 + i)
            want[0] += 1
            want[1] += 1
            want[99 + i] += 2
            assert torch.equal(d, want)
        assert o["again"][99] == 2.0 and o["again"][0] == 1.0
    assert torch.equal(out[0]["again"], out[1]["again"])
    for o in out:
        assert o["after"] == o["before"], "the destroyed group's state outlived it"


def _rank_subgroup_sites(rank: int, world_size: int, cap: int) -> list:
    import colltune
    from colltune.select import selector

    sel = selector.Selector()
    old, selector.MAX_SITES = selector.MAX_SITES, cap
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    mine = pairs[rank // 2]
    out = []
    try:
        # A site on the default group, with an overlap known after the call.
        for _ in range(2):
            res = colltune.sparse_allreduce(torch.tensor([rank, 7]), torch.ones(2), 64, name="shared", policy=sel)
            out.append(res.to_dense())
        # Ranks 0 and 1 fill their pair's sites past the bound; ranks 2 and 3 make none.
        if rank < 2:
            for i in range(cap + 2):
                colltune.sparse_allreduce(torch.tensor([rank, i]), torch.ones(2), 64, group=mine, name=f"t{i}", policy=sel)
        # The shared site again: every rank still holds it, so every rank sends the same record.
        res = colltune.sparse_allreduce(torch.tensor([rank, 7]), torch.ones(2), 64, name="shared", policy=sel)
        out.append(res.to_dense())
    finally:
        selector.MAX_SITES = old
        for g in pairs:
            dist.destroy_process_group(g)
    return out


def test_sites_of_one_group_are_not_forgotten_for_calls_on_another():
    # One bound across groups made ranks 0 and 1 forget the default group's site while ranks 2 and 3
    # kept it: their next call on it disagreed on the record ("ranks disagree on 'eager'").
    out = pool(4).run(_rank_subgroup_sites, 3)
    for o in out:
        assert all(torch.equal(d, out[0][0]) for d in o)


def test_site_caches_of_living_groups_are_never_evicted_for_other_groups(monkeypatch):
    # Past MAX_GROUPS only destroyed groups' sites go: a rank in many more groups than another still
    # holds the sites of the groups they share.
    from colltune.algorithms import comm
    from colltune.select import selector

    monkeypatch.setattr(selector, "MAX_GROUPS", 4)
    monkeypatch.setattr(comm, "live_serials", lambda: {0, 7})
    sites = selector._Sites()
    shared = sites.site(("sparse", "t", 64, 1, "f", 2, 7))
    shared.overlap = 0.5
    for serial in range(100, 110):  # groups that are gone by now
        sites.site(("sparse", "t", 64, 1, "f", 2, serial))
    assert sites.get(("sparse", "t", 64, 1, "f", 2, 7)) is shared and shared.overlap == 0.5
    assert len(sites.groups) <= 4
