"""``tools/zipf_mix.py`` at tiny scale: every algorithm and auto timed, bytes beside the bound, the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colltune.algorithms.registry import BUILTIN_NAMES

_TOOLS = Path(__file__).resolve().parents[2] / "tools"
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_the_mix_times_every_algorithm_and_reports_regret_and_bytes(tmp_path):
    out = tmp_path / "mix.json"
    cmd = [sys.executable, str(_TOOLS / "zipf_mix.py"), "-P", "2", "--n", "2000", "--density", "0.02", "0.05",
           "--dim", "4", "--calls", "2", "--rounds", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "auto's regret over the mix" in proc.stdout and "hashpart fastest in" in proc.stdout
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) == 2
    for row in rows:
        assert set(row["ms"]) == {*BUILTIN_NAMES, "auto"} and all(t > 0 for t in row["ms"].values())
        assert row["fastest"] in BUILTIN_NAMES and row["auto_picked"] in BUILTIN_NAMES and row["regret"] > 0
        # Bytes per rank per call: hashpart's within its bound (entries of a 4-byte index and 4 float32s).
        assert 0 < row["sent"]["hashpart"] <= row["hashpart_bound_bytes"] + 1024 and row["sent"]["oktopk"] > 0
    # The summary is the geometric mean over the configurations.
    for key, field in (("regret_geomean", "regret"), ("choice_regret_geomean", "choice_regret")):
        assert doc[key] == pytest.approx(float(np.exp(np.mean([np.log(r[field]) for r in rows]))))


def test_ids_are_zipf_skewed_and_the_hot_set_moves_with_the_shift():
    sys.path.insert(0, str(_TOOLS))
    from zipf_mix import zipf_rows

    rng = np.random.default_rng(0)
    a, b = zipf_rows(10_000, 50_000, 1.05, 0, rng), zipf_rows(10_000, 50_000, 1.05, 777, rng)
    assert a.min() >= 0 and a.max() < 10_000
    hot_a, hot_b = np.bincount(a).argmax(), np.bincount(b).argmax()
    assert np.bincount(a).max() > 50 * 50_000 / 10_000  # the hottest id far above the mean count
    assert (hot_b - hot_a) % 10_000 == 777  # the same rank, moved by the shift
