"""A rank that dies makes every survivor raise within the process-group timeout, never hang.

Each distributed test starts 2 or 3 gloo ranks with a short process-group
timeout (:data:`PG_TIMEOUT_S`). After a warm-up round (the first ``auto``
call loads the selector, which takes seconds and is not what is measured),
one rank SIGKILLs itself before, or in the middle of, a sequence of
``sparse_allreduce`` (every registered algorithm and auto) and ``topk_allreduce``
calls, made synchronously or with ``async_op=True`` (several handles in
flight, then ``wait()`` on each). Every survivor writes what it got (per
call: exception type, message, end time) to a JSON file; the victim writes
the time of its kill. The parent asserts that every survivor raised within
``PG_TIMEOUT_S + SLACK_S`` of the kill, that every handle's ``wait()``
returned or raised by then (the handles queued behind the first failure
raise ``AbandonedCallError`` at once, unrun), and that the survivors exit
cleanly.

Survivors wait for each other's reports before they return, so that a
survivor's exit (which closes its sockets) never wakes another one up: the
test measures how survivors notice the dead rank, not each other.

Run::

    python3 -m pytest -q tests/test_faults.py -s   # -s shows the elapsed times
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from functools import partial
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import colltune
from colltune import api
from colltune.algorithms.errors import ColltuneValueError
from colltune.offline.launch import Outcome, failure_report, launch_ranks

#: Process-group timeout in the ranks of these tests, in seconds.
PG_TIMEOUT_S = 5.0
#: What a survivor may take beyond the process-group timeout to raise (a loaded 2-core machine).
SLACK_S = 5.0
ALGORITHMS = (*colltune.algorithms.names(), "auto")
#: Async calls a survivor makes on the broken group after its synchronous call raised.
AFTER_CALLS = 3


# --------------------------------------------------------------------------- rank side


def _calls(rank: int) -> list[tuple[str, Callable[..., Any]]]:
    """Return the calls of one round: every algorithm through both front doors, this rank's inputs."""
    g = torch.Generator().manual_seed(rank + 1)
    n, k = 4096, 48
    idx = torch.randint(0, n, (k,), generator=g)
    vals = torch.randn(k, generator=g)
    rows = torch.randn(k, 4, generator=g)  # embedding rows for one of the sparse calls
    grad = torch.randn(64, 64, generator=g)
    states = {a: colltune.TopkState(density=0.02) for a in ALGORITHMS}
    calls: list[tuple[str, Callable[..., Any]]] = []
    for a in ALGORITHMS:
        values = rows if a == "allgather" else vals
        calls.append((f"sparse_allreduce/{a}", partial(colltune.sparse_allreduce, idx, values, n, algorithm=a)))
        calls.append((f"topk_allreduce/{a}", partial(colltune.topk_allreduce, grad, states[a], algorithm=a)))
    return calls


def _record(name: str, start: float, exc: BaseException | None = None) -> dict[str, Any]:
    """Describe how one call ended (``type`` is ``None`` when it returned); times are ``time.time()``."""
    return {
        "call": name,
        "type": None if exc is None else type(exc).__name__,
        "classes": [] if exc is None else [c.__name__ for c in type(exc).__mro__],
        "message": "" if exc is None else str(exc)[:600],
        "start": start,
        "end": time.time(),
    }


def _die(outdir: str) -> None:
    """Note the time and SIGKILL this process (no cleanup, as when a node or the OOM killer takes a rank)."""
    with open(os.path.join(outdir, "killed_at.json"), "w") as f:
        json.dump(time.time(), f)
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_all(handles: list[tuple[str, float, Any]]) -> list[dict[str, Any]]:
    """Wait on every handle in order; return how each ended."""
    out = []
    for name, start, handle in handles:
        try:
            handle.wait()
        except Exception as exc:  # noqa: BLE001 - the survivor reports whatever it got
            out.append(_record(name, start, exc))
        else:
            out.append(_record(name, start))
    return out


def _await(paths: list[str], seconds: float) -> None:
    """Wait until every file of ``paths`` exists (at most ``seconds``)."""
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.02)


