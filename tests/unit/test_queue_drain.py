"""``api.drain()``: a thread about to issue collectives of its own lets colltune's queued calls go first.

Calls run without a process group (locally), on colltune's worker thread.
"""

from __future__ import annotations

import gc
import threading

from colltune import api


def test_drain_returns_once_every_queued_call_has_run() -> None:
    gate, ran = threading.Event(), []
    first = api.submit_call(lambda wire: gate.wait(10), True, None)  # holds the worker
    second = api.submit_call(lambda wire: ran.append("second"), True, None)
    drained = threading.Event()
    waiter = threading.Thread(target=lambda: (api.drain(), drained.set()))
    waiter.start()
    try:
        assert not drained.wait(0.2)  # the worker is held: drain waits
    finally:
        gate.set()  # never leave the process's worker held for the tests after this one
    waiter.join(10)
    assert drained.is_set() and ran == ["second"] and second.is_completed() and first.is_completed()


def test_drain_returns_failed_calls_without_raising() -> None:
    def fail(wire: object) -> None:
        raise KeyError("not a collective's error")

    handle = api.submit_call(fail, True, None)
    api.drain()
    assert handle.is_completed()
    assert api.submit_call(lambda wire: "next", True, None).wait(10) == "next"  # calls queued later still run


def test_drain_on_the_worker_thread_returns_at_once() -> None:
    # A call (or a handle's callback) on the worker that drains must not wait for itself, nor for the calls
    # queued behind it, which wait for it.
    gate = threading.Event()
    holder = api.submit_call(lambda wire: gate.wait(10), True, None)
    inner = api.submit_call(lambda wire: api.drain() or "drained", True, None)
    behind = api.submit_call(lambda wire: "behind", True, None)
    gate.set()
    assert inner.wait(10) == "drained" and behind.wait(10) == "behind" and holder.wait(10)


def test_drain_after_the_last_handle_is_dropped_returns() -> None:
    # The latest call is held weakly: once its handle is gone and it has run, drain has nothing to wait for.
    handle = api.submit_call(lambda wire: "done", True, None)
    assert handle.wait(10) == "done"
    # The worker thread lets go of a call only when it takes the next one (after the result is set): hand it
    # one straight through the executor, so that colltune's latest call stays this one.
    api._executor.submit(lambda: None).result(10)
    del handle
    gc.collect()
    assert api._last is not None and api._last() is None  # not kept alive by colltune
    api.drain()
    assert api.submit_call(lambda wire: "inline", False, None) == "inline"
