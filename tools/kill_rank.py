"""Measure how long the survivors of a dead rank take to raise, in synchronous and asynchronous calls.

Starts ``--ranks`` local gloo ranks with a process-group timeout of
``--pg-timeout`` seconds. Every rank runs a warm-up round (every algorithm
of ``sparse_allreduce`` and ``topk_allreduce`` once, so the selector is
loaded), then two rounds of the same calls, in one of four scenarios:

``sync/before``     the victim dies before the first call; the others call synchronously
``sync/mid``        the victim dies in the middle of the sequence
``async/before``    the others submit every call with ``async_op=True`` and then ``wait()``
                    on each handle; the victim dies, before its first call, once they have
``async/in-flight`` the same, but the victim dies with its first three calls in flight

The victim is the last rank. With ``--signal KILL`` (the default) it
SIGKILLs itself, as when the OOM killer or a failed node takes a rank: its
sockets close and the survivors learn of it from the kernel. With
``--signal STOP`` it freezes instead (a hung rank: sockets open, nothing
sent), so the survivors can only give up at the process-group timeout.

For each survivor the table gives the seconds from the kill to its first
exception (``first raise``), the seconds until its last call or handle
ended (``all done``: every queued handle raised or returned), how many of
its handles were dropped unrun (``dropped``: ``AbandonedCallError``, queued
behind the call that failed) out of how many, and the first exception's
type and gist.

Usage::

    python tools/kill_rank.py                               # P = 3, 5 s timeout, SIGKILL
    python tools/kill_rank.py --ranks 2 --pg-timeout 10 --repeats 3
    python tools/kill_rank.py --signal STOP --json kill.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from functools import partial
from typing import Any, Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import colltune  # noqa: E402
from colltune.model.files import write_text_atomic  # noqa: E402
from colltune.offline import launch  # noqa: E402

#: Every registered algorithm, then the front door's own choice.
ALGORITHMS = (*colltune.algorithms.names(), "auto")
#: Scenario -> (mode, index of the call before which the victim dies).
SCENARIOS: dict[str, tuple[str, int]] = {
    "sync/before": ("sync", 0),
    "sync/mid": ("sync", 5),
    "async/before": ("async", 0),
    "async/in-flight": ("async", 3),
}
#: How long a survivor waits for the others' reports before it returns (beyond the timeout).
LINGER_S = 20.0


# --------------------------------------------------------------------------- rank side


def _calls(rank: int) -> list[tuple[str, Callable[..., Any]]]:
    """Return one round of calls on this rank's inputs: every algorithm through both front doors."""
    g = torch.Generator().manual_seed(rank + 1)
    n, k = 4096, 48
    idx = torch.randint(0, n, (k,), generator=g)
    vals = torch.randn(k, 4, generator=g)
    grad = torch.randn(64, 64, generator=g)
    states = {a: colltune.TopkState(density=0.02) for a in ALGORITHMS}
    calls: list[tuple[str, Callable[..., Any]]] = []
    for a in ALGORITHMS:
        calls.append((f"sparse/{a}", partial(colltune.sparse_allreduce, idx, vals, n, algorithm=a)))
        calls.append((f"topk/{a}", partial(colltune.topk_allreduce, grad, states[a], algorithm=a)))
    return calls


def _ended(start: float, exc: BaseException | None = None) -> dict[str, Any]:
    return {"type": None if exc is None else type(exc).__name__, "message": "" if exc is None else str(exc),
            "start": start, "end": time.time()}


def _die(outdir: str, how: str) -> None:
    """Note the time and the pid, then SIGKILL or SIGSTOP this process."""
    with open(os.path.join(outdir, "victim.json"), "w") as f:
        json.dump({"time": time.time(), "pid": os.getpid()}, f)
    os.kill(os.getpid(), signal.SIGKILL if how == "KILL" else signal.SIGSTOP)


def _await(paths: list[str], seconds: float) -> None:
    """Wait until every file of ``paths`` exists (at most ``seconds``)."""
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.02)


def _rank(rank: int, world_size: int, cfg: dict[str, Any]) -> None:
    victim, mode, kill_at, outdir = world_size - 1, cfg["mode"], cfg["kill_at"], cfg["outdir"]
    calls = _calls(rank)
    for _, call in calls:
        call()
    dist.barrier()
    ends: list[dict[str, Any]] = []
    if mode == "sync":
        for i, (_, call) in enumerate(calls * 2):
            if rank == victim and i == kill_at:
                _die(outdir, cfg["signal"])
            start = time.time()
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the survivor reports what it got
                ends.append(_ended(start, exc))
                break
            ends.append(_ended(start))
    else:
        handles = []
        for i, (_, call) in enumerate(calls * 2):
            if rank == victim and i == kill_at:
                # Die once every survivor has submitted all of its calls: their queues are full.
                _await([os.path.join(outdir, f"submitted{r}") for r in range(victim)], LINGER_S)
                _die(outdir, cfg["signal"])
            handles.append((time.time(), call(async_op=True)))
        open(os.path.join(outdir, f"submitted{rank}"), "w").close()
        for start, handle in handles:
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001 - the survivor reports what it got
                ends.append(_ended(start, exc))
            else:
                ends.append(_ended(start))
    write_text_atomic(os.path.join(outdir, f"rank{rank}.json"), json.dumps(ends))
    # Stay until every survivor reported (an exit closes sockets and would wake the others),
    # then the lowest rank ends a frozen victim so that the launch returns.
    _await([os.path.join(outdir, f"rank{r}.json") for r in range(victim)], LINGER_S)
    if rank == 0 and cfg["signal"] == "STOP":
        with open(os.path.join(outdir, "victim.json")) as f:
            os.kill(json.load(f)["pid"], signal.SIGKILL)


