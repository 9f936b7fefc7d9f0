"""Run a function on several gloo ranks (CPU processes) and collect what each rank returns.

Three entry points, from the simplest to the fastest:

``run_ranks(fn, world_size, *args)``
    One launch: ``world_size`` fresh processes, a fresh ``FileStore`` in a
    temporary directory, ``fn(rank, world_size, *args)`` on each rank, the
    return values in rank order.

``run_cases(fn, world_size, cases)``
    One launch for many cases: ``fn(rank, world_size, case)`` for each case in
    turn, in the same process group; returns ``results[case][rank]``.

``RankPool(world_size)`` / :func:`pool`
    Ranks that stay up between calls, so that a test (or a hypothesis example)
    costs a round trip instead of a launch. ``pool(P).run(fn, *args)`` behaves
    like ``run_ranks`` and returns the same list. When a call fails or hangs,
    its ranks are killed and the next call starts fresh ones. Pool ranks keep
    module state (caches, registries) from earlier calls: a test whose outcome
    could depend on what ran before belongs in ``run_ranks`` / ``run_cases``.

Rank functions must be module-level (they are pickled by reference) and return
something picklable (tensors included). Each rank runs with one intra-op thread
on gloo with a short process-group timeout.

The rank bootstrap is the package's launcher (:mod:`colltune.offline.launch`, the engine
of ``run_local``); this module adds the ``AssertionError`` reports, the cases
driver, the persistent pool and :func:`expect_error`.

Failures raise ``AssertionError`` naming the rank and showing the first real
error: a rank's own exception is preferred to the secondary "connection closed
by peer" / timeout errors it causes on the other ranks. A rank that is still
running at the deadline (or a few seconds after another rank failed) is killed
and reported with a dump of its Python stacks taken just before the kill.

:func:`expect_error` lets a rank function call something that should raise on
every rank and return what was raised, so that tests can assert on every rank.
"""

from __future__ import annotations

import importlib.util
import io
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from multiprocessing.connection import wait as _mp_wait
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from colltune.offline.launch import (
    GRACE_S,
    Outcome,
    exit_rank,
    failure_report,
    kill_ranks,
    launch_ranks,
    rank_context,
    read_errors,
    setup_rank,
    write_error,
)
from colltune.offline.launch import short_repr as _short

__all__ = [
    "NATIVE_SIGNALS",
    "once_more_after_a_native_death",
    "PG_TIMEOUT_S",
    "run_ranks",
    "run_cases",
    "RankPool",
    "pool",
    "shutdown_pools",
    "expect_error",
    "Raised",
]

#: Process-group timeout in every rank: a rank stuck in a collective fails after this.
PG_TIMEOUT_S = 30.0

#: How the harness's reports describe a rank it killed.
_KILLED = "killed by the harness"


def _report(outcome: Outcome, what: str) -> str:
    return failure_report(outcome, what, killed_as=_KILLED, label_errors=True)


def _cases_driver(rank, world_size, fn, cases):
    out = []
    for i, case in enumerate(cases):
        try:
            out.append(fn(rank, world_size, case))
        except BaseException as exc:
            raise _CaseError(f"case {i} ({_short(case)}) failed: {type(exc).__name__}: {exc}") from exc
    return out


class _CaseError(RuntimeError):
    pass


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = PG_TIMEOUT_S,
    grace: float = GRACE_S,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh gloo ranks; return the results in rank order.

    Args:
        fn: a module-level function (it is pickled by reference).
        world_size: number of ranks.
        *args: passed to ``fn`` on every rank (must be picklable).
        timeout: the parent kills every rank still running after this many seconds.
        pg_timeout: the process-group timeout inside the ranks.
        grace: after one rank failed, how long the others may run before they are killed.

    Raises:
        AssertionError: a rank raised, died, or was killed; the message names the
            rank with the first real error and shows its traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    outcome = launch_ranks(
        fn, world_size, args, timeout=timeout, pg_timeout=pg_timeout, grace=grace, prefix="colltune-ranks-"
    )
    if outcome.failed:
        raise AssertionError(_report(outcome, f"run_ranks({getattr(fn, '__name__', fn)}, world_size={world_size})"))
    return outcome.results


