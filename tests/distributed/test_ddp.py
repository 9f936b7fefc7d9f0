"""Training integration (``colltune.train``): the DDP comm hook and the sparse-gradient synchronizer.

Each distributed check runs in the shared rank pools and compares with what
plain ``DistributedDataParallel`` computes on the same data:

* exact mode: after ``SparseGradSync.synchronize()`` every gradient equals
  the dense DDP reference (sparse ones once densified), is coalesced and is
  bitwise identical on every rank, at P = 2 and 3, for every algorithm;
* the hook returns a Future of the bucket's shape, honours the warm-up
  (gradients equal DDP's exactly until ``start_compression_iter``), and keeps
  dense what the policy keeps dense;
* state goes through a checkpoint (``torch.save`` of ``state_dict()``) and a
  resumed run is bitwise the same as the uninterrupted one;
* a model without sparse gradients passes through unchanged.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from colltune.algorithms import registry
from colltune.algorithms.errors import ColltuneTypeError, ColltuneValueError
from colltune.model.policy import parse_policy
from colltune.train import ColltuneHookState, SparseGradSync, colltune_hook, sparse_parameters

from ddp_cases import batch, dense_grad, joined_sync_run, net, unused_layer_run
from harness import expect_error, pool

KEEP_FC1_DENSE = """
version: 1
rules:
  - name: keep-fc1
    when: {tensor: "fc1.*"}
    use: dense
"""


class Tower(nn.Module):
    """A model without sparse gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).squeeze(1)


# --------------------------------------------------------------------------- rank functions


def _sync_vs_ddp(rank: int, world_size: int, algorithms: list[str]) -> dict:
    """Gradients after SparseGradSync (per algorithm) and after DDP on the dense copy of the same model."""
    last = world_size - 1
    ids, bag, y = batch(rank, 0, use_bag=rank != last)  # the last rank never touches the bag
    ref = nn.parallel.DistributedDataParallel(net(False), find_unused_parameters=True)
    nn.functional.mse_loss(ref(ids, bag), y).backward()
    want = {n: dense_grad(p) for n, p in ref.module.named_parameters()}
    out: dict = {"want": want, "got": {}, "coalesced": {}, "algorithm": {}, "per_table": {}}
    for algo in algorithms:
        model = net(True)
        nn.functional.mse_loss(model(ids, bag), y).backward()
        alone = net(True)  # the same gradients, one sparse_allreduce per table
        nn.functional.mse_loss(alone(ids, bag), y).backward()
        SparseGradSync(alone, algorithm=algo, fuse=False).synchronize()
        out["per_table"][algo] = {n: dense_grad(p) for n, p in alone.named_parameters()}
        sync = SparseGradSync(model, algorithm=algo)
        sync.synchronize()
        out["got"][algo] = {n: dense_grad(p) for n, p in model.named_parameters()}
        out["coalesced"][algo] = all(
            p.grad.is_sparse and p.grad.is_coalesced() for p in sparse_parameters(model).values()
        )
        out["algorithm"][algo] = {r["tensor"]: r["algorithm"] for r in sync.summary()}
        sparse_opt = torch.optim.SparseAdam(list(sparse_parameters(model).values()), lr=0.01)
        sparse_opt.step()  # SparseAdam accepts the synchronized gradients
    return out


