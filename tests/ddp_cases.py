"""Training scenarios shared by the CPU and the GPU tests.

- :func:`unused_layer_run`: a layer no rank uses, under ``colltune_hook``.
  The model's first layer is skipped from step 3 on, on every rank, so DDP
  (``find_unused_parameters=True``) keeps no result for it; what top-k
  selected there must go back to the residuals (``colltune.train.hook``).
- :func:`joined_sync_run`: uneven inputs under ``Join`` with
  ``SparseGradSync``, checked against a dense replay of every rank's steps.
- :class:`Net`, :func:`batch`, :func:`net`, :func:`dense_grad`: the model with
  two sparse tables and a dense tower the training tests use, its batches.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn


class Gated(nn.Module):
    """Two layers, the first skipped on steps the caller says: unused then on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(40, 40), nn.Linear(40, 1)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        return self.b(self.a(x) if use_a else x)


def unused_layer_run(rank: int, world_size: int, device: str = "cpu", as_view: bool = False,
                     to_none: bool = True) -> list[float]:
    """Compress from the first step; ``a`` is used in steps 0 to 2 only. Per step, how far ``a.weight``'s
    fed-in gradients (each rank's own, computed apart on the CPU) are from what DDP delivered plus the
    residuals, summed over the ranks in float64. ``device`` ``cuda``: the model on GPU 0 (ranks share it)."""
    from colltune.train import ColltuneHookState, colltune_hook

    if device == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = Gated().to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None,
                                              find_unused_parameters=True, gradient_as_bucket_view=as_view)
    state = ColltuneHookState(model=ddp, density=0.05, start_compression_iter=0, min_compress_numel=1,
                              algorithm="allgather")
    ddp.register_comm_hook(state, colltune_hook)
    g = torch.Generator().manual_seed(rank)
    numel = model.a.weight.numel()
    fed, delivered, apart = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64), []
    for step in range(6):
        use = step < 3
        x = torch.randn(8, 40, generator=g)
        alone = Gated()
        alone.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        alone(x, use).sum().backward()
        own = torch.zeros(numel, dtype=torch.float64) if alone.a.weight.grad is None else alone.a.weight.grad.double()
        ddp.zero_grad(set_to_none=to_none)
        ddp(x.to(device), use).sum().backward()
        dist.all_reduce(own := own.reshape(-1))
        fed += own
        if model.a.weight.grad is not None:  # DDP's gradient as the optimizer would apply it
            delivered += model.a.weight.grad.double().cpu().reshape(-1) * world_size
        (residual,) = [st.residual for st in state.topk_states.values()]  # one part: a.weight first
        held = residual[:numel].double().cpu()
        dist.all_reduce(held)
        apart.append(float((fed - delivered - held).abs().max()))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.01 * p.grad
    return apart


ROWS, DIM = 200, 8


