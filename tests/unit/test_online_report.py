"""``colltune.offline.online_report``: a call stream's regret over calls and its accuracy, drawn from the run's JSON."""

from __future__ import annotations

import json
import math

import pytest

from colltune.algorithms.errors import ColltuneValueError
from colltune.offline.online_report import load_run, regret_series, write_online_report


def _run(calls: int = 40) -> dict:
    """Two sites; allgather is truly fastest, the profile prices it 3x too high; 'on' learns after 10 calls."""
    out = []
    for site in (0, 1):
        for i in range(calls):
            forced = {"dense": 300.0, "allgather": 100.0, "oktopk": 200.0}
            on = "allgather" if i >= 10 else "oktopk"
            out.append({"site": site, "call": i, "forced": forced,
                        "predicted": {"dense": 300.0, "allgather": 300.0, "oktopk": 200.0},
                        "on": {"algorithm": on, "source": "model", "us": forced[on],
                               "correction": {"allgather": 1 / 3 if i >= 10 else 1.0}},
                        "off": {"algorithm": "oktopk", "source": "model", "us": 200.0, "correction": {}}})
    return {"summary": {"ranks": 2, "sites": 2, "calls": calls, "profile": "test", "wrong": ["allgather", 3.0]},
            "calls": out}


def test_the_running_regret_falls_once_correction_learns() -> None:
    calls = _run()["calls"]
    xs, on = regret_series(calls, "on", window=5)
    _, off = regret_series(calls, "off", window=5)
    assert xs[0] == 4 and on[0] == pytest.approx(2.0) and on[-1] == pytest.approx(1.0)
    assert all(r == pytest.approx(2.0) for r in off)
    assert on[xs.index(12)] == pytest.approx(math.exp(2 / 5 * math.log(2.0)))  # calls 8, 9 regret 2; 10..12 none


def test_the_report_writes_its_pictures_and_summary(tmp_path) -> None:
    path = tmp_path / "online.json"
    path.write_text(json.dumps(_run()))
    files = write_online_report(str(path), str(tmp_path / "out"))
    assert set(files) == {"regret", "predicted-vs-measured", "summary"}
    for key in ("regret", "predicted-vs-measured"):
        assert open(files[key], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    text = open(files["summary"], encoding="utf-8").read()
    # allgather: measured 100 against 300 predicted (0.33); corrected to 100 from call 10 on (1.00 median)
    assert "| allgather | 80 | 0.33 | 1.00 |" in text and "made wrong: allgather x3" in text


@pytest.mark.parametrize("content", ["{", "[]", '{"calls": []}', '{"calls": [{"site": 0}]}'])
def test_a_file_that_is_not_a_run_is_refused_naming_what_is_missing(tmp_path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ColltuneValueError, match="--online"):
        load_run(str(path))
