"""Measure the per-call host cost of each algorithm as the world size grows, with the communication stubbed.

One process plays rank 0 of a group of ``P`` ranks in which every rank holds
the same input. A stub comm layer (:class:`StubComm`) answers every
collective at once with what the other ranks would have sent: with
identical inputs, each peer sends this rank what this rank sends itself
(its own region, its own record, its own counts). So a call costs only its
host work: Python, torch dispatch, packing, merging and the per-peer
bookkeeping, which is what grows with ``P`` when the bytes do not.

Per algorithm and mode it runs the steps the front door runs for one call
(the metadata exchange, then the algorithm; coalescing and the selector,
which do not depend on the algorithm, are left out), after a few calls that
fill the caches (eager slot, region boundaries, thresholds), and prints the
median microseconds per call. The time the stub spends writing the bytes
that would have arrived is measured apart and left out of ``host us``; the
backend's own cost per message (a few microseconds on gloo, less on NCCL)
is not in it either: column ``msgs`` says how many messages the call sends.

Usage::

    python tools/host_cost.py                                   # P = 2 .. 1024, n = 2^20, k = 1024 per rank
    python tools/host_cost.py -P 2 64 1024 --k 64 --calls 20 --json host.json
    python tools/host_cost.py --algorithms oktopk --modes exact --row 64   # embedding rows

The world size of a call changes nothing in a rank's view but the loops over
peers, so run it on a quiet machine and compare runs of two versions side by
side; the ratio between small and large ``P`` in one run is the figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from colltune import algorithms  # noqa: E402
from colltune.algorithms import meta  # noqa: E402
from colltune.algorithms.allgather import eager_slot, slot_need  # noqa: E402
from colltune.algorithms.base import Prepared, SparseInput  # noqa: E402
from colltune.algorithms.comm import Comm  # noqa: E402
from colltune.algorithms.state import TopkState  # noqa: E402
from colltune.api import _run_topk  # noqa: E402
from colltune.cli.common import save_json  # noqa: E402

WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _Group:
    """Stands for a process group: the algorithms keep per-group state under it."""


class StubComm(Comm):
    """Rank ``rank`` of ``world_size`` identical ranks: every collective returns at once.

    What arrives is what this rank sends itself (identical inputs), written
    into the buffers the caller provides; the time spent writing it is
    summed in :attr:`stub_s`. Traffic is counted as the real layer counts it.
    """

    __slots__ = ("stub_s",)

    def __init__(self, world_size: int, rank: int = 0) -> None:
        super().__init__(_Group(), torch.device("cpu"), direct=False)
        self.world_size, self.rank, self.stub_s = world_size, rank, 0.0

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        p = self.world_size
        self._count("all_reduce", 2 * t.numel() * t.element_size() * (p - 1) // p, 2 * (p - 1))
        t0 = time.perf_counter()
        if op == "sum" and t.numel() * t.element_size() <= 65536:
            t.mul_(p)  # control data (boundaries, histograms): the sum of P equal tensors
        self.stub_s += time.perf_counter() - t0
        return t

    def all_gather(self, t: torch.Tensor, *, direct: bool | None = None) -> torch.Tensor:
        p = self.world_size
        self._count("all_gather", (p - 1) * t.numel() * t.element_size(), p - 1)
        t0 = time.perf_counter()
        out = t.contiguous().unsqueeze(0).expand((p,) + tuple(t.shape)).reshape((p * t.shape[0],) + tuple(t.shape[1:]))
        self.stub_s += time.perf_counter() - t0
        return out

    def all_to_all(self, t: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        p, me = self.world_size, self.rank
        row = t.element_size() * int(torch.Size(t.shape[1:]).numel())
        self._count("all_to_all", row * (int(sum(send_counts)) - int(send_counts[me])), p - 1)
        t0 = time.perf_counter()
        start = int(sum(send_counts[:me]))
        mine = t[start : start + int(send_counts[me])]
        out = torch.zeros((int(sum(recv_counts)),) + tuple(t.shape[1:]), dtype=t.dtype)
        if all(int(c) == mine.shape[0] for c in recv_counts):
            out = mine.repeat((p,) + (1,) * (t.dim() - 1))
        self.stub_s += time.perf_counter() - t0
        return out

    def exchange(self, sends: Sequence[tuple], recvs: Sequence[tuple], count: bool = True) -> list:
        if count:
            for t, *_ in sends:
                if t.numel():
                    self._count("send", t.numel() * t.element_size(), 1)
        return []

    def rotated_exchange(
        self,
        peers_in_flight: int,
        send_for: Callable[[int], Sequence[tuple[torch.Tensor, int]]],
        recv_for: Callable[[int], Sequence[tuple[torch.Tensor, int]]],
    ) -> None:
        p, me = self.world_size, self.rank
        own = {tag: t for t, tag in send_for(me)}  # what every peer sends this rank
        for i in range(1, p):
            dst, src = (me + i) % p, (me - i) % p
            self.exchange([(t, dst, tag) for t, tag in send_for(dst)], [])
            for buf, tag in recv_for(src):
                t0 = time.perf_counter()
                m = own.get(tag)
                if m is not None and buf.numel() and m.numel():
                    n = min(buf.numel(), m.numel())
                    buf.reshape(-1)[:n].copy_(m.reshape(-1)[:n])
                self.stub_s += time.perf_counter() - t0


def _input(n: int, k: int, row: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
    vals = rng.standard_normal((k, row)).astype(np.float32)
    return torch.from_numpy(idx), torch.from_numpy(vals)


def _exact_call(name: str, n: int, idx: torch.Tensor, vals: torch.Tensor) -> Callable[[StubComm], None]:
    """Return one exact call of ``name`` on a comm: the record (with the slot the front door fills), then the algorithm."""
    algo = algorithms.get(name)
    knobs = algo.check_knobs({})
    record = {"kind": meta.name_code("sparse"), "size": n, "row_numel": vals.shape[1], "dtype": 0, "op": 0,
              "algorithm": meta.name_code(name), "policy": 0, "count": idx.numel()}

    def call(comm: StubComm) -> None:
        cap = meta.slot_bytes(comm)
        slot, payload_bytes, eager, work = None, 0, meta.EAGER_NONE, None
        if algo.eager_entries:
            slot, eager = eager_slot(idx, vals, n, torch.float32, cap), meta.EAGER_ENTRIES
        else:
            slot = algo.eager_payload(idx, n, comm, knobs, cap)
            if isinstance(slot, Prepared):
                slot, work = slot.payload, slot.work
            payload_bytes = 0 if slot is None else int(slot.size)
        records, slots = meta.exchange(comm, dict(record, eager=eager, payload=payload_bytes), None, slot)
        counts = tuple(rec["count"] for rec in records)
        need = slot_need(counts, vals.shape[1], n, torch.float32) if algo.eager_entries else 0
        meta.note_slot_use(comm, need)
        payload = slots[:, :payload_bytes] if payload_bytes else None
        entries = slots if algo.eager_entries else None
        inp = SparseInput(idx, vals, n, (vals.shape[1],) if vals.shape[1] > 1 else (), torch.float32, counts,
                          entries, "sum", payload, work=work)
        algo.sparse_allreduce(inp, comm, knobs)

    return call


def _topk_call(name: str, n: int, k: int, seed: int = 0) -> Callable[[StubComm], None]:
    """Return one top-k call of ``name``: the record, then the algorithm on ``residual + tensor``."""
    algo = algorithms.get(name)
    knobs = algo.check_knobs({})
    state = TopkState(k=k)
    grad = torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32))
    record = {"kind": meta.name_code("topk"), "size": n, "row_numel": k, "dtype": 0, "op": 0,
              "algorithm": meta.name_code(name), "policy": 0, "count": k}

    def call(comm: StubComm) -> None:
        meta.exchange(comm, record, None)
        meta.note_slot_use(comm, 0)
        acc = grad.clone() if state.residual is None else grad + state.residual
        _run_topk(acc, state, comm, name, knobs)  # the library's own residual update, whatever ``sent`` is
        state.step += 1

    return call


def measure(call: Callable[[StubComm], None], p: int, calls: int, warmup: int) -> dict[str, float]:
    """Return the median host microseconds per call (stub time left out), and the messages and bytes of one call."""
    comm = StubComm(p)
    host, msgs, sent = [], 0, 0
    for i in range(warmup + calls):
        comm.traffic = algorithms.Traffic()
        comm.stub_s = 0.0
        t0 = time.perf_counter()
        call(comm)
        wall = time.perf_counter() - t0
        if i >= warmup:
            host.append(wall - comm.stub_s)
            msgs, sent = comm.traffic.messages, comm.traffic.bytes_sent
    return {"host_us": statistics.median(host) * 1e6, "messages": msgs, "bytes_sent": sent}


def _parse_int(text: str) -> int:
    if "^" in text:
        base, exp = text.split("^")
        return int(base) ** int(exp)
    return int(float(text))


def _cases(args: argparse.Namespace) -> list[tuple[str, str, Callable[[], Callable[[StubComm], None]]]]:
    """Return ``(algorithm, mode, factory)``: the factory makes a fresh call (fresh top-k state) per world size."""
    out = []
    idx, vals = _input(args.n, args.k, args.row)
    for mode in args.modes:
        for name in args.algorithms:
            if mode == "exact":
                out.append((name, mode, lambda name=name: _exact_call(name, args.n, idx, vals)))
            else:
                out.append((name, mode, lambda name=name: _topk_call(name, args.n, args.k)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-P", "--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES), help="world sizes")
    ap.add_argument("--n", type=_parse_int, default=2**20, help="rows (default 2^20)")
    ap.add_argument("--k", type=_parse_int, default=1024, help="entries per rank, and top-k's k (default 1024)")
    ap.add_argument("--row", type=int, default=1, help="values per row in exact mode (default 1)")
    ap.add_argument("--algorithms", nargs="+", default=list(algorithms.names()),
                    help="algorithms (default: every registered one)")
    ap.add_argument("--modes", nargs="+", default=["exact", "topk"], choices=("exact", "topk"), help="modes")
    ap.add_argument("--calls", type=int, default=15, help="timed calls per point (default 15)")
    ap.add_argument("--warmup", type=int, default=3, help="calls before timing (default 3)")
    ap.add_argument("--json", metavar="FILE", help="write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"n={args.n} k={args.k} row={args.row}: host us per call (median of {args.calls}), messages per call")
    print(f"{'algorithm':<10} {'mode':<6} " + " ".join(f"{'P=' + str(p):>14}" for p in args.world_sizes))
    report: dict[str, Any] = {"n": args.n, "k": args.k, "row": args.row, "rows": []}
    for name, mode, factory in _cases(args):
        cells = []
        for p in args.world_sizes:
            r = measure(factory(), p, args.calls, args.warmup)
            report["rows"].append({"algorithm": name, "mode": mode, "world_size": p, **r})
            cells.append(f"{r['host_us']:>8.0f} {r['messages']:>5}")
        print(f"{name:<10} {mode:<6} " + " ".join(cells), flush=True)
    save_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
