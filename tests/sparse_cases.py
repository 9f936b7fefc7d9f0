"""Deterministic sparse inputs, a float64 dense reference, and comparison helpers.

A *case* is a plain dict, so it pickles to the ranks and prints in test ids:

=============  ===============================================================
key            meaning
=============  ===============================================================
seed           base seed; rank ``r``'s data comes from ``seed * 1000 + r``
size           number of dense rows
counts         entries per rank before coalescing (duplicates included)
pattern        ``random`` (uniform indices, duplicates likely, unsorted),
               ``identical`` (the same index set on every rank: overlap 1),
               ``disjoint`` (index sets of different ranks never meet: overlap 0),
               ``cancel`` (duplicates whose values cancel to exactly 0),
               ``explicit`` (``indices`` / ``values``: one list per rank)
row_shape      shape of one row, ``()`` for scalars
dtype          value dtype name (float32, float64, float16, bfloat16)
index_dtype    int32 or int64
op             sum or avg
noncontig      pass non-contiguous index and value views
=============  ===============================================================

Every rank builds every rank's input from the case alone, so the parent can
build the reference without receiving the inputs.
"""

from __future__ import annotations

import math

import torch

from colltune import algorithms

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}

#: Relative tolerance per value dtype, applied to the sum of the magnitudes of
#: the summands at each position: about one unit in the last place of the
#: output dtype. 16-bit types are accumulated in fp32 and rounded once by
#: dense, twice by the sparse algorithms (each rank's sums travel in 16 bits):
#: at most two unit roundoffs (2^-7 bf16, 2^-10 fp16), just inside.
RTOL = {
    torch.float64: 1e-13,
    torch.float32: 2e-6,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}

#: The unit roundoff of each 16-bit dtype (half its machine epsilon): a rounding changes a value by at most this
#: fraction of it.
UNIT_ROUNDOFF = {dt: torch.finfo(dt).eps / 2 for dt in (torch.bfloat16, torch.float16)}

#: Every registered algorithm, then the front door's own choice: the dense-reference suites run each.
ALGORITHMS = (*algorithms.names(), "auto")


def case(**kw) -> dict:
    """Return a case with defaults filled in."""
    c = {
        "seed": 0,
        "size": 50,
        "counts": None,  # filled per world size by the caller
        "pattern": "random",
        "row_shape": (),
        "dtype": "float32",
        "index_dtype": "int64",
        "op": "sum",
        "noncontig": False,
        "requires_grad": False,
    }
    c.update(kw)
    c["row_shape"] = tuple(c["row_shape"])
    return c


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def make_input(c: dict, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return rank ``rank``'s (indices, values) for case ``c`` (deterministic)."""
    dtype = DTYPES[c["dtype"]]
    idtype = INDEX_DTYPES[c["index_dtype"]]
    row_shape = tuple(c["row_shape"])
    pattern = c["pattern"]
    if pattern == "explicit":
        idx = torch.tensor(c["indices"][rank], dtype=torch.int64)
        vals = torch.tensor(c["values"][rank], dtype=torch.float64).reshape((len(c["indices"][rank]),) + row_shape)
        return idx.to(idtype), vals.to(dtype)
    k = int(c["counts"][rank])
    size = int(c["size"])
    g = _gen(c["seed"] * 1000 + rank)
    if pattern == "random":
        idx = torch.randint(0, size, (k,), generator=g)
    elif pattern == "identical":
        shared = torch.randperm(size, generator=_gen(c["seed"] * 1000 + 999))[:k]
        idx = shared[torch.randperm(shared.numel(), generator=g)]  # same set, rank-specific order
    elif pattern == "disjoint":
        mine = torch.arange(rank, size, world_size)
        idx = mine[torch.randperm(mine.numel(), generator=g)[:k]]
    elif pattern == "cancel":
        half = torch.randint(0, size, (k // 2,), generator=g)
        idx = torch.cat((half, half.flip(0)))
    else:
        raise ValueError(f"unknown pattern {pattern!r}")
    shape = (idx.numel(),) + row_shape
    if pattern == "cancel":
        v = torch.randn((idx.numel() // 2,) + row_shape, generator=g, dtype=torch.float64).to(dtype)
        vals = torch.cat((v, -v.flip(0)))
    else:
        vals = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    idx = idx.to(idtype)
    if c.get("noncontig"):
        idx = torch.stack((idx, idx), dim=1)[:, 0]
        vals = torch.stack((vals, vals), dim=-1)[..., 1]
        assert (idx.numel() <= 1 or not idx.is_contiguous()) and (vals.numel() <= 1 or not vals.is_contiguous())
    if c.get("requires_grad"):
        vals.requires_grad_(True)  # e.g. values taken from a parameter: reduced as data, no graph
    return idx, vals


def reference(c: dict, world_size: int, ranks: list[int] | None = None) -> dict:
    """Return the float64 dense reference of the reduction over ``ranks`` (default: all).

    Keys: ``dense`` (``[size, *row_shape]`` float64), ``magnitude`` (sum of
    absolute summands, same shape, divided like ``dense`` for avg), ``union``
    (sorted unique int64 indices).
    """
    ranks = list(range(world_size)) if ranks is None else ranks
    size = int(c["size"])
    row_shape = tuple(c["row_shape"])
    dense = torch.zeros((size,) + row_shape, dtype=torch.float64)
    mag = torch.zeros_like(dense)
    idxs = []
    for r in ranks:
        idx, vals = make_input(c, r, world_size)
        idx = idx.to(torch.int64)
        v = vals.to(torch.float64)
        dense.index_add_(0, idx, v)
        mag.index_add_(0, idx, v.abs())
        idxs.append(idx)
    if c["op"] == "avg":
        dense /= len(ranks)
        mag /= len(ranks)
    union = torch.unique(torch.cat(idxs)) if idxs else torch.empty(0, dtype=torch.int64)
    return {"dense": dense, "magnitude": mag, "union": union}


def raw(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` (any dtype, bf16 included), for bitwise comparisons."""
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_close_to_reference(values: torch.Tensor, indices: torch.Tensor, ref: dict, dtype: torch.dtype, what: str):
    """Check the sparse result (``indices``, ``values``) against the dense reference."""
    rtol = RTOL[dtype]
    got = torch.zeros_like(ref["dense"])
    if indices.numel():
        got.index_copy_(0, indices, values.to(torch.float64))
    err = (got - ref["dense"]).abs()
    allowed = rtol * ref["magnitude"] + 1e-300
    bad = err > allowed
    if bool(bad.any()):
        pos = bad.nonzero()[0].tolist()
        pos_t = tuple(pos)
        n_bad = int(bad.sum())
        raise AssertionError(
            f"{what}: {n_bad} element(s) differ from the float64 reference beyond rtol={rtol} of the summed "
            f"magnitudes; first at {pos_t}: got {got[pos_t].item()!r}, expected {ref['dense'][pos_t].item()!r} "
            f"(allowed error {allowed[pos_t].item():.3g}, max error {err.max().item():.3g})"
        )


def overlap(c: dict, world_size: int) -> float:
    """The design's overlap of the coalesced index sets (0 disjoint, 1 identical)."""
    sets = [set(make_input(c, r, world_size)[0].tolist()) for r in range(world_size)]
    ks = [len(s) for s in sets]
    big_k, u = sum(ks), len(set().union(*sets))
    denom = big_k - max(ks)
    return math.nan if denom == 0 else (big_k - u) / denom
