"""SparseGradSync as recommendation models are trained: a same start on every rank, several optimizers.

* Ranks seeded differently start from rank 0's parameters and buffers
  (``init_sync``, as DDP does); with ``init_sync=False`` they keep their own,
  with ``broadcast_buffers=False`` their own buffers.
* SparseAdam for the embedding and Adam for the rest, both attached:
  one synchronization per step whichever steps first, and the training
  equals a one-process replica that averages every rank's gradients.
* An optimizer that was not attached and steps a parameter whose sparse
  gradient is not synchronized raises on every rank before changing it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from colltune.train import SparseGradSync

from harness import expect_error, pool

ROWS, DIM, STEPS = 64, 8, 8


class Rec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 1))
        self.register_buffer("scale", torch.rand(1) + 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).sum(1) * self.scale).squeeze(1)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, ROWS, (16, 3), generator=g), torch.randn(16, generator=g)


def _optimizers(model: Rec) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.05), torch.optim.Adam(model.mlp.parameters(), lr=0.01)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in list(model.parameters()) + list(model.buffers())])


def _rank_init(rank: int, world_size: int, init_sync: bool, broadcast_buffers: bool = True) -> torch.Tensor:
    torch.manual_seed(rank)  # seeded differently on every rank
    model = Rec()
    SparseGradSync(model, init_sync=init_sync, broadcast_buffers=broadcast_buffers)
    return _flat(model)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_seeded_differently_start_from_rank_0(world_size: int) -> None:
    out = pool(world_size).run(_rank_init, True)
    assert all(torch.equal(out[0], o) for o in out[1:])
    torch.manual_seed(0)
    assert torch.equal(out[0], _flat(Rec()))  # rank 0's own model, unchanged
    apart = pool(world_size).run(_rank_init, False)
    assert not torch.equal(apart[0], apart[1])
    own = pool(world_size).run(_rank_init, True, False)  # the buffer, last, stays each rank's own
    assert all(torch.equal(out[0][:-1], o[:-1]) for o in own) and len({float(o[-1]) for o in own}) == world_size


def _replica_step(replica: Rec, opts: tuple, world_size: int, step: int) -> None:
    """One step of the one-process reference: every rank's gradients, averaged."""
    grads: dict[str, torch.Tensor] = {}
    for r in range(world_size):
        replica.zero_grad()
        ids, y = _batch(r, step)
        nn.functional.mse_loss(replica(ids), y).backward()
        for name, p in replica.named_parameters():
            g = p.grad.to_dense() if p.grad.is_sparse else p.grad
            grads[name] = grads.get(name, torch.zeros_like(p)) + g / world_size
    for name, p in replica.named_parameters():
        p.grad = grads[name].to_sparse() if name == "emb.weight" else grads[name]
    for opt in opts:
        opt.step()


def _rank_two_optimizers(rank: int, world_size: int, order: str, separately: bool) -> dict:
    torch.manual_seed(rank)
    model = Rec()
    sync = SparseGradSync(model)
    replica = Rec()
    replica.load_state_dict(model.state_dict())
    sparse_adam, adam = _optimizers(model)
    if separately:
        sync.attach(sparse_adam)
        sync.attach(adam)
    else:
        sync.attach(sparse_adam, adam)
    ref_opts = _optimizers(replica)
    for step in range(STEPS):
        ids, y = _batch(rank, step)
        nn.functional.mse_loss(model(ids), y).backward()
        for opt in ((sparse_adam, adam) if order == "sparse-first" else (adam, sparse_adam)):
            opt.step()
        sparse_adam.zero_grad()
        adam.zero_grad()
        _replica_step(replica, ref_opts if order == "sparse-first" else ref_opts[::-1], world_size, step)
    return {"params": _flat(model), "reference": _flat(replica), "syncs": sync.step}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("order, separately", [("sparse-first", False), ("dense-first", False), ("sparse-first", True)])
def test_sparse_adam_and_adam_synchronize_once_per_step(world_size: int, order: str, separately: bool) -> None:
    out = pool(world_size).run(_rank_two_optimizers, order, separately)
    for o in out:
        assert o["syncs"] == STEPS
        assert torch.allclose(o["params"], o["reference"], atol=1e-5)
        assert torch.equal(o["params"], out[0]["params"])


def _rank_unattached(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)
    model = Rec()
    sync = SparseGradSync(model)
    sparse_adam, adam = _optimizers(model)
    sync.attach(adam)  # the embedding's optimizer forgotten
    ids, y = _batch(rank, 0)
    nn.functional.mse_loss(model(ids), y).backward()
    before = model.emb.weight.detach().clone()
    raised = expect_error(sparse_adam.step)
    unchanged = torch.equal(before, model.emb.weight)
    adam.step()  # synchronizes; the embedding's optimizer may step now
    sparse_adam.step()
    return {"raised": raised, "unchanged": unchanged, "params": _flat(model)}


def test_an_unattached_optimizer_stepping_unsynchronized_gradients_raises() -> None:
    out = pool(2).run(_rank_unattached)
    for o in out:
        assert o["raised"].type == "ColltuneValueError", o["raised"]
        assert "emb.weight" in o["raised"].message and "sync.attach(opt1, opt2)" in o["raised"].message
        assert o["unchanged"]
    assert torch.equal(out[0]["params"], out[1]["params"])


