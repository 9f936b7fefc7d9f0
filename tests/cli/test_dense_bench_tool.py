"""``tools/dense_bench.py`` at tiny scale: it runs, prints its table and writes every field (not timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "dense_bench.py"
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("dtype,wire", [("float32", "accum"), ("bfloat16", "value")])
def test_dense_against_all_reduce_reports_every_cell(tmp_path, dtype, wire):
    out = tmp_path / "dense.json"
    cmd = [sys.executable, str(_TOOL), "--ranks", "2", "--log-n", "8", "10", "--row-numel", "1", "4",
           "--repeats", "2", "--dtype", dtype, "--wire", wire, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "donated/ar" in proc.stdout and "dense/ar" in proc.stdout
    report = json.loads(out.read_text())
    assert report["config"]["dtype"] == dtype and report["config"]["wire"] == wire
    rows = report["runs"]["2"]
    assert set(rows) == {"8:1", "8:4", "10:1", "10:4"}
    width = 4 if dtype == "float32" else 2
    for key, row in rows.items():
        assert set(row["median_ms"]) == {"all_reduce", "donated", "dense"}
        assert all(t > 0 for t in row["median_ms"].values())
        assert row["ratio"] == row["median_ms"]["dense"] / row["median_ms"]["all_reduce"]
        assert row["donated_ratio"] == row["median_ms"]["donated"] / row["median_ms"]["all_reduce"]
        # Dense, donated or not, hands the backend the same tensor a plain all_reduce gets: the same bits, and its bytes
        # (P = 2: the ring sends n * r * width; 16-bit rows with wire=value half fp32's), plus the record.
        assert row["same_bits"], key
        assert row["all_reduce_bytes"] == row["n"] * row["row_numel"] * width, key
        assert row["bytes_sent"] > row["all_reduce_bytes"]


def test_bad_arguments_exit_2():
    proc = subprocess.run([sys.executable, str(_TOOL), "--ranks", "1"], capture_output=True, text=True, timeout=60,
                          env=_ENV)
    assert proc.returncode == 2 and "--ranks >= 2" in proc.stderr
