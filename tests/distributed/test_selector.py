"""The selector: policy, then the cost model's argmin, then dense; caching, hysteresis, agreement across ranks.

Pure tests use a synthetic analytic profile (a slow network, so that all
three algorithms win somewhere) and a stand-in group; distributed tests run
``algorithm="auto"`` end to end on gloo ranks (tests/harness.py).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from colltune.model.features import (
    Features,
    bitmap_indices,
    bitmap_positions_torch,
    make_bitmap,
    make_bitmap_torch,
    overlap_bitmap_bits,
)
from colltune.model.policy import parse_policy
from colltune.model.profile import Primitive, Profile
from colltune.select.selector import SAFE_DEFAULT, Selector, _bucket, candidates, profiles_dir, shipped_profile

from harness import expect_error, pool

# --------------------------------------------------------------------------- fixtures

_NET = Primitive(alpha_us=20.0, beta_us_per_byte=1e-3, launch_us=10.0)
SYNTHETIC = Profile(
    kind="analytic",
    meta={"backend": "gloo", "notes": "synthetic: a 1 GB/s network, fast local memory"},
    primitives={
        "all_reduce": _NET,
        "all_gather": _NET,
        "all_to_all": _NET,
        "p2p": Primitive(alpha_us=20.0, beta_us_per_byte=1e-3, launch_us=5.0),
        "local": Primitive(alpha_us=2.0, beta_us_per_byte=1e-5, launch_us=0.0),
    },
)


class _Group:
    """What the selector reads of a group when no collective is due."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        self.world_size, self.rank, self.device = world_size, rank, torch.device("cpu")

    def all_reduce(self, *a, **k):  # pragma: no cover - a test that reaches it is wrong
        raise AssertionError("no collective expected: the overlap was seeded")


def _features(n: int, density: float, p: int, overlap: float) -> Features:
    k = max(1, round(density * n))
    big_k = p * k
    return Features.build(numel=n, row_numel=1, dtype="float32", k_per_rank=[k] * p, union=big_k - overlap * (big_k - k))


def _decide(sel: Selector, n: int, counts, overlap: float, site=("sparse", "w", None)):
    """Seed the site's overlap (as a completed call would), then decide."""
    p = len(counts)
    key = site + (n, p)
    k_sum, k_max = sum(counts), max(counts)
    sel.observe_sparse(key, counts, round(k_sum - overlap * (k_sum - k_max)))
    return sel.decide_sparse(key, comm=_Group(p), backend="gloo", name="w", size=n, row_numel=1,
                             dtype=torch.float32, counts=tuple(counts), indices=None)


# --------------------------------------------------------------------------- the choice


def test_candidates_are_the_registered_algorithms_with_a_schedule():
    from colltune import algorithms
    from colltune.model.cost_model import ALGORITHMS as BUILTIN

    assert candidates() == BUILTIN == algorithms.names()


@pytest.mark.parametrize(
    "n, density, p, overlap, expected",
    [
        (2**20, 0.8, 4, 0.9, "dense"),          # nearly dense: the sparse formats only add index bytes
        (2**20, 1e-5, 8, 0.0, "allgather"),     # tiny: latency decides, one gather
        (2**20, 1e-4, 8, 0.5, "allgather"),
        (2**20, 2e-2, 8, 1.0, "oktopk"),        # large k, identical sets: split-reduce wins
        (2**20, 5e-2, 8, 0.9, "oktopk"),
        (2**20, 2e-2, 8, 0.0, "allgather"),     # ... but not when the sets are disjoint
    ],
)
def test_synthetic_profile_choices(n, density, p, overlap, expected):
    sel = Selector(profile=SYNTHETIC, environ={})
    e = sel.explain(_features(n, density, p, overlap))
    assert e.choice.algorithm == expected, e.choice.reason
    assert e.choice.source == "model"
    pred = {r.algorithm: r.predicted_us for r in e.rows}
    assert min(pred, key=pred.get) == expected
    assert e.choice.term is not None and e.choice.term.split(".")[0] in candidates()


