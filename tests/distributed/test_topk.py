"""Top-k mode (``topk_allreduce``): selection counts, error feedback, agreement across ranks, traffic.

Every rank runs a sequence of calls on deterministic random tensors (with
abrupt changes of scale, so reused thresholds have to adapt) and returns, per
call, what it delivered and what it got; the parent checks:

* error feedback, per rank: ``new residual + acc restricted to sent_indices
  == old residual + tensor`` (checked bitwise in the rank);
* the result is the sum over ranks of ``acc[sent_indices]`` (divided by P
  for ``avg``), against a float64 reference, and bitwise identical on every rank;
* ``local_count`` is within the band ``[floor(2k/3), ceil(5k/4)]`` for
  ``oktopk`` and exactly k for ``allgather``;
* ``dense`` sends everything: the plain allreduce of acc, residual zero;
* Ok-Topk's traffic stays within the paper's Eq. 3 bound at P = 4.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from colltune.algorithms import get, names

from harness import pool
from sparse_cases import DTYPES, RTOL, raw

STEPS = 40  # more than the default refresh period (32): crosses a refresh


def topk_cfg(**kw) -> dict:
    c = {
        "seed": 0,
        "shape": (64, 64),
        "k": 40,
        "density": None,
        "algorithm": "oktopk",
        "op": "avg",
        "dtype": "float32",
        "steps": STEPS,
        "state_kw": {},
        "small": True,  # return dense results (only for small tensors)
        "correlated": False,
    }
    c.update(kw)
    return c


def _scale(step: int) -> float:
    # Abrupt changes of magnitude every 7 calls: x1, x4, x0.25, ...
    return (1.0, 4.0, 0.25)[(step // 7) % 3]


def make_tensor(c: dict, rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s tensor at call ``step``.

    Default: independent each call, with abrupt changes of scale (stresses the
    reused thresholds). ``correlated``: a fixed per-rank gradient plus 10 % noise,
    the slowly changing gradients Ok-Topk's threshold reuse assumes.
    """
    g = torch.Generator().manual_seed(c["seed"] * 1_000_003 + rank * 10_007 + step)
    noise = torch.randn(c["shape"], generator=g, dtype=torch.float64)
    if c.get("correlated"):
        base = torch.randn(c["shape"], generator=torch.Generator().manual_seed(c["seed"] * 1_000_003 + rank * 10_007 - 1), dtype=torch.float64)
        return (base + 0.1 * noise).to(DTYPES[c["dtype"]])
    return (noise * _scale(step)).to(DTYPES[c["dtype"]])


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ------------------------------------------------------------------ rank function


def _run_topk(rank, world_size, c):
    import colltune

    state = colltune.TopkState(k=c["k"], density=c["density"], **c["state_kw"])
    steps = []
    for step in range(c["steps"]):
        t = make_tensor(c, rank, step)
        old = None if state.residual is None else state.residual.clone()
        acc = t.reshape(-1).to(_acc_dtype(t.dtype))
        acc = acc + old if old is not None else acc.clone()
        res = colltune.topk_allreduce(t, state, op=c["op"], algorithm=c["algorithm"])
        new = state.residual
        sent = res.sent_indices
        mask = torch.zeros(acc.numel(), dtype=torch.bool)
        if sent is None:
            mask[:] = True
        else:
            mask[sent] = True
        # Error feedback: new residual + acc[sent] == old residual + tensor (= acc), i.e.
        # zero where sent, unchanged acc elsewhere.
        inv_sent = bool((new[mask] == 0).all())
        inv_rest = raw(new[~mask]) == raw(acc[~mask])
        rec = {
            "algorithm": getattr(res, "algorithm", c["algorithm"]),
            "k": state.k_for(acc.numel()),
            "local_count": int(res.local_count),
            "global_count": int(getattr(res, "global_count", -1)),
            "sent": None if sent is None else sent.clone(),
            "sent_unique": None if sent is None else int(sent.unique().numel()) == int(sent.numel()),
            "acc_sent": acc.clone() if sent is None else acc[sent].clone(),
            "indices": None if res.indices is None else res.indices.clone(),
            "values": res.values.clone(),
            "dense": res.to_dense().clone() if c["small"] else None,
            "dense_shape": tuple(res.to_dense().shape) if c["small"] else None,
            "bytes": res.traffic.bytes_sent,
            "meta_bytes": getattr(res.traffic, "meta_bytes", None),
            "inv_sent_zero": inv_sent,
            "inv_rest_equal": inv_rest,
            "residual_zero": bool((new == 0).all()),
            "residual_dtype": new.dtype,
            "step_attr": state.step,
        }
        steps.append(rec)
    return steps


