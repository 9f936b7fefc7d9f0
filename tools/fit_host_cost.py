"""Fit an NCCL profile's host cost (``host_call_us``, ``host_kernel_us``, ``host_sync_us``) to per-call GPU measurements.

The input is a per-call file as ``tools/gpu_call_bench.py --json`` writes it
(``rows``) or the team's ``h100-per-call.json`` (a list of rows): per input,
each algorithm's median ms (``<algorithm>_ms`` or ``{algorithm: {ms,
syncs, launches}}``), its host syncs and, where counted, its kernel
launches. At P = 1 no byte crosses a wire, so a call's time is its host
cost and its kernels; the fit is the least-squares plane
``ms * 1000 = host_call_us + host_kernel_us * launches + host_sync_us * syncs``
over the exact calls of every algorithm (the line without ``launches``
where a file has none), and it prints the constants and its median and
largest relative error, and how the launches it fitted compare with the
counts the profile multiplies (each algorithm's ``HOST_KERNELS``).
``--no-kernels`` fits the line on a file with launches.
``profiles/analytic-nccl.yaml`` holds the line fitted to the team's H100
file (which counts no launches), and its notes the plane fitted to
``profiles/measurements/h200-per-call.json``::

    python tools/fit_host_cost.py profiles/measurements/h100-per-call.json
    python tools/fit_host_cost.py profiles/measurements/h200-per-call.json
    python tools/fit_host_cost.py --no-kernels profiles/measurements/h200-per-call.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from colltune.algorithms import get, names

#: Every registered algorithm: each one's exact calls are points of the fit.
ALGORITHMS = names()


def points(rows: list[dict], kernels: bool = True) -> list[tuple[str, float, float | None, float]]:
    """``(algorithm, syncs, launches or None, us)`` of every exact call with counted syncs, in either file's
    layout (``kernels`` false: launches left out)."""
    out = []
    for row in rows:
        if "n" not in row or row.get("n") is None:
            continue  # a top-k row
        for a in ALGORITHMS:
            got = row.get(a) if isinstance(row.get(a), dict) else {
                "ms": row.get(f"{a}_ms"), "syncs": row.get(f"{a}_syncs"), "launches": row.get(f"{a}_launches")}
            if got.get("ms") is not None and got.get("syncs") is not None:
                launches = got.get("launches") if kernels else None
                out.append((a, float(got["syncs"]), None if launches is None else float(launches), float(got["ms"]) * 1e3))
    return out


def design(pts: list[tuple[str, float, float | None, float]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The constants' names, the design matrix and the times: with a kernel column where every point has
    launches (a file counts them for every call or for none)."""
    kernels = bool(pts) and all(k is not None for _, _, k, _ in pts)
    names_ = ["host_call_us", *(["host_kernel_us"] if kernels else []), "host_sync_us"]
    x = np.array([[1.0, *([k] if kernels else []), s] for _, s, k, _ in pts]).reshape(len(pts), len(names_))
    return names_, x, np.array([t for *_, t in pts])


def fit(names_: list[str], x: np.ndarray, y: np.ndarray) -> tuple[dict[str, float], float, float]:
    """Return the constants of :func:`design`'s columns, the median relative error and the largest."""
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    err = np.abs(x @ coef / y - 1)
    return dict(zip(names_, (float(c) for c in coef))), float(np.median(err)), float(err.max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="per-call measurements (JSON)")
    ap.add_argument("--no-kernels", action="store_true", help="fit the line without the per-kernel term")
    args = ap.parse_args(argv)
    try:
        with open(args.file) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        ap.error(f"{args.file}: cannot read per-call measurements ({exc}); the team's H100 and H200 files are in "
                 "profiles/measurements/, and tools/gpu_call_bench.py --json writes one")
    pts = points(data["rows"] if isinstance(data, dict) else data, kernels=not args.no_kernels)
    names_, x, y = design(pts)
    if not pts or np.linalg.matrix_rank(x) < len(names_):
        ap.error(f"{args.file}: the calls do not determine {', '.join(names_)}: need exact calls whose counts of "
                 f"syncs (and launches, where given) vary independently, got {len(pts)} calls")
    consts, med, worst = fit(names_, x, y)
    print(f"{len(pts)} calls: " + ", ".join(f"{k} {v:.0f}" for k, v in consts.items())
          + f" (median error {med:.0%}, largest {worst:.0%})")
    if "host_kernel_us" in consts:  # what the profile multiplies is the algorithms' declared count, not these
        ratios = [k / get(a).HOST_KERNELS["exact"] for a, _, k, _ in pts if k is not None and get(a).HOST_KERNELS]
        if ratios:
            print(f"launches per call against HOST_KERNELS['exact']: {min(ratios):.2f}x to {max(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
