"""``colltune demo``: everything it writes goes under the one directory it names; bad ``--out`` exits 2.

The profile run and the benchmark are replaced by stand-ins (a synthetic
profile, an empty report): what is checked is where the files go, what is
passed from one step to the next, and what is printed.
"""

from __future__ import annotations

import json
import os

import pytest
from test_cli_report import synthetic_profile

from colltune import cli
from colltune.model.profile import load_profile
from colltune.offline import bench, profiling


@pytest.fixture
def stand_ins(monkeypatch):
    """Replace the profile run and the benchmark; return what each was called with."""
    calls: dict = {}

    def fake_profile(out, world_sizes, grid, **kw):
        calls["profile"] = (out, list(world_sizes))
        synthetic_profile(out, world_sizes=tuple(world_sizes), ns=(2**12,), densities=(1e-2,))
        return profiling.ProfileResult(load_profile(out), out, 2, 0, 2, True, 0.1, profiling.journal_path(out),
                                       list(world_sizes))

    def fake_bench(configs, **kw):
        calls["bench"] = ({c.world_size for c in configs}, kw["profile"])
        return {"format": "colltune-bench/1", "configs": [], "topk": [], "elapsed_s": 0.0}

    monkeypatch.setattr(profiling, "run_profile", fake_profile)
    monkeypatch.setattr(bench, "run", fake_bench)
    return calls


def test_demo_writes_under_its_default_directory_only(stand_ins, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--no-progress"]) == 0
    assert os.listdir(tmp_path) == ["colltune-demo"]  # no profiles/local.yaml, no colltune-bench.json here
    out_dir = tmp_path / "colltune-demo"
    assert sorted(os.listdir(out_dir)) == ["bench.json", "profile.yaml"]
    profile = os.path.join("colltune-demo", "profile.yaml")
    assert stand_ins["profile"] == (profile, [2, 4])
    assert stand_ins["bench"] == ({4}, profile)  # the bench runs at the largest P, on the profile just written
    assert load_profile(out_dir / "profile.yaml").meta["world_sizes"] == [2, 4]
    assert json.loads((out_dir / "bench.json").read_text())["format"] == "colltune-bench/1"
    printed = capsys.readouterr().out
    assert f"writing {profile} and {os.path.join('colltune-demo', 'bench.json')}" in printed
    assert "everything is in colltune-demo" in printed
    assert "(a) " not in printed and "FAILS" not in printed  # the team's targets: tools/check_targets.py


def test_demo_out_names_the_directory(stand_ins, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "runs" / "first"
    assert cli.main(["demo", "--out", str(target), "-P", "2", "--no-progress"]) == 0
    assert os.listdir(tmp_path) == ["runs"]
    assert sorted(os.listdir(target)) == ["bench.json", "profile.yaml"]
    assert stand_ins["profile"] == (str(target / "profile.yaml"), [2])


@pytest.mark.parametrize("name", ["local.yaml", "bench.json", "a-file"])
def test_demo_out_must_be_a_directory(name, tmp_path, capsys, monkeypatch):
    def _too_late(*a, **k):
        raise AssertionError("a bad --out must be refused before anything runs")

    monkeypatch.setattr(profiling, "run_profile", _too_late)
    path = tmp_path / name
    if name == "a-file":
        path.write_text("")
    assert cli.main(["demo", "--out", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "directory" in err and "Traceback" not in err