def _hook_run(rank: int, world_size: int, cfg: dict) -> dict:
    """Train a DDP model with the colltune hook for a few steps; record the futures and the gradients."""
    model = net(False)
    plain = nn.parallel.DistributedDataParallel(net(False))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.get("bucket_cap_mb", 25))
    policy = parse_policy(cfg["policy"], "inline.yaml") if cfg.get("policy") else None
    state = ColltuneHookState(
        model=ddp,
        density=cfg["density"],
        start_compression_iter=cfg["warmup"],
        min_compress_numel=cfg.get("min_compress_numel", 1),
        algorithm=cfg["algorithm"],
        policy=policy,
    )
    shapes: list = []

    def hook(st, bucket):
        fut = colltune_hook(st, bucket)
        shapes.append((tuple(bucket.buffer().shape), bucket.buffer().dtype))
        return fut.then(lambda f: (shapes.append((tuple(f.value().shape), f.value().dtype)), f.value())[1])

    ddp.register_comm_hook(state, hook)
    steps = []
    names = [n for n, _ in model.named_parameters()]
    delivered = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    averaged = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for step in range(cfg["steps"]):
        ids, bag, y = batch(rank, step)
        for m in (plain, ddp):
            m.zero_grad()
            nn.functional.mse_loss(m(ids, bag), y).backward()
        exact = {n: torch.equal(p.grad, q.grad) for (n, p), (_, q) in
                 zip(ddp.module.named_parameters(), plain.module.named_parameters())}
        steps.append({"iter": state.iter, "exact": exact, "keys": sorted(state.topk_states)})
        for n, p, q in zip(names, ddp.module.parameters(), plain.module.parameters()):
            delivered[n] += p.grad
            averaged[n] += q.grad
        # Keep both models on the same weights, so every step compares like with like.
        with torch.no_grad():
            for p, q in zip(ddp.module.parameters(), plain.module.parameters()):
                p.sub_(0.1 * q.grad)
                q.sub_(0.1 * q.grad)
    # What is still in the residuals, per parameter (keys name the parameters, in layout order).
    residual = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    for key, st in state.topk_states.items():
        if st.residual is not None:
            parts = key.split("|")
            for n, piece in zip(parts, torch.split(st.residual, [sizes[n] for n in parts])):
                residual[n] += piece.view_as(residual[n])
    for t in residual.values():
        dist.all_reduce(t)
        t /= world_size
    return {"shapes": shapes, "steps": steps, "pickled": pickle.dumps(state), "stats": dict(state.stats),
            "delivered": delivered, "averaged": averaged, "residual": residual}


#: The torch.distributed collectives colltune and the training wrappers issue from Python.
_COLLECTIVES = ("all_reduce", "all_to_all_single", "batch_isend_irecv", "broadcast", "all_gather_into_tensor",
                "all_gather_single")


@contextlib.contextmanager
def _recorded_collectives() -> Iterator[list]:
    """Record ``(thread name, on the default group, colltune's worker idle)`` for every collective issued."""
    from colltune import api
    from colltune.algorithms import comm

    issued: list = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def recording(name, fn):
        def call(*args, **kwargs):
            group = args[0][0].group if name == "batch_isend_irecv" else kwargs.get("group")
            issued.append((threading.current_thread().name, group is None or group is dist.group.WORLD,
                           api._pending == 0))
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, recording(name, fn))
    comm._all_gather_single.cache_clear()
    try:
        yield issued
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        comm._all_gather_single.cache_clear()


def _in_one_order(issued: list) -> bool:
    """Whether every collective ran on colltune's worker thread, or on the caller's while the worker was idle:
    then every rank issues them in one order."""
    return all(thread.startswith("colltune") or idle for thread, _, idle in issued)


def _hook_order(rank: int, world_size: int, cfg: dict) -> dict:
    """Record the thread and group of every collective the hook issues in compressed steps, and whether the
    worker was idle when the hook returned for the last bucket."""
    from colltune import api

    model = net(False)
    # Delayed: DDP all-reduces the bag's gradient from a hook on the embedding's, after the tower's buckets.
    delayed = {"delay_all_reduce_named_params": [("bag.weight", model.bag.weight)],
               "param_to_hook_all_reduce": model.emb.weight, "bucket_cap_mb": 0.004} if cfg.get("delay") else {}
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=cfg["find_unused"],
                                              static_graph=cfg.get("static_graph", False), **delayed)
    plain = nn.parallel.DistributedDataParallel(net(False))
    state = ColltuneHookState(model=ddp if cfg["bind"] else None, density=0.05, start_compression_iter=1,
                              algorithm=cfg["algorithm"], policy=parse_policy(KEEP_FC1_DENSE, "inline.yaml"))
    idle_after_last: list = []

    def hook(st, bucket):
        compressing = st.compressing
        fut = colltune_hook(st, bucket)
        if bucket.is_last() and compressing:
            idle_after_last.append(api._pending == 0)
        return fut

    ddp.register_comm_hook(state, hook)
    exact = []
    with contextlib.ExitStack() as stack:
        for step in range(4):
            ids, bag, y = batch(rank, step)
            plain.zero_grad()
            nn.functional.mse_loss(plain(ids, bag), y).backward()
            if step == 1:  # compressed from here on
                issued = stack.enter_context(_recorded_collectives())
            ddp.zero_grad()
            nn.functional.mse_loss(ddp(ids, bag), y).backward()
            exact.append(torch.equal(model.fc1.weight.grad, plain.module.fc1.weight.grad))
            with torch.no_grad():
                for p, q in zip(model.parameters(), plain.module.parameters()):
                    p.sub_(0.1 * q.grad)
                    q.sub_(0.1 * q.grad)
    return {"issued": issued, "idle_after_last": idle_after_last, "drains": state._ddp_collective_after,
            "drains_within": state._ddp_collective_within, "exact": exact, "compressed": sorted(state.topk_states)}


