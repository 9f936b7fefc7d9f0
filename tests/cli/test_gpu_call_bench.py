"""tools/gpu_call_bench.py: one rank, every contender timed; on the CPU here (syncs counted on CUDA only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from colltune.algorithms import names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_runs_every_contender_and_writes_json(tmp_path):
    out = tmp_path / "calls.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "gpu_call_bench.py"), "--log-n", "10", "--density", "1e-2",
           "--rows", "0", "4", "--rounds", "2", "--warmup", "1", "--topk", "--topk-log-n", "12", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3
    for row in rows[:2]:
        assert set(row) >= {"all_reduce", "densify+all_reduce", *names(), "auto"}
        assert all(row[c]["ms"] > 0 for c in ("all_reduce", "dense", "auto"))
    assert set(rows[2]) >= {"torch.topk", *names()}
    assert "all_reduce" in done.stdout and "top-k" in done.stdout
