"""tools/online_bench.py: a short call stream at P = 2, every contender timed, and the report drawn from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from colltune.algorithms import names
from colltune.offline.online_report import write_online_report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_short_stream_times_every_contender_and_reports(tmp_path):
    out = tmp_path / "online.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "online_bench.py"), "--ranks", "2", "--calls", "8",
           "--sites", "2", "--settle", "2", "--wrong", "allgather:0.33", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr  # 1: the ranks decided apart
    run = json.loads(out.read_text())
    calls, s = run["calls"], run["summary"]
    assert len(calls) == 16 and {c["site"] for c in calls} == {0, 1}
    for c in calls:
        assert set(c["forced"]) == set(names()) and all(t > 0 for t in c["forced"].values())
        assert c["on"]["algorithm"] in names() and c["off"]["us"] > 0
    assert s["same_on_every_rank"] and s["wrong"] == ["allgather", 0.33]
    lo, hi = s["on_over_off_ci95"]
    assert lo <= s["on_over_off"] <= hi and s["on_over_off_choices"] > 0
    for mode in ("on", "off"):
        assert 1.0 <= s[mode]["smoothed_regret_geomean"] <= s[mode]["smoothed_regret_max"]
    assert "95% confidence" in done.stdout and "the same decisions on every rank: True" in done.stdout
    summary = open(write_online_report(str(out), str(tmp_path / "report"))["summary"], encoding="utf-8").read()
    assert "95% confidence" in summary and "| on | " in summary and "| off | " in summary