def _sync_order(rank: int, world_size: int, dense: str) -> dict:
    """An asynchronous SparseGradSync step with dense (or top-k) and sparse gradients: the threads of its
    collectives, and its gradients against a synchronous step's."""
    grads = []
    for async_op in (False, True):
        model = net(True)
        ids, bag, y = batch(rank, 0)
        nn.functional.mse_loss(model(ids, bag), y).backward()
        sync = SparseGradSync(model, dense=dense, density=0.5)
        with _recorded_collectives() if async_op else contextlib.nullcontext() as issued:  # the async step's
            sync.synchronize(async_op=async_op)
            sync.wait()
        grads.append({n: dense_grad(p) for n, p in model.named_parameters()})
    return {"issued": issued, "same": all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])}


def _hook_plans(rank: int, world_size: int) -> dict:
    """Rank 1 keeps fc1 dense, rank 0 compresses it; record each step."""
    ddp = nn.parallel.DistributedDataParallel(net(False))
    policy = parse_policy(KEEP_FC1_DENSE, "inline.yaml") if rank == 1 else None
    state = ColltuneHookState(model=ddp, density=0.05, start_compression_iter=1, policy=policy)
    ddp.register_comm_hook(state, colltune_hook)
    steps = []
    for step in range(2):
        ids, bag, y = batch(rank, step)
        steps.append(expect_error(lambda: nn.functional.mse_loss(ddp(ids, bag), y).backward()))
    alive = torch.ones(1)
    dist.all_reduce(alive)  # the group still works
    return {"steps": steps, "alive": float(alive)}


def _train(model, opt, step_fn, steps, first):
    losses = []
    for step in range(first, first + steps):
        losses.append(step_fn(model, opt, step))
    return losses


def _sync_step(rank: int):
    def step(model, opt, i):
        ids, bag, y = batch(rank, i)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(ids, bag), y)
        loss.backward()
        opt.step()  # the synchronizer runs before the step (attach)
        return float(loss)
    return step


def _sync_resume(rank: int, world_size: int, cfg: dict) -> dict:
    """Train, checkpoint, train on; then restore the checkpoint in a fresh model and train on again."""
    def build():
        model = net(True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sync = SparseGradSync(model, algorithm=cfg["algorithm"], dense="topk", density=0.05,
                              start_compression_iter=2, min_compress_numel=1, topk_algorithm=cfg["topk"],
                              policy=parse_policy(KEEP_FC1_DENSE, "inline.yaml"))
        sync.attach(opt)
        return model, opt, sync

    step = _sync_step(rank)
    model, opt, sync = build()
    _train(model, opt, step, 4, 0)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sync": sync.state_dict()}, buf)
    straight = _train(model, opt, step, 4, 4)
    straight_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    routes = sync.routes()

    model2, opt2, sync2 = build()
    ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sync2.load_state_dict(ckpt["sync"])
    resumed = _train(model2, opt2, step, 4, 4)
    same = all(torch.equal(p, straight_params[n]) for n, p in model2.named_parameters())
    return {"straight": straight, "resumed": resumed, "same": same, "routes": routes,
            "residuals": sorted(sync.topk_states)}


def _hook_resume(rank: int, world_size: int) -> dict:
    """The same for the DDP hook: its state_dict restores residuals, thresholds and the step."""
    def build():
        ddp = nn.parallel.DistributedDataParallel(net(False))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        state = ColltuneHookState(model=ddp, density=0.05, start_compression_iter=2, min_compress_numel=1,
                                  algorithm="oktopk")
        ddp.register_comm_hook(state, colltune_hook)
        return ddp, opt, state

    def step(model, opt, i):
        ids, bag, y = batch(rank, i)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(ids, bag), y)
        loss.backward()
        opt.step()
        return float(loss)

    ddp, opt, state = build()
    _train(ddp, opt, step, 4, 0)
    buf = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
    straight = _train(ddp, opt, step, 4, 4)
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}

    ddp2, opt2, state2 = build()
    ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    ddp2.module.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    state2.load_state_dict(ckpt["hook"])
    resumed = _train(ddp2, opt2, step, 4, 4)
    same = all(torch.equal(p, params[n]) for n, p in ddp2.module.named_parameters())
    return {"straight": straight, "resumed": resumed, "same": same, "iter": state2.iter,
            "has_residual": any(st.residual is not None for st in state2.topk_states.values())}


