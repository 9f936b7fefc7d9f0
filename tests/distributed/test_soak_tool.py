"""Smoke test of ``tools/soak.py``: a short soak on 2 ranks runs, compares every call and reports memory."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

_TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")


@pytest.fixture(scope="module")
def soak():
    """Import ``tools/soak.py`` as the module ``soak`` (its rank function is pickled by that name)."""
    if _TOOLS not in sys.path:
        sys.path.insert(0, _TOOLS)
    spec = importlib.util.spec_from_file_location("soak", os.path.join(_TOOLS, "soak.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module
    spec.loader.exec_module(module)
    return module


def test_short_soak_compares_every_call_and_samples_memory(soak, tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert soak.main(["--ranks", "2", "--calls", "50", "--every", "10", "--seed", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mismatches"] == []
    assert sum(report["kinds"].values()) == 50
    assert [s["calls"] for s in report["samples"]] == [0, 10, 20, 30, 40, 50]
    assert all(len(s["rss"]) == 2 and min(s["rss"]) > 0 for s in report["samples"])
    assert len(report["ranks"]) == 2 and all(r["after_warmup"] > 0 for r in report["ranks"])
    printed = capsys.readouterr().out
    assert "growth" in printed and "50 calls, 0 differed" in printed


def test_growth_compares_the_last_quarter_with_the_samples_after_warmup(soak):
    samples = [{"calls": c, "rss": r} for c, r in [(0, 50), (10, 100), (20, 100), (30, 101), (40, 110), (50, 110)]]
    g = soak.growth(samples, warmup=10)
    assert g["after_warmup"] == 100 and g["last_quarter"] == 110 and g["growth"] == pytest.approx(0.10)
