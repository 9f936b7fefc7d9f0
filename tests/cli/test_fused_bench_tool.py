"""``tools/fused_bench.py`` at tiny scale: both modes run, print their table and write their figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "fused_bench.py"
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_time_mode_reports_every_contender_and_the_same_bits(tmp_path):
    out = tmp_path / "time.json"
    cmd = [sys.executable, str(_TOOL), "--ranks", "2", "--tables", "5", "--max-rows", "1000", "--batch", "64",
           "--repeats", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "per-table/fused" in proc.stdout and "torch/fused" in proc.stdout
    run = json.loads(out.read_text())["runs"]["2"]
    assert run["same_bits"] and set(run["median_ms"]) == {"fused", "per-table", "torch"}
    assert all(t > 0 for t in run["median_ms"].values())
    assert len(run["entries_rank0"]) == 5 and run["fused_bytes"] > 0


def test_bytes_mode_reports_oktopk_against_allgather(tmp_path):
    out = tmp_path / "bytes.json"
    cmd = [sys.executable, str(_TOOL), "--bytes", "--ranks", "2", "--max-log-n", "14", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["bytes"]
    assert set(rows) == {"4096", "16384"}
    for r in rows.values():
        assert r["oktopk"] > 0 and r["allgather"] > 0 and r["ratio"] == r["oktopk"] / r["allgather"]