def test_decide_uses_the_cost_model_and_caches_per_site():
    sel = Selector(profile=SYNTHETIC, environ={}, reevaluate_every=4)
    first = _decide(sel, 2**20, [20972] * 8, 1.0)
    assert (first.algorithm, first.source, first.cached) == ("oktopk", "model", False)
    assert set(first.predicted_us) == set(candidates()) and first.overlap_source == "previous call"
    again = [_decide(sel, 2**20, [20972] * 8, 1.0) for _ in range(3)]
    assert all(c.cached and c.algorithm == "oktopk" for c in again)
    # Every reevaluate_every calls the decision is taken again.
    assert not _decide(sel, 2**20, [20972] * 8, 1.0).cached
    # A drift out of the band (counts, or overlap) re-evaluates at once.
    assert not _decide(sel, 2**20, [20972] * 8, 0.0).cached
    moved = _decide(sel, 2**20, [20972 * 2] * 8, 0.0)
    assert not moved.cached


def test_calls_that_wander_inside_a_bucket_stop_being_decided_again_once_both_ends_agree():
    sel = Selector(profile=SYNTHETIC, environ={}, overlap_band=0.05, count_band=0.1)
    n = 2**20
    # Two calls alternating in one bucket of K, each outside the other's band: counts 18% apart, overlaps 0.2 apart.
    a, b = ([17000] * 8, 1.0), ([20000] * 8, 0.8)
    first, second, third = _decide(sel, n, *a), _decide(sel, n, *b), _decide(sel, n, *a)
    assert first.algorithm == second.algorithm == third.algorithm == "oktopk"
    assert _bucket(8 * 17000) == _bucket(8 * 20000)
    assert not first.cached and not second.cached  # b was outside a's band: decided, the same algorithm
    assert third.cached  # the entry now covers both
    assert all(_decide(sel, n, *c).cached for c in (b, a, b, a))
    # Outside the range both ends confirmed, or another algorithm's region, the call is decided again.
    assert not _decide(sel, n, [17000] * 8, 0.5).cached


def test_hysteresis_holds_a_choice_near_a_boundary():
    sel = Selector(profile=SYNTHETIC, environ={}, reevaluate_every=1, overlap_band=0.0, margin=0.05)
    n, counts = 2**20, [20972] * 8
    # Find where oktopk overtakes allgather as overlap grows.
    grid = np.linspace(0, 1, 201)
    fresh = Selector(profile=SYNTHETIC, environ={})  # explain() keeps no state: no incumbent
    winners = [fresh.explain(_features(n, 0.02, 8, o)).choice.algorithm for o in grid]
    cross = next(i for i, w in enumerate(winners) if w == "oktopk")
    assert 0 < cross < 200 and winners[cross - 1] == "allgather"
    lo, hi = grid[cross - 2], grid[cross + 1]
    start = _decide(sel, n, counts, lo)
    assert start.algorithm == "allgather"
    seen = [_decide(sel, n, counts, o).algorithm for o in (hi, lo, hi, lo, hi)]
    assert seen == ["allgather"] * 5, "near the boundary the incumbent must hold (no flapping)"
    held = _decide(sel, n, counts, hi)
    assert held.source == "hysteresis" and "within 5%" in held.reason
    # Far from the boundary the better algorithm takes over, and then holds in turn.
    assert _decide(sel, n, counts, 1.0).algorithm == "oktopk"
    assert [_decide(sel, n, counts, o).algorithm for o in (lo, hi, lo)] == ["oktopk"] * 3
    assert _decide(sel, n, counts, 0.0).algorithm == "allgather"


