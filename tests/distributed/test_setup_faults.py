"""A peer that never makes its first call on a group: the call raises CollectiveError, and a retry raises at once.

The first colltune call on a group makes the group's private twin
(:func:`colltune.algorithms.comm.private_group`), a rendezvous of every rank
of the group bounded by the group's timeout. Here, at P = 2 with a short
process-group timeout (:data:`PG_TIMEOUT_S`), rank 0 calls
``sparse_allreduce`` on the default group and on a group of its own
(``dist.new_group``) while rank 1 never calls colltune. Each first call must
raise :class:`~colltune.CollectiveError` naming the group and the timeout
soon after the timeout; each retry (synchronous, then with
``async_op=True``) must raise at once, saying that the set-up failed earlier
and why. Rank 1 waits until rank 0 is done; then both run a barrier on each
group (the caller's own groups still work) and exit cleanly.

Run::

    python3 -m pytest -q tests/distributed/test_setup_faults.py -s   # -s shows the times
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import colltune
from colltune.offline.launch import Outcome, failure_report, launch_ranks

#: Process-group timeout in the ranks of this test, in seconds.
PG_TIMEOUT_S = 2.0


def _call(group: Any, async_op: bool = False) -> dict[str, Any]:
    """Make one ``sparse_allreduce`` on ``group``; return how it ended (times from ``time.monotonic()``)."""
    start = time.monotonic()
    try:
        out = colltune.sparse_allreduce(torch.tensor([1, 5]), torch.ones(2), 8, group=group, async_op=async_op)
        if async_op:
            out.wait(30)
    except Exception as exc:  # noqa: BLE001 - the parent asserts on whatever came
        return {"classes": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                "cause": repr(exc.__cause__), "seconds": time.monotonic() - start}
    return {"classes": [], "message": "", "cause": "", "seconds": time.monotonic() - start}


def _lonely_rank(rank: int, world_size: int, outdir: str) -> dict[str, Any]:
    """Rank 0 calls colltune on two groups, twice each; rank 1 never does, and waits for rank 0 to finish."""
    # Every rank of the job makes it (torch's rule); only rank 0 calls colltune on it. torch gives a new
    # group its own timeout (30 min by default, not the default group's): the twin inherits it.
    sub = dist.new_group([0, 1], timeout=timedelta(seconds=PG_TIMEOUT_S))
    done = os.path.join(outdir, "done")
    report: dict[str, Any] = {"sub_name": sub.group_name}
    if rank == 0:
        from colltune.algorithms import comm

        setups: list[Any] = []  # every set-up of a private twin rank 0 tries: a retry must not try again
        make_twin = comm._make_twin
        comm._make_twin = lambda group: (setups.append(group), make_twin(group))[1]  # type: ignore[assignment]
        report["world"] = [_call(None), _call(None), _call(None, async_op=True)]
        report["sub"] = [_call(sub), _call(sub)]
        comm._make_twin = make_twin  # type: ignore[assignment]
        report["setups"] = len(setups)
        open(done, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    # The caller's own groups still work on both ranks.
    dist.barrier()
    dist.barrier(group=sub)
    return report


def _run() -> Outcome:
    with tempfile.TemporaryDirectory(prefix="colltune-setup-faults-") as outdir:
        return launch_ranks(_lonely_rank, 2, (outdir,), pg_timeout=PG_TIMEOUT_S, grace=20, timeout=120,
                            prefix="colltune-setup-faults-")


def test_first_call_without_the_peer_raises_and_a_retry_raises_at_once():
    """The set-up's timeout is a CollectiveError naming the group and timeout; a retry says why, at once."""
    outcome = _run()
    detail = failure_report(outcome, "P=2, rank 1 never calls colltune", killed_as="killed by the test (hung)",
                            label_errors=True)
    assert not outcome.failed and outcome.exitcodes == {0: 0, 1: 0}, f"a rank failed or hung\n{detail}"
    report = outcome.results[0]
    assert report["setups"] == 2, report["setups"]  # one per group: no retry waited for the peer again
    for what, group_words, recs in (
        ("default group", "the default process group (ranks 0, 1)", report["world"]),
        ("new_group", f"process group {report['sub_name']!r} (ranks 0, 1)", report["sub"]),
    ):
        first, *retries = recs
        print(f"{what}: first call {first['seconds']:.2f} s: {first['message'][:200]}")
        assert "CollectiveError" in first["classes"] and "RuntimeError" in first["classes"], (what, first)
        assert group_words in first["message"], (what, first["message"])
        assert f"timeout ({PG_TIMEOUT_S:g} s)" in first["message"], (what, first["message"])
        assert "The backend said: " in first["message"] and first["cause"] != "None", (what, first)
        for retry in retries:
            print(f"{what}: retry {retry['seconds']:.4f} s: {retry['message'][:200]}")
            assert "CollectiveError" in retry["classes"], (what, retry)
            assert group_words in retry["message"], (what, retry["message"])
            assert "failed on an earlier call" in retry["message"], (what, retry["message"])
            assert "CollectiveError: " in retry["message"], (what, retry["message"])  # the earlier failure, named
            assert f"timeout ({PG_TIMEOUT_S:g} s)" in retry["message"], (what, retry["message"])
            assert "Re-create the group" in retry["message"], (what, retry["message"])
