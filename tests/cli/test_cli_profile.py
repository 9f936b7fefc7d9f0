"""``colltune profile`` and ``colltune fit`` on P = 2 with a tiny grid; resuming after a kill; bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from colltune import cli
from colltune.algorithms.registry import BUILTIN_NAMES
from colltune.model.profile import load_profile
from colltune.offline import profiling

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--world-size", "2", "--n", "2^10", "--density", "1e-2", "1e-1", "--overlap", "0", "1",
        "--repeats", "2", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    """A profile of 4 configurations x the built-in algorithms at P = 2, measured once for the module."""
    out = tmp_path_factory.mktemp("profile") / "tiny.yaml"
    assert cli.main(["profile", *TINY, "--out", str(out)]) == 0
    return out


def test_profile_writes_a_valid_profile(tiny_profile, capsys):
    prof = load_profile(tiny_profile)
    assert prof.kind == "measured"
    meta = prof.meta
    assert meta["backend"] == "gloo" and meta["world_sizes"] == [2]
    assert meta["nodes"] == 1 and meta["ranks_per_node"] == 2
    for key in ("torch_version", "host", "date"):
        assert meta[key]
    assert len(prof.measurements) == 4 * len(BUILTIN_NAMES)
    assert {m.algorithm for m in prof.measurements} == set(BUILTIN_NAMES)
    for m in prof.measurements:
        assert m.world_size == 2 and m.numel == 1024 and m.time_us > 0 and m.repeats == 2
        # The union is exact: disjoint sets give 2k, identical ones k.
        assert m.union == (2 * m.k_max if m.overlap == 0 else m.k_max)
    assert set(prof.primitives) >= {"all_reduce", "all_gather", "all_to_all", "p2p", "local"}
    assert prof.model is not None and prof.model["type"] == "colltune.LearnedCostModel"
    assert not os.path.exists(profiling.journal_path(tiny_profile))  # complete: the journal is gone
    assert not [p for p in os.listdir(tiny_profile.parent) if p.endswith(".tmp")]


def test_profile_measures_embedding_rows(tmp_path):
    out = tmp_path / "rows.yaml"
    argv = ["profile", "--world-size", "2", "--n", "2^10", "--density", "1e-2", "--overlap", "0", "1",
            "--row-shape", "4", "2", "--repeats", "2", "--no-progress", "--out", str(out)]
    assert cli.main(argv) == 0
    prof = load_profile(out)
    assert len(prof.measurements) == 2 * len(BUILTIN_NAMES) and {m.row_numel for m in prof.measurements} == {8}
    assert prof.meta["grid"]["row_numel"] == 8


def test_fit_reports_errors_and_stores_the_model(tiny_profile, tmp_path, capsys):
    out = tmp_path / "fitted.yaml"
    report = tmp_path / "cv.json"
    assert cli.main(["fit", str(tiny_profile), "--out", str(out), "--folds", "2", "--json", str(report)]) == 0
    text = capsys.readouterr().out
    for alg in BUILTIN_NAMES:
        assert any(line.startswith(alg) and "%" in line for line in text.splitlines()), text
    assert "regret on held-out configurations" in text and "geomean" in text
    fitted = load_profile(out)
    assert fitted.model["type"] == "colltune.LearnedCostModel"
    assert fitted.meta["fit"]["regret_geomean"] >= 1.0
    assert fitted.measurements == load_profile(tiny_profile).measurements
    cv = json.loads(report.read_text())
    assert cv["cv"]["n_groups"] == 4 and set(cv["cv"]["per_algorithm"]) == set(BUILTIN_NAMES)


def test_fit_adds_the_measurements_of_other_profiles_of_the_backend(tiny_profile, tmp_path, capsys):
    import dataclasses

    from colltune.model.profile import save_profile

    rows = tmp_path / "rows.yaml"
    argv = ["profile", "--world-size", "2", "--n", "2^10", "--density", "1e-2", "--overlap", "1",
            "--row-shape", "4", "--repeats", "2", "--no-progress", "--out", str(rows)]
    assert cli.main(argv) == 0
    out = tmp_path / "pooled.yaml"
    assert cli.main(["fit", str(tiny_profile), "--add", str(rows), "--out", str(out), "--folds", "2",
                     "--notes", "scalars and rows of 4"]) == 0
    pooled, base, more = load_profile(out), load_profile(tiny_profile), load_profile(rows)
    assert pooled.measurements == base.measurements + more.measurements
    assert {m.row_numel for m in pooled.measurements} == {1, 4}
    assert pooled.primitives == base.primitives and pooled.meta["added"][0]["measurements"] == len(more.measurements)
    assert pooled.meta["added"][0]["grid"]["row_numel"] == 4 and pooled.meta["notes"] == "scalars and rows of 4"
    # Another backend's measurements are refused, naming both backends.
    nccl = tmp_path / "nccl.yaml"
    save_profile(dataclasses.replace(more, meta={**more.meta, "backend": "nccl"}), nccl)
    capsys.readouterr()
    assert cli.main(["fit", str(tiny_profile), "--add", str(nccl), "--out", str(tmp_path / "x.yaml")]) == 2
    assert "measured on backend 'nccl'" in capsys.readouterr().err and not (tmp_path / "x.yaml").exists()


def _journal_configs(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if '"kind":"config"' in line]


def test_a_killed_run_resumes_without_measuring_again(tmp_path):
    out = tmp_path / "killed.yaml"
    journal = profiling.journal_path(out)
    argv = [sys.executable, "-m", "colltune.cli", "profile", "--world-size", "2", "--n", "2^12", "2^13",
            "--density", "1e-3", "1e-2", "5e-2", "1e-1", "--overlap", "0", "1", "--repeats", "3",
            "--no-progress", "--out", str(out)]
    env = dict(os.environ)
    proc = subprocess.Popen(argv, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 25
    try:
        while time.monotonic() < deadline:
            if os.path.exists(journal) and len(_journal_configs(journal)) >= 2:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the command, its forkserver and its ranks
        proc.communicate()
    assert not out.exists()  # nothing half-written
    before = {r["key"]: r["measurements"] for r in _journal_configs(journal)}
    assert 2 <= len(before) < 16
    with open(journal, "a") as fh:  # a line cut short by the kill
        fh.write('{"kind":"config","key":"P2-n4096')

    assert cli.main(["profile", *argv[argv.index("--world-size"):], "--resume"]) == 0
    prof = load_profile(out)
    assert len(prof.measurements) == 16 * len(BUILTIN_NAMES)
    by_key = {}
    for m in prof.measurements:
        by_key.setdefault(profiling.measurement_key(m), {})[m.algorithm] = m.to_dict()
    assert len(by_key) == 16
    for key, ms in before.items():  # the first run's medians, untouched: not measured again
        assert {m["algorithm"]: m for m in ms} == by_key[key]
    assert not os.path.exists(journal)


def test_budget_stops_early_and_resume_finishes(tmp_path, capsys):
    out = tmp_path / "budget.yaml"
    argv = ["profile", *TINY, "--out", str(out), "--budget", "0.0001"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "incomplete" in text and "--resume" in text
    assert os.path.exists(profiling.journal_path(out))
    assert "partial" in load_profile(out).meta["notes"]
    # Without --resume the journal is not overwritten.
    assert cli.main(argv[:-2]) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli.main(argv[:-2] + ["--resume"]) == 0
    assert "resuming:" in capsys.readouterr().out
    assert len(load_profile(out).measurements) == 4 * len(BUILTIN_NAMES)
    assert not os.path.exists(profiling.journal_path(out))


def _bad_profiles(tmp_path, good):
    text = good.read_text()
    corrupt = tmp_path / "corrupt.yaml"
    corrupt.write_text("format: colltune-profile\nversion: 1\nmeta: [unclosed\n")
    truncated = tmp_path / "truncated.yaml"
    truncated.write_text(text[: len(text) // 2])
    other = tmp_path / "version.yaml"
    other.write_text(text.replace("\nversion: 1\n", "\nversion: 7\n"))
    return {"corrupt": (corrupt, "YAML"), "truncated": (truncated, ""), "version": (other, "version 7")}


@pytest.mark.parametrize("command", ["fit", "report", "bench"])
def test_a_bad_profile_exits_2_and_writes_nothing(tiny_profile, tmp_path, capsys, command):
    for name, (path, needle) in _bad_profiles(tmp_path, tiny_profile).items():
        before = path.read_bytes()
        dest = tmp_path / f"{command}-{name}-out"
        argv = {"fit": ["fit", str(path)], "report": ["report", str(path), "--out", str(dest)],
                "bench": ["bench", "--quick", "--profile", str(path), "--json", str(dest)]}[command]
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err
        assert str(path) in err and needle in err and "Traceback" not in err, (name, err)
        assert path.read_bytes() == before and not dest.exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["profile", "--world-size", "0"], "--world-size"),
        (["profile", "--world-size", "-3"], "--world-size"),
        (["profile", "--bogus"], "--bogus"),
        (["profile", "--grid", "huge"], "--grid"),
        (["profile", "--budget", "0"], "--budget"),
        (["fit"], "PROFILE"),
        (["fit", "x.yaml", "--bogus"], "--bogus"),
        (["tune", "--world-size", "0"], "--world-size"),
        (["tune", "--trials", "0"], "--trials"),
        (["tune", "--bogus"], "--bogus"),
        (["report", "x.yaml"], "--out"),
        (["demo", "--world-size", "0"], "--world-size"),
    ],
)
def test_bad_options_exit_2_with_a_message(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_unwritable_outputs_exit_2_before_any_rank_starts(tiny_profile, tmp_path, capsys, monkeypatch):
    from colltune.offline import launch, report

    def _too_late(*a, **k):
        raise AssertionError("the output path must be refused before any rank starts or any work is done")

    # Refused up front: no rank is launched, no model fitted, no report drawn.
    monkeypatch.setattr(launch, "rank_context", _too_late)
    monkeypatch.setattr(launch, "launch_ranks", _too_late)
    monkeypatch.setattr(profiling, "fit_profile", _too_late)
    monkeypatch.setattr(report, "write_report", _too_late)
    missing = tmp_path / "no" / "such" / "dir" / "x.yaml"
    a_file = tmp_path / "plain-file"
    a_file.write_text("")
    cases = [
        ["profile", "--world-size", "2", "--out", str(missing)],
        ["profile", "--world-size", "2", "--out", str(tmp_path)],
        ["fit", str(tiny_profile), "--out", str(missing)],
        ["tune", "--world-size", "2", "--out", str(missing)],
        ["tune", "--world-size", "2", "--storage", str(missing)],
        ["report", str(tiny_profile), "--out", str(a_file)],
        ["report", str(tiny_profile), "--out", str(a_file / "sub")],
    ]
    for argv in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("--out" in err or "--storage" in err), (argv, err)
    assert not missing.parent.exists()


def test_a_missing_profile_exits_2(tmp_path, capsys):
    assert cli.main(["fit", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "nope.yaml" in err and "cannot read" in err


def test_the_journal_keeps_every_round_and_refuses_a_corrupt_middle(tmp_path):
    cfg = profiling.ProfileConfig(2, 1024, 10, 5)
    from colltune.model.profile import Measurement

    m = Measurement.from_features(cfg.features(), "dense", time_us=30.0, spread_us=20.0, repeats=5, bytes_sent=8)
    path = str(tmp_path / "j.jsonl")
    j = profiling.Journal(path, {"backend": "gloo"})
    j.add_config(cfg.key, [m.to_dict()], times_us={"dense": [10.0, 20.0, 30.0, 40.0, 50.0]})
    again = profiling.Journal(path, {"backend": "gloo"})
    assert [x.time_us for x in again.measurements()] == [30.0]
    assert [x.time_us for x in again.measurements("lower-quartile")] == [20.0]
    assert profiling.measurement_key(again.measurements()[0]) == cfg.key
    with pytest.raises(profiling.ProfilingError, match="backend"):
        profiling.Journal(path, {"backend": "nccl"})
    lines = open(path).read().splitlines()
    with open(path, "w") as fh:
        fh.write("\n".join([lines[0], "{not json", lines[1]]) + "\n")
    with pytest.raises(profiling.ProfilingError, match="corrupt"):
        profiling.Journal(path, {"backend": "gloo"})


def _stderr_on_a_terminal(argv: list[str], timeout: float = 300.0) -> str:
    """Run ``colltune ARGV`` with standard error on a pseudo-terminal (so tqdm draws bars); return what it drew."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "colltune.cli", *argv], stdout=subprocess.DEVNULL, stderr=slave,
                            cwd=_ROOT)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the terminal's last writer closed it
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
        proc.wait(timeout=60)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.skipif(sys.platform != "linux", reason="pseudo-terminals as Linux has them")
