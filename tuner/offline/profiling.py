"""Measure the cluster: time every algorithm over a grid of calls, fit the cost model, write a profile.

``colltune profile`` runs :func:`run_profile`; ``colltune fit`` refits and
cross-validates a profile (:func:`fit_profile`); ``colltune demo`` profiles
this machine quickly and benchmarks the result. Active profiling (measuring
only where the decision is uncertain) lives in :mod:`colltune.offline.active`.

What one profiling run does
---------------------------

1. **Primitives.** For each world size, every rank times ``all_reduce``,
   ``all_gather``, ``all_to_all``, one point-to-point step and a local copy
   over a few message sizes (interleaved, medians), and a non-negative
   least-squares fit gives each primitive's ``launch_us``, ``alpha_us`` and
   ``beta_us_per_byte`` under the schedules :mod:`colltune.model.cost_model` prices.
2. **Sweep.** For each configuration of the grid (rows ``n``, density,
   overlap, dtype) every rank builds its input from a shared seed with
   :class:`~colltune.offline.workloads.Workload` (exact, controlled overlap), warms each
   algorithm up, then times rounds in which every algorithm runs once, in an
   order rotated each round (:mod:`colltune.offline.bench`'s engine). A call's time is
   the max over ranks; the median over rounds (``--statistic``: or their
   lower quartile) is recorded as ``time_us`` with the interquartile range
   as ``spread_us``, and the statistic used as the profile's
   ``meta.statistic``. The union size recorded is the exact one, read off
   the result. Configurations run in a shuffled (seeded) order, so that load
   from other processes spreads over the grid instead of skewing one corner.
3. **Journal.** Rank 0 appends each finished configuration to a JSON-lines
   journal next to the output (``OUT.journal.jsonl``) and ``fsync``\\ s it. An
   interrupted run (Ctrl-C, a crash, a kill, ``--budget``) keeps everything it
   measured; ``--resume`` measures only what the journal (and an existing
   output profile) lacks.
4. **Fit and write.** The learned cost model is fitted on the measurements
   with the measured primitives as its prior, and the profile (metadata,
   primitives, measurements, model) is written to a temporary file and
   renamed (:func:`colltune.model.profile.save_profile`). The journal is removed once
   the whole grid is in the profile.

Example:
    >>> from colltune.offline.profiling import Grid, run_profile
    >>> grid = Grid.preset("quick")
    >>> result = run_profile("profiles/local.yaml", [2, 4], grid)  # doctest: +SKIP
    >>> result.profile.meta["world_sizes"]                         # doctest: +SKIP
    [2, 4]
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import random
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from colltune.algorithms import registry
from colltune.algorithms.errors import ColltuneValueError
from colltune.algorithms.registry import BUILTIN_NAMES
from colltune.model.profile import (
    Measurement,
    Primitive,
    Profile,
    learned_columns,
    load_profile,
    profile_from_measurements,
    save_profile,
)

if TYPE_CHECKING:
    from colltune.model.cost_model import LearnedCostModel

__all__ = [
    "ALGORITHMS",
    "GRIDS",
    "JOURNAL_FORMAT",
    "ProfilingError",
    "Grid",
    "ProfileConfig",
    "TimingPlan",
    "Journal",
    "ProfileResult",
    "STATISTICS",
    "summarize",
    "timed_rounds",
    "measure_config",
    "measure_primitives",
    "measure_host",
    "host_terms",
    "run_profile",
    "fit_primitives",
    "fit_model",
    "fit_profile",
    "format_fit_report",
    "journal_path",
    "check_output_path",
    "setup_device",
    "profile_meta",
]

logger = logging.getLogger(__name__)

#: The built-in algorithms, whose times are the learned model's columns. A profile measures every registered
#: algorithm (plugins too: the learned model leaves them to their schedules, the report and simulate read them).
ALGORITHMS: tuple[str, ...] = BUILTIN_NAMES
#: First line of a journal; a journal of another format is refused.
JOURNAL_FORMAT = "colltune-profile-journal/1"
DTYPES = ("float32", "float64", "float16", "bfloat16")


class ProfilingError(ColltuneValueError):
    """A profiling run cannot start or continue: bad options, an unusable journal or output path (exit status 2)."""


# --------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Grid:
    """The configurations a profile sweeps, per world size.

    Attributes:
        n: dense rows.
        density: entries per rank over ``n`` (``k = round(density * n)``, at least 1).
        overlap: requested overlap of the ranks' index sets, in [0, 1]; raised
            where ``n`` is too small for it (the achieved one is recorded).
        dtype: value dtypes.
        row_numel: elements per value row (1: a 1-D gradient).
        seed: input seed, and the seed of the measuring order.
    """

    n: tuple[int, ...]
    density: tuple[float, ...]
    overlap: tuple[float, ...]
    dtype: tuple[str, ...] = ("float32",)
    row_numel: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n", "density", "overlap", "dtype"):
            if not getattr(self, name):
                raise ProfilingError(f"the grid needs at least one value of {name}, but got none.")
        for n in self.n:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ProfilingError(f"grid n must be integers >= 1, but got {n!r}.")
        for d in self.density:
            if not 0.0 < d <= 1.0:
                raise ProfilingError(f"grid density must be in (0, 1], but got {d!r}.")
        for o in self.overlap:
            if not 0.0 <= o <= 1.0:
                raise ProfilingError(f"grid overlap must be in [0, 1], but got {o!r}.")
        for t in self.dtype:
            if t not in DTYPES:
                raise ProfilingError(f"grid dtype must be among {', '.join(DTYPES)}, but got {t!r}.")
        if self.row_numel < 1:
            raise ProfilingError(f"grid row_numel must be >= 1, but got {self.row_numel}.")

    @classmethod
    def preset(cls, name: str, **override: Any) -> "Grid":
        """Return the grid ``quick`` or ``full`` (:data:`GRIDS`), with fields replaced by ``override`` when given."""
        if name not in GRIDS:
            raise ProfilingError(f"--grid must be one of {', '.join(GRIDS)}, but got {name!r}.")
        fields = dict(GRIDS[name])
        fields.update({k: v for k, v in override.items() if v is not None})
        for k in ("n", "density", "overlap", "dtype"):
            fields[k] = tuple(fields[k])
        return cls(**fields)

    def configs(self, world_size: int) -> list["ProfileConfig"]:
        """Return the distinct configurations at ``world_size``, in grid order.

        Two requested points that give the same call (same ``k`` after
        rounding, same shared count after the overlap is raised to fit) are
        measured once.
        """
        from colltune.offline.workloads import k_for_density, shared_count

        out: dict[str, ProfileConfig] = {}
        for dtype in self.dtype:
            for n in self.n:
                for d in self.density:
                    k = k_for_density(n, d)
                    for o in self.overlap:
                        s = k if world_size == 1 else shared_count(n, k, world_size, o)
                        cfg = ProfileConfig(world_size, n, k, s, dtype, self.row_numel, self.seed)
                        out.setdefault(cfg.key, cfg)
        return list(out.values())

    def as_dict(self) -> dict[str, Any]:
        """Return the grid as plain data (journal header, profile metadata)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


