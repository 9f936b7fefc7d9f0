"""tools/gpu_call_bench.py: one rank, every contender timed; on the CPU here (syncs counted on CUDA only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from colltune.algorithms import names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_runs_every_contender_and_writes_json(tmp_path):
    out = tmp_path / "calls.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "gpu_call_bench.py"), "--log-n", "10", "--density", "1e-2",
           "--rows", "0", "4", "--rounds", "2", "--warmup", "1", "--topk", "--topk-log-n", "12", "--floor", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4
    for row in rows[:2]:
        assert set(row) >= {"all_reduce", "densify+all_reduce", *names(), "auto"}
        assert all(row[c]["ms"] > 0 for c in ("all_reduce", "dense", "auto"))
    assert set(rows[2]) >= {"torch.topk", *names()}
    assert "all_reduce" in done.stdout and "top-k" in done.stdout
    assert rows[3]["floor"] and all(rows[3][f] > 0 for f in ("launch_us", "read_us", "all_reduce_1_us"))
    assert "median / densify+all_reduce 1.00" in done.stdout  # the summary, the baseline against itself


def test_the_summary_of_the_stored_h200_file_gives_the_readme_table():
    cmd = [sys.executable, os.path.join(ROOT, "tools", "gpu_call_bench.py"), "--summary",
           os.path.join(ROOT, "profiles", "measurements", "h200-per-call.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    readme = open(os.path.join(ROOT, "README.md")).read()
    label = {"all_reduce": "`all_reduce` of the dense tensor", "densify+all_reduce": "densify + `all_reduce`",
             "oktopk": "Ok-Topk", "auto": "`auto`"}
    lines = done.stdout.splitlines()
    assert len(lines) == 7, lines  # all_reduce, densify + all_reduce, the four algorithms, auto
    for line in lines:  # e.g. "dense  0.49 to 1.91 ms, syncs [1], kernels 17 to 40, ... 2.22"
        name, rest = line.split(None, 1)
        ms, ratio = rest.split(" ms,")[0], rest.rsplit(" ", 1)[1]
        syncs = rest.split("syncs [")[1].split("]")[0]
        kernels = rest.split("kernels ")[1].split(",")[0]  # "17 to 40", or "0" where every call launched as many
        row = f"| {label.get(name, name)} | {ms} | {syncs} | {kernels} | {ratio} |"
        assert row in readme, row  # the algorithm's own row, every cell


def test_trace_splits_each_calls_host_time_on_the_device_path(tmp_path):
    # --device-path: CPU tensors take CUDA's code path, so the trace shows the ops a GPU call dispatches.
    traces = tmp_path / "traces"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "gpu_call_bench.py"), "--log-n", "10", "--density", "1e-2",
           "--rows", "0", "--rounds", "2", "--warmup", "1", "--device-path", "--trace", str(traces)]
    no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # --device-path is for CPU tensors
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=no_gpu)
    assert done.returncode == 0, done.stderr
    assert "the device path on CPU tensors" in done.stdout and "where host time goes" in done.stdout
    host = json.loads((traces / "host.json").read_text())
    (label, per), = host["inputs"].items()
    assert set(per) == {"all_reduce", "densify+all_reduce", *names(), "auto"}
    for name, got in per.items():
        assert got["wall_us"] > 0 and got["profiled_wall_us"] > 0, (name, got)
        assert (traces / f"{label}-{name.replace('+', '-plus-')}.json.gz").stat().st_size > 0
        assert (traces / f"{label}-{name.replace('+', '-plus-')}.txt").read_text().count("aten::") >= (name != "all_reduce")
    assert per["dense"]["aten_us"] > 0 and "aten::sort" in per["dense"]["ops"]  # the coalesce's sort, on the device path