def test_each_world_size_has_one_bar_that_ends_at_100_percent(tmp_path):
    argv = ["profile", "--world-size", "1", "2", "--n", "2^10", "--density", "1e-2", "1e-1", "--overlap", "0",
            "--dtype", "float32", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "p.yaml")]
    drawn = _stderr_on_a_terminal(argv)
    states = [s for s in drawn.replace("\r\n", "\r").split("\r") if s.startswith("profile P=")]
    assert {s.split(":")[0] for s in states} == {"profile P=1", "profile P=2"}, drawn
    for p in (1, 2):
        mine = [s for s in states if s.startswith(f"profile P={p}:")]
        assert "100%" in mine[-1] and "2/2" in mine[-1], mine  # each world size counts its own 2 configurations
        assert all("/2 " in s for s in mine), mine


def test_p2p_measures_into_the_profile_it_wrote(tmp_path, capsys, monkeypatch):
    import pathlib
    import shutil

    from colltune.model import nccl

    repo = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "p2p.yaml"

    def fake_profile(path, *a, **k):  # the grid's measurements are another test's: copy a profile in their place
        shutil.copy(repo / "profiles" / "analytic-nccl.yaml", path)
        return None

    monkeypatch.setattr(profiling, "run_profile", fake_profile)
    assert cli.main(["profile", "--world-size", "2", "--p2p", "--out", str(out), "--no-progress"]) == 0
    figures = load_profile(out).meta["p2p"]
    assert set(figures) == {"intra_node"}  # two local ranks: one node
    assert figures["intra_node"]["latency_us"] > 0 and figures["intra_node"]["bandwidth_GBps"] > 0
    assert nccl.P2P.from_meta(figures).intra_latency_us == figures["intra_node"]["latency_us"]


