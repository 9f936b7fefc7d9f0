"""End-to-end example: click prediction with a 1M x 64 embedding table, data-parallel on P ranks.

The model looks up 26 categorical fields in one shared embedding table
(``--rows`` x ``--dim``, 1M x 64 by default: 256 MB of fp32) and feeds the
concatenated rows to a small MLP. The data is generated on each rank: every
field has its own vocabulary (10 to ``--rows`` values, log-spaced, as the
fields of public click logs do), ids are Zipf-distributed within a field and
hashed into the table, and labels come from a fixed hidden logistic model.
Hot ids recur within a batch and across ranks, so the per-rank sparse
gradients overlap as they do in practice.

Five ways to synchronize the gradients (``--mode``; the data, the seeds and
the initial weights are the same for all):

``ddp-dense``          DDP over the whole model, dense embedding gradients (256 MB allreduce per step)
``ddp-sparse``         DDP over the whole model, ``nn.Embedding(sparse=True)`` (gloo's sparse allreduce)
``colltune``           DDP over the MLP only; the embedding outside DDP, its sparse gradient
                       averaged exactly by ``colltune.train.SparseGradSync`` (``--algorithm``, ``auto``
                       by default) before every ``optimizer.step()``
``colltune-sync-all``  no DDP at all: the synchronizer alone averages the embedding's sparse
                       gradient (as above) and the MLP's gradients (one bucketed allreduce)
``colltune-topk``      as ``colltune``, plus ``colltune.train.colltune_hook`` on the MLP's DDP: top-k
                       compression with error feedback after ``--warmup`` dense steps

Every run prints the loss, the step time, the bytes this rank sent per step
and the algorithm chosen per tensor; ``--bench`` runs the five modes side by
side in the same ranks, one step of each in turn (so that a busy moment on a
shared machine slows every mode alike), ``--repeats`` times, and prints the
median step times, the speed-up of each exact colltune mode over the faster
DDP mode and the loss gaps to ``ddp-dense`` (``--json`` writes everything to a file). A
step is timed on every rank from ``zero_grad`` to the end of
``optimizer.step()`` after a barrier, and counts as long as its slowest rank.

Usage::

    python tools/train_ctr.py --ranks 4 --mode colltune              # P local gloo ranks
    python tools/train_ctr.py --ranks 4 --bench --steps 20 --repeats 3
    torchrun --nproc-per-node 4 tools/train_ctr.py --mode colltune   # the same code under torchrun
    torchrun --nproc-per-node 8 tools/train_ctr.py --backend nccl --bench   # a GPU per rank; skips ddp-sparse

With ``--backend nccl`` every rank trains on ``cuda:<local rank>`` (a GPU
per rank on each machine); modes NCCL cannot run are skipped with a line
saying why (``ddp-sparse``: DDP cannot reduce sparse gradients on NCCL).

Bytes sent: colltune's own counters for its calls; for DDP, the textbook
volume of what it runs (ring allreduce ``2 L (P-1)/P``; gloo's sparse
allreduce gathers every rank's entries, ``(P-1)`` times the
local coalesced ``nnz x (8 + row bytes)``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
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

from colltune.algorithms import registry  # noqa: E402
from colltune.offline.launch import in_torchrun, run_here, run_local  # noqa: E402
from colltune.train import ColltuneHookState, SparseGradSync, colltune_hook  # noqa: E402

MODES = ("ddp-dense", "ddp-sparse", "colltune", "colltune-sync-all", "colltune-topk")
#: The modes that synchronize exactly with colltune (the issue's setup (c)).
EXACT_MODES = ("colltune", "colltune-sync-all")
#: Modes NCCL cannot run, and why: skipped with a line on --backend nccl.
NCCL_SKIPS = {"ddp-sparse": "DDP cannot reduce sparse gradients on NCCL (NCCL has no sparse allreduce; "
                            "run it with --backend gloo)"}


# --------------------------------------------------------------------------- data


class ClickData:
    """Synthetic click logs: Zipf ids per field, hashed into one table; labels from a hidden logistic model.

    ``batch(rank, step)`` depends only on the seed, the rank and the step, so
    every mode trains on exactly the same samples.
    """

    def __init__(self, rows: int, fields: int, zipf: float, seed: int) -> None:
        self.rows, self.fields = rows, fields
        card = np.unique(np.round(np.logspace(1, math.log10(rows), fields)).astype(np.int64))
        self.card = card
        self.offsets = np.concatenate([[0], np.cumsum(card[:-1])])
        self.cdfs = []
        for c in card:
            p = np.arange(1, int(c) + 1, dtype=np.float64) ** -zipf
            cdf = np.cumsum(p)
            self.cdfs.append(cdf / cdf[-1])
        rng = np.random.default_rng(seed)
        self.perm = rng.permutation(rows)  # hashing: a field's hot ids land anywhere in the table
        self.true_w = rng.normal(0.0, 1.0, rows).astype(np.float32)
        self.bias = -1.5  # about 20 % clicks
        self.seed = seed

    @property
    def num_fields(self) -> int:
        return len(self.card)

    def batch(self, rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, rank, step])
        cols = [np.searchsorted(cdf, rng.random(size)) for cdf in self.cdfs]
        ids = self.perm[(np.stack(cols, 1) + self.offsets) % self.rows]
        logit = self.true_w[ids].sum(1) / math.sqrt(self.num_fields) + self.bias
        y = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return torch.from_numpy(ids), torch.from_numpy(y)


# --------------------------------------------------------------------------- model


class CTRModel(nn.Module):
    """One shared embedding table for every field, then a small MLP on the concatenated rows."""

    def __init__(self, rows: int, dim: int, fields: int, hidden: int, sparse: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(rows, dim, sparse=sparse)
        nn.init.normal_(self.embedding.weight, std=0.01)
        self.mlp = nn.Sequential(
            nn.Linear(fields * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden // 2), nn.ReLU(),
            nn.Linear(hidden // 2, 1),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids).flatten(1)
        return self.mlp(x).squeeze(1)


# --------------------------------------------------------------------------- one run


def _build(mode: str, cfg: dict, data: ClickData, device: torch.device) -> tuple[nn.Module, Any, Any, Any]:
    """Return (module to call, optimizer, synchronizer or None, hook state or None)."""
    torch.manual_seed(cfg["seed"])
    sparse = mode != "ddp-dense"
    model = CTRModel(cfg["rows"], cfg["dim"], data.num_fields, cfg["hidden"], sparse).to(device)
    sync = hook = None
    if mode in ("ddp-dense", "ddp-sparse"):
        net: nn.Module = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    elif mode == "colltune-sync-all":
        net = model  # no DDP at all: the synchronizer averages the MLP too (one bucketed allreduce)
        sync = SparseGradSync(model, algorithm=cfg["algorithm"], policy=cfg["policy"])
    else:
        # DDP over the dense tower only (its allreduce overlaps the backward pass); the embedding
        # stays outside DDP and goes through colltune's synchronizer.
        model.mlp = nn.parallel.DistributedDataParallel(model.mlp)
        if mode == "colltune-topk":
            hook = ColltuneHookState(
                model=model, density=cfg["density"], start_compression_iter=cfg["warmup"],
                algorithm=cfg["topk_algorithm"], policy=cfg["policy"],
            )
            model.mlp.register_comm_hook(hook, colltune_hook)
        net = model
        sync = SparseGradSync(model, algorithm=cfg["algorithm"], policy=cfg["policy"])  # the embedding only
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    if sync is not None:
        sync.attach(opt)  # the training loop below is the same for every mode
    return net, opt, sync, hook


def _mlp_ring_bytes(model: nn.Module, p: int) -> int:
    """Textbook bytes one rank sends when DDP allreduces the MLP (ring: ``2 L (P-1)/P``)."""
    nbytes = sum(q.numel() * q.element_size() for q in model.mlp.parameters())
    return 2 * nbytes * (p - 1) // p if p > 1 else 0


def _ddp_bytes(mode: str, model: nn.Module, ids: torch.Tensor, p: int) -> tuple[int, dict[str, str]]:
    """Textbook bytes one rank sends per step under DDP, and what runs per tensor."""
    if p == 1:
        return 0, {}
    dense = sum(q.numel() * q.element_size() for n, q in model.named_parameters() if "embedding" not in n)
    emb = model.embedding.weight
    algos = {"mlp.*": "allreduce (DDP)"}
    if mode == "ddp-dense":
        dense += emb.numel() * emb.element_size()
        algos["embedding.weight"] = "allreduce (DDP, dense gradient)"
        sparse = 0
    else:
        nnz = ids.unique().numel()  # gloo coalesces, then gathers every rank's rows
        sparse = (p - 1) * nnz * (8 + emb.shape[1] * emb.element_size())
        algos["embedding.weight"] = "gloo sparse allreduce (coalesce, allgather)"
    return 2 * dense * (p - 1) // p + sparse, algos


class Run:
    """One mode's model, optimizer and synchronizer, trained one step at a time."""

    def __init__(self, mode: str, cfg: dict, data: ClickData, rank: int, p: int, device: torch.device) -> None:
        self.mode, self.cfg, self.data, self.rank, self.p, self.device = mode, cfg, data, rank, p, device
        self.net, self.opt, self.sync, self.hook = _build(mode, cfg, data, device)
        self.model = self.net.module if isinstance(self.net, nn.parallel.DistributedDataParallel) else self.net
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.times: list[float] = []
        self.cpu: list[float] = []  # this process's CPU time per step, all threads
        self.losses: list[float] = []
        self.sent: list[int] = []
        self._hook_before = 0
        self._ids: torch.Tensor | None = None

    def step(self, step: int, log: bool) -> None:
        """Train one step on this rank's batch ``step`` (the same batch in every mode)."""
        ids, y = self.data.batch(self.rank, step, self.cfg["batch"])
        ids, y = ids.to(self.device), y.to(self.device)
        if self.p > 1:
            dist.barrier()  # every mode's step starts with the ranks aligned
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.net(ids), y)
        loss.backward()
        self.opt.step()  # colltune modes: the synchronizer runs here, before the update
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)
        self.losses.append(float(loss.detach()))
        if self.sync is None:
            nbytes = _ddp_bytes(self.mode, self.model, ids, self.p)[0]
        else:
            nbytes = self.sync.last_bytes
            if self.hook is not None:
                nbytes += self.hook.bytes_sent - self._hook_before
                self._hook_before = self.hook.bytes_sent
            elif self.mode == "colltune":
                nbytes += _mlp_ring_bytes(self.model, self.p)  # DDP's allreduce of the MLP
        self.sent.append(nbytes)
        self._ids = ids
        if log:
            print(f"[{self.mode:<17}] step {step:4d}  loss {self.losses[-1]:.5f}  step {self.times[-1] * 1e3:8.1f} ms  "
                  f"sent {nbytes / 2**20:8.2f} MiB", flush=True)

    def finish(self) -> dict:
        """Evaluate, gather the slowest rank's step times, free the model; return the record of the run."""
        if self.sync is None:
            algos = _ddp_bytes(self.mode, self.model, self._ids, self.p)[1]
        else:
            algos = {row["tensor"]: row["algorithm"] + (" (sparse, exact)" if row["route"] == "sparse" else "")
                     for row in self.sync.summary()}
            if self.mode == "colltune":
                algos["mlp.*"] = "allreduce (DDP over the MLP only)"
            if self.hook is not None:
                for key, st in self.hook.stats.items():
                    if "/" not in key and key.startswith("bucket"):
                        algos[f"DDP {key}, steps < {self.cfg['warmup']}"] = f"{st.algorithm} ({st.reason})"
                    else:
                        label = "DDP " + key if key.startswith("bucket") else key
                        algos[label] = f"{st.algorithm} ({st.route}: {st.reason})"
        # Evaluation on a fixed held-out batch, the same for every mode and rank.
        with torch.no_grad():
            ids, y = self.data.batch(10_000, 0, self.cfg["eval_batch"])
            eval_loss = float(self.loss_fn(self.model(ids.to(self.device)), y.to(self.device)))
        t = torch.tensor(self.times, dtype=torch.float64)
        if self.p > 1:  # a step takes as long as its slowest rank
            t = t.to(self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = {
            "mode": self.mode,
            "step_times": t.cpu().tolist(),
            "cpu_times": self.cpu,
            "losses": self.losses,
            "eval_loss": eval_loss,
            "bytes_per_step": self.sent,
            "algorithms": algos,
        }
        self.net = self.opt = self.sync = self.hook = self.model = None  # type: ignore[assignment]
        gc.collect()
        return out


def _median_step(run: dict, skip: int) -> float:
    ts = run["step_times"][skip:] or run["step_times"]
    return statistics.median(ts)


def rank_main(rank: int, world_size: int, cfg: dict) -> list[dict] | None:
    """Run every requested mode (``--bench``: interleaved, repeated) on this rank; rank 0 returns the runs."""
    device = torch.device("cpu")
    if cfg["backend"] == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    data = ClickData(cfg["rows"], cfg["fields"], cfg["zipf"], cfg["seed"])
    runs = []
    every = cfg["log_every"]
    for rep in range(cfg["repeats"]):
        if cfg["interleave"] == "step":
            # All modes side by side, one step each in turn (the order rotates every step),
            # so that a busy moment on a shared machine hits every mode alike.
            if rank == 0 and every:
                print(f"== {', '.join(cfg['modes'])}: interleaved per step (repeat {rep + 1} of {cfg['repeats']}, "
                      f"P={world_size})", flush=True)
            active = [Run(m, cfg, data, rank, world_size, device) for m in cfg["modes"]]
            for step in range(cfg["steps"]):
                k = step % len(active)
                for r in active[k:] + active[:k]:
                    r.step(step, rank == 0 and every > 0 and (step % every == 0 or step == cfg["steps"] - 1))
            done = [r.finish() for r in active]
            del active
        else:
            done = []
            for mode in cfg["modes"]:
                if rank == 0 and every:
                    print(f"== {mode} (repeat {rep + 1} of {cfg['repeats']}, P={world_size})", flush=True)
                r = Run(mode, cfg, data, rank, world_size, device)
                for step in range(cfg["steps"]):
                    r.step(step, rank == 0 and every > 0 and (step % every == 0 or step == cfg["steps"] - 1))
                done.append(r.finish())
                del r
        for run in done:
            run["repeat"] = rep
            runs.append(run)
            if rank == 0:
                _print_run(run, cfg)
    return runs if rank == 0 else None


def _print_run(run: dict, cfg: dict) -> None:
    skip = cfg["skip"]
    mib = statistics.median(run["bytes_per_step"][skip:] or run["bytes_per_step"]) / 2**20
    cpu = statistics.median(run["cpu_times"][skip:] or run["cpu_times"]) * 1e3
    print(f"-- {run['mode']}: median step {_median_step(run, skip) * 1e3:.1f} ms (CPU {cpu:.1f} ms on rank 0), "
          f"final train loss {run['losses'][-1]:.5f}, eval loss {run['eval_loss']:.5f}, sent {mib:.2f} MiB/step")
    for tensor, algo in run["algorithms"].items():
        print(f"     {tensor:<30} {algo}")


def summarize(runs: list[dict], cfg: dict, world_size: int) -> dict:
    """Medians per mode over the repeats, the speed-up of colltune, and the loss gaps."""
    skip = cfg["skip"]
    per_mode: dict[str, dict] = {}
    for mode in cfg["modes"]:
        rs = [r for r in runs if r["mode"] == mode]
        per_mode[mode] = {
            "median_step_ms": statistics.median(_median_step(r, skip) for r in rs) * 1e3,
            "step_ms_per_repeat": [round(_median_step(r, skip) * 1e3, 1) for r in rs],
            "cpu_ms_rank0": statistics.median(t for r in rs for t in (r["cpu_times"][skip:] or r["cpu_times"])) * 1e3,
            "eval_loss": rs[-1]["eval_loss"],
            "final_train_loss": rs[-1]["losses"][-1],
            "mib_per_step": statistics.median(rs[-1]["bytes_per_step"][skip:] or rs[-1]["bytes_per_step"]) / 2**20,
            "algorithms": rs[-1]["algorithms"],
        }
    out: dict[str, Any] = {"world_size": world_size, "config": cfg, "modes": per_mode}
    base = [m for m in ("ddp-dense", "ddp-sparse") if m in per_mode]
    if base:
        out["best_ddp"] = min(base, key=lambda m: per_mode[m]["median_step_ms"])
    out["speedup_vs_best_ddp"] = {}
    for mode in EXACT_MODES:
        if base and mode in per_mode:
            out["speedup_vs_best_ddp"][mode] = _speedup(runs, per_mode, base, out["best_ddp"], mode, cfg)
    if "colltune" in out["speedup_vs_best_ddp"]:  # colltune's speedup under flat keys too, for readers of the summary
        sp = out["speedup_vs_best_ddp"]["colltune"]
        out["speedup_colltune_vs_best_ddp"] = sp["median_step"]
        out["speedup_per_repeat"] = sp["per_repeat"]
        out["speedup_median_of_step_ratios"] = sp["median_of_step_ratios"]
    if "ddp-dense" in per_mode:
        ref = per_mode["ddp-dense"]["eval_loss"]
        out["loss_gap_vs_ddp_dense"] = {m: (v["eval_loss"] - ref) / ref for m, v in per_mode.items()}
    return out


def _speedup(runs: list[dict], per_mode: dict, base: list[str], best: str, mode: str, cfg: dict) -> dict:
    """How much faster ``mode`` steps than the faster DDP mode ``best`` (of ``base``): overall, per repeat, per step."""
    skip = cfg["skip"]
    out: dict[str, Any] = {"median_step": per_mode[best]["median_step_ms"] / per_mode[mode]["median_step_ms"]}
    reps, ratios = [], []
    for rep in range(cfg["repeats"]):
        # Per repeat: the ratio measured within one interleaved round.
        row = {r["mode"]: r for r in runs if r["repeat"] == rep}
        if mode in row and all(m in row for m in base):
            reps.append(min(_median_step(row[m], skip) for m in base) / _median_step(row[mode], skip))
            # Per step: steps taken side by side (interleaved per step).
            for i in range(skip, len(row[mode]["step_times"])):
                ratios.append(min(row[m]["step_times"][i] for m in base) / row[mode]["step_times"][i])
    out["per_repeat"] = [round(x, 2) for x in reps]
    out["median_of_step_ratios"] = statistics.median(ratios) if ratios else float("nan")
    return out


def _print_summary(s: dict) -> None:
    print(f"\n== summary (P={s['world_size']}, medians over {s['config']['repeats']} interleaved repeats, "
          f"{s['config']['steps']} steps each, first {s['config']['skip']} not timed)")
    print(f"{'mode':<18} {'step ms':>9} {'CPU ms':>8} {'MiB/step':>9} {'eval loss':>10} {'gap vs (a)':>11}  "
          "per repeat (ms)")
    for mode, v in s["modes"].items():
        gap = s.get("loss_gap_vs_ddp_dense", {}).get(mode)
        gap_s = f"{gap * 100:+.3f}%" if gap is not None else "-"
        print(f"{mode:<18} {v['median_step_ms']:9.1f} {v['cpu_ms_rank0']:8.1f} {v['mib_per_step']:9.2f} "
              f"{v['eval_loss']:10.5f} {gap_s:>11}  "
              f"{v['step_ms_per_repeat']}")
    for mode, sp in s.get("speedup_vs_best_ddp", {}).items():
        print(f"{mode} vs the faster DDP ({s['best_ddp']}): {sp['median_step']:.2f}x faster per step "
              f"(per repeat: {sp['per_repeat']}; median of per-step ratios: {sp['median_of_step_ratios']:.2f})")


def parse_args(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="local ranks to start (ignored under torchrun)")
    ap.add_argument("--mode", nargs="+", choices=MODES, default=["colltune"],
                    help="how gradients are synchronized")
    ap.add_argument("--bench", action="store_true", help="run all five modes, interleaved and repeated")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--interleave", choices=("step", "run"), default=None,
                    help="step: all modes side by side, one step each in turn (default with several modes); "
                         "run: one mode after the other")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the median step time")
    ap.add_argument("--batch", type=int, default=4096, help="samples per rank per step")
    ap.add_argument("--eval-batch", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--fields", type=int, default=26)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids within a field")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--algorithm", default="auto", choices=("auto", *registry.names()),
                    help="colltune's algorithm for the embedding gradient")
    # The hook compresses: every registered algorithm but the dense-like ones (priced on the whole tensor).
    ap.add_argument("--topk-algorithm", default="auto",
                    choices=("auto", *(n for n in registry.names() if registry.get(n).topk_priced_on != "tensor")))
    ap.add_argument("--density", type=float, default=0.01, help="top-k density of the MLP gradients")
    ap.add_argument("--warmup", type=int, default=5, help="dense steps before top-k compression starts")
    ap.add_argument("--policy", default=None, help="a policy YAML file (rules may name parameters, e.g. 'mlp.4.*')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--log-every", type=int, default=5, help="print every this many steps (0: only summaries)")
    ap.add_argument("--json", default=None, help="write the runs and the summary to this file")
    a = ap.parse_args(argv)
    cfg = {k.replace("-", "_"): v for k, v in vars(a).items()}
    modes = list(MODES) if a.bench else list(dict.fromkeys(a.mode))
    if a.backend == "nccl":
        _check_gpus(ap, a.ranks)
    cfg["skipped"] = {m: NCCL_SKIPS[m] for m in modes if a.backend == "nccl" and m in NCCL_SKIPS}
    cfg["modes"] = [m for m in modes if m not in cfg["skipped"]]
    if not cfg["modes"]:
        ap.error("nothing to run on nccl: " + "; ".join(f"{m}: {why}" for m, why in cfg["skipped"].items()))
    if cfg["interleave"] is None:
        cfg["interleave"] = "step" if len(cfg["modes"]) > 1 else "run"
    return cfg


