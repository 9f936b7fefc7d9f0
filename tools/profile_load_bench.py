"""Measure what loading a profile near the 16 MiB size limit costs: time and peak memory.

Writes profiles just under :data:`colltune.model.yamlsafe.MAX_BYTES` into a
folder (once, in about a minute; later runs reuse them), then loads each with
:func:`colltune.model.profile.load_profile` in a fresh Python process, a few
times, and prints the medians of wall time, CPU time and peak resident
memory (``VmHWM`` on Linux, else ``ru_maxrss``: the whole process, the
interpreter and imports included; the ``baseline`` row is a process that
loads nothing):

- ``measured``: the largest profile a ``colltune profile`` run writes: the
  shipped grid profile's measurements repeated (times varied) until the file
  is just under the limit, some 63,000, with its stored model and checksum,
  in the layout :func:`~colltune.model.profile.save_profile` writes.
- ``hand-edited``: the same file with a comment and a quoted value among the
  measurements and the ``checksum`` line deleted, as after an edit by hand.
- ``block-style``: the same measurements dumped by PyYAML in block style (a
  line per field), cut to fit the limit: not the layout colltune writes.
- ``zeros``, ``keys``, ``nested``: adversarial YAML of the same size: a flat
  list ``[0,0,...]`` (one node per 2 bytes), a mapping of tiny keys, and
  lists nested 90 deep, repeated.

Each row says whether the file loaded or how it was refused. The machine's
load shows in the wall times; CPU time is steadier on a shared machine.

Usage::

    python tools/profile_load_bench.py                      # files in /tmp/colltune-profile-bench, 3 runs each
    python tools/profile_load_bench.py --repeats 5 --only measured zeros
    python tools/profile_load_bench.py --dir bench-profiles --json load.json

To compare with another version of colltune, run the same command with that
version first on ``PYTHONPATH`` (a folder holding its ``colltune`` package):
the files in ``--dir`` are reused, so both load the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import statistics
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NAMES = ("baseline", "measured", "hand-edited", "block-style", "zeros", "keys", "nested")

_CHILD = r"""
import json, resource, sys, time


def peak_mib():
    # VmHWM is this process's own high-water mark; ru_maxrss can carry the parent's over fork and exec.
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


path = sys.argv[1]
from colltune.model.profile import ProfileError, load_profile
start = peak_mib()
wall, cpu = time.perf_counter(), time.process_time()
outcome = "nothing loaded"
if path:
    try:
        outcome = f"loaded: {len(load_profile(path).measurements)} measurements"
    except ProfileError as exc:
        outcome = f"refused: {exc}"
print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "peak_mib": peak_mib(), "start_mib": start, "outcome": outcome}))
"""

_HEAD = "format: colltune-profile\nversion: 1\nkind: analytic\nmeta:\n  backend: gloo\n"
_TAIL = "primitives:\n" + "".join(
    f"  {p}: {{alpha_us: 1.0, beta_us_per_byte: 1.0e-06}}\n" for p in ("all_reduce", "all_gather", "all_to_all", "p2p")
) + "measurements: []\n"


def _limit() -> int:
    from colltune.model import yamlsafe

    return yamlsafe.MAX_BYTES


def _write_measured(path: str, limit: int) -> None:
    """Repeat the shipped grid profile's measurements, times varied, until the file is just under ``limit``."""
    from colltune.model.profile import load_profile, save_profile

    base = load_profile(os.path.join(_ROOT, "profiles", "cpu-gloo-grid.yaml"))
    rng = random.Random(0)
    originals = list(base.measurements)

    def grown(n: int) -> list:
        return [dataclasses.replace(m, time_us=m.time_us * (1 + rng.random() / 10), spread_us=rng.random() * 100,
                                    repeats=m.repeats + i // len(originals))
                for i, m in ((i, originals[i % len(originals)]) for i in range(n))]

    n = len(originals)
    for _ in range(20):  # about the right count, from the bytes per measurement of the last try
        base.measurements = grown(n)
        save_profile(base, path)
        size = os.path.getsize(path)
        if limit - 2000 < size <= limit:
            return
        per = size / n
        n = max(1, n + int((limit - 1000 - size) / per))
    raise RuntimeError(f"could not size {path} just under {limit:,} bytes")


def _write_hand_edited(src: str, path: str) -> None:
    with open(src, encoding="utf-8") as fh:
        lines = [line for line in fh if not line.startswith("checksum:")]
    cut = lines.index("measurements:\n")
    lines.insert(cut + 10, "# re-measured by hand on 2026-11-30\n")
    lines[cut + 20] = re.sub(r"algorithm: (\w+)", r"algorithm: '\1'", lines[cut + 20], count=1)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(lines)


def _write_block(src: str, path: str, limit: int) -> None:
    import yaml

    from colltune.model.profile import load_profile

    with open(src, encoding="utf-8") as fh:
        text = fh.read()
    cut = text.index("\nmeasurements:\n") + 1
    head = "".join(line + "\n" for line in text[:cut].splitlines() if not line.startswith("checksum:"))
    rows = [m.to_dict() for m in load_profile(src).measurements]
    body = yaml.dump({"measurements": rows}, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper),
                     default_flow_style=False, sort_keys=False, width=10**9)
    room = limit - len(head.encode())
    body = body[: body.rindex("\n- ", 0, room) + 1]  # whole measurements only
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(head + body)