# ------------------------------------------------------------------ checks


def check_topk(c: dict, world_size: int, per_rank: list) -> None:
    dtype = DTYPES[c["dtype"]]
    numel = math.prod(c["shape"])
    for step in range(c["steps"]):
        recs = [per_rank[r][step] for r in range(world_size)]
        first = recs[0]
        alg = first["algorithm"]
        k = first["k"]
        where = f"{c['algorithm']}->{alg} P={world_size} step {step}"
        # Reference: the sum over ranks of what each rank delivered.
        ref = torch.zeros(numel, dtype=torch.float64)
        mag = torch.zeros(numel, dtype=torch.float64)
        for rec in recs:
            if rec["sent"] is None:
                ref += rec["acc_sent"].to(torch.float64)
                mag += rec["acc_sent"].to(torch.float64).abs()
            else:
                ref.index_add_(0, rec["sent"], rec["acc_sent"].to(torch.float64))
                mag.index_add_(0, rec["sent"], rec["acc_sent"].to(torch.float64).abs())
        if c["op"] == "avg":
            ref /= world_size
            mag /= world_size
        for r, rec in enumerate(recs):
            w = f"{where} rank {r}"
            assert rec["inv_sent_zero"], f"{w}: the residual is not zero at sent_indices"
            assert rec["inv_rest_equal"], f"{w}: the residual changed outside sent_indices (error feedback broken)"
            assert rec["step_attr"] == step + 1
            assert rec["algorithm"] == alg, f"{w}: ranks ran different algorithms"
            # Bitwise identical results.
            assert (rec["indices"] is None) == (first["indices"] is None)
            if rec["indices"] is not None:
                assert raw(rec["indices"]) == raw(first["indices"]), f"{w}: indices differ from rank 0's"
            assert raw(rec["values"]) == raw(first["values"]), f"{w}: values differ from rank 0's bitwise"
            assert rec["values"].dtype == dtype, f"{w}: values dtype {rec['values'].dtype}"
            if rec["dense"] is not None:
                assert rec["dense_shape"] == tuple(c["shape"]), f"{w}: to_dense() shape {rec['dense_shape']}"
                assert raw(rec["dense"]) == raw(first["dense"])
            # Selection counts.
            if alg == "oktopk":
                lo, hi = math.floor(2 * k / 3), math.ceil(5 * k / 4)
                assert lo <= rec["local_count"] <= hi, f"{w}: local_count {rec['local_count']} outside [{lo}, {hi}] (k={k})"
            elif alg == "allgather":
                assert rec["local_count"] == k, f"{w}: allgather selected {rec['local_count']} != k={k}"
                assert rec["sent"] is not None and rec["sent"].numel() == k, f"{w}: TopkA delivers all k selected"
            elif alg == "dense":
                assert rec["residual_zero"], f"{w}: dense must leave a zero residual"
            if rec["sent"] is not None:
                assert rec["sent_unique"], f"{w}: sent_indices has duplicates"
                assert rec["sent"].numel() <= rec["local_count"], f"{w}: sent more than selected"
                if rec["sent"].numel():
                    assert int(rec["sent"].min()) >= 0 and int(rec["sent"].max()) < numel
                assert rec["indices"] is not None
                assert bool(torch.isin(rec["sent"], rec["indices"]).all()), f"{w}: a sent index is missing from the result"
            if rec["indices"] is not None:
                idx = rec["indices"]
                assert idx.dtype == torch.int64
                assert bool((idx[1:] > idx[:-1]).all()), f"{w}: result indices not sorted unique"
                assert rec["values"].numel() == idx.numel()
                if rec["global_count"] >= 0:
                    assert rec["global_count"] == idx.numel(), f"{w}: global_count {rec['global_count']} != {idx.numel()}"
            # Traffic.
            if world_size == 1:
                assert rec["bytes"] == 0, f"{w}: a single rank sent {rec['bytes']} bytes"
            else:
                assert rec["bytes"] > 0, f"{w}: no traffic counted"
        # The result is the (averaged) sum of the delivered accumulations.
        got = torch.zeros(numel, dtype=torch.float64)
        if first["indices"] is None:
            got[:] = first["values"].reshape(-1).to(torch.float64)
        else:
            got[first["indices"]] = first["values"].reshape(-1).to(torch.float64)
        err = (got - ref).abs()
        allowed = RTOL[dtype] * mag + 1e-300
        if bool((err > allowed).any()):
            i = int((err - allowed).argmax())
            raise AssertionError(
                f"{where}: result != sum over ranks of acc[sent_indices]{' / P' if c['op'] == 'avg' else ''}: "
                f"at flat index {i} got {got[i].item()!r}, expected {ref[i].item()!r} "
                f"({int((err > allowed).sum())} elements off)"
            )


