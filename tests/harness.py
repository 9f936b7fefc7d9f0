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
something ``torch.save`` accepts. Each rank runs with one intra-op thread on
gloo with a short process-group timeout.

Failures raise ``AssertionError`` naming the rank and showing the first real
error: a rank's own exception is preferred to the secondary "connection closed
by peer" / timeout errors it causes on the other ranks. A rank that is still
running at the deadline (or a few seconds after another rank failed) is killed
and reported with a dump of its Python stacks taken just before the kill.

:func:`expect_error` lets a rank function call something that should raise on
every rank and return what was raised, so that tests can assert on every rank.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
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
#: After the first rank failed, the other ranks get this long to finish before they are killed.
GRACE_S = 5.0

_CTX = None
_CTX_LOCK = threading.Lock()


def _context():
    global _CTX
    with _CTX_LOCK:
        if _CTX is None:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["torch"])
            _CTX = ctx
    return _CTX


# --------------------------------------------------------------------------- rank side


def _err_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.error.json")


def _stack_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.stacks.txt")


def _result_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.result.pt")


_KEEP_OPEN: list = []


def _setup_rank(rank: int, world_size: int, workdir: str, pg_timeout: float) -> None:
    """Common start of every rank: one thread, stack dumps on SIGUSR1, the process group."""
    torch.set_num_threads(1)
    if hasattr(signal, "SIGUSR1"):
        import faulthandler

        stack_file = open(_stack_path(workdir, rank), "w")
        _KEEP_OPEN.append(stack_file)  # faulthandler writes to its descriptor until the process ends
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
    )


def _write_error(workdir: str, rank: int, exc: BaseException, context: str = "") -> None:
    record = {
        "time": time.time(),
        "rank": rank,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "context": context,
    }
    tmp = _err_path(workdir, rank) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, _err_path(workdir, rank))


def _save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _die() -> None:
    """Leave at once: closing the sockets makes the peers fail fast instead of waiting for a timeout."""
    try:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(1)


def _rank_entry(fn, rank, world_size, args, workdir, pg_timeout):
    try:
        _setup_rank(rank, world_size, workdir, pg_timeout)
        out = fn(rank, world_size, *args)
        _save(out, _result_path(workdir, rank))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        _write_error(workdir, rank, exc)
        _die()
    dist.destroy_process_group()


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


def _short(obj: Any, limit: int = 200) -> str:
    s = repr(obj)
    return s if len(s) <= limit else s[: limit - 3] + "..."


# --------------------------------------------------------------------------- parent side

# Errors that a rank gets because ANOTHER rank failed or vanished. They are reported
# only when no rank has a better one.
_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset|connection reset|Broken pipe|"
    r"ECONNRESET|EPIPE|Socket closed|[Tt]imed? ?out|Timeout|DistNetworkError|"
    r"Failed to recv|Failed to send|Read error|Write error|SIGTERM|SIGKILL",
)


@dataclass
class _Outcome:
    world_size: int
    results: list = field(default_factory=list)  # per rank, or None
    errors: dict = field(default_factory=dict)  # rank -> error record
    exitcodes: dict = field(default_factory=dict)  # rank -> exit code
    killed: list = field(default_factory=list)  # ranks killed by the parent
    stacks: dict = field(default_factory=dict)  # rank -> stack dump of a killed rank
    reason: str = ""  # why ranks were killed

    @property
    def failed(self) -> bool:
        return bool(self.errors or self.killed or any(c not in (0, None) for c in self.exitcodes.values()))


def _signal_name(code: int | None) -> str:
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _is_secondary(record: dict) -> bool:
    return bool(_SECONDARY.search(record["type"] + ": " + record["message"]))


def _report(outcome: _Outcome, what: str) -> str:
    """Build the failure message: the first real error first, then one line per other rank."""
    records = sorted(outcome.errors.values(), key=lambda r: r["time"])
    primary = [r for r in records if not _is_secondary(r)]
    first = primary[0] if primary else (records[0] if records else None)
    lines = []
    if first is not None:
        lines.append(
            f"{what}: rank {first['rank']} of {outcome.world_size} raised {first['type']}: {first['message']}"
        )
        if first.get("context"):
            lines.append(f"  while: {first['context']}")
        lines.append("---- traceback of rank %d ----" % first["rank"])
        lines.append(first["traceback"].rstrip())
    else:
        lines.append(f"{what}: failed without a Python exception on any rank ({outcome.reason or 'see below'})")
    lines.append("---- all ranks ----")
    for rank in range(outcome.world_size):
        if rank in outcome.errors:
            r = outcome.errors[rank]
            kind = "secondary error" if (_is_secondary(r) and r is not first) else "error"
            lines.append(f"rank {rank}: {kind}: {r['type']}: {_short(r['message'], 300)}")
        elif rank in outcome.killed:
            lines.append(f"rank {rank}: killed by the harness ({outcome.reason})")
        elif outcome.exitcodes.get(rank) not in (0, None):
            lines.append(
                f"rank {rank}: died with {_signal_name(outcome.exitcodes[rank])} and no Python traceback"
            )
        else:
            lines.append(f"rank {rank}: ok")
    for rank, stack in sorted(outcome.stacks.items()):
        if stack.strip():
            lines.append(f"---- Python stacks of rank {rank} when it was killed ----")
            lines.append(stack.strip()[-6000:])
    return "\n".join(lines)