def test_fit_folds_in_the_calls_online_correction_measured(tiny_profile, tmp_path, capsys):
    state = tmp_path / "online.json"
    # What a job's selector wrote: two calls of one site at P = 2 (rows 2^12, 40 entries per rank, union 60).
    state.write_text(json.dumps({
        "format": "colltune-online", "version": 2, "sites": {"s": {"allgather": [0.1, 2.0]}},
        "samples": {"s": [[4096, 1, "float32", 2, 80, 40, 60, "allgather", 250.0],
                          [4096, 1, "float32", 2, 80, 40, 60, "dense", 400.0]]}}))
    out = tmp_path / "folded.yaml"
    assert cli.main(["fit", str(tiny_profile), "--out", str(out), "--folds", "2", "--online", str(state)]) == 0
    assert "folding in 2 measured calls" in capsys.readouterr().out
    before, after = load_profile(tiny_profile).measurements, load_profile(out).measurements
    assert after[: len(before)] == before and len(after) == len(before) + 2
    added = after[-2:]
    assert [(m.algorithm, m.numel, m.k_sum, m.union, m.time_us) for m in added] == [
        ("allgather", 4096, 80, 60, 250.0), ("dense", 4096, 80, 60, 400.0)]
    assert added[0].overlap == pytest.approx(0.5)
    state.write_text('{"format": "colltune-online", "version": 2, "sites": {}}')
    assert cli.main(["fit", str(tiny_profile), "--out", str(out), "--online", str(state)]) == 2
    assert "--online" in capsys.readouterr().err


