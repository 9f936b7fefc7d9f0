"""``tools/dlrm.py`` at tiny scale: every mode trains, prints its figures, and the losses of the modes agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "dlrm.py"


def test_tiny_bench_prints_every_field_and_the_modes_agree(tmp_path):
    out = tmp_path / "dlrm.json"
    cmd = [sys.executable, str(_TOOL), "--ranks", "2", "--bench", "--steps", "3", "--skip", "1", "--dense-steps", "2",
           "--scale", "0.001", "--batch", "128", "--bot-mlp", "32", "--top-mlp", "32", "--log-every", "1",
           "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = proc.stdout
    for mode in ("ddp-dense", "ddp-sparse", "colltune-per-table", "colltune-fused"):
        assert f"-- {mode}: median step" in printed
    for field in ("loss", "step", "sync", "MiB/step", "colltune-fused vs the faster DDP mode",
                  "sparse sync time, colltune-per-table / colltune-fused", "largest loss gap", "peak RSS"):
        assert field in printed, field

    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["world_size"] == 2 and len(s["table_rows"]) == 26
    assert set(s["modes"]) == {"ddp-dense", "ddp-sparse", "colltune-per-table", "colltune-fused"}
    for mode, v in s["modes"].items():
        assert v["median_step_ms"] > 0 and v["mib_per_step"] > 0, mode
        assert v["algorithms"], mode
    # colltune's modes name the algorithm that ran per table (or bucket), from the synchronizer's stats.
    algos = set(s["modes"]["colltune-fused"]["algorithms"].values())
    assert any(a.split()[0] in ("allgather", "oktopk", "dense") for a in algos), algos
    assert s["modes"]["colltune-fused"]["median_sync_ms"] > 0
    # Exact averaging everywhere: the same losses up to float rounding, step by step.
    assert s["loss_gaps"]["largest"] < 1e-5, s["loss_gaps"]
    runs = {r["mode"]: r["losses"] for r in report["runs"]}
    assert len(runs["colltune-fused"]) == 3 and len(runs["ddp-dense"]) == 2
    assert runs["colltune-fused"][0] == runs["ddp-sparse"][0] == runs["ddp-dense"][0]  # the same start
