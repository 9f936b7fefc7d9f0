"""Online correction: a selector that learns from its own calls (``colltune.select.online``).

Scripted on the selector alone: a cost model wrong in a known way (the
shipped analytic NCCL profile, with a "true" time per algorithm that
mis-scales one of them), the measured time of every call fed back as the
metadata exchange would. Checked:

* it converges to the truly fastest algorithm, whether the profile prices
  the chosen algorithm too low or the fastest one too high, and then stays;
* one busy call (an algorithm's first measurement 8x or 16x its time)
  delays but does not lock the fastest algorithm out: it counts clipped
  until a second call confirms it, and a change two calls confirm counts
  in full;
* two algorithms priced wrong: never worse than the profile alone;
* a machine uniformly slower than its profile changes no decision once
  each algorithm has been measured (each tried in the first calls);
* exploration stays within its budgets (3% of the calls and of the time)
  and never tries an algorithm predicted more than 2x slower; a runner-up
  confirmed slower is tried less and less, in turn with the others (also
  at a site alternating between two sizes decided differently), and a
  change of decision starts the waits over;
* what a site measured long ago fades to one call's weight;
* a policy rule, ``COLLTUNE_ALGO`` and ``online=False`` turn it off;
* the state file round-trips, and a corrupt, truncated, huge or foreign one
  is ignored with a warning;
* the group's :class:`Feedback` delivers the maximum over ranks only once
  every rank's figure is in, and drops another call's.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from colltune.model.policy import parse_policy
from colltune.select import online
from colltune.select.selector import Selector

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "analytic-nccl.yaml")
COMM = SimpleNamespace(world_size=8, rank=0)
N = 2**20


def _decide(sel: Selector, density: float, name: str = "t") -> object:
    k = int(N * density)
    counts = [k] * 8
    key = ("sparse", name, N, 1, "float32", 8, 0)
    sel.observe_sparse(key, counts, int(k * 8 * 0.5))  # the overlap known, as after a first call
    return key, sel.decide_sparse(key, comm=COMM, backend="nccl", name=name, size=N, row_numel=1, dtype="float32",
                                  counts=counts, indices=None, ranks_per_node=8)


def _stream(sel: Selector, truth: dict[str, float], calls: int, density: float = 1e-2,
            busy: dict[str, float] | None = None) -> list:
    """Decide ``calls`` calls at one site; each measures ``truth`` times the profile's own prediction.

    ``busy``: an algorithm's first measured call takes this many times its time (a busy moment).
    """
    out, measured = [], set()
    for _ in range(calls):
        key, c = _decide(sel, density)
        if c.predicted_us is None:  # not the cost model's decision (a policy, COLLTUNE_ALGO): nothing to learn
            out.append((c.algorithm, c.source, 1.0, 1.0, None, None))
            continue
        t = c.predicted_us[c.algorithm] * truth.get(c.algorithm, 1.0)
        if busy and c.algorithm not in measured:
            t *= busy.get(c.algorithm, 1.0)
        measured.add(c.algorithm)
        sel.observe_time(key, c.algorithm, c.predicted_us[c.algorithm], t, c.source == "explore")
        best = min(c.predicted_us[a] * truth.get(a, 1.0) for a in c.predicted_us)
        out.append((c.algorithm, c.source, t / best, t, dict(c.predicted_us), c.corrected_us))
    return out


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


@pytest.mark.parametrize("truth, fastest", [
    ({"allgather": 3.0}, "oktopk"),  # the profile prices the chosen algorithm 3x too low (Ok-Topk is next)
    ({"dense": 0.6}, "dense"),  # ... or the third one too high (within the exploring margin: tried after Ok-Topk)
])
def test_a_wrong_profile_converges_to_the_truly_fastest(truth: dict[str, float], fastest: str) -> None:
    sel = Selector(profile=PROFILE, environ={})
    calls = _stream(sel, truth, 400)
    assert calls[0][0] == "allgather"  # the profile's pick at density 1e-2
    after = calls[150:]
    assert all(a == fastest for a, src, *_ in after if src != "explore"), [c[:2] for c in after][:20]
    regret = [r for _, _, r, *_ in after]
    assert _geomean(regret) <= 1.03 and sorted(regret)[int(0.95 * len(regret))] <= 1.10


@pytest.mark.parametrize("busy", [8.0, 16.0])
def test_one_busy_call_does_not_lock_the_fastest_algorithm_out(busy: float) -> None:
    # dense, priced 3x too high, is the fastest; its first measured call (an exploring one, after Ok-Topk's)
    # came at a busy moment. That measurement counts at most CLIP_FIRST above dense's prior, so dense stays in
    # the exploring window and is tried again once its turn comes and the exploring time that busy call spent
    # is within the site's budget (about call 510). Taken at face value it priced dense out for good.
    calls = _stream(Selector(profile=PROFILE, environ={}), {"dense": 1 / 3}, 800, busy={"dense": busy})
    assert calls[0][0] == "allgather" and calls[34][:2] == ("oktopk", "explore")
    assert calls[102][:2] == ("dense", "explore")
    assert all(a == "dense" for a, src, *_ in calls[600:] if src != "explore"), [c[:2] for c in calls[600:]][:10]


def _plain(xs: list[float]) -> float:
    """The log mean of ``xs`` (log ratios, oldest first) with every call counted whole."""
    m = online._Mean()
    for x in xs:
        m.add(x)
    return m.s / m.n


def test_a_busy_call_counts_clipped_and_a_change_two_calls_confirm_counts_in_full() -> None:
    ratios, own = online.Ratios(), {}
    for _ in range(30):
        ratios.observe(own, "dense", 100.0, 100.0)
    ratios.observe(own, "dense", 100.0, 800.0)  # one busy call: 8x
    m, pool = own["dense"], ratios.every["dense"]
    assert m.s == pytest.approx(online.CLIP) and m.excess == pytest.approx(math.log(8.0) - online.CLIP)
    ratios.observe(own, "dense", 100.0, 100.0)  # not confirmed: the cut part is dropped
    assert m.excess == 0.0 and m.s == pytest.approx(online.CLIP * online.DECAY)
    assert (pool.s, pool.n) == pytest.approx((m.s, m.n))  # the pool took the same (one site)
    # A change to 3x: a call above the cap is cut, the next, as high, confirms it; so the mean is always at
    # least where counting every call whole had it one call before, and there once a cut is confirmed.
    ratios, own = online.Ratios(), {}
    for _ in range(30):
        ratios.observe(own, "dense", 100.0, 100.0)
    confirmed = 0
    for i in range(1, 13):
        ratios.observe(own, "dense", 100.0, 300.0)
        got, m = own["dense"].s / own["dense"].n, own["dense"]
        assert _plain([0.0] * 30 + [math.log(3.0)] * (i - 1)) - 1e-12 <= got, i
        if m.excess == 0.0:
            confirmed += 1
            assert got == pytest.approx(_plain([0.0] * 30 + [math.log(3.0)] * i)), i
    assert confirmed == 11  # all but the first: each call as high as the last confirms it
    assert (ratios.every["dense"].s, ratios.every["dense"].n) == pytest.approx((own["dense"].s, own["dense"].n))
    # A second call only part as high confirms only that part: both count up to where both went.
    ratios, own = online.Ratios(), {}
    for _ in range(30):
        ratios.observe(own, "dense", 100.0, 100.0)
    ratios.observe(own, "dense", 100.0, 800.0)
    part = online.CLIP + 0.3  # above the first call's cut, below its value
    ratios.observe(own, "dense", 100.0, 100.0 * math.exp(part))
    assert own["dense"].excess == 0.0
    assert own["dense"].s / own["dense"].n == pytest.approx(_plain([0.0] * 30 + [part] * 2))
    # A site's first measurement of an algorithm counts at most CLIP_FIRST above its prior (1: nothing known);
    # a second as high, even after the site ran others (the cut part aged with the mean), confirms it.
    first, own = online.Ratios(), {}
    for _ in range(3):
        first.observe(own, "dense", 100.0, 100.0)
    cap = math.log(first.factor(own, "oktopk")) + online.CLIP_FIRST
    first.observe(own, "oktopk", 100.0, 500.0)
    assert own["oktopk"].s == pytest.approx(cap) and own["oktopk"].excess == pytest.approx(math.log(5.0) - cap)
    first.observe(own, "oktopk", 100.0, 500.0)  # a second measurement, so the weights are not one call's
    first.observe(own, "oktopk", 100.0, 1500.0)  # cut: 3x what the site now expects
    assert own["oktopk"].excess > 0
    for _ in range(5):
        first.observe(own, "dense", 100.0, 100.0)
    assert own["oktopk"].weight < 1.0  # the cut call aged with the mean while the site ran dense
    first.observe(own, "oktopk", 100.0, 1500.0)  # confirmed: both count whole, the first at its aged weight
    ref = online._Mean()
    for x in (math.log(5.0), math.log(5.0), math.log(15.0)):
        ref.add(x)
    for _ in range(5):
        ref.fade()
    ref.add(math.log(15.0))
    assert (own["oktopk"].s, own["oktopk"].n) == pytest.approx((ref.s, ref.n))


def test_two_algorithms_priced_wrong_never_do_worse_than_the_profile_alone() -> None:
    truth = {"allgather": 3.0, "dense": 2.0}  # oktopk, priced right, is the fastest
    on = _stream(Selector(profile=PROFILE, environ={}), truth, 400)
    off = _stream(Selector(profile=PROFILE, environ={}, online=False), truth, 400)
    assert _geomean([c[2] for c in on[50:]]) < _geomean([c[2] for c in off[50:]])


@pytest.mark.parametrize("factor", [2.5, 8.0])
def test_a_uniformly_slower_machine_changes_no_decision_once_each_algorithm_is_measured(factor: float) -> None:
    ref = [c[0] for c in _stream(Selector(profile=PROFILE, environ={}, online=False), {}, 200)]
    slow = _stream(Selector(profile=PROFILE, environ={}), {a: factor for a in ("dense", "allgather", "oktopk",
                                                                                 "hashpart")}, 200)
    # The first call is set-up; the second measures allgather; each algorithm not measured yet, priced by the
    # machine's ratio shrunk toward 1 (optimism), is tried within the next few, and the second measurement of
    # each confirms the first (which counted only CLIP_FIRST above its prior); then the profile's choices.
    assert {a for a, *_ in slow[:8]} == {"allgather", "dense", "oktopk", "hashpart"}, [c[:2] for c in slow[:8]]
    settled = [(i, a, want) for i, ((a, src, *_), want) in enumerate(zip(slow, ref)) if i >= 10 and src != "explore"]
    assert all(a == want for _, a, want in settled), settled[:10]
    assert _geomean([c[2] for c in slow[5:]]) <= 1.01


def test_exploration_keeps_to_its_budgets_and_its_margin() -> None:
    sel = Selector(profile=PROFILE, environ={})
    calls = _stream(sel, {"oktopk": 0.9}, 1000, density=3e-2)
    explored = [c for c in calls if c[1] == "explore"]
    assert explored, "a close runner-up is tried now and then"
    assert len(explored) <= 0.03 * len(calls)
    assert sum(c[3] for c in explored) <= 0.03 * sum(c[3] for c in calls)
    for algorithm, _, _, _, _, corrected in explored:
        assert corrected[algorithm] <= online.EXPLORE_WITHIN * min(corrected.values())


def test_a_runner_up_that_keeps_measuring_slower_is_tried_less_and_less() -> None:
    # The profile is right: every exploring call confirms the choice, so each waits twice as long, up to the cap.
    calls = _stream(Selector(profile=PROFILE, environ={}), {}, 1000, density=3e-2)
    at = [i for i, c in enumerate(calls) if c[1] == "explore"]
    gaps = [b - a for a, b in zip(at, at[1:])]
    longest = online.EXPLORE_BACKOFF * online.EXPLORE_EVERY
    assert at[0] <= online.EXPLORE_EVERY + 1 and gaps == sorted(gaps), at
    assert gaps[0] >= 2 * online.EXPLORE_EVERY and set(gaps[2:]) == {longest}, gaps
    assert len(at) <= 3 + 1000 // longest


def test_every_runner_up_takes_its_turn_and_a_stale_bucket_does_not_stop_the_backoff() -> None:
    sel = Selector(profile=PROFILE, environ={})
    _stream(sel, {"dense": 0.6}, 300, density=1e-2)  # a bucket decided for dense, left behind below
    calls = _stream(sel, {"dense": 1.6}, 1200, density=3e-2)  # Ok-Topk now; its runners-up keep measuring slower
    explored = [(i, c[0]) for i, c in enumerate(calls) if c[1] == "explore" and i >= 100]  # Ok-Topk's by then
    assert all(c[0] == "oktopk" for c in calls[100:] if c[1] != "explore")
    gaps = [b[0] - a[0] for a, b in zip(explored, explored[1:])]
    assert gaps[-3:] == [online.EXPLORE_BACKOFF * online.EXPLORE_EVERY] * 3, gaps
    tried = [a for _, a in explored]
    counts = {a: tried.count(a) for a in set(tried)}
    assert len(counts) >= 2 and max(counts.values()) - min(counts.values()) <= 1, tried  # in turn, none left out


def test_a_site_alternating_between_two_buckets_keeps_its_backoff() -> None:
    # Density 1e-2 (allgather) and 0.2 (another algorithm) in turns of 40 calls: each bucket's decision
    # stays what it was, so the site is not changing its mind and its exploring wait keeps doubling.
    sel = Selector(profile=PROFILE, environ={})
    turns = [_stream(sel, {}, 40, density=1e-2 if i % 2 == 0 else 0.2) for i in range(40)]
    chosen = [{a for a, src, *_ in turn if src != "explore"} for turn in turns[:2]]
    assert chosen[0] == {"allgather"} and len(chosen[1]) == 1 and chosen[1] != chosen[0], chosen
    calls = [c for turn in turns for c in turn]
    at = [i for i, c in enumerate(calls) if c[1] == "explore"]
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert set(gaps[2:]) == {online.EXPLORE_BACKOFF * online.EXPLORE_EVERY}, gaps


def test_an_exploring_call_that_changes_the_decision_tries_as_often_again() -> None:
    sel = Selector(profile=PROFILE, environ={})
    settled = _stream(sel, {}, 400, density=3e-2)  # Ok-Topk, its runners-up confirmed slower: the longest wait
    assert settled[-1][0] == "oktopk"
    key = _decide(sel, 3e-2)[0]
    assert sel._sites.get(key).explore_gap == online.EXPLORE_BACKOFF * online.EXPLORE_EVERY
    drifted = _stream(sel, {"dense": 0.75}, 500, density=3e-2)  # now dense is the fastest by a quarter
    switched = next(i for i, c in enumerate(drifted) if c[0] == "dense")
    # The runners-up are tried in turn (the one measured longest ago first), each at the longest wait: three.
    assert switched <= 3 * online.EXPLORE_BACKOFF * online.EXPLORE_EVERY
    assert all(c[0] == "dense" for c in drifted[switched + 2:] if c[1] != "explore")
    after = [i for i, c in enumerate(drifted) if c[1] == "explore" and i > switched]
    assert after and after[0] - switched <= online.EXPLORE_EVERY + 1, (switched, after)  # the wait starts over


def test_what_a_site_measured_long_ago_fades_to_one_calls_weight() -> None:
    pool, own = online.Ratios(), {}
    for _ in range(10):  # a few noisy early calls: allgather measured 4x its prediction
        pool.observe(own, "allgather", 100.0, 400.0)
    heavy, mean = own["allgather"].n, own["allgather"].s / own["allgather"].n
    assert heavy > 8 and mean > 0.8 * math.log(4.0)
    for _ in range(200):  # then the site runs dense
        pool.observe(own, "dense", 100.0, 100.0)
    assert own["allgather"].n == pytest.approx(1.0) and own["allgather"].s == pytest.approx(mean)
    pool.observe(own, "allgather", 100.0, 100.0)  # one exploring call measures it as predicted
    assert own["allgather"].s / own["allgather"].n < 0.55 * mean  # it outweighs the old figure
    assert own["dense"].n > 30 * online.DECAY  # the running algorithm keeps its memory of about 30 calls


def test_an_algorithm_predicted_far_slower_is_never_tried() -> None:
    # At density 1e-4 oktopk is predicted 1.38x allgather's time: inside the margin; dense x1.16.
    sel = Selector(profile=PROFILE, environ={})
    calls = _stream(sel, {"oktopk": 100.0}, 600, density=1e-4)
    tried = [c for c in calls if c[0] == "oktopk"]
    assert len(tried) <= 2  # once measured 100x slower, never again


@pytest.mark.parametrize("how", ["off", "policy", "env"])
def test_online_correction_is_off_where_the_user_decides(how: str) -> None:
    kw: dict = {"profile": PROFILE, "environ": {}}
    if how == "off":
        kw["environ"] = {"COLLTUNE_ONLINE": "0"}
    elif how == "policy":
        kw["policy"] = parse_policy("version: 1\ndefault: allgather\n")
    else:
        kw["environ"] = {"COLLTUNE_ALGO": "allgather"}
    calls = _stream(Selector(**kw), {"allgather": 3.0}, 200)
    assert {a for a, *_ in calls} == {"allgather"} and not any(c[1] == "explore" for c in calls)


def test_the_setting_is_checked_and_shared() -> None:
    with pytest.raises(ValueError, match="COLLTUNE_ONLINE"):
        Selector(profile=PROFILE, environ={"COLLTUNE_ONLINE": "maybe"})
    on, off = Selector(profile=PROFILE, environ={}), Selector(profile=PROFILE, environ={}, online=False)
    assert on.online and not off.online
    assert on.digest("nccl") != off.digest("nccl")  # ranks set differently raise at the record, never diverge


def test_feedback_delivers_the_slowest_rank_once_every_rank_reported() -> None:
    got: list[float] = []
    fb = online.Feedback()
    timer = online.Timer(SimpleNamespace(type="cpu"))
    timer.marks = [0.0, 0.002]
    fb.hold(7, timer, got.append)
    assert fb.fields() == {"fb_code": 7, "fb_us": 2000}
    fb.arrived([7, 7, 7], [2000, -1, 1500])  # one rank's figure not ready (a CUDA event): wait
    assert got == []
    fb.arrived([7, 7, 7], [2000, 3100, 1500])
    assert got == [3100.0] and fb.fields() == {"fb_code": -1, "fb_us": -1}
    fb.hold(8, timer, got.append)
    fb.arrived([8, 9, 8], [1, 1, 1])  # another call's figure: dropped, never mixed
    assert got == [3100.0] and fb.code is None


def test_a_cuda_timer_marks_the_stream_of_the_call_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the marks are events on the call's device's current stream, whatever device the thread has
    current."""
    import torch

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.stream = None

        def record(self, stream: object = None) -> None:
            self.stream = stream

    asked: list[object] = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: asked.append(device) or f"stream {device}")
    device = torch.device("cuda", 3)
    timer = online.Timer(device)
    timer.mark()
    bucket = timer.fork()  # a fused call's bucket: its own marks after the shared exchange
    bucket.mark()
    assert asked == [device, device]
    assert [m.stream for m in bucket.marks] == ["stream cuda:3"] * 2


