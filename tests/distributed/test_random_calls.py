"""Randomized calls on world sizes, dtypes, index widths and row widths nobody tuned to.

Each seed draws a case: the size (up to 2^33 rows, so int64 indices travel),
the row shape (scalars to 64, empty rows, 2-d rows), the value and index
dtypes, the pattern (uniform, a hot set, ranks left empty, every rank the
same indices), the entries per rank (0 to 3000) and the op. On fresh ranks
(so that the eager slot starts where a job's does), every registered
algorithm runs it on the host and the device path, twice each, and a fused
call runs it with two more cases beside single calls of the same three.
Checked in the parent against a float64 reference built from the case
alone:

* the indices are the union, the values within the dtype's tolerance
  (two unit roundoffs for 16-bit values; 1e-5 relative for fp32);
* every rank holds the same bits, and a repeat gives the same bits;
* the device path gives the host path's bits (dense at P >= 3 aside: on
  gloo its host path sums small buffers in rank order, its device path
  runs gloo's ring, as NCCL's would be);
* a fused call gives each tensor its single call's bits.

Twelve seeds per world size 1 to 4 in the fast suite, forty per world size
up to 8 behind the ``slow`` marker.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from colltune.algorithms import names

from harness import run_ranks
from sparse_cases import UNIT_ROUNDOFF, raw

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Relative tolerance of the summed magnitudes: two unit roundoffs for 16-bit values (see dense.py); for fp32,
#: looser than the suite's RTOL, as a hot row here sums up to 8 x 3000 entries, a rounding per addition.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2 * UNIT_ROUNDOFF[torch.float16] + 1e-6,
       torch.bfloat16: 2 * UNIT_ROUNDOFF[torch.bfloat16] + 1e-5}
#: ... plus, where a result is subnormal (fp16 below 2^-14, as an avg over five ranks gets), two roundings of
#: half its fixed spacing: a relative bound does not hold there.
TINY = {torch.float64: 0.0, torch.float32: 0.0, torch.float16: 2.0**-24, torch.bfloat16: 0.0}


def draw(seed: int) -> dict:
    r = random.Random(seed)
    size = r.choice([1, 7, 100, 1000, 5000, 1 << 16, 1 << 20, 1 << 33])
    return {
        "seed": seed, "size": size,
        "row": r.choice([(), (1,), (3,), (2, 5), (16,), (33,), (0,), (64,)]),
        "dtype": r.choice(DTYPES),
        "index_dtype": r.choice([torch.int32, torch.int64]) if size < 2**31 else torch.int64,
        "pattern": r.choice(["uniform", "hot", "some empty", "same"]),
        "kmax": r.choice([0, 1, 5, 50, 500, 3000]),
        "op": r.choice(["sum", "avg"]),
    }


def make(c: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s indices and values of case ``c`` (any process builds any rank's)."""
    g = torch.Generator().manual_seed(c["seed"] * 1000 + rank)
    k = random.Random(c["seed"] * 1000 + rank).randint(0, c["kmax"])
    if c["pattern"] == "some empty" and rank % 2 == 0:
        k = 0
    n = c["size"]
    shared = torch.Generator().manual_seed(c["seed"])
    if c["pattern"] == "hot":
        hot = torch.randint(0, n, (min(n, 20),), generator=shared)
        idx = hot[torch.randint(0, hot.numel(), (k,), generator=g)]
    elif c["pattern"] == "same":
        idx = torch.randint(0, n, (k,), generator=shared)
    else:
        idx = torch.randint(0, n, (k,), generator=g)
    vals = torch.randn((k, *c["row"]), generator=g, dtype=torch.float64).to(c["dtype"])
    return idx.to(c["index_dtype"]), vals