# ------------------------------------------------------------------ tests


ALGS = [*names(), "auto"]
#: The algorithms that send a selection of each rank's k entries (and keep the rest as residual), not the whole
#: tensor as dense does.
SELECTING = [n for n in names() if get(n).topk_priced_on == "selection"]


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_topk_over_many_calls(world_size, algorithm):
    c = topk_cfg(seed=world_size, algorithm=algorithm)
    per_rank = pool(world_size).run(_run_topk, c, timeout=120)
    check_topk(c, world_size, per_rank)


@pytest.mark.parametrize("algorithm", names())
def test_topk_sum_op_and_short_refresh_periods(algorithm):
    # Refreshes every few calls: local and global thresholds and region boundaries all recomputed many times.
    c = topk_cfg(
        seed=11,
        algorithm=algorithm,
        op="sum",
        shape=(3000,),
        k=None,
        density=0.02,
        state_kw={"local_refresh": 5, "global_refresh": 3, "boundary_refresh": 7},
    )
    per_rank = pool(3).run(_run_topk, c, timeout=120)
    check_topk(c, 3, per_rank)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
@pytest.mark.parametrize("algorithm", names())
def test_topk_dtypes(dtype, algorithm):
    c = topk_cfg(seed=21, algorithm=algorithm, dtype=dtype, steps=12, shape=(40, 25), k=30)
    per_rank = pool(2).run(_run_topk, c, timeout=120)
    check_topk(c, 2, per_rank)
    for step in per_rank[0]:
        assert step["residual_dtype"] == _acc_dtype(DTYPES[dtype]) or step["residual_dtype"] == DTYPES[dtype]


def test_topk_selects_more_than_a_quarter():
    # k close to numel: every algorithm must still deliver correct sums.
    for algorithm in (*SELECTING, "auto"):
        c = topk_cfg(seed=31, algorithm=algorithm, shape=(200,), k=120, steps=6)
        per_rank = pool(2).run(_run_topk, c, timeout=120)
        check_topk(c, 2, per_rank)


#: Metadata allowance for one Ok-Topk top-k call at P = 4, in bytes, explicitly:
#:   the call's metadata record: all_gather of 17 int64 plus the eager slot
#:   (1024 B at P = 4; Ok-Topk's counts per region ride in it while its
#:   boundaries are cached): (P-1) * (136 + 1024)                           =   3480
#:   count/size exchanges (a few all_to_all / all_gather of P int64)        <=   1024
#:   region boundaries (all_reduce of P float64, direct on gloo: 32 * (P-1))  =     96
#:   an exact global threshold: radix select, 4 all_reduce of 256 int32
#:   (each direct on gloo: 1024 * (P-1) = 3072 B)                             =  12288
#: total 16888, rounded up to 17 KiB = 4352 words of 4 bytes: O(P), independent
#: of k. With k = 5000 the data bound is 6k(P-1)/P = 22500 words.
EQ3_META_ALLOWANCE_BYTES = 17408