#: The built-in grids. ``quick`` takes about a minute for P = 2 and 4 on two
#: cores; ``full`` is the grid the active-profiling comparison uses (about
#: 400 configurations per world size).
GRIDS: dict[str, dict[str, Any]] = {
    "quick": {
        "n": (2**14, 2**16, 2**18),
        "density": (1e-3, 1e-2, 1e-1),
        "overlap": (0.0, 1.0),
        "dtype": ("float32",),
    },
    "full": {
        "n": (2**12, 2**14, 2**16, 2**18, 2**20),
        "density": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
        "overlap": (0.0, 0.25, 0.5, 0.75, 1.0),
        "dtype": ("float32", "float16"),
    },
}


@dataclass(frozen=True)
class ProfileConfig:
    """One call to measure: every rank holds ``k`` entries of ``n`` rows, ``shared`` of them common to all ranks.

    The overlap is ``shared / k`` and the union ``shared + P (k - shared)``
    (:class:`~colltune.offline.workloads.Workload`).
    """

    world_size: int
    n: int
    k: int
    shared: int
    dtype: str = "float32"
    row_numel: int = 1
    seed: int = 0

    @property
    def key(self) -> str:
        """A stable name of the call, used by the journal to know what was measured."""
        return f"P{self.world_size}-n{self.n}-r{self.row_numel}-{self.dtype}-k{self.k}-s{self.shared}"

    @property
    def union(self) -> int:
        """The exact union size of the ranks' index sets."""
        return self.shared + self.world_size * (self.k - self.shared)

    @property
    def overlap(self) -> float:
        """The overlap ``(K - u) / (K - k_max)`` (1 for one rank)."""
        return 1.0 if self.world_size == 1 else self.shared / self.k

    @property
    def density(self) -> float:
        """Entries per rank over ``n``."""
        return self.k / self.n

    def workload(self) -> Any:
        """Return the input generator of this call."""
        import torch

        from colltune.offline.workloads import Workload

        row_shape = () if self.row_numel == 1 else (self.row_numel,)
        w = Workload(self.n, self.k, self.world_size, self.shared / self.k, row_shape=row_shape,
                     dtype=getattr(torch, self.dtype), seed=self.seed)
        if w.shared != self.shared:  # shared_count rounds the same way; a mismatch is a bug
            raise ColltuneValueError(f"workload of {self.key} has {w.shared} shared indices, expected {self.shared}.")
        return w

    def features(self) -> Any:
        """Return the :class:`~colltune.model.features.Features` of this call (exact union)."""
        from colltune.model.features import Features

        return Features.build(numel=self.n, row_numel=self.row_numel, dtype=self.dtype,
                              k_per_rank=[self.k] * self.world_size, union=float(self.union))

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as plain data."""
        return asdict(self)


@dataclass(frozen=True)
class TimingPlan:
    """How many calls each configuration gets.

    Rounds (every algorithm once, in a rotated order) go on until the median
    of every algorithm is known to ``precision`` (its standard error, from
    the interquartile range, over the median), at least ``min_repeats`` and
    at most ``max_repeats`` rounds, and no new round after ``budget_s``
    seconds. Fast calls thus get many rounds and slow ones few; on a noisy
    machine the spread recorded says how far to trust each median.
    """

    warmup: int = 1
    min_repeats: int = 5
    max_repeats: int = 41
    budget_s: float = 1.5
    precision: float = 0.04

    @classmethod
    def for_grid(cls, name: str) -> "TimingPlan":
        """Return the plan of a built-in grid.

        ``quick``: 3 to 9 rounds in 0.4 s to 8%; ``full``: 5 to 41 in 1.5 s to 4%.
        """
        return cls(1, 3, 9, 0.4, 0.08) if name == "quick" else cls()

    def bench_plan(self) -> Any:
        from colltune.offline.bench import Plan

        return Plan(warmup=self.warmup, min_repeats=self.min_repeats, max_repeats=self.max_repeats,
                    budget_s=self.budget_s)


def _median_rel_se(ts: Sequence[float]) -> float:
    """Return the standard error of the median over the median, estimated from the interquartile range."""
    if len(ts) < 3:
        return math.inf
    q1, med, q3 = np.percentile(ts, [25, 50, 75])
    return 1.2533 * (q3 - q1) / 1.349 / math.sqrt(len(ts)) / med if med > 0 else math.inf


def timed_rounds(calls: Mapping[str, Callable[[], Any]],
                 plan: TimingPlan) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Time interleaved rounds until every median is precise enough (collective: every rank calls it).

    Each round runs every call once, in an order rotated each round, each
    after a barrier; a call's time is the max over ranks of its wall time.
    Every rank takes the same stopping decision from the same reduced numbers.

    Returns:
        The times (seconds, max over ranks) per call, and the last output of each.
    """
    from colltune.offline import bench

    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    elapsed = [0.0]

    def record(local: dict[str, float], start: float) -> None:
        red = bench.reduce_max([local[n] for n in names] + [time.perf_counter() - start])
        for n, t in zip(names, red):
            times[n].append(t)
        elapsed[0] = red[-1]

    def done(start: float) -> bool:
        return elapsed[0] >= plan.budget_s or all(_median_rel_se(times[n]) <= plan.precision for n in names)

    last = bench.run_rounds(calls, plan, record, done)
    return times, last


# --------------------------------------------------------------------------- the journal


def journal_path(out: str | os.PathLike[str]) -> str:
    """Return the journal of the profile written to ``out``: ``OUT.journal.jsonl`` next to it."""
    return os.fspath(out) + ".journal.jsonl"


