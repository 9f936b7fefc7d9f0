"""Soak the training wrapper: many steps of an embedding model under ``SparseGradSync``, every step checked.

Every rank trains the same model (``EmbeddingBag(sparse=True)`` tables of
1 to 60,000 rows and widths 4 to 32, an MLP on top, SGD) for ``--steps``
steps. Each step every rank draws its own batch from its own generator:
bags of 0 to 4 ids per table, half of the steps crowded into a hot range
(the ranks' rows overlap), and now and then a table a rank does not use
at all (its gradient is ``None`` there, zero for the average). The
synchronizer averages the gradients after backward, a third of the steps
asynchronously (``synchronize(async_op=True)``, then ``wait()``); with
``--hook attach`` it runs at the optimizer's step (``attach``), with
``--hook backward`` at the end of every backward, asynchronously
(``attach_to_backward(async_op=True)``), the optimizer's step waiting.

Rank 0 also draws every other rank's batches (each rank's generator is
seeded from the seed and the rank) and, at the step's parameters, runs
each rank's backward again on a copy of the model: the same float32 ops
on the same inputs, so the same gradients each rank had. Their float64
average is the reference each averaged gradient is checked against, as
the optimizer is about to apply it (a step pre-hook): a
sparse one must hold exactly the rows the ranks' bags name (``None`` when
they name none), and every value must lie within ``TOL`` (1e-5, the
random-calls suite's bound for fp32) of the ranks' summed magnitudes
divided by P. On an asynchronous step rank 0 computes the reference while
the reduction runs. Every ``--every`` steps and after the last, the ranks
compare a hash of their parameters bit for bit.

The run's options: ``--algorithm`` for the sparse gradients (``auto`` or a
registered one), ``--no-fuse`` (one call per gradient, not one fused
call), ``--dense`` (``allreduce`` is checked value by value; ``topk``
compresses the MLP's weights with error feedback, from the sixth step).
``--uneven G`` gives the ranks uneven inputs: rank q trains ``G`` q steps
fewer than rank 0, under ``torch.distributed.algorithms.join.Join`` (the
synchronizer, or the DDP model), so the ranks that ran out shadow the
others' steps; the references average what the ranks still training
computed over P, the synchronizer's steps are all synchronous or all
asynchronous (a joined rank shadows in its last mode), a table goes unused
on any rank under DDP only before the first rank joins (the DDP hook
cannot give back what a joined rank sent to a table no rank still
training used), and the parameters are compared and
the error feedback checked once, after every rank has joined.
``--hook ddp`` trains the model with dense tables under
``DistributedDataParallel`` (0.25 MB buckets, ``find_unused_parameters``,
density 0.002, so that the tables' parts hold residuals)
with ``colltune_hook`` instead of the synchronizer: its first 5 steps go
dense and are checked value by value, then ``--algorithm`` compresses
every bucket part of 256 elements or more. A fifth of its steps, one
table goes unused on every rank (DDP then keeps no result for it).

Top-k's error feedback is checked over the run as ``tools/soak.py``
checks it (:class:`soak.Conservation`), per parameter: every ``--every``
steps the float64 sum of every rank's gradients so far must equal what
the wrapper delivered (times P) plus the residuals the ranks hold, taken
out of the wrapper's top-k states parameter by parameter. It covers
every MLP parameter under ``--dense topk`` and every parameter under
``--hook ddp``, whichever route each takes. The exit status is 1 if any
gradient was wrong, any parameter's error feedback broke, or any step's
parameters differed across ranks.

Usage::

    python tools/train_soak.py                                   # P = 3, 300 steps
    python tools/train_soak.py --ranks 4 --steps 1000 --algorithm oktopk --no-fuse
    python tools/train_soak.py --ranks 2 --steps 500 --dense topk --device-path
    python tools/train_soak.py --ranks 3 --hook backward
    python tools/train_soak.py --ranks 3 --hook ddp --algorithm oktopk
    python tools/train_soak.py --ranks 3 --uneven 20 --dense topk --hook backward
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

_TOOLS = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_TOOLS), _TOOLS):  # the repository, and tools/ (its sibling soak.py)
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from soak import Conservation, digest, input_generators  # noqa: E402  (its sibling in tools/)
from torch import nn  # noqa: E402
from torch.distributed.algorithms.join import Join  # noqa: E402

from colltune.offline import launch  # noqa: E402

#: The embedding tables: rows and width. A table of one row, tables of one size, and one of 60,000 rows.
TABLES: tuple[tuple[int, int], ...] = ((1, 4), (50, 8), (1000, 16), (1000, 16), (20_000, 8), (60_000, 32))
#: Samples per rank and step, most ids in a bag, and the dense features per sample.
BATCH, MAX_BAG, DENSE_IN = 24, 4, 4
#: How the synchronizer runs: ``synchronize()`` after backward (a third of the steps asynchronous, then
#: ``wait()``), ``attach(optimizer)`` (at the optimizer's step), ``attach_to_backward(async_op=True)``.
HOOKS = ("none", "attach", "backward", "ddp")
#: A value's largest error against the float64 average, relative to the ranks' summed magnitudes over P.
TOL = 1e-5
#: Steps the wrappers reduce dense before their top-k compresses (checked value by value under DDP).
WARMUP = 5


class Model(nn.Module):
    """Embedding tables (bags summed) and dense features into a small MLP: one output per sample. The tables'
    gradients are sparse, or dense with ``sparse=False`` (what DDP's communication hooks take)."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.sparse = sparse
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, w, mode="sum", sparse=sparse) for n, w in TABLES)
        self.mlp = nn.Sequential(nn.Linear(sum(w for _, w in TABLES) + DENSE_IN, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        parts = []
        for t, (table, (_, width)) in enumerate(zip(self.tables, TABLES)):
            bag = batch["bags"][t]
            # A table the batch leaves out takes no part: its gradient stays None on this rank.
            parts.append(table(*bag) if bag is not None else torch.zeros(BATCH, width))
        return self.mlp(torch.cat([*parts, batch["dense"]], dim=1)).squeeze(1)


def draw_batch(g: torch.Generator, hot: bool, unused_share: float = 0.08) -> dict[str, Any]:
    """One rank's batch: per table, bags of 0 to ``MAX_BAG`` ids (``None`` in ``unused_share`` of the draws: the
    table unused)."""
    bags: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for n, _ in TABLES:
        lengths = torch.randint(0, MAX_BAG + 1, (BATCH,), generator=g)
        ids = torch.randint(0, min(n, 64) if hot else n, (int(lengths.sum()),), generator=g)
        unused = float(torch.rand((), generator=g)) < unused_share
        bags.append(None if unused else (ids, torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]))))
    return {"bags": bags, "dense": torch.randn(BATCH, DENSE_IN, generator=g), "y": torch.randn(BATCH, generator=g)}


