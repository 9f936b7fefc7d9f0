"""Asynchronous calls compose with the caller's own collectives on the same group.

An ``async_op=True`` call is followed, before its ``wait()``, by whatever a
training step does on the same group: a plain ``dist.all_reduce``, an
``all_gather``, a ``broadcast``, DDP's backward. colltune's collectives run
on a private twin of the group, so they never pair with the caller's; the
results equal the dense reference, bit for bit on every rank, and nothing
waits for the group's timeout. Ranks may also disagree on ``async_op`` for
the same call.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import colltune

from harness import run_ranks

N = 4096
ITERATIONS = 20
#: Short enough that a deadlock fails the test in seconds, long enough for two shared cores.
PG_TIMEOUT_S = 15.0


def _inputs(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    k = 40 + 7 * rank + step
    return torch.randint(0, N, (k,), generator=g), torch.randn(k, generator=g)


def _reference(world_size: int, step: int) -> torch.Tensor:
    out = torch.zeros(N, dtype=torch.float64)
    for r in range(world_size):
        idx, vals = _inputs(r, step)
        out.index_add_(0, idx, vals.double())
    return out


def _ddp_step(ddp: nn.Module, rank: int, step: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + rank))
    ddp(x).pow(2).sum().backward()


def _compose(rank: int, world_size: int, algorithm: str) -> list[str]:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    problems = []
    for step in range(ITERATIONS):
        idx, vals = _inputs(rank, step)
        handle = colltune.sparse_allreduce(idx, vals, N, algorithm=algorithm, async_op=True)
        t = torch.full((3,), float(rank + step))
        dist.all_reduce(t)  # the caller's own collective on the same group, before wait()
        _ddp_step(ddp, rank, step)  # DDP's backward: its bucket allreduces
        gathered = [torch.empty(2) for _ in range(world_size)]
        dist.all_gather(gathered, torch.tensor([rank, step], dtype=torch.float32))
        res = handle.wait()
        expected_t = sum(float(r + step) for r in range(world_size))
        if not torch.equal(t, torch.full((3,), expected_t)):
            problems.append(f"step {step}: the caller's all_reduce gave {t.tolist()}")
        if [g.tolist() for g in gathered] != [[float(r), float(step)] for r in range(world_size)]:
            problems.append(f"step {step}: the caller's all_gather gave {gathered}")
        if not torch.allclose(res.to_dense().double(), _reference(world_size, step), atol=1e-5):
            problems.append(f"step {step}: colltune's result differs from the dense reference")
    return problems


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algorithm", ["auto", *colltune.algorithms.names()])
def test_async_call_then_other_collectives_then_wait(world_size: int, algorithm: str) -> None:
    out = run_ranks(_compose, world_size, algorithm, pg_timeout=PG_TIMEOUT_S, timeout=120)
    assert out == [[]] * world_size


def _mixed(rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank 0 calls asynchronously, the others synchronously, interleaved with plain collectives."""
    results = []
    for step in range(6):
        idx, vals = _inputs(rank, step)
        if rank == 0:
            handle = colltune.sparse_allreduce(idx, vals, N, async_op=True)
            dist.barrier()
            res = handle.wait()
        else:
            res = colltune.sparse_allreduce(idx, vals, N)
            dist.barrier()
        results.append(torch.cat([res.indices.double(), res.values.double()]))
    return results


def test_ranks_may_disagree_on_async_op() -> None:
    out = run_ranks(_mixed, 3, pg_timeout=PG_TIMEOUT_S, timeout=120)
    for step in range(6):
        for r in range(1, 3):
            assert torch.equal(out[0][step], out[r][step])


def _subgroup(rank: int, world_size: int) -> list[str]:
    """Ranks 0 and 2 of 3 call on their subgroup, with their own collectives on it in between."""
    sub = dist.new_group([0, 2])
    problems = []
    if rank == 1:
        return problems
    members = [0, 2]
    for step in range(ITERATIONS):
        idx, vals = _inputs(rank, step)
        handle = colltune.sparse_allreduce(idx, vals, N, group=sub, async_op=True)
        t = torch.full((2,), float(rank + step))
        dist.all_reduce(t, group=sub)
        res = handle.wait()
        expected = torch.zeros(N, dtype=torch.float64)
        for r in members:
            i, v = _inputs(r, step)
            expected.index_add_(0, i, v.double())
        if not torch.equal(t, torch.full((2,), float(sum(r + step for r in members)))):
            problems.append(f"step {step}: the caller's all_reduce on the subgroup gave {t.tolist()}")
        if not torch.allclose(res.to_dense().double(), expected, atol=1e-5):
            problems.append(f"step {step}: colltune's result on the subgroup differs from the dense reference")
    return problems


def test_async_on_a_subgroup_composes() -> None:
    assert run_ranks(_subgroup, 3, pg_timeout=PG_TIMEOUT_S, timeout=120) == [[]] * 3


def _hook_overlap(rank: int, world_size: int) -> dict:
    """With colltune's worker held up, the DDP hook still returns at once, with a Future not yet done."""
    import threading

    from colltune import api
    from colltune.train import ColltuneHookState, colltune_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = ColltuneHookState(model=ddp, density=0.25, start_compression_iter=0, min_compress_numel=1,
                              algorithm="allgather")
    returned_done: list[bool] = []

    def hook(s, bucket):
        fut = colltune_hook(s, bucket)
        returned_done.append(fut.done())
        return fut

    ddp.register_comm_hook(state, hook)
    release = threading.Event()
    api.submit_call(lambda wire: release.wait(30), True, None)  # holds the worker until released
    threading.Timer(0.5, release.set).start()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    ddp(x).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {"returned_done": returned_done, "grads": grads}


def test_ddp_hook_returns_before_its_allreduce_completes() -> None:
    out = run_ranks(_hook_overlap, 2, pg_timeout=PG_TIMEOUT_S, timeout=120)
    for o in out:
        assert o["returned_done"] and not any(o["returned_done"]), o["returned_done"]
    assert torch.equal(out[0]["grads"], out[1]["grads"])