def run_cases(fn: Callable, world_size: int, cases: Sequence[Any], *, timeout: float = 120.0, **kw) -> list:
    """Run ``fn(rank, world_size, case)`` for every case in one launch; return ``results[case][rank]``.

    The cases run in order in the same process group. The first case that raises
    ends the launch; the error names the case index and the case.
    """
    cases = list(cases)
    per_rank = run_ranks(_cases_driver, world_size, fn, cases, timeout=timeout, **kw)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]


# --------------------------------------------------------------------------- persistent ranks


def _pool_worker(rank, world_size, workdir, pg_timeout, conn):
    try:
        setup_rank(rank, world_size, workdir, "gloo", pg_timeout)
    except BaseException as exc:
        write_error(workdir, rank, exc, "starting the rank")
        exit_rank()
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            exit_rank()
        if msg is None:
            break
        call_id, fn, args = msg
        try:
            out = fn(rank, world_size, *args)
            buf = io.BytesIO()
            torch.save(out, buf)
            payload = buf.getvalue()
        except BaseException as exc:
            write_error(workdir, rank, exc, f"call {call_id}: {getattr(fn, '__name__', fn)}{_short(args, 300)}")
            try:
                conn.send(("error", call_id))
            finally:
                exit_rank()
        conn.send(("ok", call_id, payload))
    dist.destroy_process_group()
    conn.close()