def loss_of(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The batch's mean squared error."""
    return ((model(batch) - batch["y"]) ** 2).mean()


#: Per parameter: the float64 average of the ranks' gradients, their summed magnitudes over P, and for a
#: table the rows the ranks' bags name (for an MLP parameter, whether some rank had a gradient).
Reference = dict[str, tuple[torch.Tensor, torch.Tensor, "set[int] | bool"]]


def reference(model: nn.Module, batches: list[dict[str, Any]], world_size: int | None = None) -> Reference:
    """Each rank's gradient (``batches``, in rank order) at ``model``'s parameters, on a fresh copy of them
    (not of the gradients, which an asynchronous synchronization may still be reducing), averaged over
    ``world_size`` (by default one per batch: the ranks that have joined add none)."""
    copy_ = Model(model.sparse)
    copy_.load_state_dict(model.state_dict())
    sums: dict[str, list[Any]] = {}
    for batch in batches:
        copy_.zero_grad(set_to_none=True)
        loss_of(copy_, batch).backward()
        for name, param in copy_.named_parameters():
            total, mags, some = sums.setdefault(name, [torch.zeros(param.shape, dtype=torch.float64),
                                                       torch.zeros(param.shape, dtype=torch.float64), False])
            if param.grad is not None:
                dense = (param.grad.to_dense() if param.grad.is_sparse else param.grad).double()
                sums[name] = [total + dense, mags + dense.abs(), True]
    p = world_size or len(batches)
    out: Reference = {name: (total / p, mags / p, some) for name, (total, mags, some) in sums.items()}
    for t, _ in enumerate(TABLES if model.sparse else ()):  # a sparse result holds exactly the rows some rank's bags name
        name = f"tables.{t}.weight"
        avg, mags, _ = out[name]
        out[name] = (avg, mags, {i for b in batches if b["bags"][t] is not None for i in b["bags"][t][0].tolist()})
    return out


def wrong(model: nn.Module, ref: Reference, dense_checked: bool, none_is_zero: bool = False) -> list[str]:
    """Say how each averaged gradient of ``model`` is off its reference (empty: all right). With
    ``none_is_zero`` (DDP, which hands every parameter a gradient) a zero gradient stands for no rank's."""
    out = []
    for name, param in model.named_parameters():
        avg, mags, some = ref[name]
        grad = param.grad
        if name.startswith("mlp.") and not dense_checked:
            continue
        if none_is_zero:
            grad, some = torch.zeros_like(param) if grad is None else grad, True
        if grad is None:
            if some:
                out.append(f"{name}: no gradient, but some rank had one" if some is True else
                           f"{name}: no gradient, but the ranks' bags name {len(some)} rows")
            continue
        if not some:
            out.append(f"{name}: a gradient, but no rank had one" if some is False else
                       f"{name}: a gradient, but the ranks' bags name no row")
            continue
        if grad.is_sparse:
            rows = set(grad.coalesce().indices()[0].tolist())
            if rows != some:
                out.append(f"{name}: rows {sorted(some - rows)[:5]} missing, {sorted(rows - some)[:5]} extra")
        got = (grad.to_dense() if grad.is_sparse else grad).double()
        err = (got - avg).abs()
        off = ~(err <= TOL * mags + 1e-30)
        if bool(off.any()):
            out.append(f"{name}: {int(off.sum())} values off the average (largest error {float(err.max()):.3g})")
    return out


def residuals(topk_states: dict[str, Any], numels: dict[str, int]) -> dict[str, SimpleNamespace]:
    """Each parameter's residual out of a training wrapper's top-k states, keyed by their parameters' names
    (joined by ``|`` in the layout's order, for a part of a DDP bucket). A parameter two states hold is summed
    (a residual kept twice: the ledger then breaks, as it should)."""
    out: dict[str, SimpleNamespace] = {}
    for key, st in topk_states.items():
        if st.residual is not None:
            names = key.split("|")
            if any(n not in numels for n in names) or sum(numels[n] for n in names) != st.residual.numel():
                raise ValueError(f"top-k state {key!r}: its residual ({st.residual.numel()} elements) is not its "
                                 "parameters' (by name) laid end to end; give the hook the model (model=ddp)")
            for name, piece in zip(names, torch.split(st.residual.reshape(-1), [numels[n] for n in names])):
                held = out.setdefault(name, SimpleNamespace(residual=torch.zeros(numels[name], dtype=piece.dtype)))
                held.residual = held.residual + piece
    return out


def _wrap(model: Model, cfg: dict[str, Any]) -> tuple[nn.Module, Any, list[str]]:
    """Put ``model`` under the run's wrapper; return what computes the loss, the wrapper (its ``topk_states``
    hold the residuals) and the parameters its top-k may compress (checked by the ledger)."""
    from colltune.train import ColltuneHookState, SparseGradSync, colltune_hook

    if cfg["hook"] == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.25)
        state = ColltuneHookState(model=ddp, density=0.002, start_compression_iter=WARMUP, min_compress_numel=256,
                                  algorithm=cfg["algorithm"])
        ddp.register_comm_hook(state, colltune_hook)
        return ddp, state, [n for n, _ in model.named_parameters()]
    sync = SparseGradSync(model, algorithm=cfg["algorithm"], dense=cfg["dense"], fuse=cfg["fuse"],
                          start_compression_iter=WARMUP, min_compress_numel=256)
    return model, sync, [n for n, _ in model.named_parameters() if n.startswith("mlp.") and cfg["dense"] == "topk"]


