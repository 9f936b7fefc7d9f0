"""DLRM-style example and benchmark: 26 sparse embedding tables, data-parallel on P ranks.

The model is DLRM's (Naumov et al., 2019) on Criteo-like data: 13 dense
features go through a bottom MLP (``--bot-mlp``, 512-256-64 and then
``--dim``), 26 categorical features each look up their own
``nn.EmbeddingBag(sparse=True)`` table (``--dim`` 16 by default, or 64),
the 27 vectors interact by pairwise dot products, and a top MLP
(``--top-mlp``, 512-256 and then 1) gives the click logit (BCE loss).

The tables have the sizes of the Criteo Kaggle data set's 26 fields (3 to
10.1M values), capped at ``--max-rows`` (4.5M by default, as DLRM's
``--max-ind-range`` hashes them): 20.8M rows in all, 1.33 GB of fp32 per rank
at ``--dim 16`` (``--scale`` shrinks every table, e.g. for tests). The data
is generated on each rank, deterministically from the seed, the rank and
the step: ids are Zipf-distributed within a table (``--zipf``) and hashed
into it; most fields are present in every sample (every sample hits the
tiny tables, and all their rows), some are missing in part of the samples
and three in all but a few percent (few samples hit them); labels come
from a fixed hidden logistic model of the ids and the dense features.

Four ways to synchronize the gradients (``--mode``; the data, the seeds and
the initial weights are the same for all, so the losses agree up to float
rounding), and two baselines that do not synchronize:

``none``                no synchronization: every rank trains its own copy (what a step costs without any)
``none+fused-call``     ``none``, plus one ``colltune.sparse_allreduce_many`` over the embedding gradients
                        after backward, its result unused: what the fused call adds to a step; at P = 1
                        (no other rank to exchange with or wait for) the fused call's own local cost
``ddp-dense``           DDP over the whole model, dense embedding gradients (a 1.33 GB allreduce per step)
``ddp-sparse``          DDP over the whole model, sparse embedding gradients (gloo's sparse allreduce, per table)
``colltune-per-table``  DDP over the MLPs only; ``colltune.train.SparseGradSync`` (``fuse=False`` where it has
                        the option): one ``colltune.sparse_allreduce`` per table, before ``optimizer.step()``
``colltune-fused``      DDP over the MLPs only; every table's gradient in one ``colltune.sparse_allreduce_many``
                        (``SparseGradSync(fuse=True)`` where it has the option, else this tool's own
                        optimizer hook around ``sparse_allreduce_many``)

Every run prints per mode the loss, the step time, the time of the sparse
gradients' synchronization alone (colltune modes: the synchronizer's call;
DDP modes: the time a collective of an embedding gradient was in flight,
from a timing comm hook that runs DDP's own ``allreduce_hook``), the bytes
this rank sent per step and the algorithm per table or bucket.

``--bench`` runs ``ddp-sparse``, ``colltune-per-table`` and ``colltune-fused``
side by side in the same ranks, one step of each in turn, ``--repeats``
times, then ``ddp-dense`` for ``--dense-steps`` steps on its own (its
dense gradient, bucket and backward temporaries, about 3 x 1.33 GB per
rank, do not fit beside three copies of the model at P=4 in 24 GiB;
``--dense-steps 0`` skips it). It prints the median
step and sync times, the speed-up of ``colltune-fused`` over the faster
DDP mode, the ratio of per-table to fused sync time, and the largest loss
gap between the modes (``--json`` writes everything). A step is timed on
every rank from ``zero_grad`` to the end of ``optimizer.step()`` after a
barrier and counts as long as its slowest rank.

Optimizer: plain SGD (no per-row state), so memory is the weights plus
the gradients: sparse gradients are small, ``ddp-dense``'s are as large as
the tables.

Usage::

    python tools/dlrm.py --ranks 4 --mode colltune-fused               # P local gloo ranks
    python tools/dlrm.py --ranks 4 --bench --steps 20 --repeats 3
    torchrun --nproc-per-node 4 tools/dlrm.py --mode colltune-fused    # the same code under torchrun

On GPUs (``--device cuda``) the model, the tables, the batches and the
gradients live on ``cuda:<local rank % GPUs>``, and every step (and every
synchronizer call) is timed between ``torch.cuda.synchronize()`` calls; the
DDP modes' sync time comes from CUDA events around the embedding buckets'
collectives. The backend (``--backend``) is NCCL when every rank on the
machine has a GPU of its own, else gloo with the ranks sharing the GPUs (a
note says so; for testing). ``--bench`` on GPUs also interleaves ``none``
and ``none+fused-call``. Modes NCCL cannot run are skipped with a line
saying why (``ddp-sparse``: DDP cannot reduce sparse gradients on NCCL)::

    torchrun --nproc-per-node 8 tools/dlrm.py --device cuda --bench --steps 20 --repeats 3   # NCCL, a GPU per rank
    python tools/dlrm.py --ranks 1 --device cuda --mode none none+fused-call colltune-fused  # one GPU
    python tools/dlrm.py --ranks 4 --device cuda --bench --scale 0.1   # on one GPU: 4 ranks share it over gloo

Bytes sent: colltune's own counters for its calls; for DDP, the textbook
volume of what it runs (ring allreduce ``2 L (P-1)/P``; gloo's sparse
allreduce gathers every rank's entries: ``(P-1)`` times the local coalesced
``nnz x (8 + row bytes)`` per table).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import resource
import statistics
import sys
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

import colltune  # noqa: E402
from colltune.offline.launch import in_torchrun, run_here, run_local  # noqa: E402
from colltune.train import SparseGradSync, sparse_parameters  # noqa: E402

MODES = ("ddp-dense", "ddp-sparse", "colltune-per-table", "colltune-fused", "none", "none+fused-call")
DDP_MODES = ("ddp-dense", "ddp-sparse")
#: The baselines that leave the gradients alone (their losses are compared only with each other at P > 1).
UNSYNCED_MODES = ("none", "none+fused-call")
#: What ``--bench`` interleaves step by step; ``ddp-dense`` runs after them, alone (memory).
BENCH_MODES = ("ddp-sparse", "colltune-per-table", "colltune-fused")
#: What ``--bench --device cuda`` interleaves: the baselines too.
GPU_BENCH_MODES = ("none", "none+fused-call", *BENCH_MODES)
#: Modes NCCL cannot run, and why (they are skipped with this line).
NCCL_SKIPS = {"ddp-sparse": "DDP cannot reduce sparse gradients on NCCL (NCCL has no sparse allreduce; "
                            "run it with --backend gloo)"}

#: Rows of the 26 categorical fields of the Criteo Kaggle display-advertising data set (DLRM's counts).
CRITEO_KAGGLE_ROWS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
#: Share of the samples in which a field has a value (the others look up nothing in that table).
PRESENCE = (
    1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.02, 1.0, 1.0, 1.0,
    1.0, 1.0, 1.0, 1.0, 1.0, 0.56, 0.56, 0.56, 0.56, 0.56, 0.01, 0.56, 0.05,
)
_HASH_MUL = 2654435761  # a prime: id -> (id * _HASH_MUL + b) mod rows is a bijection of every table


def table_rows(max_rows: int, scale: float) -> list[int]:
    """Rows per table: Criteo Kaggle's counts capped at ``max_rows``, times ``scale`` (tables of <= 32 rows stay)."""
    return [max(min(n, 32), int(round(min(n, max_rows) * scale))) for n in CRITEO_KAGGLE_ROWS]