def _host_rank(rank, world_size):
    import torch

    return profiling.measure_host(world_size, BUILTIN_NAMES, torch.device("cpu"), rounds=3)


def test_host_cost_is_timed_on_rank_0_alone_for_every_algorithm_and_call():
    from colltune.algorithms import get
    from colltune.offline import launch

    out = launch.run_local(_host_rank, 2, backend="gloo", timeout=300)
    assert out[1] == []  # the other rank only joins the one-rank group's creation
    calls = {(s["algorithm"], s["n"], s["row_numel"]) for s in out[0]}
    assert calls == {(a, n, r) for a in BUILTIN_NAMES for n, _, r in profiling.HOST_CALLS}
    for s in out[0]:
        assert s["primitive"] == "host" and s["time_us"] > 0 and s["repeats"] == 3
        alg = get(s["algorithm"])  # the counts the fit multiplies: each algorithm's declared ones
        assert (s["kernels"], s["syncs"]) == (alg.HOST_KERNELS["exact"], alg.HOST_SYNCS["exact"])


def test_host_terms_recover_known_constants_and_need_a_plane():
    counts = [(34, 2), (47, 2), (59, 3), (94, 3)]
    rows = [{"primitive": "host", "algorithm": a, "kernels": k, "syncs": s, "time_us": 343 + 16 * k + 67 * s}
            for a, (k, s) in zip(BUILTIN_NAMES, counts)]
    got = profiling.host_terms([*rows, {"primitive": "all_reduce", "time_us": 1.0}])
    assert got["host_call_us"] == pytest.approx(343, rel=1e-3)
    assert got["host_kernel_us"] == pytest.approx(16, rel=1e-3)
    assert got["host_sync_us"] == pytest.approx(67, rel=1e-3)
    assert "4 small calls" in got["host_source"] and "median error 0%" in got["host_source"]
    # Counts on one line cannot tell the three apart: no host cost rather than a made-up one.
    line = [dict(r, kernels=10 * i, syncs=i) for i, r in enumerate(rows)]
    assert profiling.host_terms(line) == {} and profiling.host_terms(rows[:2]) == {}
    # Never negative, even where noise would push a least-squares fit below zero.
    noisy = [dict(r, time_us=t) for r, t in zip(rows, (900.0, 700.0, 1500.0, 1400.0))]
    assert min(v for k, v in profiling.host_terms(noisy).items() if k != "host_source") >= 0


