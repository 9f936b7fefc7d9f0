"""``colltune bench``: a tiny grid writes valid JSON; bad options exit with status 2 and a message."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from colltune import cli
from colltune.algorithms.errors import ColltuneValueError
from colltune.cli import common
from colltune.offline import bench

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_cli(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``python -m colltune.cli`` in a fresh process (a fresh forkserver, output captured)."""
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "colltune.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=_ROOT,
    )


def _bench_two_configs(out, *options: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``colltune bench`` on P=2, n=2^12, density 1e-2, overlaps 0 and 1; return the process and the JSON."""
    proc = _run_cli(
        "bench", "--world-size", "2", "--n", "2^12", "--density", "1e-2", "--overlap", "0", "1",
        *options, "--no-progress", "--json", str(out),
    )
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


def test_tiny_grid_writes_valid_json(tmp_path):
    out = tmp_path / "bench.json"
    proc, report = _bench_two_configs(
        out, "--repeats", "2", "--budget", "0.5", "--topk", "--topk-n", "2^12", "--topk-steps", "3",
    )
    assert report["format"] == "colltune-bench/1"
    assert report["contenders"] == list(bench.all_contenders())
    assert [c["overlap_requested"] for c in report["configs"]] == [0.0, 1.0]
    for c in report["configs"]:
        assert (c["n"], c["density"], c["world_size"], c["k"]) == (4096, 0.01, 2, 41)
        assert c["repeats"] == 2
        assert c["reference"] == "float64" and c["tolerance"] == bench.tolerance("float32", 2)
        assert set(c["contenders"]) == set(bench.all_contenders())
        for name, e in c["contenders"].items():
            assert len(e["times_ms"]) == 2
            assert 0 < e["min_ms"] <= e["median_ms"] <= e["max_ms"]
            assert e["q1_ms"] <= e["median_ms"] <= e["q3_ms"]
            assert e["bytes_per_rank"] > 0 and e["bytes_per_rank_max"] >= e["bytes_per_rank"]
            assert e["bytes_estimated"] is (name == "torch")
            assert e["agrees"] and e["max_rel_err"] <= c["tolerance"], (name, e["max_rel_err"])
        assert set(c["speedup_vs_torch"]) == set(bench.all_contenders()) - {"torch"}
        # The oracle: the fastest fixed algorithm timed; auto's choice and its regret against it.
        assert c["oracle"]["algorithm"] in bench.fixed_algorithms()
        assert c["oracle"]["median_ms"] == min(c["contenders"][a]["median_ms"] for a in bench.fixed_algorithms())
        if "auto" in bench.all_contenders():
            assert c["auto"]["algorithm"] in bench.fixed_algorithms() and c["auto"]["regret"] > 0
            assert set(c["auto"]["speedup"]) == {*bench.fixed_algorithms(), "torch"}
    # Overlap achieved by construction: 0 -> disjoint, 1 -> identical index sets.
    assert report["configs"][0]["overlap"] == 0.0 and report["configs"][0]["union"] == 2 * 41
    assert report["configs"][1]["overlap"] == 1.0 and report["configs"][1]["union"] == 41
    # Allgather sends (P-1) k entries of 4 + 4 bytes, plus the metadata record.
    ag = report["configs"][0]["contenders"]["allgather"]
    assert ag["bytes_per_rank"] - ag["meta_bytes_per_rank"] == 41 * 8
    (topk,) = report["topk"]
    assert (topk["n"], topk["world_size"], topk["steps"], topk["k"]) == (4096, 2, 3, 41)
    assert math.isclose(topk["bound_words"], 6 * 41 / 2)
    assert set(topk["contenders"]) == set(bench.topk_contenders())
    assert "targets" not in report  # team checks: tools/check_targets.py
    # The table: a header, one line per configuration, the verdicts.
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:5] == ["n", "density", "P", "overlap", "reps"]
    assert lines[1].startswith("---")
    table = []
    for line in lines[2:]:
        if not line.startswith(" 2^12"):
            break
        table.append(line)
    assert len(table) == 2
    assert "top-k n=2^12" in proc.stdout and "(a) " not in proc.stdout and "FAILS" not in proc.stdout
    assert f"wrote {out}" in proc.stdout
    checked = 2 * len(bench.all_contenders())  # two configurations
    assert f"float32 (eps 1.2e-07): {checked} of {checked} agree" in proc.stdout
    if "auto" in bench.all_contenders():  # the decision table: auto against the oracle
        assert "decision table" in proc.stdout and report["auto_summary"]["configs"] == 2


def test_bfloat16_results_agree_with_the_exact_reference(tmp_path):
    # PyTorch's bfloat16 sum differs from ours by an ulp or two at P = 3: each is within bfloat16's
    # tolerance of the exact sum, where a reference in bfloat16 would make one of them disagree.
    out = tmp_path / "bf16.json"
    proc = _run_cli("bench", "--world-size", "2", "3", "--n", "2^12", "--density", "1e-2", "--overlap", "0.5", "1",
                    "--dtype", "bfloat16", "--repeats", "1", "--budget", "0.2", "--no-progress", "--json", str(out),
                    timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert len(report["configs"]) == 4
    for c in report["configs"]:
        assert c["reference"] == "float64" and c["tolerance"] == c["world_size"] * 2**-7
        for name, e in c["contenders"].items():
            assert e["agrees"] and 0 <= e["max_rel_err"] <= c["tolerance"], (name, c["world_size"], e["max_rel_err"])
    results = 4 * len(bench.all_contenders())
    assert report["agreement"] == {"bfloat16": {"eps": 2**-7, "results": results, "agree": results,
                                                "worst": report["agreement"]["bfloat16"]["worst"], "disagree": []}}
    assert f"bfloat16 (eps 7.8e-03): {results} of {results} agree" in proc.stdout
    assert "disagree" not in proc.stdout and "!" not in proc.stdout


def test_the_reference_is_the_exact_sum_and_catches_a_wrong_result():
    import torch

    w = bench.BenchConfig(n=4096, density=1e-2, overlap=0.5, world_size=3, dtype="bfloat16").workload()
    idx, total, magnitude = bench._exact_reference(w)
    parts = [w.make(r) for r in range(3)]
    assert torch.equal(idx, torch.unique(torch.cat([i for i, _ in parts])))
    dense = torch.zeros(4096, dtype=torch.float64)
    for i, v in parts:
        dense.index_add_(0, i, v.double())
    assert torch.equal(total, dense[idx]) and bool((magnitude >= total.abs()).all())
    tol = bench.tolerance("bfloat16", 3)
    rounded = total.to(torch.bfloat16)  # the exact sum, rounded once: within half an ulp
    assert bench._rel_error((idx, total, magnitude), (idx, rounded)) <= tol / 6
    wrong = rounded.clone()
    wrong[0] += 4 * tol * magnitude[0].item()
    assert bench._rel_error((idx, total, magnitude), (idx, wrong)) > tol
    assert bench._rel_error((idx, total, magnitude), (idx[1:], rounded[1:])) == math.inf
    rounded[3] = float("nan")
    assert bench._rel_error((idx, total, magnitude), (idx, rounded)) == math.inf
    assert bench.tolerance("float32", 2) == 2 * 2**-23 and bench.tolerance("float64", 8) == 8 * 2**-52


def test_a_contender_that_raises_is_recorded_and_the_rest_goes_on(tmp_path):
    # PyTorch's gloo sparse all_reduce has no float16 kernel ("cadd_sparse" not
    # implemented for 'Half'): the torch contender fails, ours are timed.
    out = tmp_path / "f16.json"
    proc, report = _bench_two_configs(
        out, "--repeats", "1", "--warmup", "0", "--contenders", "torch", "allgather", "--dtype", "float16",
    )
    assert len(report["configs"]) == 2
    for c in report["configs"]:
        assert c["contenders"]["allgather"]["median_ms"] > 0
        torch_entry = c["contenders"]["torch"]
        if "error" not in torch_entry:
            pytest.skip("this torch reduces float16 sparse tensors on gloo; nothing failed")
        assert "Half" in torch_entry["error"]
    assert proc.stdout.count("failed: n=2^12") == 2
    assert "Traceback" not in proc.stderr


def test_burst_times_back_to_back_calls_per_call(monkeypatch, tmp_path):
    monkeypatch.setattr(bench.dist, "barrier", lambda *a, **k: None)
    ran = {"a": 0, "b": 0}

    def counter(name):
        def call():
            ran[name] += 1
            return ran[name]
        return call

    last: dict = {}
    local = bench._one_round({"a": counter("a"), "b": counter("b")}, ["a", "b"], 1, last, burst=4)
    assert ran == {"a": 4, "b": 4} and last == {"a": 4, "b": 4}
    assert set(local) == {"a", "b"} and all(t >= 0 for t in local.values())
    with pytest.raises(ValueError, match="burst"):
        bench.Plan(burst=0)
    monkeypatch.undo()
    out = tmp_path / "burst.json"
    proc, report = _bench_two_configs(out, "--repeats", "1", "--burst", "3", "--contenders", "allgather", "torch")
    assert report["plan"]["burst"] == 3
    assert "bursts of 3 back-to-back calls" in proc.stdout
    assert all(c["contenders"]["allgather"]["median_ms"] > 0 for c in report["configs"])


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench", "--world-size", "0"], "--world-size"),
        (["bench", "--world-size", "two"], "--world-size"),
        (["bench", "--density", "0"], "--density"),
        (["bench", "--density", "1.5"], "--density"),
        (["bench", "--overlap", "-0.1"], "--overlap"),
        (["bench", "--n", "2^x"], "--n"),
        (["bench", "--repeats", "0"], "--repeats"),
        (["bench", "--burst", "0"], "--burst"),
        (["bench", "--contenders", "nccl"], "--contenders"),
        (["bench", "--no-such-option"], "--no-such-option"),
        (["no-such-command"], "no-such-command"),
        ([], "usage"),
    ],
)
def test_bad_option_exits_2_with_a_message(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err


def test_unwritable_json_path_exits_2_before_running(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "dir" / "b.json"
    assert cli.main(["bench", "--quick", "--json", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and "Traceback" not in err
    assert cli.main(["bench", "--quick", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_n_accepts_powers():
    assert common.parse_n("2^20") == common.parse_n("2**20") == common.parse_n("1048576") == 2**20


def test_every_command_is_registered_once():
    parser = cli.build_parser()
    assert "bench" in cli.COMMANDS
    assert parser.parse_args(["bench", "--quick"]).command == "bench"


# --------------------------------------------------------------------------- auto against the oracle, with its noise


def _config(auto_ms, oracle_ms, n=2**16):
    """A configuration where ``auto`` ran allgather, the oracle, timed in rounds of the given times."""
    c = {"n": n, "density": 0.01, "world_size": 4, "overlap": 0.5,
         "contenders": {"auto": bench._stats([t / 1e3 for t in auto_ms]),
                        "allgather": bench._stats([t / 1e3 for t in oracle_ms])}}
    bench._add_oracle(c, "allgather", "")
    return c


def test_the_median_interval_has_the_stated_coverage():
    assert bench.median_interval(5) == (1, 1 - 2 / 32)  # min to max: all five rounds can reach
    k, coverage = bench.median_interval(15)
    assert coverage >= bench.CONFIDENCE and 1 - 2 * sum(math.comb(15, j) for j in range(k + 1)) / 2**15 < 0.95


@pytest.mark.parametrize(
    ("auto", "oracle", "verdict"),
    [
        ([1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], "within noise"),
        ([0.6, 0.62, 0.61, 0.6, 0.63, 0.6], [1.0, 1.01, 0.99, 1.0, 1.02, 1.0], "faster"),
        ([1.5, 1.52, 1.49, 1.5, 1.51, 1.5], [1.0, 1.01, 0.99, 1.0, 1.02, 1.0], "slower"),
        ([0.5, 0.5], [1.0, 1.0], "few rounds"),
    ],
)
def test_auto_against_the_oracle_is_judged_by_its_interval(auto, oracle, verdict):
    a = _config(auto, oracle)["auto"]
    assert a["verdict"] == verdict and a["paired_rounds"] == len(auto)
    assert a["regret_lo"] <= a["regret_paired"] <= a["regret_hi"]
    assert a["regret"] > 0 and "choice_regret" in a  # the fields earlier reports hold are kept


def test_a_ratio_below_1_is_never_printed_as_a_regret():
    report = {"configs": [
        _config([0.6, 0.62, 0.61, 0.6, 0.63, 0.6], [1.0, 1.01, 0.99, 1.0, 1.02, 1.0]),
        _config([0.97, 1.0, 0.95, 0.99, 0.96, 0.98], [1.0, 0.97, 1.01, 0.96, 1.0, 1.02], n=2**20),
        _config([1.5, 1.52, 1.49, 1.5, 1.51, 1.5], [1.0, 1.01, 0.99, 1.0, 1.02, 1.0], n=2**22),
    ]}
    report["auto_summary"] = bench.auto_summary(report)
    text = bench.format_auto(report)
    rows = text.splitlines()[3:6]
    assert "x faster [" in rows[0] and "regret" not in rows[0]
    assert "within noise (0.9" in rows[1] and "regret" not in rows[1]
    assert "regret 1.50 [" in rows[2]
    assert "regret 0." not in text
    s = report["auto_summary"]
    assert s["verdicts"] == {"faster": 1, "within noise": 1, "slower": 1}
    assert s["slower_max"] == pytest.approx(1.5, rel=0.02) and "worst regret 1.5" in text
    assert "slower in 1, within noise in 1, faster in 1" in text


def test_a_report_without_intervals_still_prints():
    c = _config([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    for key in ("regret_paired", "regret_lo", "regret_hi", "regret_confidence", "paired_rounds", "verdict"):
        del c["auto"][key]
    report = {"configs": [c]}
    summary = bench.auto_summary(report)
    for key in ("verdicts", "regret_lo_geomean", "regret_hi_geomean", "slower_max"):
        del summary[key]
    report["auto_summary"] = summary
    assert "1.00" in bench.format_auto(report)


def test_bench_on_nccl_needs_a_gpu_per_local_rank(fake_gpus, capsys):
    fake_gpus(2)
    assert cli.main(["bench", "--backend", "nccl", "-P", "4", "--n", "2^10", "--density", "1e-2"]) == 2
    err = capsys.readouterr().err
    assert "--backend nccl needs a GPU per rank" in err and "P = 4" in err and "2 GPU(s)" in err


def test_bench_on_nccl_leaves_torch_out_saying_why(fake_gpus, monkeypatch, tmp_path, capsys):
    fake_gpus(4)
    real_run, seen = bench.run, {}

    def fake_run(configs, **kw):
        seen.update(kw)
        return {"configs": [], "topk": [], "contenders": kw["contenders"]}

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr("colltune.cli.bench._print_summary", lambda *a: None)
    argv = ["bench", "--backend", "nccl", "-P", "4", "--n", "2^10", "--density", "1e-2", "--json",
            str(tmp_path / "b.json")]
    assert cli.main(argv) == 0
    assert seen["backend"] == "nccl" and "torch" not in seen["contenders"] and "auto" in seen["contenders"]
    assert "skipping torch: PyTorch's sparse all_reduce runs on gloo only" in capsys.readouterr().out
    with pytest.raises(ColltuneValueError, match="gloo only"):
        real_run([], contenders=["auto", "torch"], backend="nccl")
