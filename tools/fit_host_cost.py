"""Fit an NCCL profile's host cost (``host_call_us``, ``host_sync_us``) to per-call GPU measurements.

The input is a per-call file as ``tools/gpu_call_bench.py --json`` writes it
(``rows``) or the team's ``h100-per-call.json`` (a list of rows): per input,
each algorithm's median ms (``<algorithm>_ms`` or ``{algorithm: {ms,
syncs}}``) and its host syncs. At P = 1 no byte crosses a wire, so a call's
time is its host cost and its kernels; the fit is the least-squares line
``ms * 1000 = host_call_us + host_sync_us * syncs`` over the exact calls of
every algorithm, and it prints both constants and its median and largest
relative error. ``profiles/analytic-nccl.yaml`` holds this fit of the H100 file::

    python tools/fit_host_cost.py h100-per-call.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from colltune.algorithms import names

#: Every registered algorithm: each one's exact calls are points of the fit.
ALGORITHMS = names()


def points(rows: list[dict]) -> list[tuple[float, float]]:
    """``(syncs, us)`` of every exact call with counted syncs, in either file's layout."""
    out = []
    for row in rows:
        if "n" not in row or row.get("n") is None:
            continue  # a top-k row
        for a in ALGORITHMS:
            got = row.get(a) if isinstance(row.get(a), dict) else {"ms": row.get(f"{a}_ms"), "syncs": row.get(f"{a}_syncs")}
            if got.get("ms") is not None and got.get("syncs"):
                out.append((float(got["syncs"]), float(got["ms"]) * 1e3))
    return out


def fit(pts: list[tuple[float, float]]) -> tuple[float, float, float, float]:
    """Return ``(call_us, sync_us, median relative error, largest relative error)``."""
    x = np.array([[1.0, s] for s, _ in pts])
    y = np.array([t for _, t in pts])
    (call, sync), *_ = np.linalg.lstsq(x, y, rcond=None)
    err = np.abs(x @ np.array([call, sync]) / y - 1)
    return float(call), float(sync), float(np.median(err)), float(err.max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="per-call measurements (JSON)")
    args = ap.parse_args(argv)
    with open(args.file) as fh:
        data = json.load(fh)
    pts = points(data["rows"] if isinstance(data, dict) else data)
    if len({s for s, _ in pts}) < 2:
        ap.error(f"{args.file}: need exact calls with at least two different sync counts, got {len(pts)} calls")
    call, sync, med, worst = fit(pts)
    print(f"{len(pts)} calls: host_call_us {call:.0f}, host_sync_us {sync:.0f} "
          f"(median error {med:.0%}, largest {worst:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