# --------------------------------------------------------------------------- data


class DLRMData:
    """Synthetic Criteo-like samples: 13 dense features, one Zipf id per present field, hidden-model labels.

    ``batch(rank, step)`` depends only on the seed, the rank and the step, so
    every mode trains on exactly the same samples. Nothing per row is stored:
    the Zipf draw is the continuous inverse CDF, hashing and the hidden
    model's weights are arithmetic on the id.
    """

    def __init__(self, rows: list[int], zipf: float, seed: int) -> None:
        self.rows, self.zipf, self.seed = rows, zipf, seed
        rng = np.random.default_rng(seed)
        self.hash_add = rng.integers(0, 2**31, len(rows))
        self.dense_w = rng.normal(0.0, 1.0, 13).astype(np.float32)
        self.bias = -1.2  # about a quarter clicks

    def _zipf(self, rng: np.random.Generator, n: int, rows: int) -> np.ndarray:
        """``n`` Zipf ranks in ``[0, rows)`` (continuous inverse CDF of ``k ** -zipf`` on ``[1, rows + 1)``)."""
        u, s = rng.random(n), self.zipf
        if abs(s - 1.0) < 1e-9:
            x = np.power(float(rows + 1), u)
        else:
            x = np.power(1.0 + u * ((rows + 1.0) ** (1.0 - s) - 1.0), 1.0 / (1.0 - s))
        return np.minimum(x.astype(np.int64) - 1, rows - 1)

    def batch(self, rank: int, step: int, size: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]],
                                                               torch.Tensor]:
        """Return (dense features ``[B, 13]``, per table (ids, bag offsets), labels ``[B]``)."""
        rng = np.random.default_rng([self.seed, rank, step])
        dense = rng.normal(0.0, 1.0, (size, 13)).astype(np.float32)
        logit = dense @ self.dense_w / math.sqrt(13) + self.bias
        bags = []
        for t, rows in enumerate(self.rows):
            present = rng.random(size) < PRESENCE[t]
            ids = (self._zipf(rng, int(present.sum()), rows) * _HASH_MUL + self.hash_add[t]) % rows
            w = ((ids * 0x9E3779B1 + (t + 1) * 0x85EBCA6B) % 2**32) / 2**32 * 3.0 - 1.5  # hidden weight of an id
            contrib = np.zeros(size)
            contrib[present] = w
            logit = logit + contrib * (2.0 / math.sqrt(len(self.rows)))
            offsets = np.concatenate([[0], np.cumsum(present[:-1])]).astype(np.int64)
            bags.append((torch.from_numpy(ids), torch.from_numpy(offsets)))
        y = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return torch.from_numpy(dense), bags, torch.from_numpy(y)


# --------------------------------------------------------------------------- model


