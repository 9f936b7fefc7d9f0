"""Start local CPU ranks for a command, or join the ranks ``torchrun`` started.

Two ways a colltune command gets its ranks:

``run_local(fn, world_size, *args)``
    Starts ``world_size`` processes on this machine (``torch.multiprocessing``
    in ``forkserver`` mode with torch preloaded), joins them in one process
    group through a ``FileStore`` in a fresh temporary directory (no ports),
    runs ``fn(rank, world_size, *args)`` on each, and returns the results in
    rank order. Each rank uses one intra-op thread. A deadline in the parent
    kills ranks that are stuck; the first real error of any rank is re-raised
    in the parent as :class:`RankError`, naming the rank and carrying its
    traceback (a rank's own exception wins over the "connection closed" and
    timeout errors it causes on the other ranks).

``in_torchrun()`` / :func:`run_here`
    Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) a command runs in the
    rank it was started in instead: :func:`run_here` joins the ``env://``
    process group and calls ``fn(rank, world_size, *args)`` once.

Rank functions must be module-level (they are pickled by reference); their
arguments and return values must be picklable.

The rank bootstrap and the parent's bookkeeping (:func:`launch_ranks`,
:func:`setup_rank`, :func:`write_error`, :func:`kill_ranks`,
:func:`failure_report`, ...) are also the engine of the test suite's harness
(``tests/harness.py``).

Example:
    >>> from colltune.offline.launch import run_local
    >>> run_local(my_rank_fn, 4, "arg")  # doctest: +SKIP
    [result_of_rank_0, result_of_rank_1, result_of_rank_2, result_of_rank_3]
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colltune.algorithms.errors import ColltuneError, ColltuneValueError
from colltune.model.files import atomic_path

__all__ = ["RankError", "run_local", "run_here", "in_torchrun", "torchrun_rank"]

#: Default process-group timeout inside the ranks, in seconds.
PG_TIMEOUT_S = 60.0
#: After the first rank failed, the others get this long to finish before they are killed.
GRACE_S = 5.0

# Errors that a rank gets because ANOTHER rank failed or vanished; reported
# only when no rank has a better one.
_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset|connection reset|Broken pipe|ECONNRESET|EPIPE|"
    r"Socket closed|[Tt]imed? ?out|Timeout|DistNetworkError|Failed to recv|Failed to send|"
    r"Read error|Write error|SIGTERM|SIGKILL"
)

_CTX = None
_CTX_LOCK = threading.Lock()
_KEEP_OPEN: list = []


class RankError(ColltuneError, RuntimeError):
    """A rank of a local launch raised, died, or was killed at the deadline.

    Attributes:
        rank: the rank with the first real error (``None`` if no rank raised).
        exc_type: the name of that rank's exception class (``""`` if none).
        remote_traceback: that rank's formatted traceback (``""`` if none).

    The rank's own exception, when it could be pickled, is the ``__cause__``.
    """

    def __init__(self, message: str, rank: int | None = None, exc_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


def in_torchrun() -> bool:
    """Return whether this process was started by ``torchrun`` (``RANK`` and ``WORLD_SIZE`` are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_rank() -> tuple[int, int]:
    """Return ``(rank, world_size)`` from the ``torchrun`` environment."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _device_id(backend: str, rank: int | None = None) -> torch.device | None:
    """The GPU a rank binds its NCCL group to (``device_id``), so torch need not guess it from the global rank.

    Under torchrun the local rank's GPU; for local ranks their rank's, modulo the GPUs. ``None`` off NCCL.
    """
    if "nccl" not in str(backend).lower() or not torch.cuda.is_available():
        return None
    local = int(os.environ.get("LOCAL_RANK", rank or 0))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def run_here(fn: Callable[..., Any], *args: Any, backend: str = "gloo", pg_timeout: float = PG_TIMEOUT_S) -> Any:
    """Run ``fn(rank, world_size, *args)`` in this ``torchrun`` rank; return what it returns.

    Joins the ``env://`` process group unless one is already initialized; a
    group this function created is destroyed before it returns.
    """
    if not in_torchrun():
        raise ColltuneValueError(
            "run_here needs the RANK and WORLD_SIZE environment variables that torchrun sets; "
            "start the command with torchrun, or use run_local to start local ranks."
        )
    rank, world_size = torchrun_rank()
    created = False
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout),
                                device_id=_device_id(backend))
        created = True
    try:
        return fn(dist.get_rank(), dist.get_world_size(), *args)
    finally:
        if created:
            dist.destroy_process_group()


# --------------------------------------------------------------------------- rank side
#
# The pieces below are shared with the test suite's harness (tests/harness.py),
# which runs its one-shot launches and its persistent rank pool on them.


def rank_context():
    """Return the ``forkserver`` multiprocessing context (torch preloaded) that every local rank starts from."""
    global _CTX
    with _CTX_LOCK:
        if _CTX is None:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["torch", "torch.distributed"])
            _CTX = ctx
    return _CTX


def rank_path(workdir: str, rank: int, what: str) -> str:
    """Return the path of a rank's file ``what`` (``error.json``, ``stacks.txt``, ...) in ``workdir``."""
    return os.path.join(workdir, f"rank{rank}.{what}")


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, so that readers never see half a file."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


#: How often a local rank checks that the process that launched it is still there, in seconds.
PARENT_POLL_S = 1.0


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _watch_parent(pid: int) -> None:
    """Leave the rank when the launching process ``pid`` is gone.

    A launcher that exits cleanly, or on Ctrl-C, kills its ranks itself; one
    killed outright (``SIGTERM``, ``SIGKILL``) cannot, and its ranks, children
    of the forkserver, would run on. This daemon thread ends them within
    :data:`PARENT_POLL_S` seconds instead.
    """

    def watch() -> None:
        while _process_alive(pid):
            time.sleep(PARENT_POLL_S)
        exit_rank()

    threading.Thread(target=watch, name="colltune-parent-watch", daemon=True).start()


def setup_rank(
    rank: int,
    world_size: int,
    workdir: str,
    backend: str = "gloo",
    pg_timeout: float = PG_TIMEOUT_S,
    parent_pid: int | None = None,
) -> None:
    """Start a local rank: one thread, stack dumps on SIGUSR1, the process group (FileStore in ``workdir``).

    With ``parent_pid`` (the launcher's pid), the rank also exits when that process is gone.
    """
    if parent_pid is not None:
        _watch_parent(parent_pid)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set or parallel work started: harmless
        pass
    stacks = open(rank_path(workdir, rank, "stacks.txt"), "w")
    _KEEP_OPEN.append(stacks)  # faulthandler writes to its descriptor until the process ends
    # A native crash (an abort in a backend's thread, a segfault) leaves no Python traceback: the stacks of
    # every thread at that moment say what the rank was doing.
    faulthandler.enable(file=stacks, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout), device_id=_device_id(backend, rank))
    # Wait until every rank has finished connecting: a rank that returned
    # (and closed its sockets) while another was still building its mesh
    # would make that one fail with a misleading "connection closed by peer".
    store.add("colltune/initialized", 1)
    deadline = time.monotonic() + pg_timeout
    while store.add("colltune/initialized", 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: not every rank joined the process group within {pg_timeout} s")
        time.sleep(0.002)


def write_error(workdir: str, rank: int, exc: BaseException, context: str = "") -> None:
    """Record what a rank raised for the parent: ``error.json`` (always) and the pickled exception (when it pickles)."""
    record = {
        "time": time.time(),
        "rank": rank,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "context": context,
    }
    try:
        write_atomic(rank_path(workdir, rank, "exc.pkl"), pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - not every exception pickles; the record suffices
        pass
    write_atomic(rank_path(workdir, rank, "error.json"), json.dumps(record).encode())


def exit_rank() -> None:
    """Leave the rank at once: closed sockets make the peers fail fast instead of waiting for a timeout."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(1)


def _rank_entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    workdir: str,
    backend: str,
    pg_timeout: float,
    parent_pid: int | None = None,
) -> None:
    try:
        setup_rank(rank, world_size, workdir, backend, pg_timeout, parent_pid)
        out = fn(rank, world_size, *args)
        write_atomic(rank_path(workdir, rank, "result.pkl"), pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        write_error(workdir, rank, exc)
        exit_rank()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- parent side


@dataclass
class Outcome:
    """What a set of local ranks did: results, error records, exit codes, the ranks killed and why."""

    world_size: int
    results: list = field(default_factory=list)  # per rank (only when nothing failed)
    errors: dict = field(default_factory=dict)  # rank -> error record (see write_error)
    exitcodes: dict = field(default_factory=dict)  # rank -> exit code
    killed: list = field(default_factory=list)  # ranks killed by the parent
    stacks: dict = field(default_factory=dict)  # rank -> stack dump of a killed rank, or of one dead of a signal
    reason: str = ""  # why ranks were killed
    cause: BaseException | None = None  # the unpickled exception of the first real error, if any

    @property
    def failed(self) -> bool:
        return bool(self.errors or self.killed or any(c != 0 for c in self.exitcodes.values()))

    @property
    def first(self) -> dict | None:
        """The error record of the first real error (see :func:`first_error`)."""
        return first_error(self.errors)


def kill_ranks(procs: dict, workdir: str, outcome: Outcome, reason: str) -> None:
    """Dump the Python stacks of the live ranks, kill them; record the killed ranks, their stacks and ``reason``."""
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
        _read_stacks(outcome, workdir, rank)


def _read_stacks(outcome: Outcome, workdir: str, rank: int) -> None:
    """Record the stacks ``rank`` dumped (killed by the parent, or dead of a fatal signal), if any."""
    try:
        with open(rank_path(workdir, rank, "stacks.txt")) as f:
            text = f.read()
    except OSError:
        return
    # faulthandler ends a fatal signal's dump with the list of loaded extension modules: noise here.
    outcome.stacks[rank] = "\n".join(ln for ln in text.splitlines() if not ln.startswith("Extension modules:"))


def read_errors(workdir: str, world_size: int) -> dict[int, dict]:
    """Return the error records the ranks wrote, by rank."""
    errors = {}
    for rank in range(world_size):
        try:
            with open(rank_path(workdir, rank, "error.json")) as f:
                errors[rank] = json.load(f)
        except (OSError, ValueError):
            pass
    return errors


def signal_name(code: int | None) -> str:
    """Describe an exit code: ``exit code 3`` or ``signal SIGKILL``."""
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def is_secondary(record: dict) -> bool:
    """Whether an error record is one a rank gets because ANOTHER rank failed or vanished."""
    return bool(_SECONDARY.search(record["type"] + ": " + record["message"]))


def first_error(errors: dict[int, dict]) -> dict | None:
    """The earliest error that is not secondary, else the earliest error, else ``None``."""
    records = sorted(errors.values(), key=lambda r: r["time"])
    primary = [r for r in records if not is_secondary(r)]
    return primary[0] if primary else (records[0] if records else None)


def short_repr(obj: Any, limit: int = 200) -> str:
    """``repr(obj)``, cut to ``limit`` characters."""
    s = repr(obj)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def failure_report(outcome: Outcome, what: str, *, killed_as: str = "killed", label_errors: bool = False) -> str:
    """Build the failure message: the first real error first, then one line per rank, then the stacks dumped.

    Stacks are those of the ranks killed, and of the ranks dead of a fatal signal (a native crash).

    ``killed_as`` is how a killed rank is described; with ``label_errors`` each
    failed rank's line says whether its error is secondary and shows the message's repr.
    """
    first = first_error(outcome.errors)
    world_size = outcome.world_size
    lines = []
    if first is not None:
        lines.append(f"{what}: rank {first['rank']} of {world_size} raised {first['type']}: {first['message']}")
        if first.get("context"):
            lines.append(f"  while: {first['context']}")
        lines.append(f"---- traceback of rank {first['rank']} ----")
        lines.append(first["traceback"].rstrip())
    else:
        lines.append(f"{what}: failed without a Python exception on any rank ({outcome.reason or 'see below'})")
    lines.append("---- all ranks ----")
    for rank in range(world_size):
        if rank in outcome.errors:
            r = outcome.errors[rank]
            if label_errors:
                kind = "secondary error" if (is_secondary(r) and r is not first) else "error"
                lines.append(f"rank {rank}: {kind}: {r['type']}: {short_repr(r['message'], 300)}")
            else:
                lines.append(f"rank {rank}: {r['type']}: {r['message'][:300]}")
        elif rank in outcome.killed:
            lines.append(f"rank {rank}: {killed_as} ({outcome.reason})")
        elif outcome.exitcodes.get(rank) not in (0, None):
            lines.append(f"rank {rank}: died with {signal_name(outcome.exitcodes[rank])} and no Python traceback")
        else:
            lines.append(f"rank {rank}: ok")
    for rank, stack in sorted(outcome.stacks.items()):
        if stack.strip():
            when = "was killed" if rank in outcome.killed else f"died with {signal_name(outcome.exitcodes.get(rank))}"
            lines.append(f"---- Python stacks of rank {rank} when it {when} ----")
            lines.append(stack.strip()[-6000:])
    return "\n".join(lines)


def launch_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    *,
    backend: str = "gloo",
    timeout: float = 600.0,
    pg_timeout: float = PG_TIMEOUT_S,
    grace: float = GRACE_S,
    prefix: str = "colltune-launch-",
) -> Outcome:
    """Run ``fn(rank, world_size, *args)`` on fresh local ranks and return the :class:`Outcome` (raises nothing).

    The engine of :func:`run_local` (and of the test harness's ``run_ranks``).
    Ranks still running at ``timeout``, or ``grace`` seconds after a rank
    failed, are killed with a dump of their stacks; ranks whose launcher is
    gone (killed before it could kill them) exit by themselves.
    """
    ctx = rank_context()
    outcome = Outcome(world_size=world_size)
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        procs = {
            r: ctx.Process(
                target=_rank_entry,
                args=(fn, r, world_size, args, workdir, backend, pg_timeout, os.getpid()),
                name=f"colltune-rank{r}",
                daemon=True,
            )
            for r in range(world_size)
        }
        try:
            for p in procs.values():
                p.start()
            _supervise(procs, workdir, outcome, timeout, grace)
        finally:
            # Also on KeyboardInterrupt: never leave ranks behind.
            for p in procs.values():
                if p.pid is None:  # never started (the start of an earlier rank failed)
                    continue
                if p.is_alive():
                    p.kill()
                p.join(5)
        outcome.exitcodes = {r: p.exitcode for r, p in procs.items()}
        for r, code in outcome.exitcodes.items():
            if code is not None and code < 0 and r not in outcome.killed:
                _read_stacks(outcome, workdir, r)
        _collect(outcome, workdir, world_size)
    return outcome


def _supervise(procs: dict[int, Any], workdir: str, outcome: Outcome, timeout: float, grace: float) -> None:
    """Wait for the ranks; kill the rest at the deadline, or ``grace`` seconds after one failed."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while True:
        live = [p for p in procs.values() if p.exitcode is None]
        if not live:
            return
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs.values()):
            failed_at = now
        if now >= deadline:
            kill_ranks(procs, workdir, outcome, f"still running at the deadline of {timeout:g} s")
            return
        if failed_at is not None and now - failed_at >= grace:
            kill_ranks(procs, workdir, outcome, f"still running {grace:g} s after another rank failed")
            return
        limit = deadline - now if failed_at is None else min(deadline - now, failed_at + grace - now)
        _mp_wait([p.sentinel for p in live], timeout=max(0.01, limit))


def _collect(outcome: Outcome, workdir: str, world_size: int) -> None:
    """Read what the ranks left: their errors and the first failure's exception, or every rank's result."""
    outcome.errors = read_errors(workdir, world_size)
    if outcome.failed:
        first = outcome.first
        if first is not None:
            try:
                with open(rank_path(workdir, first["rank"], "exc.pkl"), "rb") as f:
                    outcome.cause = pickle.load(f)
            except Exception:  # noqa: BLE001 - the record already says everything
                pass
    else:
        for r in range(world_size):
            with open(rank_path(workdir, r, "result.pkl"), "rb") as f:
                outcome.results.append(pickle.load(f))


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 600.0,
    pg_timeout: float = PG_TIMEOUT_S,
    grace: float = GRACE_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh local ranks; return the results in rank order.

    Args:
        fn: a module-level function (it is pickled by reference).
        world_size: number of ranks to start (>= 1).
        *args: passed to ``fn`` on every rank; must be picklable.
        backend: the process-group backend (``gloo`` for CPU ranks).
        timeout: the parent kills every rank still running after this many seconds.
        pg_timeout: the process-group timeout inside the ranks, in seconds.
        grace: after one rank failed, how long the others may run before they are killed.

    Returns:
        What ``fn`` returned on each rank, in rank order.

    Raises:
        ColltuneValueError: ``world_size`` is not a positive int.
        RankError: a rank raised, died or was killed; the message names the
            rank with the first real error and shows its traceback.

    Example:
        >>> run_local(my_rank_fn, 2)  # doctest: +SKIP
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ColltuneValueError(f"world_size must be an int >= 1, but got {world_size!r}.")
    what = f"{getattr(fn, '__name__', fn)} on {world_size} local ranks"
    outcome = launch_ranks(
        fn, world_size, args, backend=backend, timeout=timeout, pg_timeout=pg_timeout, grace=grace
    )
    if outcome.failed:
        first = outcome.first
        err = RankError(
            failure_report(outcome, what),
            rank=None if first is None else first["rank"],
            exc_type="" if first is None else first["type"],
            remote_traceback="" if first is None else first["traceback"],
        )
        if outcome.cause is not None:
            err.__cause__ = outcome.cause
        raise err
    return outcome.results