def _no_sparse(rank: int, world_size: int) -> dict:
    """A model with no sparse gradients: dense='allreduce' equals DDP; dense='skip' beside DDP changes nothing."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ref = nn.parallel.DistributedDataParallel(Tower())
    ref(x).sum().backward()
    torch.manual_seed(0)
    alone = Tower()
    alone(x).sum().backward()
    SparseGradSync(alone).synchronize()
    torch.manual_seed(0)
    model = Tower()
    model.fc1 = nn.parallel.DistributedDataParallel(model.fc1)  # DDP over part of the model
    model(x).sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    sync = SparseGradSync(model, dense="skip")
    sync.synchronize()
    return {
        "alone": all(torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7)
                     for p, q in zip(alone.parameters(), ref.module.parameters())),
        "untouched": all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters()),
        "tracked": sync.routes(),
    }


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_equals_dense_ddp(world_size):
    # Every algorithm at P = 3; at P = 2 the sparse ones (dense-like ones move the whole tensor).
    sparse = [n for n in registry.names() if registry.get(n).topk_priced_on != "tensor"]
    algos = [*registry.names(), "auto"] if world_size == 3 else sparse
    out = pool(world_size).run(_sync_vs_ddp, algos, timeout=90)
    for algo in algos:
        for name, want in out[0]["want"].items():
            got = out[0]["got"][algo][name]
            assert got is not None and want is not None, (algo, name)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (algo, name, (got - want).abs().max())
            for r in range(1, world_size):  # the same bits on every rank
                assert torch.equal(out[r]["got"][algo][name], got), (algo, name, r)
            alone = out[0]["per_table"][algo][name]  # fused (the default) gives each table its own call's bits
            assert alone is not None and torch.equal(alone.view(torch.uint8), got.view(torch.uint8)), (algo, name)
        assert all(o["coalesced"][algo] for o in out), algo
        if algo != "auto":
            assert out[0]["algorithm"][algo]["emb.weight"] == algo


def test_hook_future_shape_and_warmup():
    cfg = {"density": 0.05, "warmup": 3, "algorithm": "allgather", "steps": 5}
    out = pool(2).run(_hook_run, cfg, timeout=90)
    r0 = out[0]
    # Every Future holds a tensor of its bucket's shape and dtype.
    assert r0["shapes"] and len(r0["shapes"]) % 2 == 0
    for bucket, value in zip(r0["shapes"][0::2], r0["shapes"][1::2]):
        assert bucket == value
    # The warm-up is honoured: steps 0..2 equal DDP exactly, then compression changes the gradients.
    for step in r0["steps"][:3]:
        assert all(step["exact"].values()), step
    for step in r0["steps"][3:]:
        assert not step["exact"]["fc1.weight"], step
    assert [s["iter"] for s in r0["steps"]] == [1, 2, 3, 4, 5]
    state = pickle.loads(r0["pickled"])  # no process group inside
    assert state.process_group is None and state.iter == 5 and state.topk_states


def test_hook_rebuilt_buckets_lose_nothing():
    # Compression from the first step, small buckets: DDP's rebuild after step 0 regroups the
    # parameters, and the residuals must follow them (error feedback loses no gradient mass).
    cfg = {"density": 0.05, "warmup": 0, "algorithm": "allgather", "steps": 3, "bucket_cap_mb": 0.01}
    out = pool(2).run(_hook_run, cfg, timeout=90)
    r0 = out[0]
    assert r0["steps"][0]["keys"] != r0["steps"][-1]["keys"], "expected DDP to regroup the buckets"
    for name, got in r0["delivered"].items():
        want = r0["averaged"][name]
        assert torch.allclose(got + r0["residual"][name], want, rtol=1e-5, atol=1e-6), name


def _hook_options_change(rank: int, world_size: int) -> dict:
    """Compress every parameter, then raise min_compress_numel past them all: each bucket's routes follow."""
    model = net(False)
    plain = nn.parallel.DistributedDataParallel(net(False))
    ddp = nn.parallel.DistributedDataParallel(model)
    state = ColltuneHookState(model=ddp, density=0.05, start_compression_iter=0, min_compress_numel=1,
                              algorithm="allgather")
    ddp.register_comm_hook(state, colltune_hook)
    routes, exact = [], []
    for step in range(4):
        if step == 2:
            state.min_compress_numel = 10**9  # every parameter dense from here
        ids, bag, y = batch(rank, step)
        for m in (plain, ddp):
            m.zero_grad()
            nn.functional.mse_loss(m(ids, bag), y).backward()
        routes.append(state.decisions["emb.weight"]["route"])
        exact.append(all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.module.parameters())))
        with torch.no_grad():
            for p, q in zip(model.parameters(), plain.module.parameters()):
                p.sub_(0.1 * q.grad)
                q.sub_(0.1 * q.grad)
    return {"routes": routes, "exact": exact}