def test_the_state_file_round_trips_and_the_next_run_starts_from_it(tmp_path: Path) -> None:
    path = tmp_path / "online.json"
    first = Selector(profile=PROFILE, environ={"COLLTUNE_ONLINE_STATE": str(path)})
    _stream(first, {"allgather": 3.0}, 60)
    first.save_online_state()
    assert _decide(Selector(profile=PROFILE, environ={}), 1e-2)[1].algorithm == "allgather"  # the profile's pick
    again = Selector(profile=PROFILE, environ={}, online_state=path)
    _, c = _decide(again, 1e-2)
    assert c.algorithm == "oktopk" and c.corrected_us["allgather"] > c.corrected_us["oktopk"]
    assert again.digest("nccl") != Selector(profile=PROFILE, environ={}).digest("nccl")  # ranks must share it


@pytest.mark.parametrize("content", [
    "not json at all", '{"format": "colltune-online", "version": 1, "sites": {"a": {"dense": [0',  # truncated
    '{"format": "something-else"}', '{"format": "colltune-online", "version": 99}',
    '{"format": "colltune-online", "version": 1, "colltune": "0.0.1", "sites": {}}',  # another colltune's
    '{"format": "colltune-online", "version": 1, "sites": {"s": {"dense": [0, "x"]}}}',
    "huge",
])
def test_a_bad_state_file_is_ignored_with_a_warning(tmp_path: Path, content: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "online.json"
    if content == "huge":
        path.write_text(" " * (online.MAX_STATE_BYTES + 1))
    else:
        path.write_text(content)
    with caplog.at_level("WARNING"):
        sel = Selector(profile=PROFILE, environ={}, online_state=path)
    assert "ignored" in caplog.text and "online.json" in caplog.text
    assert sel.digest("nccl") == Selector(profile=PROFILE, environ={}).digest("nccl")
    assert _decide(sel, 1e-2)[1].algorithm == "allgather"


def test_the_state_keeps_each_sites_last_calls_as_measurements_to_fold_into_a_profile(tmp_path: Path) -> None:
    path = tmp_path / "online.json"
    sel = Selector(profile=PROFILE, environ={"COLLTUNE_ONLINE_STATE": str(path)})
    out = _stream(sel, {"allgather": 3.0}, 40)
    sel.save_online_state()
    _, meta = online.load_state(str(path))
    (samples,) = meta["samples"].values()
    assert len(samples) == online.SAMPLES_PER_SITE  # the most recent of the 39 measured (the first is set-up)
    k = int(N * 1e-2)
    assert samples[-1][:7] == [N, 1, "float32", 8, 8 * k, k, int(k * 8 * 0.5)]
    assert samples[-1][7] == out[-1][0] and samples[-1][8] == pytest.approx(out[-1][3], abs=0.05)
    ms = online.measurements_from_state(str(path))
    assert len(ms) == online.SAMPLES_PER_SITE
    m = ms[-1]
    assert (m.algorithm, m.numel, m.world_size, m.k_sum, m.k_max, m.union) == (out[-1][0], N, 8, 8 * k, k, 4 * k)
    assert m.overlap == pytest.approx(4 / 7) and m.density == pytest.approx(k / N)
    # A second run keeps the file's samples of sites it did not see, and appends to those it did.
    again = Selector(profile=PROFILE, environ={}, online_state=path)
    again.save_online_state()
    assert online.load_state(str(path))[1]["samples"] == meta["samples"]


def test_a_version_1_state_still_loads_and_a_bad_sample_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "online.json"
    path.write_text('{"format": "colltune-online", "version": 1, "sites": {"s": {"dense": [0.5, 2.0]}}}')
    own, meta = online.load_state(str(path))
    assert own["s"]["dense"].n == 2.0 and meta["samples"] == {}
    with pytest.raises(ValueError, match="no measured calls"):
        online.measurements_from_state(str(path))
    path.write_text('{"format": "colltune-online", "version": 2, "sites": {"s": {"dense": [0.5, 2.0]}}, '
                    '"samples": {"s": [[1024, 1, "float32", 2, 10, 20, 10, "dense", 5.0]]}}')  # k_max > k_sum
    with pytest.raises(ValueError, match=r"samples.s\[0\]"):
        online.load_state(str(path))


def test_an_algorithm_priced_too_low_does_not_make_the_unmeasured_ones_look_slow() -> None:
    # allgather measured at 3x its prediction, oktopk at its own: dense, never measured, keeps its price
    # (the smaller ratio is the prior), where the mean of the two (1.7x) would leave it untried.
    ratios, own = online.Ratios(), {}
    for _ in range(5):
        ratios.observe(own, "allgather", 100.0, 300.0)
        ratios.observe(own, "oktopk", 100.0, 100.0)
    assert ratios.factor({}, "dense") == pytest.approx(1.0)
    assert ratios.factor(own, "allgather") > 2.0
    # A machine uniformly slower: every ratio alike. The prior of an algorithm measured nowhere is that ratio
    # shrunk toward 1 by PRIOR_CALLS (so it is tried once); one measured elsewhere starts from it whole.
    slow, own = online.Ratios(), {}
    for _ in range(5):
        slow.observe(own, "allgather", 100.0, 200.0)
        slow.observe(own, "oktopk", 100.0, 200.0)
    # Each algorithm's first call counted only CLIP_FIRST above 1; its second, as high, confirmed it whole.
    assert all(m.s / m.n == pytest.approx(math.log(2.0)) for m in slow.every.values())
    n = slow.every["oktopk"].n
    assert slow.factor({}, "dense") == pytest.approx(2.0 ** (n / (n + online.PRIOR_CALLS)))
    cap = math.log(slow.factor({}, "dense")) + online.CLIP_FIRST
    assert cap > math.log(2.0) + 0.05  # so a first call at the machine's ratio counts whole
    slow.observe({}, "dense", 100.0, 200.0)  # measured once, at another site
    assert slow.every["dense"].s == pytest.approx(math.log(2.0)) and slow.factor({}, "dense") == pytest.approx(2.0)