def reference(c: dict, world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The union, its float64 sums and the summed magnitudes (divided by P for avg)."""
    parts = [make(c, q) for q in range(world_size)]
    idx = torch.cat([i.long() for i, _ in parts])
    vals = torch.cat([v.double() for _, v in parts])
    union, inverse = torch.unique(idx, return_inverse=True)
    sums = torch.zeros((union.numel(), *c["row"]), dtype=torch.float64).index_add_(0, inverse, vals)
    mags = torch.zeros_like(sums).index_add_(0, inverse, vals.abs())
    if c["op"] == "avg":
        sums, mags = sums / world_size, mags / world_size
    return union, sums, mags


def algorithms_for(seed: int) -> list[str]:
    """The registered algorithms, less dense where a case's dense buffer would not be small (it raises there)."""
    small = all(c["size"] * max(1, math.prod(c["row"])) <= 4_000_000 for c in (draw(s) for s in family(seed)))
    return [a for a in names() if a != "dense" or small]


def family(seed: int) -> tuple[int, int, int]:
    """The case's seed and the seeds of the two cases a fused call takes beside it."""
    return seed, seed + 7777, seed + 9999


def _calls(rank: int, world_size: int, seeds: list[int]) -> dict:
    import colltune
    from colltune.algorithms.sparse import device_path

    out = {}
    for seed in seeds:
        c = draw(seed)
        idx, vals = make(c, rank)
        items = [(i, v, cc["size"]) for cc in map(draw, family(seed)) for i, v in [make(cc, rank)]]
        for algorithm in algorithms_for(seed):
            for device in (False, True):
                with device_path(device):
                    runs = [colltune.sparse_allreduce(idx, vals, c["size"], op=c["op"], algorithm=algorithm)
                            for _ in range(2)]
                    fused = colltune.sparse_allreduce_many(items, op=c["op"], algorithm=algorithm)
                    single = [colltune.sparse_allreduce(i, v, n, op=c["op"], algorithm=algorithm) for i, v, n in items]
                out[seed, algorithm, device] = {
                    "runs": [(r.indices, r.values) for r in runs],
                    "fused": [(raw(f.indices), raw(f.values)) for f in fused],
                    "single": [(raw(s.indices), raw(s.values)) for s in single],
                }
    return out


def _check(world_size: int, seeds: list[int]) -> None:
    out = run_ranks(_calls, world_size, seeds, timeout=600)
    for seed in seeds:
        c = draw(seed)
        union, sums, mags = reference(c, world_size)
        for algorithm in algorithms_for(seed):
            for device in (False, True):
                where = f"seed {seed} {c} {algorithm} on the {'device' if device else 'host'} path"
                got = out[0][seed, algorithm, device]
                idx, vals = got["runs"][0]
                assert torch.equal(idx, union), where
                assert vals.dtype == c["dtype"] and tuple(vals.shape) == (union.numel(), *c["row"]), where
                err = (vals.double() - sums).abs()
                assert bool((err <= TOL[c["dtype"]] * mags + TINY[c["dtype"]]).all()), (where, float(err.max()))
                mine = [(raw(i), raw(v)) for i, v in got["runs"]]
                assert mine[0] == mine[1], f"{where}: a repeat differs"
                assert got["fused"] == got["single"], f"{where}: a fused call differs from its single calls"
                for r in range(1, world_size):
                    theirs = out[r][seed, algorithm, device]
                    assert [(raw(i), raw(v)) for i, v in theirs["runs"]] == mine, f"{where}: rank {r} differs"
                    assert theirs["fused"] == got["fused"], f"{where}: rank {r}'s fused call differs"
            if algorithm != "dense" or world_size <= 2:
                host, dev = out[0][seed, algorithm, False]["runs"][0], out[0][seed, algorithm, True]["runs"][0]
                assert raw(host[1]) == raw(dev[1]), f"seed {seed} {algorithm}: the device path's bits differ"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_random_calls_on_every_path(world_size: int) -> None:
    _check(world_size, list(range(100 * world_size, 100 * world_size + 12)))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7, 8])
def test_more_random_calls_on_every_path(world_size: int) -> None:
    _check(world_size, list(range(1000 * world_size, 1000 * world_size + 40)))