def _faulty_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> None:
    """Warm up, then run two rounds of calls; ``cfg["victim"]`` kills itself before call ``cfg["kill_at"]``.

    In ``sync`` mode a survivor runs the calls one by one until one raises,
    then makes :data:`AFTER_CALLS` async calls on the broken group and waits
    on them. In ``async`` mode every rank submits every call, then a
    survivor waits on each handle in turn; the victim submits its first
    ``kill_at`` calls and dies (with them in flight) once every survivor has
    submitted all of its calls, so that the survivors' queues are full when
    the first call fails.
    """
    victim, kill_at, mode, outdir = cfg["victim"], cfg["kill_at"], cfg["mode"], cfg["outdir"]
    calls = _calls(rank)
    for _, call in calls:
        call()
    dist.barrier()
    sequence = calls * 2
    report: dict[str, Any] = {"rank": rank, "calls": [], "after": []}
    if mode == "sync":
        for i, (name, call) in enumerate(sequence):
            if rank == victim and i == kill_at:
                _die(outdir)
            start = time.time()
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the survivor reports whatever it got
                report["calls"].append(_record(name, start, exc))
                break
            report["calls"].append(_record(name, start))
        report["after"] = _wait_all([(name, time.time(), call(async_op=True)) for name, call in calls[:AFTER_CALLS]])
    else:
        handles = []
        for i, (name, call) in enumerate(sequence):
            if rank == victim and i == kill_at:
                _await([os.path.join(outdir, f"submitted{r}") for r in range(world_size) if r != victim], 30)
                _die(outdir)
            handles.append((name, time.time(), call(async_op=True)))
        open(os.path.join(outdir, f"submitted{rank}"), "w").close()
        report["calls"] = _wait_all(handles)
    with open(os.path.join(outdir, f"report{rank}.json.tmp"), "w") as f:
        json.dump(report, f)
    os.replace(os.path.join(outdir, f"report{rank}.json.tmp"), os.path.join(outdir, f"report{rank}.json"))
    # Stay until every survivor has reported: this rank's exit would close its sockets and
    # wake a survivor still waiting on it, hiding a hang.
    _await([os.path.join(outdir, f"report{r}.json") for r in range(world_size) if r != victim],
           PG_TIMEOUT_S + SLACK_S + 10)


# --------------------------------------------------------------------------- parent side


def _kill_a_rank(tmp_path, world_size: int, victim: int, kill_at: int, mode: str) -> tuple[float, dict[int, dict]]:
    """Launch the ranks; return the victim's kill time and every survivor's report (asserting they all wrote one)."""
    cfg = {"victim": victim, "kill_at": kill_at, "mode": mode, "outdir": str(tmp_path)}
    outcome: Outcome = launch_ranks(
        _faulty_rank, world_size, (cfg,), pg_timeout=PG_TIMEOUT_S, grace=PG_TIMEOUT_S + SLACK_S + 15, timeout=150,
        prefix="colltune-faults-",
    )
    what = f"P={world_size} {mode}, rank {victim} killed before call {kill_at}"
    detail = failure_report(outcome, what, killed_as="killed by the test (hung)", label_errors=True)
    assert outcome.exitcodes.get(victim) == -signal.SIGKILL, f"the victim did not die by SIGKILL\n{detail}"
    assert not outcome.killed, f"survivors still running long after the kill\n{detail}"
    survivors = [r for r in range(world_size) if r != victim]
    assert all(outcome.exitcodes[r] == 0 for r in survivors) and not outcome.errors, f"a survivor failed\n{detail}"
    with open(tmp_path / "killed_at.json") as f:
        killed_at = json.load(f)
    reports = {}
    for r in survivors:
        with open(tmp_path / f"report{r}.json") as f:
            reports[r] = json.load(f)
    return killed_at, reports


def _describe(what: str, rank: int, rec: dict[str, Any], killed_at: float) -> str:
    return (f"{what}: rank {rank}: {rec['call']} -> {rec['type'] or 'returned'} "
            f"{rec['end'] - killed_at:.2f} s after the kill: {rec['message'][:160]!r}")


def _check_raised_in_time(rec: dict[str, Any], killed_at: float, line: str) -> None:
    print(line)
    assert rec["type"] is not None, f"expected an exception: {line}"
    assert "RuntimeError" in rec["classes"] and "ColltuneError" in rec["classes"], (
        f"expected a colltune error (CollectiveError or AbandonedCallError): {line}"
    )
    assert rec["message"].strip(), f"expected a message: {line}"
    assert rec["end"] - killed_at <= PG_TIMEOUT_S + SLACK_S, f"raised too late: {line}"


