"""Measure how far 16-bit sums land from a float64 reference, per algorithm and world size.

The figures ``algorithms/dense.py`` quotes come from here. Each case: rows
of 16, 200 entries per rank on 64 rows (many duplicates, every row shared),
values from a normal draw rounded to the dtype, ``sum`` and ``avg``. Every
registered algorithm runs it, and dense also with ``wire="value"`` (16 bits
on the wire, as DDP reduces). The figure is the worst element's error over
the summed magnitudes (divided by P for ``avg``), in units of the
dense-reference suite's tolerance (``tests/sparse_cases.py``: 8e-3 for
bf16, 1e-3 for fp16) and of the dtype's unit roundoff. Usage::

    python tools/accuracy16.py                 # 40 cases, P = 2, 3, 4 and 8
    python tools/accuracy16.py --cases 5 -P 2 3
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from colltune.offline import launch  # noqa: E402

from sparse_cases import RTOL, UNIT_ROUNDOFF  # noqa: E402

ROWS, WIDTH, ENTRIES = 64, 16, 200


def inputs(case: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s indices and values of case ``case`` (any process builds any rank's)."""
    g = torch.Generator().manual_seed(case * 100 + rank)
    return torch.randint(0, ROWS, (ENTRIES,), generator=g), torch.randn(ENTRIES, WIDTH, generator=g).to(dtype)


def contenders() -> list[tuple[str, str, dict | None]]:
    """``(label, algorithm, knobs)``: every registered algorithm, and dense with 16 bits on the wire."""
    from colltune.algorithms import names

    return [(a, a, None) for a in names()] + [("dense, 16-bit wire", "dense", {"wire": "value"})]


def _rank(rank: int, world_size: int, cases: int) -> dict:
    import colltune

    torch.set_num_threads(1)
    out, each = {}, contenders()
    for dtype in UNIT_ROUNDOFF:  # the 16-bit dtypes
        for op in ("sum", "avg"):
            for case in range(cases):
                idx, vals = inputs(case, rank, dtype)
                for label, algorithm, knobs in each:
                    res = colltune.sparse_allreduce(idx, vals, ROWS, op=op, algorithm=algorithm, knobs=knobs)
                    out[dtype, op, case, label] = res.values
    return out


def worst(world_size: int, cases: int) -> dict[tuple[torch.dtype, str], float]:
    """Per dtype and contender, the worst element's error over the summed magnitudes (a fraction of them)."""
    got = launch.run_local(_rank, world_size, cases, backend="gloo", timeout=1800)[0]
    refs: dict[tuple[torch.dtype, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    out: dict[tuple[torch.dtype, str], float] = {}
    for (dtype, op, case, label), values in got.items():
        if (dtype, op, case) not in refs:  # the same for every contender
            parts = [inputs(case, r, dtype) for r in range(world_size)]
            ref = torch.zeros(ROWS, WIDTH, dtype=torch.float64)
            mag = torch.zeros_like(ref)
            for idx, vals in parts:
                ref.index_add_(0, idx, vals.double())
                mag.index_add_(0, idx, vals.double().abs())
            if op == "avg":
                ref, mag = ref / world_size, mag / world_size
            union = torch.unique(torch.cat([idx for idx, _ in parts]))
            refs[dtype, op, case] = ref[union], mag[union]
        ref, mag = refs[dtype, op, case]
        e = float(((values.double() - ref).abs() / mag).max())
        out[dtype, label] = max(out.get((dtype, label), 0.0), e)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=40, help="random cases per world size, dtype and op (default 40)")
    ap.add_argument("--world-size", "-P", type=int, nargs="+", default=[2, 3, 4, 8])
    args = ap.parse_args(argv)
    if args.cases < 1 or min(args.world_size) < 1:
        ap.error("--cases and every --world-size must be >= 1")
    print("worst element's error / summed magnitudes, in units of the suite's tolerance (and of the unit roundoff)")
    for p in args.world_size:
        w = worst(p, args.cases)
        for dtype in UNIT_ROUNDOFF:
            name = str(dtype).replace("torch.", "")
            cells = "  ".join(f"{label} {e / RTOL[dtype]:.2f} ({e / UNIT_ROUNDOFF[dtype]:.2f} u)"
                              for (d, label), e in w.items() if d == dtype)
            print(f"P={p} {name:<9} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