def test_hook_routes_follow_the_states_options():
    # A bucket's routes are made once per layout and options: an option changed between steps re-routes it.
    for r in pool(2).run(_hook_options_change, timeout=90):
        assert r["routes"] == ["topk", "topk", "dense", "dense"], r
        assert r["exact"] == [False, False, True, True], r  # dense: DDP's own average, bit for bit


def test_hook_plan_key_follows_a_parameters_dtype():
    # A policy matches on dtype: a parameter converted in place (the same object) gets its routes made again.
    from colltune.train import hook

    state = ColltuneHookState(density=0.05)
    param = nn.Parameter(torch.zeros(4))
    before = hook._plan_key(state, 0, [param])
    assert hook._plan_key(state, 0, [param]) == before
    param.data = param.data.half()
    assert hook._plan_key(state, 0, [param]) != before


def _sync_options_change(rank: int, world_size: int) -> list:
    """SparseGradSync's routes before and after its options change between steps."""
    model = net(True)
    sync = SparseGradSync(model, dense="topk", density=0.05, min_compress_numel=1, start_compression_iter=0)
    seen = []
    for step in range(3):
        if step == 1:
            sync.min_compress_numel = 10**9  # the dense parameters are all-reduced from here
        if step == 2:
            sync.dense = "allreduce"
        ids, bag, y = batch(rank, step)
        model.zero_grad()
        nn.functional.mse_loss(model(ids, bag), y).backward()
        sync.synchronize()
        seen.append(sync.routes()["fc1.weight"])
    return seen


def test_sync_routes_follow_its_options():
    for seen in pool(2).run(_sync_options_change, timeout=90):
        assert seen == [("topk", "auto"), ("dense", "dense"), ("dense", "dense")], seen


def test_hook_policy_keeps_parameter_dense():
    cfg = {"density": 0.05, "warmup": 1, "algorithm": "oktopk", "steps": 3, "policy": KEEP_FC1_DENSE}
    out = pool(2).run(_hook_run, cfg, timeout=90)
    for step in out[0]["steps"][1:]:
        assert step["exact"]["fc1.weight"] and step["exact"]["fc1.bias"], step  # pinned dense: exact average
        assert not step["exact"]["emb.weight"], step  # the rest is compressed


def test_sync_checkpoint_resume_and_policy():
    out = pool(2).run(_sync_resume, {"algorithm": "oktopk", "topk": "allgather"}, timeout=90)
    for r in out:
        assert r["same"], "resumed run differs from the uninterrupted one"
        assert r["resumed"] == r["straight"]
        assert r["routes"]["fc1.weight"] == ("dense", "dense")  # the policy keeps fc1 dense
        assert r["routes"]["fc2.weight"] == ("topk", "allgather")
        assert r["routes"]["emb.weight"] == ("sparse", "oktopk")
        assert "fc2.weight" in r["residuals"] and "fc1.weight" not in r["residuals"]


