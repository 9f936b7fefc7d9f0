"""Reproduce a heap corruption in PyTorch's DDP sparse allreduce on gloo, and the comm hooks that avoid it or not.

DDP starts each sparse embedding gradient's allreduce as the gradient
comes, and gloo runs two at once on its worker threads. With torch 2.13
on gloo, a model with many sparse tables corrupts the heap now and then:
a rank dies with glibc's ``malloc(): unaligned tcache chunk detected``
(on gloo's worker thread, in ``AsyncSparseAllreduceWork``'s coalesce of
its input) or a SIGSEGV. This tool imports no colltune: DDP alone, 26
``EmbeddingBag(sparse=True)`` tables (10 to 20000 rows, width 16), two
small MLPs and SGD, P ranks on gloo, in fresh processes per run.

``--hook`` picks how DDP reduces: its own way (``ddp``), or a comm hook
that averages as DDP's ``allreduce_hook`` does and hands gloo a copy of
each sparse gradient (``copy``: whether gloo overwriting the parameter's
own gradient matters), starts each sparse allreduce once the one before
it is done (``one-in-flight``: what ``tools/dlrm.py
--one-sparse-in-flight`` does), or waits for every allreduce in the hook
(``wait``). Each run prints how many steps it finished, or which rank
died and how; the last line counts the runs that died. Seen on two cores
(P = 2, 3000 steps a run, torch 2.13.0, one command after another):
``ddp`` 4 of 4 runs died (after 11 to 44 s), ``copy`` 3 of 4,
``one-in-flight`` 0 of 4, ``wait`` 0 of 2. One sparse allreduce in flight
makes the crash rarer, not impossible: a 10-step ``one-in-flight`` run of
the tool's test died once, with the test suite loading both cores (then
0 of 24 such runs alone)::

    python tools/ddp_sparse_stress.py --runs 4 --steps 3000 --hook ddp
    python tools/ddp_sparse_stress.py --runs 4 --steps 3000 --hook one-in-flight
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

TABLES, WIDTH, BATCH = 26, 16, 128
HOOKS = ("ddp", "copy", "one-in-flight", "wait")


class Model(nn.Module):
    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, WIDTH, mode="sum", sparse=True) for n in sizes)
        self.bottom = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, WIDTH))
        self.top = nn.Sequential(nn.Linear(WIDTH * (len(sizes) + 1), 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor]) -> torch.Tensor:
        return self.top(torch.cat([self.bottom(dense)] + [bag(i.view(-1, 1)) for bag, i in zip(self.bags, ids)], 1))


def copy_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none given
    """``allreduce_hook`` (the bucket averaged over the group), a sparse gradient handed to gloo as a copy."""
    t = bucket.buffer()
    t = t.clone() if t.is_sparse else t
    t.div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


class OneInFlight:
    """A comm hook state: ``allreduce_hook``, each sparse allreduce started once the one before it is done."""

    def __init__(self) -> None:
        self.last: torch.futures.Future | None = None

    @staticmethod
    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none given
        if not bucket.buffer().is_sparse:
            return default_hooks.allreduce_hook(None, bucket)
        if state.last is not None:
            state.last.wait()
        state.last = default_hooks.allreduce_hook(None, bucket)
        return state.last


def wait_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none given
    """``allreduce_hook``, waited for in the hook: one collective at a time, none beside the backward pass."""
    fut = default_hooks.allreduce_hook(None, bucket)
    fut.wait()
    return fut


def rank_main(rank: int, world_size: int, steps: int, store: str, hook: str, abort_after: int | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    sizes = [int(n) for n in torch.randint(10, 20000, (TABLES,), generator=torch.Generator().manual_seed(0))]
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Model(sizes))
    if hook == "copy":
        model.register_comm_hook(None, copy_hook)
    elif hook == "one-in-flight":
        model.register_comm_hook(OneInFlight(), OneInFlight.hook)
    elif hook == "wait":
        model.register_comm_hook(None, wait_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank + 1)
    for step in range(steps):
        if rank == 1 and step == abort_after:
            os.abort()
        loss = model(torch.randn(BATCH, 13, generator=g), [torch.randint(0, n, (BATCH,), generator=g) for n in sizes])
        opt.zero_grad(set_to_none=True)
        loss.pow(2).mean().backward()
        opt.step()
    dist.destroy_process_group()


def one_run(world_size: int, steps: int, hook: str, abort_after: int | None = None) -> str | None:
    """Run once; return ``None`` when every rank finished, else how the ranks that failed ended.

    A rank that dies takes its peers down with it (their collectives fail,
    or ``join`` ends them with SIGTERM), so the ranks dead of another signal
    are named first; else the first error ``join`` saw.
    """
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(rank_main, args=(world_size, steps, os.path.join(tmp, "store"), hook, abort_after),
                                 nprocs=world_size, join=False, start_method="spawn")
        try:
            while not ctx.join():
                pass
            return None
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
            first = str(exc).strip().splitlines()[-1]
    died = [f"rank {i} died with signal {signal.Signals(-proc.exitcode).name}" for i, proc in enumerate(ctx.processes)
            if proc.exitcode is not None and proc.exitcode < 0 and -proc.exitcode != signal.SIGTERM]
    return ", ".join(died) if died else first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="local gloo ranks (default 2)")
    ap.add_argument("--steps", type=int, default=3000, help="training steps a run (default 3000)")
    ap.add_argument("--runs", type=int, default=1, help="runs, each in fresh processes (default 1)")
    ap.add_argument("--hook", choices=HOOKS, default="ddp",
                    help="DDP's allreduce: its own (ddp, default), or a comm hook that averages as DDP's allreduce_hook "
                         "does and hands gloo a copy of each sparse gradient (copy), starts each sparse allreduce once "
                         "the one before it is done (one-in-flight), or waits for every allreduce (wait)")
    ap.add_argument("--abort-after", type=int, default=None, help=argparse.SUPPRESS)  # the test: rank 1 aborts
    args = ap.parse_args(argv)
    if args.ranks < 2 or args.steps < 1 or args.runs < 1:
        ap.error("--ranks must be at least 2, --steps and --runs at least 1")
    died = 0
    for run in range(1, args.runs + 1):
        t0 = time.perf_counter()
        failure = one_run(args.ranks, args.steps, args.hook, args.abort_after)
        died += failure is not None
        outcome = failure or f"{args.steps} steps"
        print(f"run {run}: {outcome} in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"--hook {args.hook}: {died} of {args.runs} runs died (torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
