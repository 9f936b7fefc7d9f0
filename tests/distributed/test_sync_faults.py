"""SparseGradSync when one rank goes wrong: every rank raises together, and no step mixes with another.

* One rank's bad gradient (COO over both dimensions), missing policy file
  or unknown ``COLLTUNE_ALGO`` travels in the step's first metadata
  exchange: that rank raises its own error, the others ``RemoteInputError``
  naming it, in seconds (not the process group's timeout), on every path
  (fused, fused beside dense gradients, asynchronous, one call per
  gradient); the next step on the same synchronizer is exact.
* A rank that fails on its own after the reduction and retries the step
  (while the others go on) is a step behind: the next synchronization
  raises ``RankMismatchError`` on every rank instead of averaging
  gradients of two steps; loading one checkpoint on every rank recovers.
* A training loop whose ranks retry a failed step trains exactly what a
  loop without the failure trains.
* The DDP hook: a rank that cannot route its buckets (its policy file is
  missing) raises in backward, and so does every other rank.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

from colltune.select import selector as _selector
from colltune.train import ColltuneHookState, SparseGradSync, colltune_hook

from harness import PG_TIMEOUT_S, expect_error, pool

ROWS, DIM = 40, 4
#: A failure must reach every rank well before the process group's timeout would.
PROMPT_S = PG_TIMEOUT_S / 3


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=True)
        self.bag = nn.EmbeddingBag(2 * ROWS, DIM, mode="sum", sparse=True)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).sum(1) + self.bag(ids * 2)).squeeze(1)


def _ids(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, ROWS, (6, 3), generator=g)


def _backward(model: Model, rank: int, step: int) -> None:
    model.zero_grad()
    model(_ids(rank, step)).sum().backward()


def _expected(world_size: int, step: int) -> dict[str, torch.Tensor]:
    """Every rank's gradients, averaged, from a replica (the reference)."""
    torch.manual_seed(0)
    replica = Model()
    total: dict[str, torch.Tensor] = {}
    for r in range(world_size):
        _backward(replica, r, step)
        for name, p in replica.named_parameters():
            g = p.grad.to_dense() if p.grad.is_sparse else p.grad
            total[name] = total.get(name, torch.zeros_like(p)) + g
    return {name: g / world_size for name, g in total.items()}


def _grads(model: Model) -> dict[str, torch.Tensor]:
    return {name: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone() for name, p in model.named_parameters()}


#: How the synchronizer runs: its options and whether synchronize() is asynchronous.
MODES = {
    "fused": ({"dense": "skip"}, False),  # the check rides in the fused call's record
    "fused-and-dense": ({}, False),  # an exchange of its own, then fused and dense
    "async": ({"dense": "skip"}, True),
    "async-and-dense": ({}, True),
    "per-tensor": ({"fuse": False}, False),
}