def test_policy_first_then_model_and_env_overrides():
    policy = parse_policy(
        "version: 1\n"
        "knobs: {oktopk: {peers_in_flight: 2, local_refresh: 8}}\n"
        "rules:\n"
        "  - name: tiny\n"
        "    when: {numel: [null, 4096]}\n"
        "    use: dense\n"
        "  - name: hot\n"
        "    when: {overlap: [0.9, 1.0]}\n"
        "    use: auto\n"
        "    knobs: {allgather: {mode: pad}}\n",
        source="p.yaml",
    )
    sel = Selector(policy, SYNTHETIC, environ={})
    tiny = sel.explain(_features(1024, 0.5, 4, 0.5))
    assert (tiny.choice.algorithm, tiny.choice.source, tiny.choice.rule) == ("dense", "policy", "rule 0 'tiny'")
    assert "p.yaml" in tiny.choice.reason
    hot = sel.explain(_features(2**20, 2e-2, 8, 1.0))
    assert (hot.choice.algorithm, hot.choice.source) == ("oktopk", "model")
    assert hot.choice.knobs == {"peers_in_flight": 2}  # the algorithm's own knobs ...
    assert hot.choice.state_knobs == {"local_refresh": 8}  # ... and the top-k state's, apart
    forced = Selector(policy, SYNTHETIC, environ={"COLLTUNE_ALGO": "allgather"}).explain(_features(1024, 0.5, 4, 0.5))
    assert (forced.choice.algorithm, forced.choice.source) == ("allgather", "forced")
    unpinned = Selector(policy, SYNTHETIC, environ={"COLLTUNE_ALGO": "auto"}).explain(_features(1024, 0.5, 4, 0.5))
    assert unpinned.choice.source == "model"
    assert Selector(policy, SYNTHETIC, environ={}).digest() != Selector(None, SYNTHETIC, environ={}).digest()
    assert sel.digest() != Selector(policy, SYNTHETIC, environ={"COLLTUNE_ALGO": "dense"}).digest()


def test_no_profile_means_the_safe_default():
    sel = Selector(environ={})
    assert sel.model("mpi") is None  # no profile shipped for this backend
    c = _decide_backend(sel, "mpi")
    assert (c.algorithm, c.source) == (SAFE_DEFAULT, "default")


def _decide_backend(sel: Selector, backend: str):
    key, counts = ("sparse", None, 1000, 1, 4), (10, 10, 10, 10)
    sel.observe_sparse(key, counts, 30)
    return sel.decide_sparse(key, comm=_Group(4), backend=backend, name=None, size=1000, row_numel=1,
                             dtype=torch.float32, counts=counts, indices=None)


def test_shipped_profiles_are_found_and_usable():
    assert profiles_dir() is not None
    gloo, nccl = shipped_profile("gloo"), shipped_profile("nccl")
    assert gloo is not None and nccl is not None and gloo.name == "cpu-gloo.yaml"
    sel = Selector(environ={})
    assert sel.model("gloo").kind == "learned" and sel.model("nccl").kind == "analytic"
    assert sel.digest("gloo") != sel.digest("nccl")
    c = _decide_backend(sel, "gloo")
    assert c.algorithm in candidates() and c.source == "model" and "cpu-gloo.yaml" in c.reason


def test_decision_log_lines_and_jsonl(tmp_path, caplog):
    path = tmp_path / "decisions-%r.jsonl"
    sel = Selector(profile=SYNTHETIC, environ={"COLLTUNE_LOG_FILE": str(path)})
    with caplog.at_level(logging.DEBUG, logger="colltune.select.selector"):
        _decide(sel, 2**20, [20972] * 8, 1.0)
        _decide(sel, 2**20, [20972] * 8, 1.0)  # cached: a DEBUG line, no new JSON line
    lines = [r.getMessage() for r in caplog.records if r.name == "colltune.select.selector" and " -> " in r.getMessage()]
    assert len(lines) == 2 and "oktopk" in lines[0] and "cost model" in lines[0] and "cached" in lines[1]
    records = [json.loads(x) for x in (tmp_path / "decisions-0.jsonl").read_text().splitlines()]
    assert len(records) == 1
    assert records[0]["algorithm"] == "oktopk" and records[0]["source"] == "model"
    assert set(records[0]["predicted_us"]) == set(candidates()) and records[0]["features"]["world_size"] == 8


