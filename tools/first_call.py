"""Time a training job's first ``auto`` call: import colltune, load the shipped profile, decide, reduce.

Each run starts P fresh processes on gloo (spawned, so nothing is imported
beforehand), and rank 0 reports the time of ``import colltune`` and of the
first and second ``auto`` calls, and which heavy modules got imported::

    python3 tools/first_call.py --ranks 2 --repeats 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

HEAVY = ("sklearn", "scipy", "matplotlib", "optuna", "torch._dynamo")


def _rank(rank: int, world_size: int, port: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t0 = time.perf_counter()
    import colltune

    t1 = time.perf_counter()
    idx, vals = torch.tensor([1, 5 + rank]), torch.ones(2)
    res = colltune.sparse_allreduce(idx, vals, 100_000)
    t2 = time.perf_counter()
    colltune.sparse_allreduce(idx, vals, 100_000)
    t3 = time.perf_counter()
    if rank == 0:
        out.put({"import_s": t1 - t0, "first_s": t2 - t1, "second_s": t3 - t2, "algorithm": res.algorithm,
                 "heavy": [m for m in HEAVY if m in sys.modules]})
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    runs = []
    for i in range(args.repeats):
        out: mp.Queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, out)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        got = out.get(timeout=300)
        for p in procs:
            p.join()
        runs.append(got)
        print(f"run {i}: import {got['import_s']:.3f} s, first auto call {got['first_s']:.3f} s, "
              f"second {got['second_s'] * 1e3:.1f} ms ({got['algorithm']}); heavy modules imported: "
              f"{', '.join(got['heavy']) or 'none'}")
    print(f"median first auto call: {statistics.median(r['first_s'] for r in runs):.3f} s over {len(runs)} runs")


if __name__ == "__main__":
    main()
