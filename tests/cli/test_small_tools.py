"""The measuring tools the README quotes and no other test runs, at tiny scale: each runs to the end and reports
every row (not timings). A tool that falls behind the library (a renamed attribute, a new return type) fails here
instead of in a reader's hands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from colltune.algorithms import names

_TOOLS = Path(__file__).resolve().parents[2] / "tools"
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(_TOOLS / args[0]), *args[1:]], capture_output=True, text=True,
                          timeout=240, env=_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_host_cost_reports_every_algorithm_in_both_modes(tmp_path):
    out = tmp_path / "host.json"
    _run("host_cost.py", "-P", "2", "3", "--n", "4096", "--k", "16", "--calls", "1", "--warmup", "2",
         "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    got = {(r["algorithm"], r["mode"], r["world_size"]) for r in rows}
    assert got == {(a, m, p) for a in names() for m in ("exact", "topk") for p in (2, 3)}


def test_selector_bench_times_a_cached_decision_and_a_first_call():
    text = _run("selector_bench.py", "--skip-regret")
    assert "cached decision:" in text and "first call at a new site" in text


def test_call_overhead_compares_with_torch(tmp_path):
    out = tmp_path / "overhead.json"
    text = _run("call_overhead.py", "--k", "7", "--calls", "5", "--json", str(out))
    assert "colltune" in text and "torch" in text and out.exists()