@pytest.mark.parametrize("correlated", [True, False], ids=["slowly_changing", "independent"])
def test_oktopk_traffic_within_eq3_bound_at_p4(correlated):
    p, k, steps = 4, 5_000, 24
    c = topk_cfg(
        seed=41,
        algorithm="oktopk",
        shape=(500_000,),
        k=k,
        steps=steps,
        small=False,
        op="avg",
        correlated=correlated,
        # Shorter refresh periods than the defaults, so 24 calls cross every kind of refresh.
        state_kw={"local_refresh": 10, "global_refresh": 10, "boundary_refresh": 10},
    )
    per_rank = pool(p).run(_run_topk, c, timeout=300)
    check_topk(c, p, per_rank)
    # Words: one int32 index (size < 2**31) or one float32 value, 4 bytes each.
    word = 4
    bound_words = 6 * k * (p - 1) / p
    lower_words = 2 * k * (p - 1) / p
    for r in range(p):
        for step, rec in enumerate(per_rank[r]):
            data_words = (rec["bytes"] - EQ3_META_ALLOWANCE_BYTES) / word
            assert data_words <= bound_words, (
                f"rank {r} step {step}: {rec['bytes']} bytes sent = {rec['bytes'] / word:.0f} words; minus the "
                f"{EQ3_META_ALLOWANCE_BYTES} B metadata allowance that is {data_words:.0f} words > 6k(P-1)/P = {bound_words:.0f} "
                f"(local_count {rec['local_count']}, global_count {rec['global_count']}, k {k})"
            )
            if rec["meta_bytes"] is not None:
                # The implementation's own split into data and metadata must agree with the bound too.
                assert rec["meta_bytes"] <= EQ3_META_ALLOWANCE_BYTES, f"rank {r} step {step}: metadata {rec['meta_bytes']} B"
                assert (rec["bytes"] - rec["meta_bytes"]) / word <= bound_words
    # And it does move the selection: at least the paper's lower bound on average.
    mean_bytes = sum(rec["bytes"] for r in range(p) for rec in per_rank[r]) / (p * steps)
    assert mean_bytes / word >= 0.5 * lower_words, mean_bytes