def _reduced(expected: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """The gradients the synchronizer averages in ``mode`` (with ``dense="skip"`` the sparse ones only)."""
    skip = MODES[mode][0].get("dense") == "skip"
    return {name: g for name, g in expected.items() if not (skip and name.startswith("head."))}


def _break(what: str, model: Model, sync: SparseGradSync) -> None:
    """Make this rank's next synchronization fail before any collective, as a careless user would."""
    if what == "layout":
        model.emb.weight.grad = model.emb.weight.grad.to_dense().to_sparse()  # COO over both dimensions
    elif what == "policy":
        sync.policy = "/nonexistent/colltune-policy.yaml"
        sync._routes = None
    elif what == "env":
        os.environ["COLLTUNE_ALGO"] = "no-such-algorithm"
        _selector._global = None  # the process-wide selector reads the environment when it is made


def _mend(what: str, sync: SparseGradSync) -> None:
    if what == "policy":
        sync.policy = None
        sync._routes = None
    elif what == "env":
        os.environ.pop("COLLTUNE_ALGO", None)


def _synchronize(sync: SparseGradSync, async_op: bool) -> None:
    sync.synchronize(async_op=async_op)
    sync.wait()


def _rank_one_bad(rank: int, world_size: int, case: tuple[str, str]) -> dict:
    what, mode = case
    options, async_op = MODES[mode]
    torch.manual_seed(0)
    model = Model()
    sync = SparseGradSync(model, **options)
    bad = rank == world_size - 1
    try:
        _backward(model, rank, 0)
        if bad:
            _break(what, model, sync)
        failed = expect_error(_synchronize, sync, async_op)
    finally:
        if bad:
            _mend(what, sync)
        if what == "env":  # every rank starts again from a new process-wide selector (the same history)
            _selector._global = None
    steps_after_failure = sync.step
    _backward(model, rank, 1)
    _synchronize(sync, async_op)
    return {"failed": failed, "step": steps_after_failure, "grads": _grads(model), "synced": sync.step}


CASES = [(what, mode) for what in ("layout", "policy", "env") for mode in MODES]


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_rank_failing_to_prepare_makes_every_rank_raise_and_the_next_step_is_exact(world_size: int) -> None:
    expected = _expected(world_size, 1)
    for case in CASES:
        out = pool(world_size).run(_rank_one_bad, case)
        bad = world_size - 1
        for rank, o in enumerate(out):
            failed = o["failed"]
            assert failed.raised, (case, rank)
            assert failed.elapsed < PROMPT_S, (case, rank, failed)
            if rank == bad:
                assert failed.isa("ColltuneValueError") and not failed.isa("RemoteInputError"), (case, failed)
                said = {"layout": "sparse dimensions", "policy": "colltune-policy.yaml", "env": "COLLTUNE_ALGO"}
                assert said[case[0]] in failed.message, (case, failed)
            else:
                assert failed.type == "RemoteInputError", (case, rank, failed)
                assert f"[{bad}]" in failed.message, (case, failed)
                argument = "gradients" if case[0] == "layout" else "policy"
                assert repr(argument) in failed.message, (case, failed)
            assert o["step"] == 0 and o["synced"] == 1, (case, rank, o["step"])
            for name, want in _reduced(expected, case[1]).items():
                assert torch.allclose(o["grads"][name], want, atol=1e-6), (case, rank, name)
                assert torch.equal(o["grads"][name], out[0]["grads"][name]), (case, rank, name)


#: One setting that differs on the last rank: (constructor options there, asynchronous there, head in float64).
DIFFERENCES = {
    "async": ({}, True, False),
    "fuse": ({"fuse": False}, False, False),
    "bucket_cap_mb": ({"bucket_cap_mb": 1.0}, False, False),
    "dense": ({"dense": "skip"}, False, False),
    "dtype": ({}, False, True),
}


def _rank_differs(rank: int, world_size: int, what: str) -> dict:
    options, async_op, wide = DIFFERENCES[what] if rank == world_size - 1 else ({}, False, False)
    torch.manual_seed(0)
    model = Model()
    if wide:
        model.head.double()
        model.head.register_forward_pre_hook(lambda m, args: tuple(a.double() for a in args))
    sync = SparseGradSync(model, init_sync=False, **options)
    _backward(model, rank, 0)
    return {"failed": expect_error(_synchronize, sync, async_op), "step": sync.step}


@pytest.mark.parametrize("what", list(DIFFERENCES))
def test_ranks_whose_synchronizers_differ_all_raise(what: str) -> None:
    out = pool(2).run(_rank_differs, what)
    for rank, o in enumerate(out):
        assert o["failed"].type == "RankMismatchError", (what, rank, o["failed"])
        assert "routes the gradients" in o["failed"].message, (what, rank, o["failed"])
        assert o["failed"].elapsed < PROMPT_S and o["step"] == 0


def _rank_retry_alone(rank: int, world_size: int, mode: str) -> dict:
    """Rank 0 fails on its own after the reduction (as an out-of-memory error would) and retries the step."""
    options, async_op = MODES[mode]
    torch.manual_seed(0)
    model = Model()
    sync = SparseGradSync(model, **options)
    saved = sync.state_dict()
    _backward(model, rank, 0)
    if rank == 0:
        put = sync._put_sparse

        def fail(*args: object) -> int:
            raise MemoryError("out of memory while putting the gradients back")

        sync._put_sparse = fail  # type: ignore[method-assign]
        first = expect_error(_synchronize, sync, async_op)
        sync._put_sparse = put  # type: ignore[method-assign]
        _backward(model, rank, 0)  # the retry of step 0 ...
    else:
        first = expect_error(_synchronize, sync, async_op)
        _backward(model, rank, 1)  # ... meets the others' step 1
    mixed = expect_error(_synchronize, sync, async_op)
    for _ in range(2):  # the retry and the step stay apart however often they meet
        again = expect_error(_synchronize, sync, async_op)
    sync.load_state_dict(saved)  # the same checkpoint on every rank
    _backward(model, rank, 0)
    _synchronize(sync, async_op)
    return {"first": first, "mixed": mixed, "again": again, "grads": _grads(model)}


@pytest.mark.parametrize("mode", ["fused", "fused-and-dense", "async", "per-tensor"])
def test_a_rank_retrying_a_step_alone_never_mixes_two_steps(mode: str) -> None:
    out = pool(2).run(_rank_retry_alone, mode)
    assert out[0]["first"].type == "MemoryError" and not out[1]["first"].raised
    for rank, o in enumerate(out):
        for failed in (o["mixed"], o["again"]):
            assert failed.type == "RankMismatchError", (mode, rank, failed)
            assert "step" in failed.message and "rank 0: 0, rank 1: 1" in failed.message, (mode, rank, failed)
            assert failed.elapsed < PROMPT_S
    expected = _reduced(_expected(2, 0), mode)
    for o in out:
        for name, want in expected.items():
            assert torch.allclose(o["grads"][name], want, atol=1e-6), (mode, name)
            assert torch.equal(o["grads"][name], out[0]["grads"][name]), (mode, name)


def _rank_training_with_retries(rank: int, world_size: int, fail_at: int | None) -> torch.Tensor:
    """Train a few steps; at ``fail_at`` the last rank's gradient is bad once, and every rank retries the step."""
    torch.manual_seed(0)
    model = Model()
    sync = SparseGradSync(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync.attach(opt)
    step = 0
    broken = False
    while step < 5:
        _backward(model, rank, step)
        if step == fail_at and not broken and rank == world_size - 1:
            model.emb.weight.grad = model.emb.weight.grad.to_dense().to_sparse()
        try:
            opt.step()
        except Exception:  # noqa: BLE001 - the loop's retry: every rank redoes the step
            broken = True
            continue
        step += 1
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_training_loop_retrying_a_failed_step_trains_as_without_the_failure(world_size: int) -> None:
    clean = pool(world_size).run(_rank_training_with_retries, None)
    retried = pool(world_size).run(_rank_training_with_retries, 2)
    for r in range(world_size):
        assert torch.equal(retried[r], clean[0]), r


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).squeeze(1)


def _hooked_tower(rank: int, **options: Any) -> tuple[ColltuneHookState, Callable[[], Any]]:
    """A DDP ``Tower`` under the colltune hook, compressing from the first step, and a call that runs one step's
    backward and returns what :func:`expect_error` reports of it."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Tower())
    state = ColltuneHookState(model=ddp, density=0.5, start_compression_iter=0, **options)
    ddp.register_comm_hook(state, colltune_hook)
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(rank))
    return state, lambda: expect_error(lambda: ddp(x).sum().backward())


def _rank_hook_bad_policy(rank: int, world_size: int) -> dict:
    """The DDP hook with a policy file that one rank cannot read: every rank's backward raises."""
    bad = rank == world_size - 1
    _, step = _hooked_tower(rank, min_compress_numel=1, policy="/nonexistent/colltune-policy.yaml" if bad else None)
    return {"failed": step()}


def test_the_ddp_hook_with_one_rank_unable_to_route_raises_on_every_rank() -> None:
    out = pool(2).run(_rank_hook_bad_policy)
    assert out[1]["failed"].isa("PolicyError") and "colltune-policy.yaml" in out[1]["failed"].message, out[1]
    assert out[0]["failed"].isa("RemoteInputError") and "rank 1" in out[0]["failed"].message, out[0]
    assert all(o["failed"].elapsed < PROMPT_S for o in out)


def _rank_hook_part_fails(rank: int, world_size: int) -> dict:
    """A bucket's top-k part fails (its handle's Future raises) beside a dense part that succeeds."""
    from colltune.train import hook

    class Failed:
        def get_future(self) -> torch.futures.Future:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_exception(ValueError("the top-k part failed"))
            return fut

    # fc2's bias (1 element) stays dense, the rest is compressed: the bucket joins both parts' Futures.
    state, step = _hooked_tower(rank, min_compress_numel=2)
    original = hook._api.topk_allreduce
    hook._api.topk_allreduce = lambda *a, **k: Failed()
    try:
        return {"failed": step(), "routes": sorted({d["route"] for d in state.decisions.values()})}
    finally:
        hook._api.topk_allreduce = original  # pool ranks live on: the next test calls the real one


def test_the_ddp_hook_raises_the_error_of_a_failed_part() -> None:
    for o in pool(2).run(_rank_hook_part_fails):
        assert o["routes"] == ["dense", "topk"], o
        assert "the top-k part failed" in o["failed"].message, o["failed"]


def _rank_hook_dense_part_fails(rank: int, world_size: int) -> dict:
    """A bucket's dense part fails on colltune's worker, ahead of the top-k part queued behind it."""
    from colltune.algorithms.errors import ColltuneValueError
    from colltune.train import common

    def failing(flat: torch.Tensor, wire: object) -> torch.Tensor:
        # A colltune error, which every rank raises at the same call: the ranks stay in step, and the top-k part
        # queued behind runs on each of them (any other error would drop it, or not, as the queue's timing falls).
        raise ColltuneValueError("the dense part failed")

    _, step = _hooked_tower(rank, min_compress_numel=2)
    original = common._sum_into
    common._sum_into = failing
    try:
        failed = step()
    finally:
        common._sum_into = original
    after = torch.full((3,), float(rank))
    torch.distributed.all_reduce(after)  # the group still works
    return {"failed": failed, "after": after}


def test_the_ddp_hook_raises_the_error_of_a_failed_dense_part() -> None:
    for o in pool(2).run(_rank_hook_dense_part_fails):
        assert "the dense part failed" in o["failed"].message and o["failed"].elapsed < PROMPT_S, o["failed"]
        assert o["after"].tolist() == [1.0, 1.0, 1.0]