@pytest.mark.parametrize("find_unused, static_graph, bind, algorithm, delay", [
    (False, False, True, "allgather", False), (True, False, True, "oktopk", False),
    (True, True, True, "allgather", False), (False, False, False, "allgather", False),
    (False, False, True, "allgather", True),
])
def test_hook_issues_a_compressed_step_from_one_thread_on_one_group(find_unused, static_graph, bind, algorithm, delay):
    # NCCL asks that communicators used from several threads see their collectives in the same order on every
    # rank. In a compressed step every collective of the hook (the parts of every bucket, the one kept dense
    # included, and the plan's check) goes through colltune's private twin in one queue, none through DDP's
    # group; and where DDP issues a collective of its own
    # after the last bucket (find_unused_parameters, or no DDP model known), the hook returns from the last
    # bucket once the worker has issued the step's collectives; where it issues one between buckets (the
    # delayed all-reduce of delay_all_reduce_named_params), from every bucket.
    cfg = {"find_unused": find_unused, "static_graph": static_graph, "bind": bind, "algorithm": algorithm,
           "delay": delay}
    for r in pool(2).run(_hook_order, cfg, timeout=90):
        assert r["compressed"] and (all(r["exact"]) or not bind), r["exact"]  # fc1 pinned dense: exact average
        assert len(r["issued"]) > 6, r["issued"]
        # On the twin; from the caller's thread only while the worker is idle (the first call, a plan's check,
        # and DDP's delayed all-reduce: once per compressed step).
        on_ddp_group = [idle for _, on_ddp, idle in r["issued"] if on_ddp]
        assert on_ddp_group == [True] * (3 if delay else 0) and _in_one_order(r["issued"]), r["issued"]
        # The configuration each case pins (DDP's own post-bucket all-reduce is issued from C++, where the
        # recorder cannot see it: idle_after_last is what shows the order).
        assert r["drains"] == ((find_unused and not static_graph) or not bind)
        assert r["drains_within"] == delay
        if r["drains"]:
            assert r["idle_after_last"] == [True] * 3, r["idle_after_last"]  # the three compressed steps


@pytest.mark.parametrize("dense", ["allreduce", "topk"])
def test_an_asynchronous_sync_step_issues_its_collectives_in_one_order(dense):
    # The dense (or top-k) gradients' collectives go first, on the caller's thread, then the sparse calls are
    # queued on the worker, all on colltune's twin: the same order on every rank, and the same gradients as a
    # synchronous step.
    for r in pool(2).run(_sync_order, dense, timeout=90):
        assert r["same"]
        assert any(thread.startswith("colltune") for thread, _, _ in r["issued"]), r["issued"]
        assert not any(on_group for _, on_group, _ in r["issued"]) and _in_one_order(r["issued"]), r["issued"]


def test_hook_ranks_that_route_differently_all_raise():
    # The check runs on colltune's queue now; a rank that cannot route at all: test_sync_faults.
    for r in pool(2).run(_hook_plans, timeout=60):
        assert not r["steps"][0].raised and r["alive"] == 2.0  # the warm-up step is dense
        assert r["steps"][1].isa("RankMismatchError") and "routed their gradients differently" in r["steps"][1].message


def test_hook_checkpoint_resume():
    out = pool(2).run(_hook_resume, timeout=90)
    for r in out:
        assert r["same"] and r["resumed"] == r["straight"]
        assert r["iter"] == 8 and r["has_residual"]


def test_model_without_sparse_gradients():
    out = pool(2).run(_no_sparse, timeout=60)
    for r in out:
        assert r["alone"]
        assert r["untouched"]
        assert r["tracked"] == {"fc2.weight": ("skip", "none"), "fc2.bias": ("skip", "none")}


# --------------------------------------------------------------------------- single process


def test_local_sync_without_process_group():
    model = net(True)
    ids, bag, y = batch(0, 0)
    nn.functional.mse_loss(model(ids, bag), y).backward()
    want = {n: dense_grad(p).clone() for n, p in model.named_parameters()}
    sync = SparseGradSync(model)
    sync.synchronize()
    for n, p in model.named_parameters():
        assert torch.allclose(dense_grad(p), want[n])
    assert model.emb.weight.grad.is_coalesced() and sync.step == 1


def test_options_are_validated():
    model = net(True)
    with pytest.raises(ColltuneValueError, match="dense must be one of allreduce, topk, skip"):
        SparseGradSync(model, dense="sparse")
    with pytest.raises(ColltuneValueError, match="density must be in"):
        SparseGradSync(model, density=2.0)
    with pytest.raises(ColltuneTypeError, match="start_compression_iter must be an int"):
        ColltuneHookState(start_compression_iter=1.5)
    for flag in ("fuse", "broadcast_buffers"):
        with pytest.raises(ColltuneTypeError, match=f"{flag} must be True or False, but got str 'no'"):
            SparseGradSync(model, **{flag: "no"})
    with pytest.raises(ColltuneValueError, match="algorithm must be one of auto, allgather, oktopk"):
        ColltuneHookState(algorithm="dense")
    with pytest.raises(ColltuneValueError, match="state_dict must be a dict made by the sync"):
        SparseGradSync(model).load_state_dict(ColltuneHookState().state_dict())
    state = ColltuneHookState(density=0.02)
    clone = pickle.loads(pickle.dumps(state))
    assert clone.density == 0.02 and clone.process_group is None