def test_a_cached_decision_is_cheap(monkeypatch):
    # What keeps a cached decision cheap: no policy match, no model, no
    # prediction and no new Choice on a hit -- the stored Choice comes back.
    sel = Selector(profile=SYNTHETIC, environ={})
    counts = (10486,) * 4
    first = _decide(sel, 2**20, counts, 0.5)
    assert not first.cached
    key = ("sparse", "w", None, 2**20, 4)
    group = _Group(4)

    def _not_on_a_hit(*a, **k):
        raise AssertionError("a cached decision must not match, load a model or predict")

    monkeypatch.setattr(sel, "_match", _not_on_a_hit)
    monkeypatch.setattr(sel, "model", _not_on_a_hit)
    monkeypatch.setattr(sel, "_from_model", _not_on_a_hit)
    hits = []
    for _ in range(sel.reevaluate_every - 1):  # all within one re-evaluation period
        hits.append(sel.decide_sparse(key, comm=group, backend="gloo", name="w", size=2**20, row_numel=1,
                                      dtype=torch.float32, counts=counts, indices=None))
        sel.observe_sparse(key, counts, 26214)
    assert hits[0].cached and hits[0].algorithm == first.algorithm
    assert all(h is hits[0] for h in hits), "a hit returns the stored Choice, not a new one"


def test_bad_settings_are_rejected():
    from colltune.algorithms.errors import ColltuneTypeError, ColltuneValueError

    with pytest.raises(ColltuneValueError, match="reevaluate_every"):
        Selector(environ={}, reevaluate_every=0)
    with pytest.raises(ColltuneValueError, match="margin"):
        Selector(environ={}, margin=-1)
    with pytest.raises(ColltuneTypeError, match="policy"):
        Selector(policy=42, environ={})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the overlap estimate (pure parts)


def test_torch_bitmap_matches_the_numpy_reference():
    idx = np.random.default_rng(3).integers(0, 2**62, 20000)
    for m, seed in ((1024, 0), (2**17, 5)):
        got = bitmap_positions_torch(torch.from_numpy(idx), m, seed).numpy()
        np.testing.assert_array_equal(got, bitmap_indices(idx, m, seed))
        np.testing.assert_array_equal(make_bitmap_torch(torch.from_numpy(idx), m, seed).numpy(), make_bitmap(idx, m, seed))
    assert make_bitmap_torch(torch.empty(0, dtype=torch.int32), 1024).sum() == 0


def test_overlap_bitmap_bits_is_a_shared_power_of_two():
    assert overlap_bitmap_bits(2000) == 2**15
    assert overlap_bitmap_bits(41944) == 2**16  # n = 2^20, density 1e-2, P = 4: 64 KiB
    assert overlap_bitmap_bits(0) == 2**10 and overlap_bitmap_bits(10**9) == 2**22


# --------------------------------------------------------------------------- distributed


def _rank_estimate(rank, world_size, cases):
    from colltune.algorithms.comm import Comm
    from colltune.model.features import estimate_union_collective
    from colltune.offline.workloads import Workload

    out = []
    for n, k, overlap in cases:
        w = Workload(n, k, world_size, overlap, seed=k)
        idx, _ = w.make(rank)
        comm = Comm(None, torch.device("cpu"))
        union, est = estimate_union_collective(comm, idx, [k] * world_size)
        out.append((w.overlap, est, union, w.union, comm.traffic.meta_bytes))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_collective_overlap_estimate_is_within_005(world_size):
    cases = [(2**20, k, o) for k in (1000, 5000) for o in (0.0, 0.3, 0.5, 1.0)]
    per_rank = pool(world_size).run(_rank_estimate, cases)
    for r in range(1, world_size):
        assert per_rank[r] == per_rank[0], "every rank must get the same estimate"
    for (n, k, o), (exact, est, union, exact_union, meta) in zip(cases, per_rank[0]):
        assert abs(est - exact) < 0.05, (k, o, est, exact)
        assert abs(union - exact_union) <= 0.03 * exact_union
        assert meta > 0  # the bitmap counts as control traffic