class RankPool:
    """``world_size`` gloo ranks that stay up between calls.

    ``run(fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank and
    returns the results in rank order, like :func:`run_ranks`. Any failure or
    hang kills all ranks and raises ``AssertionError``; the next call starts
    fresh ranks with a fresh store. Calls are serialized.
    """

    def __init__(self, world_size: int, *, pg_timeout: float = PG_TIMEOUT_S, start_timeout: float = 120.0):
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self.start_timeout = start_timeout
        self._procs: dict = {}
        self._conns: dict = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._calls = 0
        self._lock = threading.Lock()

    # -- lifecycle
    def _start(self) -> None:
        ctx = rank_context()
        self._tmp = tempfile.TemporaryDirectory(prefix="colltune-pool-")
        workdir = self._tmp.name
        for r in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_pool_worker,
                args=(r, self.world_size, workdir, self.pg_timeout, child_end),
                name=f"pool-rank{r}",
                daemon=True,
            )
            p.start()
            child_end.close()
            self._procs[r], self._conns[r] = p, parent_end
        ready = self._collect(None, self.start_timeout, GRACE_S, "starting the ranks")
        if ready is None:
            return
        raise AssertionError(ready)

    def close(self) -> None:
        """Stop the ranks (cleanly when they are idle)."""
        for conn in self._conns.values():
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self._conns.values():
            conn.close()
        self._procs, self._conns = {}, {}
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- calls
    def run(self, fn: Callable, *args: Any, timeout: float = 90.0, grace: float = GRACE_S) -> list:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results in rank order."""
        with self._lock:
            if not self._procs:
                self._start()
            self._calls += 1
            call_id = self._calls
            for conn in self._conns.values():
                conn.send((call_id, fn, args))
            results: dict = {}
            failure = self._collect(results, timeout, grace, f"{getattr(fn, '__name__', fn)}")
            if failure is not None:
                raise AssertionError(failure)
            return [results[r] for r in range(self.world_size)]

    def _collect(self, results: dict | None, timeout: float, grace: float, what: str) -> str | None:
        """Wait for one message per rank. Return None on success, else the failure report (ranks killed)."""
        pending = set(range(self.world_size))
        failed: set = set()
        deadline = time.monotonic() + timeout
        failed_at = None
        outcome = Outcome(world_size=self.world_size)
        while pending:
            now = time.monotonic()
            if now >= deadline or (failed_at is not None and now - failed_at >= grace):
                reason = (
                    f"no answer at the deadline of {timeout:g} s"
                    if now >= deadline
                    else f"no answer {grace:g} s after another rank failed"
                )
                kill_ranks({r: self._procs[r] for r in pending}, self._tmp.name, outcome, reason)
                break
            limit = deadline - now if failed_at is None else min(deadline - now, failed_at + grace - now)
            waitables = {self._conns[r]: r for r in pending}
            waitables.update({self._procs[r].sentinel: r for r in pending})
            for ready in _mp_wait(list(waitables), timeout=max(0.01, limit)):
                r = waitables[ready]
                if r not in pending:
                    continue
                msg = None
                try:
                    if self._conns[r].poll():
                        msg = self._conns[r].recv()
                except (EOFError, OSError):
                    msg = None
                if msg is None and self._procs[r].is_alive():
                    time.sleep(0.01)  # pipe closed, process not reaped yet
                    continue
                pending.discard(r)
                if msg is not None and msg[0] == "ok" and results is not None:
                    results[r] = torch.load(io.BytesIO(msg[2]), weights_only=False)
                elif msg is not None and msg[0] == "ready":
                    pass
                else:
                    failed.add(r)
                    if failed_at is None:
                        failed_at = time.monotonic()
        if not failed and not outcome.killed:
            return None
        # Failure: every rank goes; gather what they wrote; the next call starts fresh ranks.
        workdir = self._tmp.name
        for p in self._procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)
        outcome.exitcodes = {r: (p.exitcode if r in failed or r in outcome.killed else 0) for r, p in self._procs.items()}
        outcome.errors = read_errors(workdir, self.world_size)
        report = _report(outcome, f"RankPool(world_size={self.world_size}) {what}")
        self._procs = {}
        for conn in self._conns.values():
            conn.close()
        self._conns = {}
        self._tmp.cleanup()
        self._tmp = None
        return report


_POOLS: dict[int, RankPool] = {}


def pool(world_size: int) -> RankPool:
    """Return the shared :class:`RankPool` of ``world_size`` ranks (started on first use)."""
    p = _POOLS.get(world_size)
    if p is None:
        p = _POOLS[world_size] = RankPool(world_size)
    return p


def shutdown_pools() -> None:
    """Stop every shared pool."""
    for p in list(_POOLS.values()):
        p.close()
    _POOLS.clear()


# --------------------------------------------------------------------------- expected errors


@dataclass
class Raised:
    """What a call raised on one rank (``None`` fields when it returned)."""

    type: str | None
    classes: tuple
    message: str
    elapsed: float
    returned: Any = None

    @property
    def raised(self) -> bool:
        return self.type is not None

    def isa(self, name: str) -> bool:
        """Whether the exception is an instance of the class called ``name``."""
        return name in self.classes


def expect_error(call: Callable, *args: Any, **kwargs: Any) -> Raised:
    """Call ``call(*args, **kwargs)`` and return what it raised (or returned), with the time it took.

    Use inside a rank function so every rank reports its outcome instead of the
    launch failing on the first rank that raises.
    """
    t0 = time.monotonic()
    try:
        out = call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return Raised(
            type=type(exc).__name__,
            classes=tuple(c.__name__ for c in type(exc).__mro__),
            message=str(exc),
            elapsed=time.monotonic() - t0,
        )
    return Raised(type=None, classes=(), message="", elapsed=time.monotonic() - t0, returned=_summary(out))


def _summary(out: Any) -> str:
    return _short(out, 200)


#: Signals a process dies of in native code: an abort (an uncaught C++ exception, glibc's heap checks), a
#: segmentation fault, a bus error.
NATIVE_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)


def once_more_after_a_native_death(run: Callable[[], Any], died: Callable[[Any], bool], ok: Callable[[Any], bool],
                                   said: Callable[[Any], str]) -> Any:
    """Return ``run()``'s result; when ``died`` says a process of it died of one of :data:`NATIVE_SIGNALS`,
    the result of one more run, which must be ``ok``.

    For tests of whole programs over torch 2.13's gloo, whose native races
    (``tools/ddp_sparse_stress.py`` reproduces one without colltune) kill a
    rank now and then. A death that comes back fails with both runs'
    ``said``; one that does not leaves a warning with the first run's.
    """
    result = run()
    if not died(result):
        return result
    first = said(result)
    result = run()
    assert ok(result), f"first run:\n{first}\nsecond run:\n{said(result)}"
    warnings.warn(f"a process died in native code and the second run passed; the first run:\n{first}", stacklevel=2)
    return result


#: The repository's ``tools/`` folder.
TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def import_tool(name: str) -> ModuleType:
    """Import ``tools/<name>.py`` as the module ``name``, ``tools/`` on ``sys.path``: a rank function the tool
    defines is pickled by that module name, and the ranks it starts import the module again from there."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