def test_a_dropped_synchronizer_frees_its_model():
    # Hooks on the parameters and optimizers hold the synchronizer weakly: dropping it (without detach())
    # frees it and its model and removes its hooks, as dropping DDP does.
    import gc
    import weakref

    model = net(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = SparseGradSync(model)
    sync.attach(opt)
    sync.attach_to_backward(async_op=True)
    ids, bag, y = batch(0, 0)
    nn.functional.mse_loss(model(ids, bag), y).backward()
    opt.step()
    gone = weakref.ref(sync), weakref.ref(model.emb.weight)
    del model, opt, sync
    gc.collect()
    assert gone[0]() is None and gone[1]() is None
    # A synchronizer rebuilt for the same model and optimizer takes over; the freed one's hooks are gone.
    other = net(True)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    SparseGradSync(other).attach(opt)
    gc.collect()
    sync = SparseGradSync(other)
    sync.attach(opt)
    for _ in range(2):
        nn.functional.mse_loss(other(ids, bag), y).backward()
        opt.step()
        opt.zero_grad()
    assert sync.step == 2
    # attach_to_backward's handle keeps its synchronizer alive, as attach's does.
    third = net(True)
    handle = SparseGradSync(third).attach_to_backward()
    gc.collect()
    nn.functional.mse_loss(third(ids, bag), y).backward()
    assert third.emb.weight.grad.is_coalesced()  # it synchronized: the result comes back coalesced
    handle.remove()



@pytest.mark.parametrize("as_view,to_none", [(False, True), (False, False), (True, True), (True, False)])
def test_hook_keeps_the_error_feedback_of_a_parameter_no_rank_used(as_view, to_none):
    """DDP keeps no result for a parameter no rank used (its gradient stays ``None``, or as it was; as a
    bucket view it receives the result): what top-k selected there goes back to the residuals, not lost."""
    for apart in pool(2).run(unused_layer_run, "cpu", as_view, to_none):
        assert max(apart) < 1e-5, apart


def _joined_run(rank: int, world_size: int, algorithm: str, unused: bool) -> dict:
    """Uneven inputs under DDP's ``join``: rank r trains 3 + 2r steps with the hook compressing from the first.

    Returns the replicas' largest difference, and per parameter how far the
    ranks' fed-in gradients (each rank's own, computed apart, zero for a
    rank that has joined) are from what the last rank (never joined)
    delivered times P plus the residuals every rank holds, in float64.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 1))
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
    state = ColltuneHookState(model=ddp, density=0.05, start_compression_iter=0, min_compress_numel=1,
                              algorithm=algorithm)
    ddp.register_comm_hook(state, colltune_hook)
    fed = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}
    delivered = {n: torch.zeros_like(f) for n, f in fed.items()}
    g = torch.Generator().manual_seed(rank)
    with ddp.join():
        for _ in range(3 + 2 * rank):
            x = torch.randn(8, 24, generator=g)
            alone = nn.Sequential(nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 1))
            alone.load_state_dict(model.state_dict())
            alone(x).sum().backward()
            for n, p in alone.named_parameters():
                fed[n] += p.grad.double().reshape(-1)
            ddp.zero_grad(set_to_none=True)
            ddp(x).sum().backward()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    delivered[n] += p.grad.double().reshape(-1)
                    p -= 0.01 * p.grad
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(replicas, flat)
    held = {}  # per top-k state (a bucket part: its parameters' names joined by "|"), every rank's residual
    for key in sorted(state.topk_states):  # the same states on every rank: the buckets are alike
        residual = state.topk_states[key].residual
        held[key] = SimpleNamespace(residual=None if residual is None else residual.double())
        if residual is not None:
            dist.all_reduce(held[key].residual)
    for n in fed:
        dist.all_reduce(fed[n])
        if rank != world_size - 1:
            delivered[n].zero_()
        dist.all_reduce(delivered[n])  # the last rank's deliveries: it stepped in every step of the run
    return {"replicas": float(max((r - replicas[0]).abs().max() for r in replicas)), "fed": fed,
            "delivered": delivered, "held": held}


@pytest.mark.parametrize("algorithm,unused", [("allgather", False), ("oktopk", True)])
def test_hook_trains_uneven_inputs_under_join(algorithm, unused):
    """Under ``ddp.join()`` a rank that ran out of inputs shadows the others' steps with zeros through the
    hook: no hang, the replicas stay equal, and top-k's error feedback holds over every rank."""
    from harness import import_tool

    train_soak = import_tool("train_soak")
    for r in pool(3).run(_joined_run, algorithm, unused, timeout=120):
        assert r["replicas"] == 0.0, r
        held = train_soak.residuals(r["held"], {n: f.numel() for n, f in r["fed"].items()})
        for n, fed in r["fed"].items():
            residual = held[n].residual if n in held else torch.zeros_like(fed)
            assert float((fed - 3 * r["delivered"][n] - residual).abs().max()) < 1e-5, n


@pytest.mark.parametrize("cfg", [
    {"mode": "attach"},
    {"mode": "synchronize", "ddp": True},
    {"mode": "async", "ddp": True},
    {"mode": "async", "first": 0},  # rank 0 has no batch: it shadows in the mode attach_to_backward set
    # ... or synchronously, where the mode does not order the step's collectives (only tables in the synchronizer)
    {"mode": "synchronize-async", "ddp": True, "frozen_head": True, "first": 0},
    {"mode": "attach", "ddp": True, "own_buffers": True},
    {"mode": "attach", "ddp": True, "micro": 2},  # accumulation under no_sync: DDP's forwards outnumber the steps
], ids=lambda cfg: "-".join(f"{k}={v}" for k, v in cfg.items()))
def test_sync_trains_uneven_inputs_under_join(cfg):
    """``Join([sync])`` (or ``Join([ddp_tower, sync])``): a rank out of batches shadows the others' steps; the
    model trains as the average over the group of what the ranks still training computed, the replicas end
    equal (the last rank's model, buffers and frozen parameters too; a DDP submodule's as DDP leaves them), and
    a joined rank's own gradients are left as they were."""
    for r in pool(3).run(joined_sync_run, cfg, timeout=120):
        assert r["replicas"] == 0.0 and r["kept"] and r["steps"] == cfg.get("first", 3) + 4, r
        assert r["from_ref"] < 1e-5, r
        # The buffers: the last rank's (its steps, each adding P), or each rank's own; DDP's left as DDP leaves them.
        own = (r["rank"] + 1) * (cfg.get("first", 3) + 2 * r["rank"])
        assert r["seen"] == (own if cfg.get("own_buffers") else 3 * r["steps"]), r
        assert r["mine"] == (r["rank"] if cfg.get("ddp") else None), r


def test_sync_with_top_k_trains_uneven_inputs_under_join():
    """Top-k under ``Join``: a joined rank still sends what its residual selects; the replicas end equal."""
    for r in pool(3).run(joined_sync_run, {"mode": "attach", "ddp": True, "dense": "topk"}, timeout=120):
        assert r["replicas"] == 0.0 and r["kept"] and r["steps"] == 7, r


def _join_misordered(rank: int, world_size: int, order: str) -> object:
    from torch.distributed.algorithms.join import Join

    model = net(True)
    model.fc1 = nn.parallel.DistributedDataParallel(model.fc1)
    if order == "two ddps":
        model.fc2 = nn.parallel.DistributedDataParallel(model.fc2)
    sync = SparseGradSync(model)
    joinables = {"sync first": [sync, model.fc1], "no ddp": [sync], "two ddps": [model.fc1, model.fc2, sync]}[order]
    return expect_error(lambda: Join(joinables))


@pytest.mark.parametrize("order", ["sync first", "no ddp", "two ddps"])
def test_join_without_ddp_first_is_refused(order):
    """A DDP submodule listed after the synchronizer, or left out, would shadow in another order: refused. So
    would two (torch's join context crashes gloo on them, with or without the synchronizer)."""
    expected = "one DDP" if order == "two ddps" else "Join([model.mlp, sync])"
    for r in pool(2).run(_join_misordered, order):
        assert r.type == "ColltuneValueError" and expected in r.message, r


def _join_dividing_by_the_active(rank: int, world_size: int) -> object:
    from torch.distributed.algorithms.join import Join

    sync = SparseGradSync(net(True))
    return expect_error(lambda: Join([sync], divide_by_initial_world_size=False))


def test_join_asking_to_divide_by_the_active_ranks_is_refused():
    for r in pool(2).run(_join_dividing_by_the_active):
        assert r.type == "ColltuneValueError" and "divide_by_initial_world_size" in r.message, r