def _mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseTower(nn.Module):
    """Bottom MLP over the dense features, dot-product interaction with the embeddings, top MLP."""

    def __init__(self, dim: int, tables: int, bot: list[int], top: list[int]) -> None:
        super().__init__()
        self.bot = _mlp([13, *bot, dim], last_relu=True)
        n = tables + 1
        self.register_buffer("_li", torch.tril_indices(n, n, -1)[0], persistent=False)
        self.register_buffer("_lj", torch.tril_indices(n, n, -1)[1], persistent=False)
        self.top = _mlp([dim + n * (n - 1) // 2, *top, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, embs: list[torch.Tensor]) -> torch.Tensor:
        x = self.bot(dense)
        t = torch.stack([x, *embs], dim=1)  # [B, 27, d]
        z = torch.bmm(t, t.transpose(1, 2))[:, self._li, self._lj]  # the 351 pairwise dot products
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


class DLRM(nn.Module):
    """26 embedding tables (sum-pooled bags) and the dense tower."""

    def __init__(self, rows: list[int], dim: int, bot: list[int], top: list[int], sparse: bool) -> None:
        super().__init__()
        # DLRM's initialization, U(-1/sqrt(n), 1/sqrt(n)), into the weight given (no default init first: 20M rows).
        self.emb = nn.ModuleList(
            nn.EmbeddingBag(n, dim, mode="sum", sparse=sparse,
                            _weight=torch.empty(n, dim).uniform_(-math.sqrt(1.0 / n), math.sqrt(1.0 / n)))
            for n in rows
        )
        self.dense = DenseTower(dim, len(rows), bot, top)

    def forward(self, dense: torch.Tensor, bags: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        embs = [e(ids, offsets) for e, (ids, offsets) in zip(self.emb, bags)]
        return self.dense(dense, embs)


# --------------------------------------------------------------------------- synchronization


def _has_fuse_option() -> bool:
    return "fuse" in inspect.signature(SparseGradSync.__init__).parameters


class FusedSync:
    """Every sparse gradient of the model in one ``colltune.sparse_allreduce_many`` before ``optimizer.step()``.

    Used by ``colltune-fused`` when ``SparseGradSync`` has no ``fuse`` option:
    the same layout (DDP over the dense tower, the tables outside it), the
    same exact average, one call for all tables. With ``apply=False``
    (``none+fused-call``) the call's results are left unused: the gradients
    stay this rank's own.
    """

    def __init__(self, model: nn.Module, algorithm: str, bucket_cap_mb: float, apply: bool = True) -> None:
        self.params = list(sparse_parameters(model).items())
        self.algorithm, self.bucket_cap_mb, self.apply = algorithm, bucket_cap_mb, apply
        self.last_bytes = 0
        self.algorithms: list[str] = []
        self.buckets: list[list[int]] = []

    def attach(self, opt: torch.optim.Optimizer) -> None:
        opt.register_step_pre_hook(lambda o, a, k: self.synchronize())

    @torch.no_grad()
    def synchronize(self) -> None:
        items = []
        for _, p in self.params:
            g = p.grad
            if g is None:
                items.append((torch.empty(0, dtype=torch.int64, device=p.device), p.new_empty((0, p.shape[1])),
                              tuple(p.shape)))
            else:
                items.append((g._indices()[0], g._values(), tuple(p.shape)))
        res = colltune.sparse_allreduce_many(items, op="avg", algorithm=self.algorithm,
                                             bucket_cap_mb=self.bucket_cap_mb, name="dlrm.emb")
        if self.apply:
            for (_, p), r in zip(self.params, res):
                p.grad = r.to_sparse_coo() if r.indices.numel() else None
        self.last_bytes = int(res[0].traffic.bytes_sent) if res else 0
        self.algorithms = [r.algorithm for r in res]
        # The tensors of one bucket share its decision (or, forced, its algorithm): runs of one decision.
        self.buckets = []
        for t, r in enumerate(res):
            if t and r.decision is res[t - 1].decision and r.algorithm == res[t - 1].algorithm:
                self.buckets[-1].append(t)
            else:
                self.buckets.append([t])

    def summary(self) -> dict[str, str]:
        return {_tables(b): self.algorithms[b[0]] + " (bucket)" for b in self.buckets}


def _tables(members: list[int]) -> str:
    return f"emb.{members[0]}" if len(members) == 1 else f"emb.{members[0]}-{members[-1]} ({len(members)} tables)"


class DDPSyncTimer:
    """A DDP comm hook that runs DDP's own ``allreduce_hook`` and times the buckets that hold embedding gradients.

    The time of a step is the union of the intervals from the hook's call to
    its future's completion: how long an embedding gradient's collective was
    in flight (DDP overlaps them with the rest of the backward pass). On a
    GPU the host only enqueues the collectives, so the intervals come from
    CUDA events instead: one where the bucket was ready (the hook), one where
    its collective was done (the future's callback, whose streams wait for
    it), measured from an event at the step's start (:meth:`begin`).
    """

    def __init__(self, emb_params: list[nn.Parameter], device: torch.device | None = None,
                 one_sparse_in_flight: bool = False) -> None:
        self.ids = {id(p) for p in emb_params}
        self.one_sparse_in_flight = one_sparse_in_flight
        self._last_sparse: torch.futures.Future | None = None
        self.intervals: list[tuple[float, float]] = []
        self.device = device if device is not None and device.type == "cuda" else None
        self._ref: Any = None
        self._events: list[tuple[Any, Any]] = []

    def _event(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def begin(self) -> None:
        """Mark the start of a step: forget earlier intervals (on a GPU, record the event they are measured from)."""
        self.intervals, self._events = [], []
        self._ref = self._event() if self.device is not None else None
        self._last_sparse = None  # done: DDP waited for every bucket of the step before

    def _allreduce(self, bucket: Any) -> torch.futures.Future:
        """DDP's ``allreduce_hook``; with ``one_sparse_in_flight``, a sparse bucket's once the one before it is done.

        DDP starts every sparse gradient's allreduce as it comes, and gloo
        runs two at once on its worker threads. With torch 2.13 the heap is
        corrupted now and then, and the core dump shows two running at once
        (``tools/ddp_sparse_stress.py`` reproduces it with DDP alone);
        starting them one at a time makes it rarer, not impossible (none
        in 4 long runs there; one 10-step run of its test died under load).
        """
        if not (self.one_sparse_in_flight and bucket.buffer().is_sparse):
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
        if self._last_sparse is not None:
            self._last_sparse.wait()
        self._last_sparse = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
        return self._last_sparse

    @staticmethod
    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none given
        if not any(id(p) in state.ids for p in bucket.parameters()):
            return state._allreduce(bucket)
        if state.device is not None:
            start = state._event()
            fut = state._allreduce(bucket)

            def done_on_gpu(f: torch.futures.Future) -> torch.Tensor:
                state._events.append((start, state._event()))
                return f.value()

            return fut.then(done_on_gpu)
        t0 = time.perf_counter()
        fut = state._allreduce(bucket)

        def done(f: torch.futures.Future) -> torch.Tensor:
            state.intervals.append((t0, time.perf_counter()))
            return f.value()

        return fut.then(done)

    def take(self) -> float:
        """Return the seconds covered by the intervals since the last call, and forget them."""
        if self.device is not None and self._ref is not None:
            torch.cuda.synchronize(self.device)
            for a, b in self._events:
                self.intervals.append((self._ref.elapsed_time(a) / 1e3, self._ref.elapsed_time(b) / 1e3))
            self._events = []
        total, end = 0.0, -math.inf
        for a, b in sorted(self.intervals):
            if b > end:
                total += b - max(a, end)
                end = b
        self.intervals = []
        return total


def _build(mode: str, cfg: dict, device: torch.device) -> tuple[nn.Module, DLRM, Any, Any, Any]:
    """Return (module to call, the model, optimizer, synchronizer or None, DDP timer or None), on ``device``."""
    torch.manual_seed(cfg["seed"])  # the same initial weights in every mode and on every rank
    model = DLRM(cfg["rows"], cfg["dim"], cfg["bot"], cfg["top"], sparse=mode != "ddp-dense")
    # Built on the host (the same weights as on the CPU), then moved.
    ddp_kw: dict[str, Any] = {}
    if device.type == "cuda":
        model = model.to(device)
        ddp_kw["device_ids"] = [device.index]
    sync: Any = None
    timer = None
    if mode == "none":
        net: nn.Module = model
    elif mode == "none+fused-call":
        net = model
        sync = FusedSync(model, cfg["algorithm"], cfg["bucket_cap_mb"], apply=False)
    elif mode in DDP_MODES:
        # init_sync=False: every rank built the same weights from the same seed (saves a 1.3 GB broadcast).
        net = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, init_sync=False, **ddp_kw)
        timer = DDPSyncTimer(list(model.emb.parameters()), device, cfg["one_sparse_in_flight"])
        net.register_comm_hook(timer, DDPSyncTimer.hook)  # type: ignore[operator]
    else:
        model.dense = nn.parallel.DistributedDataParallel(model.dense, init_sync=False, **ddp_kw)  # type: ignore[assignment]
        net = model
        fused = mode == "colltune-fused"
        if _has_fuse_option():
            sync = SparseGradSync(model, algorithm=cfg["algorithm"], dense="skip", init_sync=False, fuse=fused,
                                  bucket_cap_mb=cfg["bucket_cap_mb"])  # type: ignore[call-arg]
        elif fused:
            sync = FusedSync(model, cfg["algorithm"], cfg["bucket_cap_mb"])
        else:
            sync = SparseGradSync(model, algorithm=cfg["algorithm"], dense="skip", init_sync=False)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    if sync is not None:
        sync.attach(opt)
    return net, model, opt, sync, timer


def _ring_bytes(nbytes: int, p: int) -> int:
    return 2 * nbytes * (p - 1) // p if p > 1 else 0


def _ddp_bytes(mode: str, model: DLRM, bags: list[tuple[torch.Tensor, torch.Tensor]], p: int) -> int:
    """Textbook bytes one rank sends per step under DDP."""
    if p == 1:
        return 0
    dense = sum(q.numel() * q.element_size() for q in model.dense.parameters())
    if mode == "ddp-dense":
        return _ring_bytes(dense + sum(e.weight.numel() * e.weight.element_size() for e in model.emb), p)
    row = model.emb[0].weight.shape[1] * model.emb[0].weight.element_size()
    nnz = sum(int(ids.unique().numel()) for ids, _ in bags)  # gloo coalesces, then gathers every rank's rows
    return _ring_bytes(dense, p) + (p - 1) * nnz * (8 + row)


class Run:
    """One mode's model, optimizer and synchronizer, trained one step at a time."""

    def __init__(self, mode: str, cfg: dict, data: DLRMData, rank: int, p: int,
                 device: torch.device = torch.device("cpu")) -> None:
        self.mode, self.cfg, self.data, self.rank, self.p, self.device = mode, cfg, data, rank, p, device
        self.net, self.model, self.opt, self.sync, self.timer = _build(mode, cfg, device)
        self.impl = _impl(mode, self.sync) + (", one sparse allreduce in flight at a time"
                                              if mode == "ddp-sparse" and cfg["one_sparse_in_flight"] else "")
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.times: list[float] = []
        self.sync_times: list[float] = []
        self.losses: list[float] = []
        self.sent: list[int] = []
        self._sync_t = 0.0
        if self.sync is not None:
            inner = self.sync.synchronize

            def timed() -> None:
                self._wait_gpu()  # on a GPU: the call's own time, not the backward kernels still queued
                t0 = time.perf_counter()
                inner()
                self._wait_gpu()
                self._sync_t += time.perf_counter() - t0

            self.sync.synchronize = timed  # the optimizer hook calls it through the instance

    def _wait_gpu(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, step: int, log: bool) -> None:
        """Train one step on this rank's batch ``step`` (the same batch in every mode)."""
        dense, bags, y = self.data.batch(self.rank, step, self.cfg["batch"])
        host_bags = bags
        if self.device.type == "cuda":  # the batch is on the GPU before the step starts
            dense, y = dense.to(self.device), y.to(self.device)
            bags = [(ids.to(self.device), offsets.to(self.device)) for ids, offsets in bags]
        if self.p > 1:
            dist.barrier()  # every mode's step starts with the ranks aligned
        self._sync_t = 0.0
        self._wait_gpu()
        if self.timer is not None:
            self.timer.begin()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.net(dense, bags), y)
        loss.backward()
        self.opt.step()  # colltune modes: the synchronizer runs here, before the update
        self._wait_gpu()
        self.times.append(time.perf_counter() - t0)
        self.sync_times.append(self.timer.take() if self.timer is not None else self._sync_t)
        self.losses.append(float(loss.detach()))
        if self.mode == "none":
            nbytes = 0
        elif self.mode == "none+fused-call":  # the call's own counter; nothing else is sent
            nbytes = int(self.sync.last_bytes)
        elif self.sync is None:
            nbytes = _ddp_bytes(self.mode, self.model, host_bags, self.p)
        else:  # the synchronizer's own counter, plus DDP's ring allreduce of the dense tower
            dense_bytes = sum(q.numel() * q.element_size() for q in self.model.dense.parameters())
            nbytes = int(self.sync.last_bytes) + _ring_bytes(dense_bytes, self.p)
        self.sent.append(nbytes)
        if log:
            print(f"[{self.mode:<18}] step {step:4d}  loss {self.losses[-1]:.6f}  step {self.times[-1] * 1e3:8.1f} ms  "
                  f"sync {self.sync_times[-1] * 1e3:8.1f} ms  sent {nbytes / 2**20:8.2f} MiB", flush=True)

    def algorithms(self) -> dict[str, str]:
        if self.mode == "none":
            return {"emb.*": "none (not synchronized)", "dense.*": "none (not synchronized)"}
        if self.mode == "none+fused-call":
            return {**self.sync.summary(), "dense.*": "none (not synchronized)"}
        if self.sync is None:
            what = "allreduce (DDP, dense gradient)" if self.mode == "ddp-dense" else \
                "gloo sparse allreduce (DDP: coalesce, allgather), one per table"
            return {"emb.*": what, "dense.*": "allreduce (DDP)"}
        if isinstance(self.sync, FusedSync):
            out = self.sync.summary()
        else:
            rows = [r for r in self.sync.summary() if r["route"] == "sparse"]
            out = {}
            i = 0
            while i < len(rows):  # consecutive tables with one algorithm on one line
                j = i
                while j + 1 < len(rows) and rows[j + 1]["algorithm"] == rows[i]["algorithm"]:
                    j += 1
                names = [r["tensor"].split(".")[1] for r in rows[i : j + 1]]
                key = f"emb.{names[0]}" if i == j else f"emb.{names[0]}-{names[-1]} ({j - i + 1} tables)"
                out[key] = rows[i]["algorithm"]
                i = j + 1
        out["dense.*"] = "allreduce (DDP over the dense tower only)"
        return out

    def finish(self) -> dict:
        """Gather the slowest rank's step and sync times and the peak RSS, free the model; return the record."""
        t = torch.tensor([self.times, self.sync_times], dtype=torch.float64)
        if self.p > 1:  # a step takes as long as its slowest rank
            t = t.to(_comm_device(self.device))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            t = t.cpu()
        out = {
            "mode": self.mode,
            "implementation": self.impl,
            "step_times": t[0].tolist(),
            "sync_times": t[1].tolist(),
            "losses": self.losses,
            "bytes_per_step": self.sent,
            "algorithms": self.algorithms(),
        }
        if self.sync is not None and hasattr(self.sync, "detach"):
            self.sync.detach()  # its gradient hooks live on the parameters: a cycle gc cannot see, 1.3 GB a model
        self.net = self.model = self.opt = self.sync = self.timer = None  # type: ignore[assignment]
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return out


def _impl(mode: str, sync: Any) -> str:
    if mode == "none":
        return "no synchronization (every rank trains its own copy)"
    if mode == "none+fused-call":
        return "no synchronization + one sparse_allreduce_many over the embedding gradients, its result unused"
    if mode in DDP_MODES:
        return "DistributedDataParallel(whole model)" + (", sparse gradients" if mode == "ddp-sparse" else "")
    if isinstance(sync, FusedSync):
        return "DDP(dense tower) + sparse_allreduce_many in an optimizer hook (SparseGradSync has no fuse option yet)"
    fuse = f", fuse={mode == 'colltune-fused'}" if _has_fuse_option() else ""
    return f"DDP(dense tower) + SparseGradSync(dense='skip'{fuse})"


def _comm_device(device: torch.device) -> torch.device:
    """Where this tool's own bookkeeping collectives run: the rank's GPU on NCCL, the host on gloo."""
    return device if str(dist.get_backend()).lower() == "nccl" else torch.device("cpu")


def _gather_value(value: float, p: int, device: torch.device) -> list[float]:
    """Every rank's ``value``, in rank order."""
    mine = torch.tensor([value], dtype=torch.float64)
    if p == 1:
        return mine.tolist()
    at = _comm_device(device)
    out = [torch.zeros(1, dtype=torch.float64, device=at) for _ in range(p)]
    dist.all_gather(out, mine.to(at))
    return [float(x) for x in out]


def _peak_rss_mib(p: int, device: torch.device = torch.device("cpu")) -> list[float]:
    """Every rank's peak resident memory so far, in MiB."""
    return _gather_value(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, p, device)


def _peak_gpu_mib(p: int, device: torch.device) -> list[float]:
    """Every rank's peak GPU memory allocated by torch so far, in MiB."""
    return _gather_value(torch.cuda.max_memory_allocated(device) / 2**20, p, device)


def rank_device(rank: int, cfg: dict) -> torch.device:
    """This rank's device: the host, or ``cuda:<local rank % GPUs>``, made the current device."""
    if cfg.get("device", "cpu") != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun's; a local launch's ranks are all on this machine
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)  # NCCL's communicators and barriers use the current device
    return device


def rank_main(rank: int, world_size: int, cfg: dict) -> dict | None:
    """Run every requested mode on this rank; rank 0 returns the runs and the peak RSS of every rank."""
    device = rank_device(rank, cfg)
    data = DLRMData(cfg["rows"], cfg["zipf"], cfg["seed"])
    runs = []
    every = cfg["log_every"]

    def logs(step: int, steps: int) -> bool:
        return rank == 0 and every > 0 and (step % every == 0 or step == steps - 1)

    interleaved = [m for m in cfg["modes"] if not (cfg["bench"] and m == "ddp-dense")]
    for rep in range(cfg["repeats"]):
        if len(interleaved) > 1:
            # Side by side, one step each in turn (the order rotates every step), so that a busy
            # moment on a shared machine hits every mode alike.
            if rank == 0 and every:
                print(f"== {', '.join(interleaved)}: interleaved per step (repeat {rep + 1} of {cfg['repeats']}, "
                      f"P={world_size})", flush=True)
            active = [Run(m, cfg, data, rank, world_size, device) for m in interleaved]
            for step in range(cfg["steps"]):
                k = step % len(active)
                for r in active[k:] + active[:k]:
                    r.step(step, logs(step, cfg["steps"]))
            done = [r.finish() for r in active]
            del active
        else:
            done = []
            for mode in interleaved:
                r = Run(mode, cfg, data, rank, world_size, device)
                for step in range(cfg["steps"]):
                    r.step(step, logs(step, cfg["steps"]))
                done.append(r.finish())
                del r
        for run in done:
            run["repeat"] = rep
            runs.append(run)
            if rank == 0:
                _print_run(run, cfg["skip"])
    rss_interleaved = _peak_rss_mib(world_size, device)
    gpu_interleaved = _peak_gpu_mib(world_size, device) if device.type == "cuda" else None
    if cfg["bench"] and "ddp-dense" in cfg["modes"] and cfg["dense_steps"] > 0:
        steps = min(cfg["dense_steps"], cfg["steps"])
        if rank == 0 and every:
            print(f"== ddp-dense alone, {steps} steps (P={world_size})", flush=True)
        r = Run("ddp-dense", cfg, data, rank, world_size, device)
        for step in range(steps):
            r.step(step, logs(step, steps))
        run = r.finish()
        del r
        run["repeat"] = 0
        runs.append(run)
        if rank == 0:
            _print_run(run, cfg["dense_skip"])
    rss = _peak_rss_mib(world_size, device)
    out = {"runs": runs, "peak_rss_mib": rss, "peak_rss_mib_interleaved": rss_interleaved}
    if device.type == "cuda":
        out["peak_gpu_mib"], out["peak_gpu_mib_interleaved"] = _peak_gpu_mib(world_size, device), gpu_interleaved
    return out if rank == 0 else None


def _skip_of(mode: str, cfg: dict) -> int:
    return cfg["dense_skip"] if cfg["bench"] and mode == "ddp-dense" else cfg["skip"]


def _med(xs: list[float], skip: int) -> float:
    return statistics.median(xs[skip:] or xs)


def _print_run(run: dict, skip: int) -> None:
    print(f"-- {run['mode']}: median step {_med(run['step_times'], skip) * 1e3:.1f} ms, "
          f"sync {_med(run['sync_times'], skip) * 1e3:.1f} ms, final loss {run['losses'][-1]:.6f}, "
          f"sent {_med(run['bytes_per_step'], skip) / 2**20:.2f} MiB/step  [{run['implementation']}]")
    for tensor, algo in run["algorithms"].items():
        print(f"     {tensor:<30} {algo}")


def loss_gaps(runs: list[dict], world_size: int = 1) -> dict:
    """Largest relative gap between the per-step training losses of every two modes.

    Every run starts from the same weights and sees the same batches, so a
    run's loss at step ``k`` is comparable with any other run's at step ``k``.
    At P > 1 the modes that do not synchronize (``none``, ``none+fused-call``)
    are compared only with each other: their ranks train apart.
    """
    out: dict[str, Any] = {"pairs": {}, "largest": 0.0}
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    for i, a in enumerate(modes):
        for b in modes[i + 1 :]:
            if world_size > 1 and (a in UNSYNCED_MODES) != (b in UNSYNCED_MODES):
                continue
            gap = 0.0
            for ra in (r for r in runs if r["mode"] == a):
                for rb in (r for r in runs if r["mode"] == b):
                    for x, y in zip(ra["losses"], rb["losses"]):
                        gap = max(gap, abs(x - y) / max(abs(y), 1e-12))
            out["pairs"][f"{a} vs {b}"] = gap
            out["largest"] = max(out["largest"], gap)
    return out


def summarize(res: dict, cfg: dict, world_size: int) -> dict:
    """Medians per mode over the repeats, the fused speed-up, the sync-time ratio and the loss gaps."""
    runs = res["runs"]
    per_mode: dict[str, dict] = {}
    for mode in cfg["modes"]:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        skip = _skip_of(mode, cfg)
        per_mode[mode] = {
            "median_step_ms": statistics.median(_med(r["step_times"], skip) for r in rs) * 1e3,
            "median_sync_ms": statistics.median(_med(r["sync_times"], skip) for r in rs) * 1e3,
            "step_ms_per_repeat": [round(_med(r["step_times"], skip) * 1e3, 1) for r in rs],
            "steps_timed": sum(len(r["step_times"][skip:] or r["step_times"]) for r in rs),
            "final_loss": rs[-1]["losses"][-1],
            "mib_per_step": _med(rs[-1]["bytes_per_step"], skip) / 2**20,
            "algorithms": rs[-1]["algorithms"],
            "implementation": rs[-1]["implementation"],
        }
    out: dict[str, Any] = {
        "world_size": world_size, "config": cfg, "modes": per_mode,
        "table_rows": cfg["rows"], "total_rows": sum(cfg["rows"]),
        "peak_rss_mib": res["peak_rss_mib"], "peak_rss_mib_interleaved": res["peak_rss_mib_interleaved"],
    }
    if "peak_gpu_mib" in res:
        out["peak_gpu_mib"], out["peak_gpu_mib_interleaved"] = res["peak_gpu_mib"], res["peak_gpu_mib_interleaved"]
    if "none" in per_mode:  # what each way of synchronizing adds to a step that synchronizes nothing
        base = per_mode["none"]["median_step_ms"]
        out["step_ms_over_none"] = {m: v["median_step_ms"] - base for m, v in per_mode.items() if m != "none"}
    if "none+fused-call" in per_mode:  # the fused call alone, its local work included
        out["fused_call_ms"] = per_mode["none+fused-call"]["median_sync_ms"]
    ddp = [m for m in DDP_MODES if m in per_mode]
    if ddp and "colltune-fused" in per_mode:
        best = min(ddp, key=lambda m: per_mode[m]["median_step_ms"])
        out["best_ddp"] = best
        out["speedup_fused_vs_best_ddp"] = per_mode[best]["median_step_ms"] / per_mode["colltune-fused"]["median_step_ms"]
        out["speedup_fused_vs_ddp_sparse_per_step"] = _step_ratios(runs, "ddp-sparse", "colltune-fused", "step_times",
                                                                   cfg["skip"])
    if "colltune-per-table" in per_mode and "colltune-fused" in per_mode:
        out["sync_ratio_per_table_vs_fused"] = (per_mode["colltune-per-table"]["median_sync_ms"]
                                                / per_mode["colltune-fused"]["median_sync_ms"])
        out["sync_ratio_per_step"] = _step_ratios(runs, "colltune-per-table", "colltune-fused", "sync_times", cfg["skip"])
        out["step_ratio_per_table_vs_fused"] = (per_mode["colltune-per-table"]["median_step_ms"]
                                                / per_mode["colltune-fused"]["median_step_ms"])
    out["loss_gaps"] = loss_gaps(runs, world_size)
    return out


def _step_ratios(runs: list[dict], num: str, den: str, key: str, skip: int) -> float:
    """Median over steps taken side by side (same repeat, same step) of ``num``'s time over ``den``'s."""
    ratios = []
    reps = {r["repeat"] for r in runs}
    for rep in reps:
        a = [r for r in runs if r["mode"] == num and r["repeat"] == rep]
        b = [r for r in runs if r["mode"] == den and r["repeat"] == rep]
        if a and b:
            for x, y in list(zip(a[0][key], b[0][key]))[skip:]:
                if y > 0:
                    ratios.append(x / y)
    return statistics.median(ratios) if ratios else float("nan")


def _print_summary(s: dict) -> None:
    cfg = s["config"]
    gb = s["total_rows"] * cfg["dim"] * 4 / 1e9
    print(f"\n== summary (P={s['world_size']}, {len(s['table_rows'])} tables, {s['total_rows']:,} rows x {cfg['dim']} "
          f"= {gb:.2f} GB fp32 per model, batch {cfg['batch']} per rank; medians over {cfg['repeats']} repeats of "
          f"{cfg['steps']} steps, first {cfg['skip']} not timed"
          + (f"; on {cfg['device']} over {cfg['backend']}" if cfg.get("device", "cpu") != "cpu" else "") + ")")
    print(f"{'mode':<20} {'step ms':>9} {'sync ms':>9} {'MiB/step':>9} {'final loss':>11}  per repeat (ms)")
    for mode, v in s["modes"].items():
        print(f"{mode:<20} {v['median_step_ms']:9.1f} {v['median_sync_ms']:9.1f} {v['mib_per_step']:9.2f} "
              f"{v['final_loss']:11.6f}  {v['step_ms_per_repeat']} ({v['steps_timed']} steps timed)")
    if "speedup_fused_vs_best_ddp" in s:
        sp = s["speedup_fused_vs_best_ddp"]
        vs_sparse = (f" (median of per-step ratios vs ddp-sparse: {s['speedup_fused_vs_ddp_sparse_per_step']:.2f})"
                     if "ddp-sparse" in s["modes"] else "")
        print(f"colltune-fused vs the faster DDP mode ({s['best_ddp']}): {sp:.2f}x faster per step{vs_sparse}; "
              f"target >= 1.5: {'met' if sp >= 1.5 else 'NOT met'}")
    if "sync_ratio_per_table_vs_fused" in s:
        r = s["sync_ratio_per_table_vs_fused"]
        print(f"sparse sync time, colltune-per-table / colltune-fused: {r:.2f}x (median of per-step ratios: "
              f"{s['sync_ratio_per_step']:.2f}; step time ratio {s['step_ratio_per_table_vs_fused']:.2f}x); "
              f"target >= 1.3: {'met' if r >= 1.3 else 'NOT met'}")
    if "fused_call_ms" in s:
        over = s.get("step_ms_over_none", {}).get("none+fused-call")
        print(f"the fused call's own cost (none+fused-call: one sparse_allreduce_many per step): "
              f"{s['fused_call_ms']:.1f} ms in the call" + (f", {over:+.1f} ms per step over none" if over is not None else ""))
    if "step_ms_over_none" in s:
        print("step time over none (no synchronization): "
              + ", ".join(f"{m} {d:+.1f} ms" for m, d in s["step_ms_over_none"].items()))
    g = s["loss_gaps"]
    print(f"largest loss gap between modes (relative, per step): {g['largest']:.2e}"
          + "".join(f"\n     {k:<40} {v:.2e}" for k, v in g["pairs"].items()))
    print(f"peak RSS per rank (MiB): {[round(x) for x in s['peak_rss_mib']]} "
          f"(after the interleaved modes: {[round(x) for x in s['peak_rss_mib_interleaved']]})")
    if "peak_gpu_mib" in s:
        print(f"peak GPU memory allocated per rank (MiB): {[round(x) for x in s['peak_gpu_mib']]} "
              f"(after the interleaved modes: {[round(x) for x in s['peak_gpu_mib_interleaved']]})")


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split("-") if x]


