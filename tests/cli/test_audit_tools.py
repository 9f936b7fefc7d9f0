"""tools/device_path_audit.py and tools/fit_host_cost.py: the commands behind the README's GPU figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tool, *args, cwd, rc=0):
    """The tool's output (stdout; stderr where it exits with ``rc`` other than 0)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)
    assert done.returncode == rc, done.stderr[-2000:]
    return done.stdout if rc == 0 else done.stderr


def test_the_audit_counts_every_call_within_what_the_algorithms_declare(tmp_path):
    from colltune.algorithms import get, names

    out = tmp_path / "audit.json"
    _run("device_path_audit.py", "-P", "2", "--json", str(out), cwd=tmp_path)
    calls = json.loads(out.read_text())["calls"]
    for name in names():
        alg, exact = get(name), [calls[f"{name} rows of 64"], calls[f"{name} scalars"]]
        # The syncs and kernels the cost model prices per call: ceilings the code stays within, and what it
        # does (the syncs), or not more than 10% above it (the kernels, the most of scalars and rows), so that
        # a change that trims them trims the price too.
        assert max(c["syncs"] for c in exact) == alg.HOST_SYNCS["exact"], (name, exact)
        assert calls[f"top-k {name}"]["syncs"] <= alg.HOST_SYNCS["topk"], calls[f"top-k {name}"]
        for mode, got in (("exact", exact), ("topk", [calls[f"top-k {name}"]])):
            most = max(c["kernels"] for c in got)
            assert most <= alg.HOST_KERNELS[mode] <= 1.1 * most, (name, mode, most, alg.HOST_KERNELS[mode])
    assert calls["fused, 26 tables"]["syncs"] == calls["fused, 2 tables"]["syncs"]
    # Every algorithm's fused bucket reads twice: its payload rides in the fused record, its cut reads nothing.
    assert all(calls[f"fused, 26 tables, {name}"]["syncs"] <= 2 for name in names()), calls
    # The GPU issue's bound: a fused call's ops over 26 tensors at most 1.5x those over 2 (kernels: the same).
    assert calls["fused, 26 tables"]["ops"] <= 1.5 * calls["fused, 2 tables"]["ops"]
    assert calls["fused, 26 tables"]["kernels"] == calls["fused, 2 tables"]["kernels"]
    assert 0 < calls["dense scalars"]["kernels"] < calls["dense scalars"]["ops"]
    assert all(c["host_us"] > 0 for c in calls.values() if c["host_us"] is not None)  # the thread's CPU time per call
    # Off the steady state: a missed local threshold reads no more than a steady call, a refresh less.
    events = {e: calls[f"top-k oktopk, {e}"]["syncs"] for e in ("local miss", "30x gradient", "refresh")}
    assert events["local miss"] <= calls["top-k oktopk"]["syncs"], events
    assert events["refresh"] < calls["top-k oktopk"]["syncs"] <= events["30x gradient"] <= get("oktopk").HOST_SYNCS["topk"], events


def test_the_host_cost_fit_recovers_a_known_line(tmp_path):
    from colltune.algorithms import get

    rows = [{"n": 1 << 16, "dense_ms": (400 + 60 * s) / 1e3, "dense_syncs": s} for s in (2, 4, 7)]
    path = tmp_path / "calls.json"
    path.write_text(json.dumps(rows))
    assert "host_call_us 400, host_sync_us 60 (median error 0%" in _run("fit_host_cost.py", str(path), cwd=tmp_path)
    # With launches (gpu_call_bench's layout): the plane through known points.
    plane = {"rows": [{"n": 1 << 16, "dense": {"ms": (300 + 20 * k + 100 * s) / 1e3, "syncs": s, "launches": k}}
                      for s, k in ((1, 20), (2, 40), (3, 30), (1, 60))]}
    path.write_text(json.dumps(plane))
    got = _run("fit_host_cost.py", str(path), cwd=tmp_path)
    assert "host_call_us 300, host_kernel_us 20, host_sync_us 100 (median error 0%" in got
    k = get("dense").HOST_KERNELS["exact"]  # the launches against what the profile multiplies
    assert f"against HOST_KERNELS['exact']: {20 / k:.2f}x to {60 / k:.2f}x" in got
    line = _run("fit_host_cost.py", "--no-kernels", str(path), cwd=tmp_path)  # the line through the same points
    assert "host_call_us" in line and "host_kernel_us" not in line and "HOST_KERNELS" not in line
    # Too few calls, or launches that move with the syncs (three points on one line): refused, not fitted.
    collinear = {"rows": [{"n": 1 << 16, "dense": {"ms": (300 + 20 * 10 * s + 100 * s) / 1e3, "syncs": s,
                                                   "launches": 10 * s}} for s in (1, 2, 3)]}
    for bad in (rows[:1], collinear):
        path.write_text(json.dumps(bad))
        assert "vary independently" in _run("fit_host_cost.py", str(path), cwd=tmp_path, rc=2)


def test_the_shipped_nccl_profile_holds_the_fit_its_notes_cite(tmp_path):
    """profiles/analytic-nccl.yaml's host terms are what the fit gives on the file its notes name; an unreadable
    file is refused in one line, naming where the team's files are."""
    import yaml

    with open(os.path.join(ROOT, "profiles", "analytic-nccl.yaml")) as fh:
        profile = yaml.safe_load(fh)
    consts = profile["meta"]
    got = _run("fit_host_cost.py", os.path.join(ROOT, "profiles", "measurements", "h100-per-call.json"), cwd=tmp_path)
    assert f"host_call_us {consts['host_call_us']}, host_sync_us {consts['host_sync_us']} (median error 30%" in got
    assert "profiles/measurements/" in _run("fit_host_cost.py", str(tmp_path / "missing.json"), cwd=tmp_path, rc=2)