def _rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from colltune.algorithms.sparse import device_path

    torch.set_num_threads(1)
    with device_path(cfg["device_path"]):
        torch.manual_seed(cfg["seed"])  # the same model on every rank (the wrappers also broadcast it)
        model = Model(sparse=cfg["hook"] != "ddp")
        net, wrapper, compressed = _wrap(model, cfg)
        numels = {n: p.numel() for n, p in model.named_parameters()}
        ledger = Conservation(spec=lambda name: (numels[name], torch.float32))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gens = input_generators(cfg["seed"], rank, world_size)
        plan = torch.Generator().manual_seed(cfg["seed"])  # what every rank does alike
        errors: list[dict[str, Any]] = []
        mismatches: list[int] = []
        broken: list[dict[str, Any]] = []
        asynchronous = compared = 0
        pending: dict[str, Any] = {}  # the step's reference, until the optimizer steps
        checked: list[int] = []  # the steps rank 0 checked

        def check(optimizer: Any, args: Any, kwargs: Any) -> None:
            """Check the step's gradients as the optimizer is about to apply them (after the synchronizer's
            own pre-hooks, registered first: they synchronize or wait)."""
            ref = pending.pop("ref", None)
            if ref is None:
                return
            checked.append(step := pending["step"])
            if cfg["hook"] == "ddp":  # every gradient while DDP's buckets go dense, then the ledger alone
                whys = wrong(model, ref, True, none_is_zero=True) if step < WARMUP else []
            else:
                whys = wrong(model, ref, cfg["dense"] == "allreduce")
            errors.extend({"step": step, "why": why} for why in whys)
            for name, param in model.named_parameters():
                if name in compressed:
                    avg, mags, _ = ref[name]
                    ledger.feed_sums(name, (avg * world_size).reshape(-1), (mags * world_size).reshape(-1), world_size)
                    ledger.deliver(name, torch.zeros_like(param) if param.grad is None else param.grad, "avg")

        if cfg["hook"] == "attach":
            wrapper.attach(opt)
        elif cfg["hook"] == "backward":
            wrapper.attach_to_backward(async_op=True)
        opt.register_step_pre_hook(check)
        start = time.perf_counter()
        uneven = cfg.get("uneven", 0)

        def steps_of(q: int) -> int:
            """The steps rank ``q`` trains: ``uneven`` q fewer than rank 0."""
            return cfg["steps"] - uneven * q

        def checkpoint(step: int) -> int:
            """Compare the ranks' parameters and check the error feedback (collectives on every rank)."""
            _compare(model, world_size, step, mismatches)
            broken.extend({"step": step, "why": why}
                          for why in ledger.check(compressed, residuals(wrapper.topk_states, numels), rank))
            return 1

        last_even = steps_of(world_size - 1)  # the steps every rank trains
        joined = Join([net if cfg["hook"] == "ddp" else wrapper]) if uneven else contextlib.nullcontext()
        with joined:
            for step in range(steps_of(rank)):
                hot, async_op = (bool(float(x) < y) for x, y in zip(torch.rand(2, generator=plan), (0.5, 1 / 3)))
                async_op = async_op and not uneven  # a joined rank shadows in one mode
                # Under DDP, once a rank has joined, the ranks still training use every table: one no active rank
                # used would be one the joined ranks' top-k sent to and cannot give back (colltune.train.hook).
                share = 0.0 if cfg["hook"] == "ddp" and step >= last_even else 0.08
                batches = {q: draw_batch(g, hot, share) for q, g in gens.items() if step < steps_of(q)}
                if cfg["hook"] == "ddp" and float(torch.rand((), generator=plan)) < 0.2 and step < last_even:
                    # A table no rank uses this step (DDP then keeps no result for it, which the hook must not lose).
                    skipped = int(torch.randint(len(TABLES), (), generator=plan))
                    for batch in batches.values():
                        batch["bags"][skipped] = None
                opt.zero_grad(set_to_none=True)
                loss_of(net, batches[rank]).backward()
                explicit = cfg["hook"] == "none"
                if explicit:
                    wrapper.synchronize(async_op=async_op)
                # Rank 0's reference runs while an asynchronous reduction does (the parameters stay as they are).
                pending.update(step=step, ref=reference(model, [batches[q] for q in sorted(batches)], world_size)
                               if rank == 0 else None)
                if explicit and async_op:
                    wrapper.wait()
                asynchronous += cfg["hook"] == "backward" or (explicit and async_op)
                opt.step()
                if not uneven and ((step + 1) % cfg["every"] == 0 or step + 1 == cfg["steps"]):
                    compared += checkpoint(step)
        if uneven:  # every rank has joined: the collectives of the checks line up again
            compared += checkpoint(cfg["steps"] - 1)
        routes = (sorted({d["route"] for d in wrapper.decisions.values()}) if cfg["hook"] == "ddp"
                  else sorted({r[0] for r in wrapper.routes().values()}))
        return {"wrong": errors, "mismatches": mismatches, "asynchronous": asynchronous, "compared": compared,
                "checked": len(checked), "ledger": len(compressed), "broken": broken, "worst": ledger.worst,
                "seconds": time.perf_counter() - start, "routes": routes}