class TwoTables(nn.Module):
    """Two sparse tables and a DDP tower: the synchronizer's fused call beside DDP's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=True)
        self.bag = nn.EmbeddingBag(3 * ROWS, DIM, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).sum(1) + self.bag(ids * 3)).squeeze(1)


def _rank_async(rank: int, world_size: int, mode: str) -> dict:
    torch.manual_seed(0)
    model = TwoTables()
    model.mlp = nn.parallel.DistributedDataParallel(model.mlp)
    sync = SparseGradSync(model)
    if mode == "async":
        sync.attach_to_backward(async_op=True)
    else:
        sync.attach_to_backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pending = []
    for step in range(STEPS):
        ids, y = _batch(rank, step)
        nn.functional.mse_loss(model(ids), y).backward()
        pending.append(sync._pending is not None)
        opt.step()  # waits for the sparse gradients first
        opt.zero_grad()
    return {"params": _flat(model), "pending": pending, "bytes": sync.bytes_sent}


@pytest.mark.parametrize("world_size", [2, 3])
def test_asynchronous_synchronization_beside_ddp_trains_the_same_bits(world_size: int) -> None:
    sync_run = pool(world_size).run(_rank_async, "sync")
    async_run = pool(world_size).run(_rank_async, "async")
    for s, a in zip(sync_run, async_run):
        assert torch.equal(s["params"], a["params"])
        assert torch.equal(a["params"], async_run[0]["params"])
        assert all(a["pending"]) and not any(s["pending"])  # the reduction was in flight after backward
        assert a["bytes"] > 0 and s["bytes"] > 0  # (not equal: the second run meets warm call sites)


def _rank_scaled(rank: int, world_size: int, mode: str) -> dict:
    """Mixed precision's loop (``GradScaler``: scale, backward, step, update) for four steps, rank 1's loss
    overflowing in the second. ``mode``: how the synchronizer averages before the scaler reads the gradients."""
    torch.manual_seed(rank)
    model = Rec()
    sync = SparseGradSync(model)
    opts = _optimizers(model)
    if mode == "attach_to_backward":
        sync.attach_to_backward()
    elif mode in ("async, wait", "async"):
        sync.attach_to_backward(async_op=True)
    else:  # "synchronize" after backward, or "attach" alone: the scaler reads the gradients before the average
        sync.attach(*opts)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, enabled=mode != "attach, scaler disabled")

    def train() -> dict:
        skipped, scales = [], []
        for step in range(4):
            ids, y = _batch(rank, step)
            overflow = (step, rank) == (1, 1) and scaler.is_enabled()
            loss = nn.functional.mse_loss(model(ids), y) * (1e38 if overflow else 1.0)
            before = _flat(model)
            scaler.scale(loss).backward()
            if mode == "synchronize":
                sync.synchronize()
            elif mode == "async, wait":
                sync.wait()
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            for opt in opts:
                opt.zero_grad()
            skipped.append(torch.equal(before, _flat(model)))
            scales.append(scaler.get_scale())
        return {"skipped": skipped, "scales": scales, "params": _flat(model)}

    return {"mode": mode, "out": expect_error(train) if mode in ("attach", "async") else train()}


@pytest.mark.parametrize("mode", ["attach_to_backward", "synchronize", "async, wait"])
def test_grad_scaler_skips_an_overflowing_step_on_every_rank(mode: str) -> None:
    """Averaged before GradScaler reads them, one rank's overflow reaches every rank: all skip that step and
    halve the scale together, and the replicas stay equal."""
    out = [o["out"] for o in pool(2).run(_rank_scaled, mode)]
    for o in out:
        assert isinstance(o, dict), o
        assert o["skipped"] == [False, True, False, False] and o["scales"] == [2.0**20, 2.0**19, 2.0**19, 2.0**19]
        assert torch.equal(o["params"], out[0]["params"])


def test_a_disabled_grad_scaler_steps_as_if_absent() -> None:
    """``GradScaler(enabled=False)`` (amp switched off by a flag) unscales nothing: ``attach`` is fine there."""
    out = [o["out"] for o in pool(2).run(_rank_scaled, "attach, scaler disabled")]
    for o in out:
        assert o["skipped"] == [False] * 4 and torch.equal(o["params"], out[0]["params"]), o


@pytest.mark.parametrize("mode, says", [("attach", "sync.attach_to_backward()"), ("async", "sync.wait()")])
def test_grad_scaler_reading_unaveraged_gradients_is_refused_on_every_rank(mode: str, says: str) -> None:
    """``attach`` averages at the optimizer's step, after GradScaler unscaled and checked this rank's own
    gradients (a rank that overflows would skip its step and its synchronization: the ranks would go apart or
    hang); an asynchronous synchronization not waited for is read in flight. Both raise on every rank."""
    for o in pool(2).run(_rank_scaled, mode):
        raised = o["out"]
        assert getattr(raised, "type", None) == "ColltuneValueError", raised
        assert "GradScaler" in raised.message and says in raised.message, raised