def parse_args(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="local ranks to start (ignored under torchrun)")
    ap.add_argument("--mode", nargs="+", choices=MODES, default=["colltune-fused"], help="how gradients are synchronized")
    ap.add_argument("--bench", action="store_true",
                    help=f"{', '.join(BENCH_MODES)} interleaved and repeated, then ddp-dense alone "
                         "(on cuda also none and none+fused-call)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model, the batches and the gradients live (cuda: cuda:<local rank %% GPUs>)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                    help="process group backend (default: gloo on cpu; on cuda nccl when every rank has a GPU "
                         "of its own, else gloo with ranks sharing GPUs)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the medians")
    ap.add_argument("--dense-steps", type=int, default=3, help="--bench: steps of ddp-dense (0: skip it)")
    ap.add_argument("--dense-skip", type=int, default=1, help="--bench: first ddp-dense steps left out")
    ap.add_argument("--batch", type=int, default=2048, help="samples per rank per step")
    ap.add_argument("--dim", type=int, default=16, help="embedding width (DLRM: 16 on Kaggle, 64 or 128 on Terabyte)")
    ap.add_argument("--max-rows", type=int, default=4_500_000, help="rows of the largest tables (hashing cap)")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink every table by this factor (tests: 0.001)")
    ap.add_argument("--bot-mlp", default="512-256-64", help="hidden sizes of the bottom MLP (then --dim)")
    ap.add_argument("--top-mlp", default="512-256", help="hidden sizes of the top MLP (then 1)")
    ap.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids within a table")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--algorithm", default="auto", choices=("auto", *colltune.algorithms.names()),
                    help="colltune's algorithm for the sparse gradients")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="colltune-fused: bucket capacity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=5, help="print every this many steps (0: only summaries)")
    ap.add_argument("--json", default=None, help="write the runs and the summary to this file")
    ap.add_argument("--one-sparse-in-flight", action="store_true",
                    help="ddp-sparse: start each sparse allreduce once the one before it is done (DDP starts them as "
                         "they come, and gloo runs two at once, which with torch 2.13 corrupts the heap now and then: "
                         "tools/ddp_sparse_stress.py)")
    a = ap.parse_args(argv)
    cfg = {k.replace("-", "_"): v for k, v in vars(a).items()}
    cfg["backend"], cfg["notes"] = resolve_backend(ap, a.device, a.backend, _local_ranks(a.ranks))
    bench_modes = GPU_BENCH_MODES if a.device == "cuda" else BENCH_MODES
    modes = list(bench_modes) + (["ddp-dense"] if a.dense_steps > 0 else []) if a.bench \
        else list(dict.fromkeys(a.mode))
    cfg["skipped"] = {m: NCCL_SKIPS[m] for m in modes if cfg["backend"] == "nccl" and m in NCCL_SKIPS}
    cfg["modes"] = [m for m in modes if m not in cfg["skipped"]]
    if not cfg["modes"]:
        ap.error("nothing to run on nccl: " + "; ".join(f"{m}: {why}" for m, why in cfg["skipped"].items()))
    cfg["rows"] = table_rows(a.max_rows, a.scale)
    cfg["bot"], cfg["top"] = _sizes(a.bot_mlp), _sizes(a.top_mlp)
    return cfg