class Journal:
    """The append-only record of a profiling run, one JSON object per line, each ``fsync``\\ ed.

    Line 1 is a header (``{"format": JOURNAL_FORMAT, "backend": ..., ...}``);
    then ``{"kind": "config", "key": ..., "measurements": [...]}`` per
    configuration and ``{"kind": "primitives", "world_size": P, "samples": [...]}``
    per world size. A last line cut short by a kill is dropped (and cut off
    the file) when the journal is opened again.

    Args:
        path: the file.
        header: the run's header; when the file exists it must agree on ``backend``.

    Raises:
        ProfilingError: the file is not a journal, or of another backend.
    """

    def __init__(self, path: str, header: Mapping[str, Any]) -> None:
        self.path = path
        self.header = dict(header)
        self.configs: dict[str, list[dict[str, Any]]] = {}
        #: Every round's time (us) per algorithm, per configuration, where the journal has them.
        self.raw: dict[str, dict[str, list[float]]] = {}
        self.primitives: dict[int, list[dict[str, Any]]] = {}
        if os.path.exists(path):
            self._load()
        else:
            self._append(dict(self.header, format=JOURNAL_FORMAT))

    def _load(self) -> None:
        with open(self.path, "rb") as fh:
            raw = fh.read()
        good_end = 0
        lines = []
        pos = 0
        while pos < len(raw):
            nl = raw.find(b"\n", pos)
            if nl < 0:  # a last line without its newline: cut short by a kill
                break
            chunk = raw[pos:nl]
            try:
                lines.append(json.loads(chunk.decode("utf-8")))
            except (UnicodeDecodeError, ValueError):
                if raw.find(b"\n", nl + 1) >= 0:
                    raise ProfilingError(
                        f"{self.path}: line {len(lines) + 1} of the journal is not JSON; the journal is corrupt. "
                        "Delete it to start over (what it recorded will be measured again)."
                    ) from None
                break
            pos = nl + 1
            good_end = pos
        if good_end < len(raw):
            logger.warning("journal %s: dropping a last line cut short (%d bytes)", self.path, len(raw) - good_end)
            with open(self.path, "r+b") as fh:
                fh.truncate(good_end)
                fh.flush()
                os.fsync(fh.fileno())
        if not lines or not isinstance(lines[0], dict) or lines[0].get("format") != JOURNAL_FORMAT:
            raise ProfilingError(
                f"{self.path}: not a colltune profiling journal (expected a first line with format "
                f"{JOURNAL_FORMAT!r}); move it away or pass another --out."
            )
        head = lines[0]
        if head.get("backend") != self.header.get("backend"):
            raise ProfilingError(
                f"{self.path}: the interrupted run measured backend {head.get('backend')!r}, this one asks for "
                f"{self.header.get('backend')!r}; pass --backend {head.get('backend')} to resume it, or delete "
                "the journal to start over."
            )
        for rec in lines[1:]:
            if not isinstance(rec, dict):
                continue
            if rec.get("kind") == "config" and isinstance(rec.get("key"), str):
                self.configs[rec["key"]] = list(rec.get("measurements") or [])
                if isinstance(rec.get("times_us"), dict):
                    self.raw[rec["key"]] = rec["times_us"]
            elif rec.get("kind") == "primitives" and isinstance(rec.get("world_size"), int):
                self.primitives[rec["world_size"]] = list(rec.get("samples") or [])

    def _append(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)

    def add_config(self, key: str, measurements: Sequence[Mapping[str, Any]], **extra: Any) -> None:
        """Record one configuration's measurements (durably, before returning)."""
        self._append({"kind": "config", "key": key, "measurements": list(measurements), **extra})
        self.configs[key] = list(measurements)
        if isinstance(extra.get("times_us"), dict):
            self.raw[key] = extra["times_us"]

    def add_primitives(self, world_size: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Record the primitive timings of one world size."""
        self._append({"kind": "primitives", "world_size": world_size, "samples": list(samples)})
        self.primitives[world_size] = list(samples)

    def measurements(self, statistic: str = "median") -> list[Measurement]:
        """Return every recorded measurement, in journal order, its time the ``statistic`` of its rounds."""
        out = []
        for key, ms in self.configs.items():
            raw = self.raw.get(key, {})
            for d in ms:
                m = Measurement(**d)
                if statistic != "median" and raw.get(m.algorithm):
                    t, spread = summarize(raw[m.algorithm], statistic)
                    m = dataclasses.replace(m, time_us=t, spread_us=spread)
                out.append(m)
        return out


# --------------------------------------------------------------------------- rank side


def setup_device(backend: str) -> Any:
    import torch

    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        import torch.distributed as dist

        if "LOCAL_RANK" not in os.environ and torch.cuda.device_count():
            local = dist.get_rank() % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def measure_config(rank: int, world_size: int, cfg: ProfileConfig, algorithms: Sequence[str],
                   plan: TimingPlan, device: Any = None,
                   raw: dict[str, list[float]] | None = None) -> list[dict[str, Any]] | None:
    """Time every algorithm on one configuration (collective: every rank calls it); return the measurements on rank 0.

    Args:
        rank: this rank.
        world_size: the group size; must equal ``cfg.world_size``.
        cfg: the call.
        algorithms: what to time, interleaved.
        plan: warm-up and rounds.
        device: where the tensors live (CPU for gloo).
        raw: if given, filled on rank 0 with every round's time per algorithm (us).

    Returns:
        On rank 0, one :class:`~colltune.model.profile.Measurement` mapping per
        algorithm (``time_us`` the median; :func:`run_profile` replaces it by
        the lower quartile of the rounds the journal keeps when its
        ``statistic`` asks so); ``None`` on the other ranks.

    Raises:
        ColltuneValueError: two algorithms disagree on the union (a bug).
    """
    import torch

    import colltune
    from colltune.offline import bench

    device = device or torch.device("cpu")
    w = cfg.workload()
    idx, vals = w.make(rank)
    idx, vals = idx.to(device), vals.to(device)

    def call_of(name: str) -> Callable[[], Any]:
        group = bench.contender_group(name)  # its own group: no other algorithm sizes its eager slot

        def call() -> Any:
            out = colltune.sparse_allreduce(idx, vals, cfg.n, algorithm=name, group=group)
            bench.sync_device(device)
            return out

        return call

    calls = {a: call_of(a) for a in algorithms}
    _warm_up(calls, cfg, plan)
    times, last = timed_rounds(calls, plan)
    sent = bench.reduce_max([float(last[a].traffic.bytes_sent) for a in algorithms])
    if rank != 0:
        return None
    feats = cfg.features()
    out = []
    for j, a in enumerate(algorithms):
        t_us, spread = summarize([t * 1e6 for t in times[a]], "median")
        m = Measurement.from_features(feats, a, time_us=t_us, spread_us=spread, repeats=len(times[a]),
                                      bytes_sent=int(sent[j]))
        out.append(m.to_dict())
        if raw is not None:
            raw[a] = [round(t * 1e6, 3) for t in times[a]]
    return out


def _warm_up(calls: dict[str, Callable[[], Any]], cfg: ProfileConfig, plan: TimingPlan) -> None:
    """Run every call ``plan.warmup`` times (at least once), rotating who goes first; check they agree on the union."""
    import torch.distributed as dist

    algorithms = list(calls)
    unions: dict[str, int] = {}
    for i in range(max(1, plan.warmup)):
        order = algorithms[i % len(algorithms):] + algorithms[: i % len(algorithms)]
        for a in order:
            dist.barrier()
            unions[a] = int(calls[a]().indices.numel())
    if len(set(unions.values())) != 1 or next(iter(unions.values())) != cfg.union:
        raise ColltuneValueError(f"{cfg.key}: algorithms disagree on the union size: {unions} (expected {cfg.union}).")


#: How a configuration's rounds become one time: the median (default), or the lower quartile, which
#: ignores the rounds that other processes slowed down (their interference only ever adds time).
STATISTICS: tuple[str, ...] = ("median", "lower-quartile")


def summarize(times_us: Sequence[float], statistic: str = "median") -> tuple[float, float]:
    """Return ``(time, spread)`` of a configuration's rounds: the statistic and the interquartile range (us)."""
    ts = np.asarray(times_us, dtype=np.float64)
    q1, med, q3 = np.percentile(ts, [25, 50, 75]) if ts.size > 1 else (ts[0], ts[0], ts[0])
    value = med if statistic == "median" else q1
    return max(float(value), 1e-3), float(q3 - q1)


#: Message sizes (bytes) the primitives are timed at.
PRIMITIVE_SIZES: tuple[int, ...] = (64, 4096, 65536, 1 << 20, 4 << 20)
PRIMITIVE_SIZES_QUICK: tuple[int, ...] = (64, 16384, 1 << 20)


def _primitive_calls(world_size: int, nbytes: int,
                     device: Any) -> dict[str, tuple[Callable[[], Any], dict[str, float]]]:
    """Return, per primitive, a timed call and its ``{calls, steps, bytes}`` under the cost model's schedules."""
    import torch
    import torch.distributed as dist

    from colltune.algorithms.comm import Comm

    p = world_size
    comm = Comm(None, device)
    elems = max(1, nbytes // 4)
    buf = torch.ones(elems, dtype=torch.float32, device=device)
    per_peer = torch.ones(elems * p, dtype=torch.float32, device=device)
    counts = [elems] * p
    recv = torch.empty(elems, dtype=torch.float32, device=device)
    src = torch.randn(elems * 4, device=device)
    dst = torch.empty_like(src)
    me = dist.get_rank() if p > 1 else 0
    out: dict[str, tuple[Callable[[], Any], dict[str, float]]] = {}
    if p > 1:
        out["all_reduce"] = (lambda: comm.all_reduce(buf),
                             {"calls": 1, "steps": 2 * (p - 1), "bytes": 2 * (p - 1) / p * elems * 4})
        out["all_gather"] = (lambda: comm.all_gather(buf), {"calls": 1, "steps": p - 1, "bytes": (p - 1) * elems * 4})
        out["all_to_all"] = (lambda: comm.all_to_all(per_peer, counts, counts),
                             {"calls": 1, "steps": p - 1, "bytes": (p - 1) * elems * 4})

        def p2p() -> None:
            for work in comm.exchange([(buf, (me + 1) % p)], [(recv, (me - 1) % p)]):
                work.wait()

        out["p2p"] = (p2p, {"calls": 1, "steps": 1, "bytes": elems * 4})
    out["local"] = (lambda: dst.copy_(src), {"calls": 0, "steps": 1, "bytes": 2 * src.numel() * 4})
    return out


def measure_primitives(rank: int, world_size: int, sizes: Sequence[int], plan: TimingPlan,
                       device: Any = None) -> list[dict[str, Any]] | None:
    """Time the collective primitives at ``sizes`` bytes (collective); return the samples on rank 0.

    Each sample is ``{"primitive", "size", "calls", "steps", "bytes", "time_us", "spread_us", "repeats"}``
    with ``calls``, ``steps`` and ``bytes`` as :mod:`colltune.model.cost_model` counts them.
    """
    import torch

    from colltune.offline import bench

    device = device or torch.device("cpu")
    samples: list[dict[str, Any]] = []
    for size in sizes:
        prims = _primitive_calls(world_size, size, device)

        def timed(fn: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                r = fn()
                bench.sync_device(device)
                return r

            return call

        calls = {name: timed(fn) for name, (fn, _) in prims.items()}
        for fn in calls.values():  # warm-up
            fn()
        bplan = plan.bench_plan()
        from colltune.offline.bench import Plan

        bplan = Plan(warmup=0, min_repeats=max(5, bplan.min_repeats), max_repeats=max(11, bplan.max_repeats),
                     budget_s=bplan.budget_s)
        times, _ = bench.budget_rounds(calls, bplan)
        names = list(calls)
        rounds = len(times[names[0]])
        flat = bench.reduce_max([t for name in names for t in times[name]])
        for j, name in enumerate(names):
            ts = np.asarray(flat[j * rounds:(j + 1) * rounds]) * 1e6
            q1, med, q3 = np.percentile(ts, [25, 50, 75])
            samples.append({"primitive": name, "size": int(size), **prims[name][1], "time_us": float(max(med, 1e-3)),
                            "spread_us": float(q3 - q1), "repeats": int(rounds)})
    return samples if rank == 0 else None


#: The calls that time a call's host cost (:func:`measure_host`): ``(rows, entries, row width)``, small
#: enough that their kernels take a few microseconds each.
HOST_CALLS: tuple[tuple[int, int, int], ...] = ((1 << 16, 64, 1), (1 << 12, 64, 64))


def measure_host(world_size: int, algorithms: Sequence[str], device: Any, rounds: int = 25) -> list[dict[str, Any]]:
    """Time small calls of each algorithm on rank 0 alone (collective: every rank creates the one-rank group).

    In a group of one rank no byte crosses a wire, so a small call's time is
    its host cost: the front door's Python, its kernel launches and its host
    synchronizations, which is what an NCCL profile's ``host_*`` figures
    price (:class:`colltune.model.cost_model.Network`). Each call runs after
    its device's queue drained, and is timed until it drained again.

    Returns:
        On rank 0, per algorithm and call of :data:`HOST_CALLS`, a sample
        ``{"primitive": "host", "algorithm", "n", "k", "row_numel", "kernels",
        "syncs", "time_us", "repeats"}``, ``kernels`` and ``syncs`` the
        algorithm's declared counts (``HOST_KERNELS``, ``HOST_SYNCS``) that
        the profile multiplies; an empty list on the other ranks.
    """
    import torch
    import torch.distributed as dist

    import colltune
    from colltune.offline import bench

    alone = dist.new_group([0]) if world_size > 1 else None
    if world_size > 1 and dist.get_rank() != 0:
        return []
    gen = torch.Generator().manual_seed(0)
    samples = []
    for n, k, row in HOST_CALLS:
        idx = torch.randint(0, n, (k,), generator=gen).to(device)
        vals = torch.randn((k, row) if row > 1 else (k,), generator=gen).to(device)
        for name in algorithms:
            alg = registry.get(name)
            if "exact" not in alg.HOST_KERNELS or "exact" not in alg.HOST_SYNCS:
                continue  # no declared counts (a plugin's may have none): nothing to fit its time to
            times = []
            for i in range(rounds + 3):  # three warm-up calls fill the call site's caches
                bench.sync_device(device)
                t0 = time.perf_counter()
                colltune.sparse_allreduce(idx, vals, n, algorithm=name, group=alone)
                bench.sync_device(device)
                if i >= 3:
                    times.append((time.perf_counter() - t0) * 1e6)
            samples.append({"primitive": "host", "algorithm": name, "n": n, "k": k, "row_numel": row,
                            "kernels": int(alg.HOST_KERNELS["exact"]), "syncs": int(alg.HOST_SYNCS["exact"]),
                            "time_us": float(np.median(times)), "repeats": rounds})
    return samples


#: What :func:`host_terms` fits, in the order of its design matrix's columns.
HOST_TERMS: tuple[str, ...] = ("host_call_us", "host_kernel_us", "host_sync_us")


def host_terms(samples: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Fit an NCCL profile's host cost to :func:`measure_host`'s samples; return the ``meta`` entries, or ``{}``.

    The fit is ``time_us = host_call_us + host_kernel_us * kernels +
    host_sync_us * syncs`` by non-negative least squares of the relative
    error over every sample (other samples are skipped). It needs calls
    whose ``(kernels, syncs)`` span a plane (three algorithms with counts not
    on one line); otherwise it returns ``{}`` and the profile prices no host
    cost. ``host_source`` says where the figures come from.

    Example:
        >>> rows = [{"primitive": "host", "kernels": k, "syncs": s, "time_us": 300 + 10 * k + 50 * s}
        ...         for k, s in [(30, 1), (40, 1), (60, 3), (90, 2)]]
        >>> {k: round(v) for k, v in host_terms(rows).items() if k != "host_source"}
        {'host_call_us': 300, 'host_kernel_us': 10, 'host_sync_us': 50}
    """
    rows = [s for s in samples if s.get("primitive") == "host"]
    A = np.array([[1.0, float(s["kernels"]), float(s["syncs"])] for s in rows]).reshape(len(rows), 3)
    if len(rows) < 3 or np.linalg.matrix_rank(A) < 3:
        return {}
    t = np.array([float(s["time_us"]) for s in rows])
    x = _nonnegative_relative_fit(A, t)
    err = np.abs(A @ x / t - 1)
    out: dict[str, Any] = {name: round(float(v), 3) for name, v in zip(HOST_TERMS, x)}
    algs = sorted({str(s.get("algorithm", "?")) for s in rows})
    out["host_source"] = (f"colltune profile: {len(rows)} small calls of {', '.join(algs)} alone on one rank, "
                          f"fitted on each algorithm's HOST_KERNELS and HOST_SYNCS, the counts of a call at P >= 2 "
                          f"(one rank skips some of that work: an approximation; median error "
                          f"{float(np.median(err)):.0%}, largest {float(err.max()):.0%})")
    return out


def _nonnegative_relative_fit(A: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Return ``x >= 0`` minimizing the relative error of ``A @ x`` against ``t`` (columns scaled to unit norm)."""
    from scipy.optimize import lsq_linear

    M = A / t[:, None]
    norms = np.sqrt((M**2).sum(axis=0))
    norms[norms == 0] = 1.0
    res = lsq_linear(M / norms, np.ones(len(t)), bounds=(0.0, np.inf), method="bvls")
    return np.asarray(res.x / norms, dtype=np.float64)


def _parent_gone(parent: int | None) -> bool:
    if parent is None:
        return False
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _should_stop(deadline: float | None, parent: int | None) -> bool:
    """Return whether any rank is past the deadline or lost its launcher (collective: every rank stops together).

    A launcher killed outright (SIGKILL) cannot stop its ranks; they notice
    here, before the next configuration, instead of writing to a journal a
    resumed run may be reading.
    """
    import torch
    import torch.distributed as dist

    stop = float((deadline is not None and time.time() >= deadline) or _parent_gone(parent))
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([stop], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        stop = float(t.item())
    return stop > 0


class _Progress:
    """Rank 0's progress: a tqdm bar with ETA on a terminal, else a line every tenth of the run."""

    def __init__(self, total: int, done: int, desc: str, enabled: bool) -> None:
        self.total, self.done, self.desc = total, done, desc
        self.enabled = enabled
        self.start = time.monotonic()
        self.start_done = done
        self.bar = None
        self.step = max(1, total // 10)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc=desc, unit="config", file=sys.stderr,
                            dynamic_ncols=True, mininterval=0.5)

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (self.done % self.step == 0 or self.done == self.total):
            el = time.monotonic() - self.start
            rate = (self.done - self.start_done) / el if el > 0 else 0.0
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            print(f"{self.desc}: {self.done}/{self.total} configurations, {format_seconds(el)} elapsed, "
                  f"ETA {format_seconds(eta)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _profile_rank(rank: int, world_size: int, todo: Sequence[ProfileConfig], algorithms: Sequence[str],
                  plan: TimingPlan, prim_sizes: Sequence[int] | None, journal: str, header: Mapping[str, Any],
                  deadline: float | None, progress: tuple[int, int] | None, backend: str,
                  parent: int | None = None) -> dict[str, Any] | None:
    """The rank function of one world size: primitives (unless journaled), then the configurations.

    Rank 0 appends every finished piece to the journal at once. Every rank
    stops at the same configuration once the deadline passed. Returns, on
    rank 0, ``{"measured": int, "stopped": bool}``.
    """
    import torch.distributed as dist

    device = setup_device(backend)
    jr = Journal(journal, header) if rank == 0 else None
    if world_size > 1:
        # Rank 0 knows what the journal holds (under torchrun the others do not): its plan is everyone's.
        shared = [list(todo), prim_sizes]
        dist.broadcast_object_list(shared, src=0)
        todo, prim_sizes = shared
    if prim_sizes:
        samples = measure_primitives(rank, world_size, prim_sizes, plan, device)
        if device.type == "cuda":  # a GPU call's host cost: the NCCL model's host term (host_terms)
            host = measure_host(world_size, algorithms, device)
            samples = None if samples is None else samples + host
        if jr is not None and samples is not None:
            jr.add_primitives(world_size, samples)
    bar = _Progress(progress[1], progress[0], f"profile P={world_size}", progress is not None) \
        if rank == 0 and progress is not None else None
    measured, stopped = 0, False
    try:
        for cfg in todo:
            if _should_stop(deadline, parent):
                stopped = True
                break
            t0 = time.perf_counter()
            raw: dict[str, list[float]] = {}
            ms = measure_config(rank, world_size, cfg, algorithms, plan, device, raw)
            if jr is not None and ms is not None:
                jr.add_config(cfg.key, ms, seconds=round(time.perf_counter() - t0, 3), times_us=raw)
            measured += 1
            if bar is not None:
                bar.update()
    finally:
        if bar is not None:
            bar.close()
    return {"measured": measured, "stopped": stopped} if rank == 0 else None


# --------------------------------------------------------------------------- fitting


def fit_primitives(samples: Iterable[Mapping[str, Any]],
                   prior: Mapping[str, Primitive] | None = None) -> dict[str, Primitive]:
    """Fit ``launch + steps * alpha + bytes * beta`` per primitive to timed samples.

    Non-negative least squares of the relative error. With samples from one
    world size only, ``launch`` and ``alpha`` cannot be told apart (both are
    paid once per call), so ``launch`` is set to 0 and ``alpha`` takes the
    whole fixed cost. Primitives without samples keep their ``prior``.

    Args:
        samples: as :func:`measure_primitives` returns them (any world sizes).
        prior: constants for primitives without samples (default
            :data:`colltune.model.cost_model.DEFAULT_PRIMITIVES`).

    Returns:
        Constants for ``all_reduce``, ``all_gather``, ``all_to_all``, ``p2p`` and ``local``.
    """
    from colltune.model.cost_model import DEFAULT_PRIMITIVES

    by: dict[str, list[Mapping[str, Any]]] = {}
    for s in samples:
        if s.get("primitive") != "host":  # a call's host cost (host_terms), not a collective's
            by.setdefault(str(s["primitive"]), []).append(s)
    out = dict(prior or DEFAULT_PRIMITIVES)
    for name, rows in by.items():
        A = np.array([[float(r["calls"]), float(r["steps"]), float(r["bytes"])] for r in rows])
        t = np.array([float(r["time_us"]) for r in rows])
        use_launch = len({(r["calls"], r["steps"]) for r in rows}) > 1 and A[:, 0].any()
        cols = [0, 1, 2] if use_launch else [1, 2]
        x = np.zeros(3)
        x[cols] = _nonnegative_relative_fit(A[:, cols], t)
        out[name] = Primitive(alpha_us=float(x[1]), beta_us_per_byte=float(x[2]), launch_us=float(x[0]))
    return out


def fit_model(measurements: Sequence[Measurement],
              primitives: Mapping[str, Primitive] | None = None) -> "LearnedCostModel":
    """Return a :class:`~colltune.model.cost_model.LearnedCostModel` fitted on ``measurements``.

    ``primitives`` are its prior.
    """
    from colltune.model.cost_model import LearnedCostModel

    prior = None if primitives is None else {k: p.to_dict() for k, p in primitives.items()}
    return LearnedCostModel(primitives=prior).fit(list(measurements))


#: GPU generations of the NCCL model (profiles/nccl-tuning.yaml), by a word of the device's name.
_GPU_NAMES = {"V100": "v100", "A100": "a100", "A800": "a100", "H100": "h100", "H800": "h100", "H200": "h100"}


def gpu_generation() -> str | None:
    """Return the NCCL model's generation of this process's CUDA device (``h100``...), or ``None``."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().upper()
    return next((gen for word, gen in _GPU_NAMES.items() if word in name), None)


def profile_meta(backend: str, world_sizes: Sequence[int], grid: Grid | None, notes: str) -> dict[str, Any]:
    import torch

    from colltune.offline import launch

    if launch.in_torchrun():
        ws = int(os.environ["WORLD_SIZE"])
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
        nodes = max(1, ws // max(1, per_node))
    else:
        per_node, nodes = max(world_sizes), 1
    meta: dict[str, Any] = {
        "backend": backend,
        "world_sizes": sorted(set(int(p) for p in world_sizes)),
        "nodes": nodes,
        "ranks_per_node": per_node,
        "torch_version": str(torch.__version__),
        "host": socket.gethostname(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "notes": notes,
    }
    gpu = gpu_generation() if backend == "nccl" else None
    if gpu is not None:
        meta["gpu"] = gpu  # the NCCL model's layout for this cluster (colltune.model.cost_model.Network)
    if grid is not None:
        meta["grid"] = grid.as_dict()
    return meta


# --------------------------------------------------------------------------- the driver


@dataclass
class ProfileResult:
    """What :func:`run_profile` did.

    Attributes:
        profile: the profile written.
        path: where.
        configs_total: configurations in the grid (all world sizes).
        configs_resumed: of those, already in the journal or the old profile.
        configs_measured: measured by this run.
        complete: whether every configuration is in the profile (else the
            journal is kept for ``--resume``).
        elapsed_s: wall time.
    """

    profile: Profile
    path: str
    configs_total: int
    configs_resumed: int
    configs_measured: int
    complete: bool
    elapsed_s: float
    journal: str = ""
    world_sizes: list[int] = field(default_factory=list)


def check_output_path(path: str, option: str = "--out") -> None:
    """Raise :class:`ProfilingError` unless a file can be created at ``path`` (checked before a long run)."""
    if os.path.isdir(path):
        raise ProfilingError(f"{option} {path!r} is a directory; pass a file name such as "
                             f"{os.path.join(path, 'cluster.yaml')!r}.")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ProfilingError(f"{option} {path!r}: the directory {directory!r} does not exist; create it first.")
    probe = os.path.join(directory, f".colltune-probe-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ProfilingError(f"{option} {path!r} cannot be written ({exc.strerror}); pass a path in a writable "
                             "directory.") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ProfilingError(f"{option} {path!r} exists and is read-only; pass another path or make it writable.")


def _previous_profile(out: str, backend: str) -> tuple[list[Measurement], dict[str, Primitive] | None, list[int],
                                                     dict[str, Any]]:
    """Return what an existing profile at ``out`` holds, for ``--resume``.

    That is its measurements, primitives, the world sizes its primitives
    were timed at, and its host terms (:func:`host_terms`'s entries).
    """
    if not os.path.exists(out):
        return [], None, [], {}
    prof = load_profile(out)  # a corrupt file is an error: it would be overwritten
    if prof.meta.get("backend") != backend:
        raise ProfilingError(f"{out}: the existing profile is of backend {prof.meta.get('backend')!r}, "
                             f"not {backend!r}; pass another --out or --backend.")
    timed = [int(p) for p in prof.meta.get("primitives_timed_at") or []]
    host = {k: prof.meta[k] for k in (*HOST_TERMS, "host_source") if prof.meta.get(k) is not None}
    return list(prof.measurements), dict(prof.primitives), timed, host


def algorithm_order() -> Callable[[str], tuple[int, str]]:
    """A sort key of algorithm names: the registry's order, then names it does not know (a plugin not loaded here)."""
    rank = {a: i for i, a in enumerate(registry.names())}
    return lambda a: (rank.get(a, len(rank)), a)


def measurement_key(m: Measurement) -> str:
    # The workloads give every rank k entries, s of them shared: u = s + P (k - s).
    p, k = m.world_size, m.k_max
    s = round((p * k - m.union) / (p - 1)) if p > 1 else k
    return ProfileConfig(m.world_size, m.numel, m.k_max, int(s), m.dtype, m.row_numel).key


def _print_line(line: str) -> None:
    print(line, flush=True)


@dataclass(frozen=True)
class _RunOptions:
    """The keyword options of :func:`run_profile` (documented there), checked when built."""

    backend: str = "gloo"
    plan: TimingPlan = field(default_factory=TimingPlan)
    algorithms: Sequence[str] | None = None
    budget_s: float | None = None
    resume: bool = False
    progress: bool = True
    primitive_sizes: Sequence[int] = PRIMITIVE_SIZES
    timeout: float = 6 * 3600.0
    order: Callable[[list[ProfileConfig]], list[ProfileConfig]] | None = None
    notes: str = ""
    log: Callable[[str], None] = _print_line
    statistic: str = "median"
    keep_journal: bool = False

    def __post_init__(self) -> None:
        if self.statistic not in STATISTICS:
            raise ProfilingError(f"--statistic must be one of {', '.join(STATISTICS)}, but got {self.statistic!r}.")
        known = registry.names()
        if self.algorithms is None:
            object.__setattr__(self, "algorithms", known)  # every registered algorithm (frozen: set once, here)
        for a in self.algorithms:
            if a not in known:
                raise ProfilingError(f"algorithms must be registered ones ({', '.join(known)}), but got {a!r}; a plugin's "
                                     f"module must be named in {registry.PLUGINS_ENV} on every rank.")


def run_profile(
    out: str, world_sizes: Sequence[int], grid: Grid, *, backend: str = "gloo", plan: TimingPlan | None = None,
    algorithms: Sequence[str] | None = None, budget_s: float | None = None, resume: bool = False, progress: bool = True,
    primitive_sizes: Sequence[int] = PRIMITIVE_SIZES, timeout: float = 6 * 3600.0,
    order: Callable[[list[ProfileConfig]], list[ProfileConfig]] | None = None, notes: str = "",
    log: Callable[[str], None] | None = None, statistic: str = "median", keep_journal: bool = False,
) -> ProfileResult | None:
    """Measure ``grid`` at each world size, fit the model and write the profile to ``out``.

    Local ranks are started for each world size
    (:func:`colltune.offline.launch.run_local`); under ``torchrun`` the running ranks are
    used, and ``world_sizes`` must be their number or empty.

    Args:
        out: the profile file to write.
        world_sizes: ranks per run.
        grid: the configurations.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        plan: warm-up and rounds per configuration.
        algorithms: what to time.
        budget_s: no new configuration after this many seconds; the profile
            holds what was measured and the journal stays for ``--resume``.
        resume: continue the run recorded in the journal (and keep the
            measurements of an existing profile at ``out``).
        progress: show progress on rank 0.
        primitive_sizes: message sizes of the primitive timings.
        timeout: kill the ranks of one world size after this many seconds.
        order: reorders the configurations to measure (default: shuffled by ``grid.seed``).
        notes: free text for ``meta.notes``.
        log: where to print one-line status messages (default: stdout of rank 0).
        statistic: what ``time_us`` holds: the ``median`` of the rounds, or
            their ``lower-quartile`` (robust to other processes' load);
            recorded as the profile's ``meta.statistic``.
        keep_journal: keep the journal (every round's time) after a complete run.

    Returns:
        The result on rank 0 (or without ``torchrun``); ``None`` on other ranks.

    Raises:
        ProfilingError: an unknown statistic or algorithm; a journal exists
            without ``resume``, or is unusable; ``out`` cannot be written.
        colltune.offline.launch.RankError: a rank failed (what was measured stays in the journal).
    """
    options = _RunOptions(backend=backend, plan=plan or TimingPlan(), algorithms=algorithms, budget_s=budget_s,
                             resume=resume, progress=progress, primitive_sizes=primitive_sizes, timeout=timeout,
                             order=order, notes=notes, log=log or _print_line, statistic=statistic,
                             keep_journal=keep_journal)
    return _run_profile(out, world_sizes, grid, options)


def _run_profile(out: str, world_sizes: Sequence[int], grid: Grid, options: _RunOptions) -> ProfileResult | None:
    """Measure, fit and write as :func:`run_profile` does, with its keyword options in ``options``."""
    started = time.monotonic()
    world_sizes, is_root = _run_world_sizes(world_sizes)
    if is_root and options.backend == "nccl":
        import torch  # noqa: F401  (NCCL's release is read from a loaded torch; measuring on NCCL needs it anyway)

        from colltune.select.selector import warn_nccl_version_once

        warn_nccl_version_once()  # what this run measures replaces the analytic model's NCCL release
    jpath = journal_path(out)
    header = {"backend": options.backend, "grid": grid.as_dict(), "algorithms": list(options.algorithms),
              "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}
    run = _RunState.open(out, jpath, header, options.backend, options.resume, is_root)
    per_p = {p: grid.configs(p) for p in world_sizes}
    total = sum(len(v) for v in per_p.values())
    resumed = sum(1 for v in per_p.values() for c in v if c.key in run.done_keys)
    if is_root and options.resume:
        options.log(f"resuming: {resumed} of {total} configurations already measured"
                    + (f" ({len(run.previous)} measurements from {out})" if run.previous else "")
                    + f"; {total - resumed} to go")
    deadline = None if options.budget_s is None else time.time() + options.budget_s
    launches = _Launches(grid, run, options, jpath, header, deadline, options.progress)
    measured, stopped = launches.run(world_sizes, per_p, is_root)
    if not is_root:
        return None
    profile, missing = _write_profile(out, Journal(jpath, header), run, per_p, grid, options)
    return ProfileResult(profile=profile, path=out, configs_total=total, configs_resumed=resumed,
                         configs_measured=measured, complete=missing == 0 and not stopped,
                         elapsed_s=time.monotonic() - started, journal="" if missing == 0 else jpath,
                         world_sizes=sorted({m.world_size for m in profile.measurements} | set(world_sizes)))


def _write_profile(out: str, journal: Journal, run: _RunState, per_p: dict[int, list[ProfileConfig]], grid: Grid,
                   options: _RunOptions) -> tuple[Profile, int]:
    """Write the profile of a run to ``out``; return it and how many configurations it lacks.

    ``journal`` is read after the ranks appended to it. The journal file is
    removed once nothing is missing, unless ``options.keep_journal``.
    """
    total = sum(len(v) for v in per_p.values())
    missing = total - sum(1 for v in per_p.values() for c in v if c.key in journal.configs or c.key in run.done_keys)
    note = options.notes or ("" if missing == 0 else f"partial: {missing} of {total} configurations not measured yet")
    profile = _profile_of_run(journal, run, sorted(per_p), grid, options.backend, note, options.statistic)
    save_profile(profile, out)
    if missing == 0 and not options.keep_journal:
        try:
            os.remove(journal.path)
        except OSError:
            pass
    return profile, missing


@dataclass
class _Launches:
    """One launch of ranks per world size, each measuring the configurations not done yet."""

    grid: Grid
    state: "_RunState"
    options: _RunOptions
    jpath: str
    header: dict[str, Any]
    deadline: float | None
    progress: bool

    def run(self, world_sizes: list[int], per_p: dict[int, list[ProfileConfig]], is_root: bool) -> tuple[int, bool]:
        """Return how many configurations were measured and whether the budget stopped the run."""
        from colltune.offline import launch

        measured = 0
        for p in world_sizes:
            todo = self._todo(p, per_p[p])
            need_prims = p not in self.state.done_prims and self.options.primitive_sizes
            if not launch.in_torchrun():  # under torchrun every rank must enter the launch: rank 0 decides inside
                if not todo and not need_prims:
                    continue
                if self.deadline is not None and time.time() >= self.deadline:
                    return measured, True
            got = self._launch(p, todo, bool(need_prims), len(per_p[p]))
            if not is_root:
                return measured, False
            measured += got["measured"]
            if got["stopped"]:
                return measured, True
        return measured, False

    def _todo(self, p: int, configs: list[ProfileConfig]) -> list[ProfileConfig]:
        """Return the configurations of world size ``p`` not done yet, in the order to measure them."""
        todo = [c for c in configs if c.key not in self.state.done_keys]
        if self.options.order is not None:
            return self.options.order(todo)
        random.Random(self.grid.seed * 7919 + p).shuffle(todo)
        return todo

    def _launch(self, p: int, todo: list[ProfileConfig], need_prims: bool, configs: int) -> Any:
        """Run :func:`_profile_rank` on ``p`` ranks (or the running ones); return rank 0's tally.

        ``configs`` is how many configurations world size ``p`` has in all:
        its progress bar counts those, starting at the ones already done, so
        each world size's bar ends at 100%.
        """
        from colltune.offline import launch

        o = self.options
        progress = (configs - len(todo), configs) if self.progress else None
        args = (todo, tuple(o.algorithms), o.plan, tuple(o.primitive_sizes) if need_prims else None,
                self.jpath, self.header, self.deadline, progress, o.backend,
                None if launch.in_torchrun() else os.getpid())
        if launch.in_torchrun():
            return launch.run_here(_profile_rank, *args, backend=o.backend)
        return launch.run_local(_profile_rank, p, *args, backend=o.backend, timeout=o.timeout)[0]


def _run_world_sizes(world_sizes: Sequence[int]) -> tuple[list[int], bool]:
    """Return the world sizes to measure and whether this process writes the profile.

    Under ``torchrun`` the running ranks are the one world size, and rank 0 writes.
    """
    from colltune.offline import launch

    is_root = True
    if launch.in_torchrun():
        r, here = launch.torchrun_rank()
        if world_sizes and list(world_sizes) != [here]:
            raise ProfilingError(
                f"--world-size {' '.join(map(str, world_sizes))} does not match the {here} ranks torchrun started; "
                f"omit --world-size under torchrun or pass --world-size {here}."
            )
        world_sizes, is_root = [here], r == 0
    out = sorted(set(int(p) for p in world_sizes))
    if not out or out[0] < 1:
        raise ProfilingError(f"--world-size must be >= 1, but got {out!r}.")
    return out, is_root


@dataclass
class _RunState:
    """What a profiling run starts from: the measurements and primitives of a resumed run, and what is done."""

    previous: list[Measurement]
    previous_prims: dict[str, Primitive] | None
    previous_ps: list[int]
    done_keys: set[str]
    done_prims: set[int]
    previous_host: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, out: str, jpath: str, header: dict[str, Any], backend: str, resume: bool,
             is_root: bool) -> "_RunState":
        """Check the output and the journal (rank 0 only) and read what an earlier run measured."""
        if not is_root:
            return cls([], None, [], set(), set())
        check_output_path(out)
        if os.path.exists(jpath) and not resume:
            raise ProfilingError(
                f"{jpath} holds an interrupted run of this profile; pass --resume to continue it "
                "(nothing it measured is measured again), or delete it to start over."
            )
        previous, prims, ps, host = _previous_profile(out, backend) if resume else ([], None, [], {})
        journal = Journal(jpath, header)
        return cls(previous, prims, ps, set(journal.configs) | {measurement_key(m) for m in previous},
                   set(journal.primitives) | (set(ps) if resume else set()), host)


def _profile_of_run(journal: Journal, run: _RunState, world_sizes: list[int], grid: Grid, backend: str,
                    note: str, statistic: str) -> Profile:
    """Return the profile of a run: the earlier and new measurements, the primitives' fit and the model."""
    by_key: dict[str, Measurement] = {}
    for m in [*run.previous, *journal.measurements(statistic)]:
        by_key[f"{measurement_key(m)}/{m.algorithm}"] = m
    order = algorithm_order()
    measurements = sorted(by_key.values(), key=lambda m: (m.world_size, m.dtype, m.numel, m.density, m.overlap,
                                                          order(m.algorithm)))
    samples = [s for ss in journal.primitives.values() for s in ss]
    # Fitted on this run's timings; a resumed run that timed none keeps the old profile's constants.
    primitives = fit_primitives(samples) if samples or run.previous_prims is None else run.previous_prims
    timed_at = sorted(set(journal.primitives) if samples else set(run.previous_ps if run.previous_prims else []))
    all_ps = sorted({m.world_size for m in measurements} | set(world_sizes))
    meta = profile_meta(backend, all_ps, grid, note)
    meta["primitives_timed_at"] = timed_at
    meta["statistic"] = statistic
    meta.update(host_terms(samples) or run.previous_host)  # a resumed run that timed nothing keeps the old terms
    model = None
    fitted = learned_columns(measurements)
    if len(fitted) >= 2:
        model = fit_model(fitted, primitives).to_dict()
    return profile_from_measurements(measurements, primitives, meta, model=model)


# --------------------------------------------------------------------------- fit


def _regret_summary(cv: Mapping[str, Any]) -> str:
    r = cv["regret"]
    return (f"regret on held-out configurations (time of the chosen algorithm / the fastest measured): "
            f"geomean {r['geomean']:.3f}, p95 {r['p95']:.3f}, max {r['max']:.3f}, "
            f"optimal in {100 * r['optimal_fraction']:.0f}% of {r['n_configs']}")


def fit_profile(profile: Profile, *, folds: int | None = 5, estimator: str = "gbr") -> tuple[Profile, dict[str, Any]]:
    """Cross-validate and fit the learned model on a profile's measurements.

    Args:
        profile: a measured profile.
        folds: ``GroupKFold`` folds over configurations (``None``: leave one configuration out).
        estimator: the correction regressor of :class:`~colltune.model.cost_model.LearnedCostModel`.

    Returns:
        The profile with ``model`` set (plain data) and the report:
        ``{"cv": cross_validate(...), "cv_analytic": ..., "fit_s": float}``
        where ``cv_analytic`` is the calibrated alpha-beta model alone, for comparison.

    Raises:
        ProfilingError: the profile has too few measurements or configurations.
    """
    from colltune.model.cost_model import LearnedCostModel, cross_validate, default_group

    ms = list(profile.measurements)
    groups = {default_group(m) for m in ms}
    if len(ms) < 2 or len(groups) < 2:
        raise ProfilingError(
            f"the profile has {len(ms)} measurements of {len(groups)} configurations; fitting needs at least 2 "
            "configurations. Profile more (colltune profile)."
        )
    prior = {k: p.to_dict() for k, p in profile.primitives.items()}
    t0 = time.perf_counter()
    model = LearnedCostModel(estimator=estimator, primitives=prior)  # type: ignore[arg-type]
    splits = None if folds is None else max(2, min(int(folds), len(groups)))
    cv = cross_validate(ms, model=model, n_splits=splits)
    cv_an = cross_validate(ms, model=LearnedCostModel(estimator="none", primitives=prior), n_splits=splits)
    fitted = LearnedCostModel(estimator=estimator, primitives=prior).fit(ms)  # type: ignore[arg-type]
    fit_s = time.perf_counter() - t0
    meta = dict(profile.meta)
    meta["fit"] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "estimator": estimator,
        "folds": splits if splits is not None else "leave-one-configuration-out",
        "median_rel_error": {a: v["median_rel_error"] for a, v in cv["per_algorithm"].items()},
        "regret_geomean": cv["regret"]["geomean"],
        "regret_p95": cv["regret"]["p95"],
        "optimal_fraction": cv["regret"]["optimal_fraction"],
    }
    out = Profile(kind=profile.kind, meta=meta, primitives=dict(profile.primitives),
                  measurements=ms, model=fitted.to_dict())
    return out, {"cv": cv, "cv_analytic": cv_an, "fit_s": fit_s}


def format_fit_report(report: Mapping[str, Any]) -> str:
    """Return the cross-validation report of :func:`fit_profile` as text."""
    cv, an = report["cv"], report["cv_analytic"]
    lines = [
        f"cross-validation: {cv['n_measurements']} measurements, {cv['n_groups']} configurations, "
        f"{cv['n_folds']} folds (each fold's configurations held out of the fit)",
        "",
        f"{'algorithm':<10} {'n':>5} {'median rel. error':>18} {'p90 rel. error':>15} {'alpha-beta only':>16}",
    ]
    for a, v in cv["per_algorithm"].items():
        base = an["per_algorithm"].get(a, {}).get("median_rel_error", float("nan"))
        lines.append(f"{a:<10} {v['n']:>5} {100 * v['median_rel_error']:>17.1f}% {100 * v['p90_rel_error']:>14.1f}% "
                     f"{100 * base:>15.1f}%")
    lines += ["", "learned model: " + _regret_summary(cv), "alpha-beta only: " + _regret_summary(an)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- commands


