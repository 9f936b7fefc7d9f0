"""Check the local profile's predictions against held-out measurements on this machine.

Runs ``colltune bench`` on configurations the shipped gloo profile never
measured (rows between its grid points, densities and overlaps between its
own, at P = 2, 4 and 8), then prices the same calls with ``colltune
simulate``'s engine on that profile and reports, per algorithm and world
size, the median of |predicted / measured - 1| and the share within 25%::

    python tools/validate_local.py --json validate.json
    python tools/validate_local.py --from-json validate.json     # re-read a run

The bench's own figures (medians of interleaved rounds) are printed beside
the predictions, from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HELD_OUT = {"n": ["2^15", "2^17", "2^19"], "density": ["3e-3", "2e-2"], "overlap": ["0.25", "0.75"]}


def _bench(world_sizes: list[int], repeats: int, out: str) -> None:
    from colltune.algorithms import names

    cmd = ["colltune", "bench", "-P", *map(str, world_sizes), "--n", *HELD_OUT["n"], "--density",
           *HELD_OUT["density"], "--overlap", *HELD_OUT["overlap"], "--contenders", *names(),
           "--repeats", str(repeats), "--json", out, "--no-progress"]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _compare(bench: dict) -> list[dict]:
    from colltune.model.profile import load_profile
    from colltune.offline.simulate import Workload, simulate
    from colltune.select.selector import model_for_profile, shipped_profile

    model = model_for_profile(load_profile(shipped_profile("gloo")), "cpu-gloo.yaml")
    rows = []
    for c in bench["configs"]:
        w = Workload(c["n"], c["density"], c["overlap"])
        (pt,) = simulate(model, w, [c["world_size"]])
        for a, got in c["contenders"].items():
            if a in pt.predicted_us:
                measured = got["median_ms"] * 1e3
                rows.append({"algorithm": a, "P": c["world_size"], "n": c["n"], "density": c["density"],
                             "overlap": c["overlap"], "measured_us": measured, "predicted_us": pt.predicted_us[a],
                             "error": pt.predicted_us[a] / measured - 1.0})
    return rows


def _report(rows: list[dict]) -> None:
    print(f"{'algorithm':<10}{'P':>4}{'configs':>9}{'median |err|':>14}{'within 25%':>12}")
    groups: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        groups.setdefault((r["algorithm"], r["P"]), []).append(abs(r["error"]))
    for (a, p), errs in sorted(groups.items()):
        share = sum(e <= 0.25 for e in errs) / len(errs)
        print(f"{a:<10}{p:>4}{len(errs):>9}{statistics.median(errs):>13.0%}{share:>12.0%}")
    errs = [abs(r["error"]) for r in rows]
    print(f"all: {len(errs)} predictions, median |error| {statistics.median(errs):.0%}, "
          f"{sum(e <= 0.25 for e in errs) / len(errs):.0%} within 25%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-P", "--world-size", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the bench results and the comparison here")
    parser.add_argument("--from-json", help="compare a run written earlier with --json")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as fh:
            bench = json.load(fh)["bench"]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "bench.json")
            _bench(args.world_size, args.repeats, path)
            with open(path) as fh:
                bench = json.load(fh)
    rows = _compare(bench)
    for r in rows:
        print(f"{r['algorithm']:<10} P={r['P']} n={r['n']} d={r['density']:g} o={r['overlap']:.2f}: "
              f"measured {r['measured_us'] / 1e3:.2f} ms, predicted {r['predicted_us'] / 1e3:.2f} ms "
              f"({r['error']:+.0%})")
    _report(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"bench": bench, "comparison": rows}, fh)


if __name__ == "__main__":
    sys.exit(main())