def _rank_uneven(rank, world_size, n, online=False):
    import colltune
    from colltune.select.selector import Selector

    colltune.configure(selector=Selector(environ={}, online=online))
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        seen = []
        a, b, c = (1, 40, 3000, 30000), (2, 5, 20000, 100), (500, 500, 500, 60000)
        for base in (a, a, b, b, c, a):
            k = base[rank]
            common = torch.arange(0, n, 7)[: k // 2]
            own = torch.randperm(n, generator=gen)[: k - common.numel()]
            idx = torch.cat((common, own))
            res = colltune.sparse_allreduce(idx, torch.ones(idx.numel()), n, name="uneven")
            d = res.decision
            seen.append((res.algorithm, d.source, d.reason, d.cached, d.overlap,
                         None if d.predicted_us is None else sorted(d.predicted_us.items()),
                         int(res.indices.numel()), float(res.values.sum())))
        return seen
    finally:
        colltune.configure()


@pytest.mark.parametrize("online", [False, True])
def test_decisions_are_identical_across_ranks_when_k_differs_widely(online):
    per_rank = pool(4).run(_rank_uneven, 2**18, online)
    for r in range(1, 4):
        assert per_rank[r] == per_rank[0], f"rank {r} decided differently from rank 0"
    first = per_rank[0][0]
    assert first[1] == "model" and first[4] is not None  # the overlap came from the bitmap estimate
    if not online:  # online, a measurement may make the site decide again at any call
        assert any(call[3] for call in per_rank[0][1:]), "repeated calls at the site should reuse decisions"


def _rank_policies(rank, world_size, texts, env_algo):
    import colltune
    from colltune.select.selector import Selector

    text = texts[rank % len(texts)]
    environ = {"COLLTUNE_ALGO": env_algo[rank]} if env_algo and env_algo[rank] else {}
    colltune.configure(selector=Selector(parse_policy(text, source=f"rank{rank}.yaml"), environ=environ))
    try:
        raised = expect_error(colltune.sparse_allreduce, torch.tensor([rank, 5]), torch.ones(2), 64)
    finally:
        colltune.configure(selector=Selector(environ={}))
    named = expect_error(colltune.sparse_allreduce, torch.tensor([1]), torch.ones(1), 64, name=f"t{rank}")
    after = colltune.sparse_allreduce(torch.tensor([rank, 5]), torch.ones(2), 64)  # all ranks agree again
    colltune.configure()
    return raised, named, after.indices.tolist()


@pytest.mark.parametrize("how", ["policy", "env"])
def test_ranks_with_different_configurations_raise_on_every_rank(how):
    base = "version: 1\nrules:\n  - when: {numel: [null, 100]}\n    use: dense\n"
    if how == "policy":
        texts, env = [base, base.replace("dense", "allgather")], None
    else:
        texts, env = [base], ["oktopk", "", ""]
    per_rank = pool(3).run(_rank_policies, texts, env, timeout=60)
    for r, (raised, named, after) in enumerate(per_rank):
        assert raised.isa("RankMismatchError"), (r, raised)
        assert "policy" in raised.message and "same policy" in raised.message
        assert raised.elapsed < 10, f"rank {r} took {raised.elapsed:.1f} s to raise"
        assert named.isa("RankMismatchError") and "policy" in named.message, (r, named)  # names must agree too
        assert after == [0, 1, 2, 5]


def _rank_policy_end_to_end(rank, world_size, log_dir):
    import colltune
    from colltune.select.selector import Selector

    policy = parse_policy(
        "version: 1\nrules:\n"
        "  - name: embeddings\n    when: {tensor: 'emb*'}\n    use: oktopk\n"
        "    knobs: {oktopk: {peers_in_flight: 1}}\n",
        source="e2e.yaml",
    )
    # Online correction off: the test reads which calls reuse a decision.
    sel = Selector(policy, environ={"COLLTUNE_LOG_FILE": os.path.join(log_dir, "d-%r.jsonl")}, online=False)
    idx = torch.arange(rank, 4000, 3)
    emb = colltune.sparse_allreduce(idx, torch.ones(idx.numel()), 4000, name="emb.weight", policy=sel)
    other = colltune.sparse_allreduce(idx, torch.ones(idx.numel()), 4000, name="fc.weight", policy=sel)
    other2 = colltune.sparse_allreduce(idx, torch.ones(idx.numel()), 4000, name="fc.weight", policy=sel)
    state = colltune.TopkState(k=40)
    topk = [colltune.topk_allreduce(torch.randn(4000, generator=torch.Generator().manual_seed(s)), state, name="g",
                                 policy=sel) for s in range(3)]
    return {
        "emb": (emb.algorithm, emb.decision.source, emb.decision.rule, dict(emb.decision.knobs)),
        "other": (other.algorithm, other.decision.source, other2.decision.cached, other2.decision.overlap_source),
        "topk": [(t.algorithm, t.decision.source, t.decision.cached) for t in topk],
        "union": int(emb.indices.numel()),
    }


def test_policy_and_decision_end_to_end(tmp_path):
    per_rank = pool(2).run(_rank_policy_end_to_end, str(tmp_path))
    assert per_rank[0] == per_rank[1]
    out = per_rank[0]
    assert out["emb"] == ("oktopk", "policy", "rule 0 'embeddings'", {"peers_in_flight": 1})
    assert out["other"][1] == "model" and out["other"][2] is True and out["other"][3].startswith("sketch")
    assert out["topk"][0][1] == "model" and out["topk"][1][2] and out["topk"][2][2]
    lines = (tmp_path / "d-1.jsonl").read_text().splitlines()
    assert [json.loads(x)["source"] for x in lines] == ["policy", "model", "model"]  # cached calls add no lines


# --------------------------------------------------------------------------- colltune explain


def test_explain_prints_the_table(capsys):
    from colltune import cli

    rc = cli.main(["explain", "--numel", "2^20", "--density", "1e-2", "--world-size", "4", "--overlap", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for word in (*candidates(), "predicted", "choice:", "why:", "cpu-gloo.yaml"):
        assert word in out
    chosen = [line for line in out.splitlines() if " *" in line]
    assert len(chosen) == 1 and chosen[0].split()[0] in candidates()


def test_explain_json_and_policy(tmp_path, capsys):
    from colltune import cli

    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nrules:\n  - name: pin\n    when: {world_size: 8}\n    use: oktopk\n")
    rc = cli.main(["explain", "--numel", "65536", "--density", "1e-3", "--world-size", "8", "--overlap", "0",
                   "--policy", str(policy), "--backend", "nccl", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["choice"]["algorithm"] == "oktopk" and data["choice"]["source"] == "policy"
    assert {a["algorithm"] for a in data["algorithms"]} == set(candidates())
    assert data["model"].startswith("analytic")


def test_explain_rejects_bad_options(capsys):
    from colltune import cli

    assert cli.main(["explain", "--numel", "2^20", "--density", "2", "--world-size", "4", "--overlap", "0"]) == 2
    assert "density" in capsys.readouterr().err
    assert cli.main(["explain", "--numel", "100", "--density", "0.9", "--world-size", "4", "--overlap", "0"]) == 2
    assert "overlap" in capsys.readouterr().err


# --------------------------------------------------------------------------- the first overlap: sketch, then bitmap only if decisive


class _CountingGroup(_Group):
    """Records the collectives the selector asks for (the bitmap is left as this rank's own)."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.calls = 0

    def meta(self):
        import contextlib

        return contextlib.nullcontext()

    def all_reduce(self, t, op="sum"):
        self.calls += 1
        return t


def _sets(p: int, k: int, overlap: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    s = int(round(overlap * k))
    pool_ = rng.choice(2**20, size=s + p * (k - s), replace=False)
    return [np.sort(np.concatenate([pool_[:s], pool_[s + r * (k - s) : s + (r + 1) * (k - s)]])) for r in range(p)]


@pytest.mark.parametrize("overlap, expected, collectives", [(0.9, "oktopk", 0), (0.0, "allgather", 0), (0.13, None, 1)])
def test_first_call_decides_from_the_sketch_unless_the_band_straddles_a_boundary(overlap, expected, collectives):
    from colltune.model.features import sketch_hashes

    # SYNTHETIC at n = 2^20, density 2e-2, P = 8: allgather below overlap ~0.13, oktopk above.
    p, n = 8, 2**20
    sets = _sets(p, 20972, overlap)
    sketches = [sketch_hashes(torch.from_numpy(s), 1024) for s in sets]
    sel = Selector(profile=SYNTHETIC, environ={})
    key = ("sparse", "w", None, n, p)
    assert sel.wants_sketch(key, "gloo")
    comm = _CountingGroup(p)
    choice = sel.decide_sparse(key, comm=comm, backend="gloo", name="w", size=n, row_numel=1, dtype=torch.float32,
                               counts=tuple(len(s) for s in sets), indices=torch.from_numpy(sets[0]), sketches=sketches)
    assert comm.calls == collectives
    if collectives:
        assert choice.overlap_source == "bitmap"
    else:
        assert choice.algorithm == expected and choice.overlap_source.startswith("sketch (+-")
        assert abs(choice.overlap - overlap) < 0.05
    sel.observe_sparse(key, tuple(len(s) for s in sets), len(np.unique(np.concatenate(sets))))
    assert not sel.wants_sketch(key, "gloo"), "once a call revealed the union, no sketch is needed"


def test_no_sketch_when_the_algorithm_is_forced_or_there_is_nothing_to_predict():
    key = ("sparse", "w", None, 100, 2)
    assert not Selector(profile=SYNTHETIC, environ={"COLLTUNE_ALGO": "dense"}).wants_sketch(key, "gloo")
    assert not Selector(profile=None, environ={}).wants_sketch(key, "no-such-backend")


def _rank_first_call(rank, world_size, n, k, overlap):
    import colltune
    from colltune.offline.workloads import Workload

    # Online correction off: a first call's measurement may make the site decide again at its second.
    colltune.configure(selector=Selector(environ={}, online=False))
    group = dist.new_group(list(range(world_size)))  # fresh: no algorithm state from earlier calls in the pool
    try:
        w = Workload(n, k, world_size, overlap, seed=5)
        idx, vals = w.make(rank)
        out = []
        for _ in range(2):
            res = colltune.sparse_allreduce(idx, vals, n, name="first", group=group)
            d = res.decision
            reduces = res.traffic.by_primitive.get("all_reduce", {}).get("calls", 0)
            out.append((res.algorithm, d.overlap_source, round(d.overlap, 6), reduces,
                        int(res.indices.numel()), d.cached))
        return out, w.overlap
    finally:
        colltune.configure()
        dist.destroy_process_group(group)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_first_auto_call_adds_no_collective_for_its_overlap(world_size):
    n, k = 2**20, 10486  # density 1e-2: the selector overhead target's configuration at P = 4
    per_rank = pool(world_size).run(_rank_first_call, n, k, 0.5)
    for r in range(1, world_size):
        assert per_rank[r] == per_rank[0]
    (first, second), exact = per_rank[0]
    assert first[1].startswith("sketch")
    assert abs(first[2] - exact) < 0.05
    # No bitmap all_reduce: only the algorithm's own (dense: values and mask; Ok-Topk: its first boundaries).
    assert first[3] == {"allgather": 0, "oktopk": 1, "dense": 2}[first[0]], first
    assert second[5] and second[0] == first[0], "the second call reuses the decision"