def _read_errors(workdir: str, world_size: int) -> dict:
    errors = {}
    for rank in range(world_size):
        path = _err_path(workdir, rank)
        if os.path.exists(path):
            try:
                with open(path) as f:
                    errors[rank] = json.load(f)
            except (OSError, ValueError):
                pass
    return errors


def _kill(procs: dict, workdir: str, outcome: _Outcome, reason: str) -> None:
    """Dump the stacks of the live ranks, then kill them."""
    live = {r: p for r, p in procs.items() if p.is_alive()}
    if not live:
        return
    outcome.reason = reason
    if hasattr(signal, "SIGUSR1"):
        for p in live.values():
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except (ProcessLookupError, TypeError):
                pass
        time.sleep(0.3)
    for rank, p in live.items():
        if p.is_alive():
            p.kill()
            outcome.killed.append(rank)
        p.join(5)
        try:
            with open(_stack_path(workdir, rank)) as f:
                outcome.stacks[rank] = f.read()
        except OSError:
            pass


def _launch(fn, world_size: int, args: tuple, timeout: float, pg_timeout: float, grace: float) -> _Outcome:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    outcome = _Outcome(world_size=world_size)
    with tempfile.TemporaryDirectory(prefix="colltune-ranks-") as workdir:
        procs = {
            r: ctx.Process(
                target=_rank_entry,
                args=(fn, r, world_size, args, workdir, pg_timeout),
                name=f"rank{r}",
                daemon=True,
            )
            for r in range(world_size)
        }
        for p in procs.values():
            p.start()
        deadline = time.monotonic() + timeout
        failed_at = None
        try:
            while True:
                live = [p for p in procs.values() if p.exitcode is None]
                if not live:
                    break
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs.values()):
                    failed_at = now
                if now >= deadline:
                    _kill(procs, workdir, outcome, f"still running at the deadline of {timeout:g} s")
                    break
                if failed_at is not None and now - failed_at >= grace:
                    _kill(procs, workdir, outcome, f"still running {grace:g} s after another rank failed")
                    break
                limit = deadline - now if failed_at is None else min(deadline - now, failed_at + grace - now)
                _mp_wait([p.sentinel for p in live], timeout=max(0.01, limit))
        finally:
            for p in procs.values():
                if p.is_alive():
                    p.kill()
                p.join(5)
        outcome.exitcodes = {r: p.exitcode for r, p in procs.items()}
        outcome.errors = _read_errors(workdir, world_size)
        if not outcome.failed:
            outcome.results = [
                torch.load(_result_path(workdir, r), weights_only=False) for r in range(world_size)
            ]
    return outcome


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
    outcome = _launch(fn, world_size, args, timeout, pg_timeout, grace)
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
        _setup_rank(rank, world_size, workdir, pg_timeout)
    except BaseException as exc:
        _write_error(workdir, rank, exc, "starting the rank")
        _die()
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            _die()
        if msg is None:
            break
        call_id, fn, args = msg
        try:
            out = fn(rank, world_size, *args)
            buf = io.BytesIO()
            torch.save(out, buf)
            payload = buf.getvalue()
        except BaseException as exc:
            _write_error(workdir, rank, exc, f"call {call_id}: {getattr(fn, '__name__', fn)}{_short(args, 300)}")
            try:
                conn.send(("error", call_id))
            finally:
                _die()
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
        ctx = _context()
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
        outcome = _Outcome(world_size=self.world_size)
        while pending:
            now = time.monotonic()
            if now >= deadline or (failed_at is not None and now - failed_at >= grace):
                reason = (
                    f"no answer at the deadline of {timeout:g} s"
                    if now >= deadline
                    else f"no answer {grace:g} s after another rank failed"
                )
                _kill({r: self._procs[r] for r in pending}, self._tmp.name, outcome, reason)
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
        outcome.errors = _read_errors(workdir, self.world_size)
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