# --------------------------------------------------------------------------- parent side


def _gist(message: str) -> str:
    """Return the first sentence of a backend message, without gloo's source location."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", message.strip().splitlines()[0] if message.strip() else "")
    text = re.sub(r"\s*\[[0-9a-f.:]+\]:\d+", "", text)
    return re.split(r"(?<=[a-z0-9])\. ", text)[0][:60]


def measure(world_size: int, pg_timeout: float, scenario: str, how: str) -> list[dict[str, Any]]:
    """Run one scenario; return one row per survivor (seconds after the kill)."""
    mode, kill_at = SCENARIOS[scenario]
    with tempfile.TemporaryDirectory(prefix="colltune-kill-") as outdir:
        cfg = {"mode": mode, "kill_at": kill_at, "outdir": outdir, "signal": how}
        outcome = launch.launch_ranks(_rank, world_size, (cfg,), pg_timeout=pg_timeout,
                                      grace=pg_timeout + LINGER_S + 10, timeout=pg_timeout + 240)
        try:
            with open(os.path.join(outdir, "victim.json")) as f:
                killed_at = json.load(f)["time"]
        except OSError:  # the ranks failed before the kill
            raise SystemExit(launch.failure_report(outcome, f"{scenario} on {world_size} ranks")) from None
        rows = []
        for r in range(world_size - 1):
            row: dict[str, Any] = {"scenario": scenario, "rank": r}
            try:
                with open(os.path.join(outdir, f"rank{r}.json")) as f:
                    ends = json.load(f)
            except OSError:  # killed by the launcher: it never raised
                reason = outcome.reason or launch.signal_name(outcome.exitcodes.get(r))
                row.update(first_raise_s=None, all_done_s=None, error=f"no answer ({reason})")
                rows.append(row)
                continue
            raised = [e for e in ends if e["type"] is not None]
            first = raised[0] if raised else None
            row.update(
                first_raise_s=None if first is None else first["end"] - killed_at,
                all_done_s=ends[-1]["end"] - killed_at if ends else None,
                error="none raised" if first is None else f"{first['type']}: {_gist(first['message'])}",
                abandoned=sum(e["type"] == "AbandonedCallError" for e in ends),
                calls=len(ends),
            )
            rows.append(row)
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", "-P", type=int, default=3, help="local gloo ranks, the last one dies (default 3)")
    ap.add_argument("--pg-timeout", type=float, default=5.0, help="process-group timeout in seconds (default 5)")
    ap.add_argument("--signal", choices=("KILL", "STOP"), default="KILL",
                    help="KILL: the victim dies; STOP: it hangs (default KILL)")
    ap.add_argument("--scenarios", nargs="+", choices=tuple(SCENARIOS), default=list(SCENARIOS),
                    help="which scenarios to run (default all)")
    ap.add_argument("--repeats", type=int, default=1, help="launches per scenario (default 1)")
    ap.add_argument("--json", metavar="FILE", help="write every row here")
    args = ap.parse_args(argv)
    if args.ranks < 2 or args.pg_timeout <= 0 or args.repeats < 1:
        ap.error("need --ranks >= 2, --pg-timeout > 0 and --repeats >= 1")
    rows = []
    for _ in range(args.repeats):
        for scenario in args.scenarios:
            rows += measure(args.ranks, args.pg_timeout, scenario, args.signal)
    print(f"P={args.ranks}, pg timeout {args.pg_timeout:g} s, victim rank {args.ranks - 1} gets SIG{args.signal}; "
          "seconds after the kill")
    print(f"{'scenario':<16} {'rank':>4} {'first raise':>11} {'all done':>9} {'dropped':>8}  first error")
    for row in rows:
        dropped = f"{row['abandoned']}/{row['calls']}" if "calls" in row else "-"
        print(f"{row['scenario']:<16} {row['rank']:>4} {_fmt(row['first_raise_s']):>11} "
              f"{_fmt(row['all_done_s']):>9} {dropped:>8}  {row['error']}")
    done = [r["all_done_s"] for r in rows if r["all_done_s"] is not None]
    if done:
        print(f"all done: median {statistics.median(done):.2f} s, max {max(done):.2f} s over {len(done)} survivors")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": args.ranks, "pg_timeout_s": args.pg_timeout, "signal": args.signal,
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