def _local_ranks(ranks: int) -> int:
    """Ranks on this machine: torchrun's ``LOCAL_WORLD_SIZE`` under torchrun, else ``--ranks``."""
    if in_torchrun():
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return ranks


def resolve_backend(ap: argparse.ArgumentParser, device: str, backend: str | None, local_ranks: int) -> tuple[str, list[str]]:
    """Return the backend for ``--device`` and ``--backend`` and the notes to print; ``ap.error`` on what cannot run.

    CPU: gloo. CUDA: NCCL when each of the ``local_ranks`` ranks on this
    machine can have a GPU of its own, else gloo (ranks share GPUs: for
    testing). Checked before any rank starts.
    """
    if device == "cpu":
        if backend == "nccl":
            ap.error("--backend nccl needs --device cuda (NCCL runs on GPUs only)")
        return "gloo", []
    if not torch.cuda.is_available():
        ap.error(f"--device cuda: CUDA is not available here (torch {torch.__version__}, "
                 f"torch.cuda.is_available() is False); use --device cpu")
    gpus = torch.cuda.device_count()
    if backend == "nccl" and local_ranks > gpus:
        ap.error(f"--backend nccl needs a GPU per rank: {local_ranks} ranks on this machine, {gpus} GPU(s); "
                 "leave --backend out or pass gloo to let ranks share GPUs")
    chosen = backend or ("nccl" if local_ranks <= gpus else "gloo")
    notes = []
    if chosen == "gloo" and local_ranks > gpus:
        notes.append(f"note: {local_ranks} ranks share {gpus} GPU(s) over gloo (cuda:<rank % {gpus}>): for testing, "
                     "not for figures of a GPU per rank")
    return chosen, notes


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if not in_torchrun() or os.environ.get("RANK") == "0":
        for line in cfg["notes"]:
            print(line, flush=True)
        for mode, why in cfg["skipped"].items():
            print(f"skipping {mode}: {why}", flush=True)
    if in_torchrun():
        res = run_here(rank_main, cfg, backend=cfg["backend"], pg_timeout=1800)
        world_size = int(os.environ["WORLD_SIZE"])
        if res is None:
            return 0
    else:
        world_size = cfg["ranks"]
        res = run_local(rank_main, world_size, cfg, backend=cfg["backend"], timeout=24 * 3600, pg_timeout=1800)[0]
    summary = summarize(res, cfg, world_size)
    _print_summary(summary)
    if cfg["json"]:
        with open(cfg["json"], "w") as f:
            json.dump({"summary": summary, "runs": res["runs"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