def _run_drifting_topk(rank, world_size, steps):
    import colltune

    state = colltune.TopkState(density=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        # Fresh gradients with error feedback: the residual grows, so the global threshold drifts up every call.
        res = colltune.topk_allreduce(torch.randn(2**16, generator=g), state, algorithm="oktopk")
        reduces = res.traffic.by_primitive.get("all_reduce", {}).get("calls", 0)
        out.append({"all_reduce_calls": reduces, "global_count": res.global_count, "k": state.k_for(2**16)})
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_oktopk_nudges_a_drifting_global_threshold_without_exact_selects(world_size):
    """A reused global threshold follows a drift through the nudged candidates; the radix select only runs on refreshes."""
    steps = 40
    per_rank = pool(world_size).run(_run_drifting_topk, steps, timeout=120)
    for r, recs in enumerate(per_rank):
        assert [x["global_count"] for x in recs] == [x["global_count"] for x in per_rank[0]]
        k = recs[0]["k"]
        for x in recs:
            assert math.floor(2 * k / 3) <= x["global_count"] <= math.ceil(5 * k / 4)
        exact_steps = [i for i, x in enumerate(recs) if x["all_reduce_calls"] >= 4]  # a radix select: 4 all_reduce
        # Refreshes at calls 0 and 32 (global_refresh); allow one more for an unlucky jump.
        assert len(exact_steps) <= 3, f"rank {r}: exact global selects at calls {exact_steps}"


def _radix_cases(rank, world_size):
    from colltune.algorithms.comm import Comm
    from colltune.algorithms.oktopk import radix_kth_largest

    g = torch.Generator().manual_seed(7)  # every rank draws every rank's values: each knows the union
    mags = [torch.randn(300 + 50 * r, generator=g).abs().round(decimals=2) for r in range(world_size)]  # ties
    for r, m in enumerate(mags):
        m[: 40 + r] = 0.0
        m[100 + r] = float("inf")
    union = torch.cat(mags)
    comm = Comm(None, torch.device("cpu"))
    out = []
    for k in (1, 2, 17, union.numel() // 2, union.numel() - 30, union.numel(), union.numel() + 5):
        want = float(torch.topk(union, k).values.min()) if k <= union.numel() else 0.0
        got = radix_kth_largest(mags[rank], k, comm, union.numel())
        out.append((k, want, got.dtype, tuple(got.shape), float(got)))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_radix_select_finds_the_kth_largest_of_the_union_on_the_device(world_size):
    """The exact global threshold, left where it was found as a 0-dim tensor: ties, zeros, infinity, too few values."""
    for rank_out in pool(world_size).run(_radix_cases):
        for k, want, dtype, shape, got in rank_out:
            assert dtype == torch.float32 and shape == () and got == want, (k, want, got)


def _run_state_roundtrip(rank, world_size, c):
    import colltune

    a = colltune.TopkState(k=c["k"])
    b = None
    outs_a, outs_b = [], []
    for step in range(c["steps"]):
        t = make_tensor(c, rank, step)
        if step == c["steps"] // 2:
            b = colltune.TopkState(k=1)
            b.load_state_dict(a.state_dict())
        ra = colltune.topk_allreduce(t, a, op="avg", algorithm=c["algorithm"])
        outs_a.append(raw(ra.values))
        if b is not None:
            rb = colltune.topk_allreduce(t, b, op="avg", algorithm=c["algorithm"])
            outs_b.append(raw(rb.values))
    return outs_a[c["steps"] // 2 :], outs_b


@pytest.mark.parametrize("algorithm", SELECTING)
def test_state_dict_roundtrip_resumes_identically(algorithm):
    c = topk_cfg(seed=51, algorithm=algorithm, steps=20, shape=(2000,), k=30)
    for r, (a, b) in enumerate(pool(2).run(_run_state_roundtrip, c)):
        assert a == b, f"rank {r}: a state restored from state_dict() diverged from the original"


# ------------------------------------------------------------------ Ok-Topk's counts in the metadata record


def _calls_of(res, primitive: str) -> int:
    return res.traffic.by_primitive.get(primitive, {}).get("calls", 0)


def _topk_record(res, state) -> dict:
    return {
        "algorithm": res.algorithm,
        "all_to_all": _calls_of(res, "all_to_all"),
        "collectives": sum(v["calls"] for v in res.traffic.by_primitive.values()),
        "indices": None if res.indices is None else raw(res.indices),
        "values": raw(res.values),
        "sent": None if res.sent_indices is None else raw(res.sent_indices),
        "residual": raw(state.residual),
        "local_threshold": state.local_threshold,
        "global_threshold": state.global_threshold,
    }


def _with_counts_in_record(on: bool, fn, *args):
    """Run ``fn(*args)`` with Ok-Topk's top-k counts in the record (the default) or by all_to_all on every call."""
    from colltune.algorithms import oktopk

    before = oktopk.TOPK_COUNTS_IN_RECORD
    oktopk.TOPK_COUNTS_IN_RECORD = on
    try:
        return fn(*args)
    finally:
        oktopk.TOPK_COUNTS_IN_RECORD = before


def _oktopk_topk_calls(world_size, rank, c, refresh):
    import torch.distributed as dist

    import colltune

    group = dist.new_group()  # a fresh eager slot
    state = colltune.TopkState(k=c["k"], boundary_refresh=refresh, local_refresh=4, global_refresh=6)
    out = []
    for step in range(c["steps"]):
        res = colltune.topk_allreduce(make_tensor(c, rank, step), state, algorithm="oktopk", group=group)
        out.append(_topk_record(res, state))
    return out


def _run_oktopk_counts(rank, world_size, c, refresh):
    return [_with_counts_in_record(on, _oktopk_topk_calls, world_size, rank, c, refresh) for on in (True, False)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_oktopk_topk_counts_ride_in_the_record_while_boundaries_are_cached(world_size):
    c, refresh = topk_cfg(seed=61, shape=(3000,), k=60, steps=13), 5
    for rank, (fast, slow) in enumerate(pool(world_size).run(_run_oktopk_counts, c, refresh, timeout=120)):
        # The boundaries refresh on calls 0, 5, 10: the cuts are not known before the exchange, and the counts
        # travel by all_to_all; every other call selects before the exchange and sends its counts in the record.
        assert [r["all_to_all"] for r in fast] == [int(i % refresh == 0) for i in range(c["steps"])], (rank, fast)
        assert [r["all_to_all"] for r in slow] == [1] * c["steps"], rank
        assert all(f["collectives"] == s["collectives"] - 1 for f, s in zip(fast, slow) if f["all_to_all"] == 0)
        # The same selections, sums, deliveries, residuals and thresholds, bit for bit.
        for i, (f, s) in enumerate(zip(fast, slow)):
            assert {**f, "all_to_all": 0, "collectives": 0} == {**s, "all_to_all": 0, "collectives": 0}, (rank, i)


#: Auto decisions of the planned selector, one per call: an algorithm, or one with state knobs for TopkState.
PLAN = ["oktopk", "oktopk", "oktopk", "allgather", "oktopk", "dense", "dense", "oktopk", "oktopk",
        ("oktopk", {"local_refresh": 3}), "oktopk", "oktopk", "allgather", "oktopk", "oktopk", "oktopk"]


def _planned_selector(plan):
    """Return an auto selector that decides ``plan[i]`` at the i-th top-k call; its last choice is the previous call's."""
    from colltune.select.selector import Choice, Selector

    class Planned(Selector):
        def __init__(self) -> None:
            super().__init__(environ={})
            self.calls, self.latest = 0, None

        def last_choice(self, site_key):
            return self.latest

        def decide_topk(self, site_key, **kw):
            step = plan[self.calls]
            algorithm, state_knobs = (step, {}) if isinstance(step, str) else step
            self.calls, self.latest = self.calls + 1, algorithm
            return Choice(algorithm, "planned", "policy", state_knobs=state_knobs)

    return Planned()


def _auto_topk_calls(world_size, rank, c, refresh):
    import torch.distributed as dist

    import colltune

    group = dist.new_group()
    sel = _planned_selector(PLAN)
    state = colltune.TopkState(k=c["k"], boundary_refresh=refresh)
    out = []
    for step in range(len(PLAN)):
        res = colltune.topk_allreduce(make_tensor(c, rank, step), state, group=group, policy=sel, name="w")
        out.append(_topk_record(res, state))
    return out


def _run_auto_counts(rank, world_size, c, refresh):
    return [_with_counts_in_record(on, _auto_topk_calls, world_size, rank, c, refresh) for on in (True, False)]


def _expected_all_to_all(plan, refresh: int) -> list[int]:
    """Per call: 1 where Ok-Topk runs and its counts cannot ride in the record, else 0."""
    out, runs, likely, local_refresh = [], 0, None, 32
    for step in plan:
        algorithm, knobs = (step, {}) if isinstance(step, str) else step
        changed = knobs.get("local_refresh", local_refresh) != local_refresh  # the decision changed the selection
        local_refresh = knobs.get("local_refresh", local_refresh)
        in_record = likely == "oktopk" and runs % refresh != 0 and not changed
        out.append(int(algorithm == "oktopk" and not in_record))
        runs += algorithm == "oktopk"
        likely = algorithm
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_auto_topk_calls_that_alternate_choices_keep_oktopk_bits(world_size):
    c, refresh = topk_cfg(seed=62, shape=(2500,), k=50), 4
    expected = _expected_all_to_all(PLAN, refresh)
    # Payloads sent for Ok-Topk but dropped (calls 3, 12: another algorithm chosen), no payload after a switch
    # back (4, 7, 13), refreshes (0, 11; 7), and a local refresh period changed by the decision after the
    # payload was cut (9).
    assert expected == [1, 0, 0, 0, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 0]
    for rank, (fast, slow) in enumerate(pool(world_size).run(_run_auto_counts, c, refresh, timeout=120)):
        assert [r["algorithm"] for r in fast] == [p if isinstance(p, str) else p[0] for p in PLAN]
        assert [r["all_to_all"] for r in fast] == expected, (rank, [r["all_to_all"] for r in fast])
        assert [r["all_to_all"] for r in slow] == [int(r["algorithm"] == "oktopk") for r in slow], rank
        for i, (f, s) in enumerate(zip(fast, slow)):
            assert {**f, "all_to_all": 0, "collectives": 0} == {**s, "all_to_all": 0, "collectives": 0}, (rank, i)


def random_topk_cfg(seed: int) -> dict:
    """A top-k configuration drawn at random: shape (1-d to 3-d, one element to 5000), k or a density (up to
    every element), algorithm, op, dtype, steps, correlated or not, default or short refresh periods."""
    r = random.Random(seed)
    shape = r.choice([(1,), (7,), (300,), (5000,), (64, 64), (40, 25), (3, 1, 7)])
    by_k = r.random() < 0.5
    return topk_cfg(
        seed=seed, shape=shape, k=r.randint(1, math.prod(shape)) if by_k else None,
        density=None if by_k else r.choice([1e-3, 1e-2, 0.1, 0.5, 1.0]),
        algorithm=r.choice(ALGS), op=r.choice(["sum", "avg"]), dtype=r.choice(list(DTYPES)),
        steps=r.randint(1, 15), correlated=r.random() < 0.3,
        state_kw=r.choice([{}, {"local_refresh": 3, "global_refresh": 2, "boundary_refresh": 5}]),
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, pytest.param(5, marks=pytest.mark.slow),
                                        pytest.param(8, marks=pytest.mark.slow)])
def test_topk_on_random_configurations(world_size):
    """Every invariant :func:`check_topk` holds (error feedback, selection counts, the same bits on every rank,
    the result the sum of what was delivered), on configurations nobody tuned to."""
    for seed in range(100 * world_size, 100 * world_size + 12):
        c = random_topk_cfg(seed)
        check_topk(c, world_size, pool(world_size).run(_run_topk, c, timeout=120))


def _overflowing_topk(rank: int, world_size: int, algorithm: str, device_path: bool) -> dict:
    """Four top-k calls of 1000 values: in the second rank 1's gradient overflows (every entry inf, -inf or NaN),
    in the fourth it holds three NaN among small values (where a threshold selects none of them)."""
    import contextlib

    import colltune
    from colltune.algorithms.sparse import device_path as device
    from colltune.algorithms.state import TopkState

    state, out = TopkState(density=0.01), {"residual": [], "result_finite": []}
    with device() if device_path else contextlib.nullcontext():
        for step in range(4):
            grad = torch.randn(1000, generator=torch.Generator().manual_seed(10 * rank + step))
            if rank == 1 and step == 1:
                grad = grad * math.inf
                grad[::7] = math.nan
            if rank == 1 and step == 3:
                grad[[3, 500, 999]] = math.nan
            res = colltune.topk_allreduce(grad, state, algorithm=algorithm)
            out["result_finite"].append(bool(torch.isfinite(res.values).all()))
            out["residual"].append(state.residual.clone())
    return out


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("algorithm", names())
def test_an_overflowing_step_leaves_every_residual_as_it_was(algorithm, device_path):
    """One rank's overflow (as under an AMP GradScaler) reaches every rank's result, as a dense allreduce's
    would, so a scaler skips that step on every rank; and no rank's error feedback takes it in: each residual
    stays as it was, where kept it would stay non-finite for about n / k steps, each one skipped. A rank's own
    non-finite entries are sent (and then the step is skipped alike) or, where no threshold selects them, dropped
    from its residual, not kept forever."""
    for o in pool(2).run(_overflowing_topk, algorithm, device_path):
        assert o["result_finite"][:3] == [True, False, True], o["result_finite"]
        for step in (1, 3):  # a step whose result is not finite is taken in by no residual
            if not o["result_finite"][step]:
                assert torch.equal(o["residual"][step], o["residual"][step - 1]), step
        assert all(bool(torch.isfinite(r).all()) for r in o["residual"])