def _check_queue(recs: list[dict[str, Any]], killed_at: float, what: str, rank: int, dropped: bool = True) -> None:
    """Every handle ended in time; after the first that raised, every later one raised.

    With ``dropped``, the later ones raised ``AbandonedCallError`` (they were
    queued before the first failed); else any ``RuntimeError``.
    """
    failed = [i for i, rec in enumerate(recs) if rec["type"] is not None]
    assert failed, f"{what}: rank {rank}: no handle raised: {recs}"
    first = failed[0]
    assert failed == list(range(first, len(recs))), f"{what}: rank {rank}: a handle returned after one raised"
    _check_raised_in_time(recs[first], killed_at, _describe(what, rank, recs[first], killed_at))
    for rec in recs[first + 1 :]:
        line = _describe(what, rank, rec, killed_at)
        assert (rec["type"] == "AbandonedCallError") if dropped else ("RuntimeError" in rec["classes"]), line
        assert rec["end"] - killed_at <= PG_TIMEOUT_S + SLACK_S, f"handle ended too late: {line}"
    if first + 1 < len(recs):
        print(_describe(what, rank, recs[-1], killed_at))


@pytest.mark.parametrize(
    ("world_size", "victim", "kill_at"),
    [(2, 1, 0), (3, 0, 5)],
    ids=["P2-before-first-call", "P3-mid-sequence"],
)
def test_sync_calls_raise_when_a_rank_dies(tmp_path, world_size, victim, kill_at):
    """The survivors' synchronous call raises soon after the kill, and so do async calls made afterwards."""
    killed_at, reports = _kill_a_rank(tmp_path, world_size, victim, kill_at, "sync")
    what = f"P={world_size} sync"
    for rank, report in reports.items():
        last = report["calls"][-1]
        assert all(rec["type"] is None for rec in report["calls"][:-1])
        _check_raised_in_time(last, killed_at, _describe(what, rank, last, killed_at))
        # Async calls made on the broken group raise too (each submitted after a failure runs, and fails).
        _check_queue(report["after"], killed_at, f"{what} async after", rank, dropped=False)
        assert report["after"][0]["type"] != "AbandonedCallError"


@pytest.mark.parametrize(
    ("world_size", "victim", "kill_at"),
    [(2, 0, 3), (3, 2, 0)],
    ids=["P2-victim-with-calls-in-flight", "P3-before-first-call"],
)
def test_async_handles_raise_when_a_rank_dies(tmp_path, world_size, victim, kill_at):
    """Every handle of a survivor ends soon after the kill: the first failing one raises, the rest are dropped."""
    killed_at, reports = _kill_a_rank(tmp_path, world_size, victim, kill_at, "async")
    for rank, report in reports.items():
        assert len(report["calls"]) == 2 * 2 * len(ALGORITHMS)
        _check_queue(report["calls"], killed_at, f"P={world_size} async", rank)


# --------------------------------------------------------------------------- the queue, in one process


def test_calls_queued_behind_a_failed_call_are_dropped():
    """A backend failure drops the calls queued behind it; calls submitted later run."""
    release = threading.Event()
    ran: list[str] = []

    def fails(wire: object) -> None:
        release.wait(10)
        ran.append("fails")
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    first = api.submit_call(fails, True, None)
    queued = api.submit_call(lambda wire: ran.append("queued"), True, None)
    threading.Timer(0.1, release.set).start()
    gist = r"queued before it failed \(CollectiveError: a collective of this call failed .*\) out of step"
    with pytest.raises(api.AbandonedCallError, match=gist):
        api.submit_call(lambda wire: ran.append("sync"), False, None)  # a synchronous call waits its turn behind them
    with pytest.raises(colltune.CollectiveError, match="The backend said: Connection closed by peer") as info:
        first.wait(10)
    assert isinstance(info.value.__cause__, RuntimeError) and "restart the job" in str(info.value)
    with pytest.raises(api.AbandonedCallError) as dropped:
        queued.wait(10)
    assert dropped.value.__cause__ is info.value
    assert isinstance(dropped.value, RuntimeError) and isinstance(dropped.value, colltune.ColltuneError)
    assert ran == ["fails"]
    assert api.submit_call(lambda wire: 7, True, None).wait(10) == 7
    assert api.submit_call(lambda wire: 8, False, None) == 8


def test_an_error_every_rank_raises_keeps_the_queue():
    """A colltune error (raised by every rank at the same call) leaves the calls queued behind it to run."""

    def refuses(wire: object) -> None:
        raise ColltuneValueError("size must be >= 1, but got 0.")

    first = api.submit_call(refuses, True, None)
    queued = api.submit_call(lambda wire: 5, True, None)
    with pytest.raises(ColltuneValueError):
        first.wait(10)
    assert queued.wait(10) == 5
