"""``tools/fused_bench.py`` at tiny scale: both modes run, print their table and write their figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "fused_bench.py"
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_time_mode_reports_every_contender_and_the_same_bits(tmp_path):
    out = tmp_path / "time.json"
    cmd = [sys.executable, str(_TOOL), "--ranks", "2", "--tables", "5", "--max-rows", "1000", "--batch", "64",
           "--repeats", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "per-table/fused" in proc.stdout and "torch/fused" in proc.stdout
    run = json.loads(out.read_text())["runs"]["2"]
    assert run["same_bits"] and set(run["median_ms"]) == {"fused", "per-table", "torch"}
    assert all(t > 0 for t in run["median_ms"].values())
    assert len(run["entries_rank0"]) == 5 and run["fused_bytes"] > 0


def test_bytes_mode_reports_oktopk_against_allgather(tmp_path):
    out = tmp_path / "bytes.json"
    cmd = [sys.executable, str(_TOOL), "--bytes", "--ranks", "2", "--max-log-n", "14", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["bytes"]
    assert set(rows) == {"4096", "16384"}
    for r in rows.values():
        assert r["oktopk"] > 0 and r["allgather"] > 0 and r["ratio"] == r["oktopk"] / r["allgather"]


# --------------------------------------------------------------------------- --device, --backend


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_exits_2_naming_the_option():
    proc = subprocess.run([sys.executable, str(_TOOL), "--ranks", "2", "--device", "cuda"],
                          capture_output=True, text=True, timeout=60, env=_ENV)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fused_bench.py: error: --device cuda:") and "CUDA is not available" in last, last
    assert proc.stdout == ""  # nothing ran


def test_backend_per_p_follows_the_gpus(monkeypatch, capsys, load_tool, fake_gpus):
    tool = load_tool("fused_bench")
    with pytest.raises(SystemExit) as e:
        tool.main(["--ranks", "2", "--backend", "nccl"])
    assert e.value.code == 2 and "--backend nccl needs --device cuda" in capsys.readouterr().err

    fake_gpus(2)
    ap = tool.argparse.ArgumentParser()
    assert tool.resolve_backends(ap, "cpu", None, [2, 4]) == ({2: "gloo", 4: "gloo"}, [])
    backends, notes = tool.resolve_backends(ap, "cuda", None, [2, 4])
    assert backends == {2: "nccl", 4: "gloo"} and "at P=4 the ranks share 2 GPU(s) over gloo" in notes[0]
    assert tool.resolve_backends(ap, "cuda", "gloo", [2]) == ({2: "gloo"}, [])
    with pytest.raises(SystemExit) as e:
        tool.main(["--ranks", "2", "4", "--device", "cuda", "--backend", "nccl"])
    assert e.value.code == 2 and "--backend nccl needs a GPU per rank" in capsys.readouterr().err


def test_nccl_skips_the_torch_contender_saying_why(monkeypatch, capsys, tmp_path, load_tool, fake_gpus):
    tool = load_tool("fused_bench")
    fake_gpus(2)
    calls = []

    def fake_run_local(fn, p, cfg, backend, **kw):  # what the ranks would return, without ranks
        calls.append((p, backend, cfg["device"], cfg["skip"]))
        names = [c for c in tool.CONTENDERS if c not in cfg["skip"]]
        return [{"times": {c: [0.002] * cfg["repeats"] for c in names}, "same_bits": True, "algorithms": ["allgather"],
                 "fused_bytes": 2048, "per_table_bytes": 4096, "entries": [1] * cfg["tables"]} for _ in range(p)]

    monkeypatch.setattr(tool.launch, "run_local", fake_run_local)
    out = tmp_path / "gpu.json"
    assert tool.main(["--ranks", "2", "4", "--device", "cuda", "--tables", "3", "--repeats", "2",
                      "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert calls == [(2, "nccl", "cuda", ["torch"]), (4, "gloo", "cuda", [])]
    assert "skipping torch at P=2 (nccl): dist.all_reduce of a sparse tensor is gloo's sparse allreduce" in printed
    assert "at P=4 the ranks share 2 GPU(s) over gloo" in printed
    runs = json.loads(out.read_text())["runs"]
    assert set(runs["2"]["median_ms"]) == {"fused", "per-table"} and "torch" in runs["2"]["skipped"]
    assert runs["2"]["backend"] == "nccl" and runs["4"]["backend"] == "gloo"
    assert set(runs["4"]["median_ms"]) == {"fused", "per-table", "torch"} and "skipped" not in runs["4"]