def test_the_collectives_fit_leaves_host_samples_out():
    prims = [{"primitive": "all_reduce", "size": b, "calls": 1, "steps": 2, "bytes": 2 * b, "time_us": 20 + b / 1e3}
             for b in (64, 4096, 1 << 20)]
    host = [{"primitive": "host", "algorithm": "dense", "kernels": 34, "syncs": 2, "time_us": 900.0}]
    assert profiling.fit_primitives(prims + host) == profiling.fit_primitives(prims)


def test_a_resumed_run_that_times_nothing_keeps_the_host_terms(tiny_profile, tmp_path):
    import dataclasses
    import shutil

    from colltune.model.profile import save_profile

    out = tmp_path / "tiny.yaml"
    shutil.copy(tiny_profile, out)
    host = {"host_call_us": 300.0, "host_kernel_us": 10.0, "host_sync_us": 50.0, "host_source": "by hand"}
    save_profile(dataclasses.replace(load_profile(out), meta={**load_profile(out).meta, **host}), out)
    assert cli.main(["profile", *TINY, "--out", str(out), "--resume"]) == 0  # every configuration done already
    assert {k: load_profile(out).meta.get(k) for k in host} == host


def test_host_timing_skips_an_algorithm_that_declares_no_counts():
    import torch

    from colltune import algorithms
    from colltune.algorithms.allgather import Allgather

    class Uncounted(Allgather):
        name = "uncounted"
        HOST_KERNELS: dict[str, int] = {}

    algorithms.register(Uncounted)
    try:  # no process group: a local call of one rank
        samples = profiling.measure_host(1, ["uncounted", "dense"], torch.device("cpu"), rounds=1)
    finally:
        algorithms.unregister("uncounted")
    assert {s["algorithm"] for s in samples} == {"dense"}


def test_a_profile_of_plugins_alone_falls_back_to_the_analytic_model():
    from colltune.model.cost_model import AnalyticModel, model_for_profile
    from colltune.model.profile import Measurement, profile_from_measurements

    prims = load_profile(os.path.join(_ROOT, "profiles", "cpu-gloo.yaml")).primitives
    base = load_profile(os.path.join(_ROOT, "profiles", "cpu-gloo.yaml")).measurements[:40]
    toy = [Measurement(**{**m.to_dict(), "algorithm": "toy"}) for m in base]
    model, source = model_for_profile(profile_from_measurements(toy, prims, {"backend": "gloo", "world_sizes": [2]}))
    assert isinstance(model, AnalyticModel) and source == "analytic"