def _compare(model: nn.Module, world_size: int, step: int, mismatches: list[int]) -> None:
    """Compare the ranks' parameters bit for bit (a collective); note ``step`` in ``mismatches`` if they differ."""
    digests: list[Any] = [None] * world_size
    dist.all_gather_object(digests, digest("", *model.parameters()))
    if len(set(digests)) > 1:
        mismatches.append(step)


def run(world_size: int, steps: int, every: int, seed: int, algorithm: str = "auto", dense: str = "allreduce",
        fuse: bool = True, device_path: bool = False, hook: str = "none", uneven: int = 0) -> dict[str, Any]:
    """Run the soak on fresh local ranks and return rank 0's report (see the module docstring)."""
    cfg = {"steps": steps, "every": every, "seed": seed, "algorithm": algorithm, "dense": dense, "fuse": fuse,
           "device_path": device_path, "hook": hook, "uneven": uneven}
    out = launch.run_local(_rank, world_size, cfg, backend="gloo", timeout=3600)[0]
    return {"world_size": world_size, **cfg, **out}


def main(argv: list[str] | None = None) -> int:
    from colltune.train.common import sparse_algorithms, topk_algorithms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", "-P", type=int, default=3, help="local gloo ranks (default 3)")
    ap.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    ap.add_argument("--every", type=int, default=25, help="compare the parameters every this many steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--algorithm", choices=sparse_algorithms(), default="auto", help="for the sparse gradients")
    ap.add_argument("--dense", choices=("allreduce", "topk"), default="allreduce", help="for the MLP's gradients")
    ap.add_argument("--no-fuse", action="store_true", help="one call per sparse gradient, not one fused call")
    ap.add_argument("--hook", choices=HOOKS, default="none",
                    help="how the synchronizer runs: none (synchronize() after backward), attach (at the "
                         "optimizer's step), backward (attach_to_backward, asynchronous); ddp: no synchronizer, "
                         "DDP with colltune_hook (dense tables; --algorithm then compresses its buckets)")
    ap.add_argument("--device-path", action="store_true",
                    help="send the CPU tensors down the code path CUDA tensors take")
    ap.add_argument("--uneven", type=int, default=0, metavar="G",
                    help="rank q trains G*q steps fewer than rank 0, under Join (default 0: even)")
    args = ap.parse_args(argv)
    if args.ranks < 2 or args.steps < 1 or args.every < 1:
        ap.error("need --ranks >= 2, --steps >= 1 and --every >= 1")
    if args.uneven < 0 or args.uneven * (args.ranks - 1) >= args.steps:
        ap.error("--uneven G must leave the last rank a step: 0 <= G * (ranks - 1) < steps")
    if args.hook == "ddp" and args.algorithm not in topk_algorithms():
        ap.error(f"--hook ddp compresses with one of {', '.join(topk_algorithms())}, not {args.algorithm!r}")
    r = run(args.ranks, args.steps, args.every, args.seed, args.algorithm, args.dense, not args.no_fuse,
            args.device_path, args.hook, args.uneven)
    path = "device" if r["device_path"] else "host"
    what = (f"DDP with colltune_hook, top-k {r['algorithm']}" if r["hook"] == "ddp" else
            f"sparse {r['algorithm']}{'' if r['fuse'] else ', not fused'}, dense {r['dense']}, hook {r['hook']}")
    if r["uneven"]:
        what += f"; rank q {r['uneven']} q steps fewer, under Join"
    print(f"P={r['world_size']}, {r['steps']} steps (seed {r['seed']}, the {path} path, {what}), {r['seconds']:.0f} s; "
          f"{r['asynchronous']} asynchronous; routes {', '.join(r['routes'])}")
    if r["hook"] == "ddp":
        checked = f"every gradient of the first {WARMUP} steps (DDP's dense warm-up)"
    else:
        checked = "every gradient" if r["dense"] == "allreduce" else "the sparse gradients"
    print(f"{checked} checked against the float64 average on {r['checked']} steps: {len(r['wrong'])} wrong")
    for w in r["wrong"][:10]:
        print(f"  step {w['step']}: {w['why']}")
    if r["ledger"]:
        when = "after every rank joined" if r["uneven"] else f"every {r['every']} steps"
        print(f"error feedback of {r['ledger']} parameters checked {when} (fed = delivered + "
              f"held): {len(r['broken'])} broken; largest error {r['worst']:.2f} of its bound")
        for b in r["broken"][:10]:
            print(f"  step {b['step']}: {b['why']}")
    when = "after every rank joined" if r["uneven"] else f"every {r['every']} steps and at the end"
    print(f"parameters compared bit for bit {r['compared']} times ({when}): "
          f"{len(r['mismatches'])} differed")
    return 1 if r["wrong"] or r["broken"] or r["mismatches"] or r["checked"] != r["steps"] else 0


if __name__ == "__main__":
    sys.exit(main())