def _write_adversarial(name: str, path: str, limit: int) -> None:
    room = limit - len(_HEAD) - len(_TAIL) - 100
    if name == "zeros":
        pad = "  pad: [" + "0," * (room // 2 - 10) + "0]\n"
    elif name == "keys":
        lines, size, i = [], 0, 0
        while size < room - 40:
            line = f"  k{i:x}: 0\n"
            lines.append(line)
            size += len(line)
            i += 1
        pad = "".join(lines)
    else:
        unit = "[" * 90 + "0" + "]" * 90
        pad = "  pad: [" + ",".join([unit] * ((room - 20) // (len(unit) + 1))) + "]\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(_HEAD + pad + _TAIL)


def make_files(folder: str) -> dict[str, str]:
    """Write the profiles that are not in ``folder`` yet; return their paths by name."""
    os.makedirs(folder, exist_ok=True)
    limit = _limit()
    paths = {name: os.path.join(folder, f"{name}.yaml") for name in NAMES if name != "baseline"}
    if not os.path.exists(paths["measured"]):
        _write_measured(paths["measured"], limit)
    if not os.path.exists(paths["hand-edited"]):
        _write_hand_edited(paths["measured"], paths["hand-edited"])
    if not os.path.exists(paths["block-style"]):
        _write_block(paths["measured"], paths["block-style"], limit)
    for name in ("zeros", "keys", "nested"):
        if not os.path.exists(paths[name]):
            _write_adversarial(name, paths[name], limit)
    return paths


def run_once(path: str, timeout: float) -> dict:
    """Load ``path`` (``""``: nothing) in a fresh process; return its measurement."""
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True,
                             timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return {"wall_s": float("inf"), "cpu_s": float("inf"), "peak_mib": float("nan"), "start_mib": float("nan"),
                "outcome": f"killed after {timeout:g} s"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=os.path.join("/tmp", "colltune-profile-bench"),
                        help="folder of the generated profiles (written when missing)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per file; the medians are printed")
    parser.add_argument("--only", nargs="+", choices=NAMES, help="these files only")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a load is killed")
    parser.add_argument("--json", help="also write every run here")
    args = parser.parse_args(argv)
    paths = make_files(args.dir)
    paths["baseline"] = ""
    results = {}
    print(f"{'profile':<12} {'MiB':>6} {'wall s':>7} {'cpu s':>6} {'peak MiB':>9}  outcome")
    for name in args.only or NAMES:
        runs = [run_once(paths[name], args.timeout) for _ in range(args.repeats)]
        size = os.path.getsize(paths[name]) / 2**20 if paths[name] else 0.0
        med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "cpu_s", "peak_mib")}
        results[name] = {"path": paths[name], "bytes": os.path.getsize(paths[name]) if paths[name] else 0,
                         "runs": runs, "median": med}
        outcome = runs[-1]["outcome"]
        print(f"{name:<12} {size:6.2f} {med['wall_s']:7.2f} {med['cpu_s']:6.2f} {med['peak_mib']:9.0f}  "
              f"{outcome[:150]}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
