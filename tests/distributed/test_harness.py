"""Tests of the distributed test harness itself (tests/harness.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import Raised, RankPool, expect_error, pool, run_cases, run_ranks

# ----------------------------------------------------------------- rank functions (module level)


def _sum_of_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)]) * scale
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "sum": t.item(),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for rank 1, which never comes
    return t.item()


def _rank0_hangs(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def _all_raise_mismatch(rank, world_size):
    def call():
        raise RuntimeError(f"disagreement seen by rank {rank}")

    return expect_error(call)


def _case_square(rank, world_size, case):
    t = torch.tensor([float(case)])
    dist.all_reduce(t)
    return t.item() * (rank + 1)


def _case_fails_at_two(rank, world_size, case):
    if case == 2:
        raise KeyError(f"case two on rank {rank}")
    return case


def _rank_aborts_natively(rank, world_size):
    if rank == 1:
        os.abort()  # what a native crash does: a backend's thread calling std::terminate
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _rank_dies_hard(rank, world_size):
    if rank == 1:
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _tensor_payload(rank, world_size):
    return {"bf16": torch.arange(5, dtype=torch.bfloat16) + rank, "i": torch.tensor([rank], dtype=torch.int64)}


# ----------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_run_ranks_returns_per_rank_results(world_size):
    out = run_ranks(_sum_of_ranks, world_size, 2.0)
    expected = 2.0 * sum(range(world_size))
    assert [r["rank"] for r in out] == list(range(world_size))
    for r in out:
        assert r["world_size"] == world_size
        assert r["sum"] == expected
        assert r["threads"] == 1
        assert r["backend"] == "gloo"


def test_run_ranks_returns_tensors():
    out = run_ranks(_tensor_payload, 2)
    assert out[1]["bf16"].dtype == torch.bfloat16
    assert torch.equal(out[1]["bf16"], torch.arange(5, dtype=torch.bfloat16) + 1)
    assert out[0]["i"].item() == 0


def test_a_rank_that_raises_is_reported_with_its_rank_and_message():
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank1_raises, 2, timeout=60)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    first_line = msg.splitlines()[0]
    # The real error (rank 1's), not rank 0's secondary connection error, comes first.
    assert "rank 1 of 2 raised ValueError: rank one is broken on purpose" in first_line, msg
    assert "_rank1_raises" in msg  # the traceback is included
    assert "rank 0:" in msg
    # Rank 0 is not left waiting for the process-group timeout.
    assert elapsed < 20, elapsed


def test_a_rank_that_hangs_is_killed_at_the_deadline_and_reported():
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank0_hangs, 2, timeout=3)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "rank 0: killed by the harness (still running at the deadline of 3 s)" in msg, msg
    assert "rank 1: ok" in msg, msg
    assert "time.sleep" in msg or "_rank0_hangs" in msg, msg  # stack dump of the stuck rank
    assert elapsed < 15, elapsed


def test_a_rank_that_dies_without_traceback_is_reported():
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank_dies_hard, 2, timeout=60)
    msg = str(info.value)
    assert "rank 1: died with exit code 3 and no Python traceback" in msg, msg


def test_a_rank_dead_of_a_fatal_signal_is_reported_with_its_stacks():
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank_aborts_natively, 2, timeout=60)
    msg = str(info.value)
    assert "rank 1: died with signal SIGABRT and no Python traceback" in msg, msg
    # Where every thread of the rank was when it died, not only that it died.
    stacks = msg.split("---- Python stacks of rank 1 when it died with signal SIGABRT ----", 1)[1]
    assert "_rank_aborts_natively" in stacks, msg


def test_expect_error_reports_every_rank():
    out = run_ranks(_all_raise_mismatch, 3)
    for rank, raised in enumerate(out):
        assert isinstance(raised, Raised)
        assert raised.raised
        assert raised.type == "RuntimeError" and raised.isa("Exception")
        assert raised.message == f"disagreement seen by rank {rank}"
        assert 0 <= raised.elapsed < 10  # measured; the bound only catches a hang


def test_expect_error_when_nothing_is_raised():
    r = expect_error(lambda: 42)
    assert not r.raised and r.returned == "42"


def test_run_cases_runs_all_cases_in_one_launch():
    out = run_cases(_case_square, 3, [1, 2, 5])
    assert out == [[3.0, 6.0, 9.0], [6.0, 12.0, 18.0], [15.0, 30.0, 45.0]]


def test_run_cases_names_the_failing_case():
    with pytest.raises(AssertionError) as info:
        run_cases(_case_fails_at_two, 2, [0, 1, 2, 3])
    assert "case 2 (2) failed: KeyError" in str(info.value).splitlines()[0]


def test_pool_reuses_ranks_and_recovers_after_a_failure():
    p = RankPool(2)
    try:
        assert [r["sum"] for r in p.run(_sum_of_ranks, 1.0)] == [1.0, 1.0]
        with pytest.raises(AssertionError) as info:
            p.run(_rank1_raises)
        assert "rank 1 of 2 raised ValueError: rank one is broken on purpose" in str(info.value)
        # Fresh ranks after the failure.
        assert [r["sum"] for r in p.run(_sum_of_ranks, 3.0)] == [3.0, 3.0]
        with pytest.raises(AssertionError) as info:
            p.run(_rank0_hangs, timeout=2)
        assert "rank 0: killed by the harness" in str(info.value)
        assert [r["sum"] for r in p.run(_sum_of_ranks, 1.0)] == [1.0, 1.0]
    finally:
        p.close()


def _pid(rank, world_size):
    return os.getpid()


def test_shared_pool_keeps_its_ranks_between_calls():
    # What makes the shared pool cheap: one pool per world size, and the same
    # rank processes answer every call (no per-call launch).
    p = pool(2)
    assert pool(2) is p
    pids = p.run(_pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for _ in range(20):
        assert [r["sum"] for r in p.run(_sum_of_ranks, 1.0)] == [1.0, 1.0]
    assert p.run(_pid) == pids