class Net(nn.Module):
    """Two sparse tables (one per field kind) and a small dense tower."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=sparse)
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=sparse)
        self.fc1 = nn.Linear(2 * DIM, 64)
        self.fc2 = nn.Linear(64, 1)

    def forward(self, ids: torch.Tensor, bag_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.emb(ids).sum(1)
        b = self.bag(bag_ids) if bag_ids is not None else torch.zeros_like(x)
        return self.fc2(torch.relu(self.fc1(torch.cat([x, b], 1)))).squeeze(1)


def batch(rank: int, step: int, use_bag: bool = True) -> tuple:
    g = torch.Generator().manual_seed(1000 * rank + step)
    ids = (torch.rand(16, 3, generator=g) ** 3 * ROWS).long()  # skewed: duplicates within and across ranks
    bag = (torch.rand(16, 4, generator=g) ** 2 * ROWS).long() if use_bag else None
    y = torch.rand(16, generator=g)
    return ids, bag, y


def net(sparse: bool) -> Net:
    torch.manual_seed(0)
    return Net(sparse)


def dense_grad(p: nn.Parameter) -> torch.Tensor | None:
    if p.grad is None:
        return None
    return p.grad.to_dense() if p.grad.is_sparse else p.grad


def joined_sync_run(rank: int, world_size: int, cfg: dict) -> dict:
    """Uneven inputs under ``Join``: rank r trains ``first`` + 2r steps of :class:`Net` under SparseGradSync.

    ``cfg``: ``mode`` (``attach``, ``synchronize`` after backward, ``async``:
    ``attach_to_backward(async_op=True)``, ``synchronize-async``:
    ``synchronize(async_op=True)`` then ``wait()``), ``ddp`` (DDP over
    ``fc1``, listed first), ``frozen_head`` (``fc2`` frozen: beside DDP only
    the tables are the synchronizer's), ``first``, ``micro`` (micro-batches per step, all but the last
    under DDP's ``no_sync``), ``dense`` (``allreduce`` or ``topk``) and
    ``device``. Every rank also replays every rank's steps on a dense copy on
    the CPU, averaging over the group's size what the ranks still training
    computed: the reference (``None`` under top-k, which is not exact). A
    buffer and a frozen parameter that each rank changes by hand every step
    end as the last rank to join left them (``seen``: its steps times P), or
    the buffer each rank's own with ``own_buffers`` (the synchronizer's
    ``broadcast_buffers=False``); a buffer of the DDP submodule, under DDP's
    ``broadcast_buffers=False``, stays each rank's own (``mine``: the rank).
    """
    from torch.distributed.algorithms.join import Join

    from colltune.train import SparseGradSync

    device, first, micro = cfg.get("device", "cpu"), cfg.get("first", 3), cfg.get("micro", 1)
    if device == "cuda":
        torch.cuda.set_device(0)
    model, ref = net(True).to(device), net(False)
    # State the loop changes by hand, apart on every rank: the last rank to join's ends on every rank.
    model.register_buffer("seen", torch.zeros(2, device=device))
    model.scale = nn.Parameter(torch.ones(3, device=device), requires_grad=False)
    joinables: list = []
    if cfg.get("ddp"):
        model.fc1.register_buffer("mine", torch.zeros(1, device=device))
        model.fc1 = nn.parallel.DistributedDataParallel(model.fc1, broadcast_buffers=False)
        joinables.append(model.fc1)
    if cfg.get("frozen_head"):
        model.fc2.requires_grad_(False)
        ref.fc2.requires_grad_(False)
    sync = SparseGradSync(model, algorithm="allgather", dense=cfg.get("dense", "allreduce"), start_compression_iter=1,
                          min_compress_numel=64, broadcast_buffers=not cfg.get("own_buffers"))
    joinables.append(sync)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 / micro)  # smaller steps for the larger summed gradients
    if cfg["mode"] == "attach":
        sync.attach(opt)
    elif cfg["mode"] == "async":
        sync.attach_to_backward(async_op=True)
    with Join(joinables):
        for step in range(first + 2 * rank):
            opt.zero_grad()
            for m in range(micro):
                ids, bag, y = (t.to(device) for t in batch(rank, micro * step + m))
                quiet = cfg.get("ddp") and m < micro - 1
                with model.fc1.no_sync() if quiet else contextlib.nullcontext():
                    nn.functional.mse_loss(model(ids, bag), y).backward()
            if cfg["mode"] == "synchronize":
                sync.synchronize()
            elif cfg["mode"] == "synchronize-async":
                sync.synchronize(async_op=True)
                sync.wait()
            opt.step()
            model.seen += rank + 1
            model.scale.mul_(1 + rank / 8)
            if cfg.get("ddp"):
                model.fc1.module.mine.fill_(rank)
        kept = {n: None if p.grad is None else dense_grad(p).clone() for n, p in model.named_parameters()}
    params = {n.replace(".module.", "."): p.detach().cpu() for n, p in model.named_parameters()}
    flat = torch.cat([params[n].reshape(-1) for n, _ in ref.named_parameters()])
    flat = flat.to(device) if dist.get_backend() == "nccl" else flat  # gloo gathers host memory
    flat = torch.cat([flat, model.scale.detach().to(flat.device)])
    replicas = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(replicas, flat)
    return {
        "replicas": float(max((r - replicas[0]).abs().max() for r in replicas)),
        "rank": rank,
        "seen": float(model.seen[0]),
        "mine": float(model.fc1.module.mine) if cfg.get("ddp") else None,
        "from_ref": None if cfg.get("dense") == "topk" else _from_replay(ref, params, world_size, first, micro),
        "kept": all(p.grad is None if kept[n] is None else torch.equal(kept[n], dense_grad(p))
                    for n, p in model.named_parameters()),
        "steps": sync.step,
    }


def _from_replay(ref: nn.Module, params: dict, world_size: int, first: int, micro: int) -> float:
    """Train ``ref`` on every rank's steps (rank r's ``first`` + 2r), each the group average of the ranks still
    training; return how far ``params`` are from it."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.1 / micro)
    for step in range(first + 2 * (world_size - 1)):
        opt.zero_grad()
        for r in range(world_size):
            for m in range(micro if step < first + 2 * r else 0):  # rank r still trains at this step
                ids, bag, y = batch(r, micro * step + m)
                nn.functional.mse_loss(ref(ids, bag), y).backward()  # summed over ranks and micro-batches
        for p in ref.parameters():
            if p.grad is not None:
                p.grad /= world_size
        opt.step()
    return max(float((params[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
