"""``tools/check_targets.py``: the team's benchmark targets, evaluated from a ``colltune bench`` report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_targets.py"


def check_targets_tool():
    """The team's target checks (tools/check_targets.py), imported from the repository."""
    spec = importlib.util.spec_from_file_location("check_targets", _TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _cfg(p, density, overlap, ag_ms, torch_ms, ok_ms, ag_bytes, ok_bytes):
    entry = lambda ms, b: {"median_ms": ms, "bytes_per_rank_max": b}  # noqa: E731
    return {
        "n": 2**20, "density": density, "world_size": p, "overlap_requested": overlap, "overlap": overlap,
        "contenders": {
            "allgather": entry(ag_ms, ag_bytes), "torch": entry(torch_ms, ag_bytes), "oktopk": entry(ok_ms, ok_bytes),
        },
    }


GOOD = {"configs": [_cfg(8, 1e-2, 1.0, 1.0, 2.0, 0.5, 300, 100), _cfg(2, 1e-3, 0.0, 1.05, 1.0, 2.0, 10, 10)]}
BAD = {"configs": [_cfg(8, 1e-2, 1.0, 1.0, 0.9, 1.5, 300, 101)]}


def test_targets_are_evaluated_from_a_report():
    t = check_targets_tool().check_targets(GOOD)
    assert t["a"]["holds"] is True and t["b"]["holds"] is True and t["c"]["holds"] is None
    t = check_targets_tool().check_targets(BAD)
    assert t["a"]["holds"] is False and t["b"]["bytes_holds"] is False and t["b"]["time_holds"] is False
    assert "FAILS" in check_targets_tool().format_targets(t)


def test_the_tool_reads_the_json_and_exits_1_when_a_target_fails(tmp_path, capsys):
    tool = check_targets_tool()
    for report, status in ((GOOD, 0), (BAD, 1)):
        path = tmp_path / "bench.json"
        path.write_text(json.dumps(report))
        assert tool.main([str(path)]) == status
        out = capsys.readouterr().out
        assert out.startswith("(a) allgather time / torch time <= 1.10")
        assert ("FAILS" in out) is (status == 1)
    assert tool.main([]) == 2
    assert "Usage" in capsys.readouterr().err