def _check_gpus(ap: argparse.ArgumentParser, ranks: int) -> None:
    """``ap.error`` unless each rank on this machine can have a GPU of its own (NCCL refuses two ranks on one)."""
    if not torch.cuda.is_available():
        ap.error(f"--backend nccl needs CUDA, which is not available here (torch {torch.__version__}); "
                 "use --backend gloo")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])) if in_torchrun() else ranks
    gpus = torch.cuda.device_count()
    if local > gpus:
        ap.error(f"--backend nccl needs a GPU per rank: {local} ranks on this machine, {gpus} GPU(s)")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if not in_torchrun() or os.environ.get("RANK") == "0":
        for mode, why in cfg["skipped"].items():
            print(f"skipping {mode}: {why}", flush=True)
    if in_torchrun():
        runs = run_here(rank_main, cfg, backend=cfg["backend"], pg_timeout=600)
        world_size = int(os.environ["WORLD_SIZE"])
        if runs is None:
            return 0
    else:
        world_size = cfg["ranks"]
        runs = run_local(rank_main, world_size, cfg, backend=cfg["backend"], timeout=24 * 3600, pg_timeout=600)[0]
    summary = summarize(runs, cfg, world_size)
    _print_summary(summary)
    if cfg["json"]:
        with open(cfg["json"], "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
