"""``tools/dlrm.py`` at tiny scale: every mode trains, prints its figures, and the losses of the modes agree."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from colltune.algorithms import names

from harness import NATIVE_SIGNALS, once_more_after_a_native_death

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "dlrm.py"


#: A native crash's own lines: C++'s uncaught exception (gloo's), and glibc's heap checks ("malloc(): ...").
_NATIVE = re.compile(r"terminate called|what\(\):|^(malloc|free|realloc|munmap_chunk|double free|corrupted)")
#: How the launcher reports a rank that died in native code (the torch 2.13 gloo race the README's DLRM section names).
_DIED = re.compile(r"rank \d+: died with signal (" + "|".join(s.name for s in NATIVE_SIGNALS) + ")")


def _failed(proc: subprocess.CompletedProcess) -> str:
    """What a failed run printed: a native crash's own lines first (they come early, from a rank's thread)."""
    native = [ln for ln in proc.stderr.splitlines() if _NATIVE.search(ln)]
    return "\n".join(native) + "\n" + proc.stdout[-2000:] + proc.stderr[-8000:]


def test_tiny_bench_prints_every_field_and_the_modes_agree(tmp_path):
    out = tmp_path / "dlrm.json"
    # One sparse allreduce in flight at a time: DDP's own way (two at once on gloo's threads) corrupts the heap
    # now and then with torch 2.13 (tools/ddp_sparse_stress.py), and this test is not about that.
    cmd = [sys.executable, str(_TOOL), "--ranks", "2", "--bench", "--steps", "3", "--skip", "1", "--dense-steps", "2",
           "--scale", "0.001", "--batch", "128", "--bot-mlp", "32", "--top-mlp", "32", "--log-every", "1",
           "--one-sparse-in-flight", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # One sparse allreduce in flight makes torch's race rarer, not impossible (a 10-step run of the stress tool's
    # test died once under load): a rank dead of a native signal gets one more run.
    proc = once_more_after_a_native_death(
        lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env),
        lambda p: p.returncode != 0 and bool(_DIED.search(p.stdout + p.stderr)), lambda p: p.returncode == 0, _failed)
    assert proc.returncode == 0, _failed(proc)
    printed = proc.stdout
    for mode in ("ddp-dense", "ddp-sparse", "colltune-per-table", "colltune-fused"):
        assert f"-- {mode}: median step" in printed
    assert "sparse gradients, one sparse allreduce in flight at a time]" in printed
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
    assert any(a.split()[0] in names() for a in algos), algos
    assert s["modes"]["colltune-fused"]["median_sync_ms"] > 0
    # Exact averaging everywhere: the same losses up to float rounding, step by step.
    assert s["loss_gaps"]["largest"] < 1e-5, s["loss_gaps"]
    runs = {r["mode"]: r["losses"] for r in report["runs"]}
    assert len(runs["colltune-fused"]) == 3 and len(runs["ddp-dense"]) == 2
    assert runs["colltune-fused"][0] == runs["ddp-sparse"][0] == runs["ddp-dense"][0]  # the same start


# --------------------------------------------------------------------------- --device, --backend, the none modes


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_exits_2_naming_the_option():
    proc = subprocess.run([sys.executable, str(_TOOL), "--ranks", "1", "--device", "cuda"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("dlrm.py: error: --device cuda:") and "CUDA is not available" in last, last
    assert "==" not in proc.stdout  # no rank started


def test_cpu_defaults_are_unchanged(monkeypatch, load_tool):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    tool = load_tool("dlrm")
    cfg = tool.parse_args([])
    assert (cfg["device"], cfg["backend"], cfg["modes"], cfg["notes"], cfg["skipped"]) == \
        ("cpu", "gloo", ["colltune-fused"], [], {})
    bench = tool.parse_args(["--bench"])
    assert bench["modes"] == ["ddp-sparse", "colltune-per-table", "colltune-fused", "ddp-dense"]
    assert tool.parse_args(["--mode", "none", "none+fused-call"])["modes"] == ["none", "none+fused-call"]


def test_backend_follows_the_gpus_and_nccl_skips_ddp_sparse(monkeypatch, capsys, load_tool, fake_gpus):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    tool = load_tool("dlrm")
    with pytest.raises(SystemExit) as e:
        tool.parse_args(["--backend", "nccl"])  # NCCL needs --device cuda
    assert e.value.code == 2 and "--backend nccl needs --device cuda" in capsys.readouterr().err

    fake_gpus(1)
    one = tool.parse_args(["--ranks", "1", "--device", "cuda"])
    assert (one["backend"], one["notes"]) == ("nccl", [])
    shared = tool.parse_args(["--ranks", "4", "--device", "cuda"])
    assert shared["backend"] == "gloo" and "4 ranks share 1 GPU(s) over gloo" in shared["notes"][0]
    with pytest.raises(SystemExit) as e:
        tool.parse_args(["--ranks", "4", "--device", "cuda", "--backend", "nccl"])
    assert e.value.code == 2 and "--backend nccl needs a GPU per rank" in capsys.readouterr().err

    # On NCCL, --bench runs the baselines too and skips ddp-sparse, saying why; gloo keeps it.
    bench = tool.parse_args(["--ranks", "1", "--device", "cuda", "--bench"])
    assert bench["modes"] == ["none", "none+fused-call", "colltune-per-table", "colltune-fused", "ddp-dense"]
    assert "DDP cannot reduce sparse gradients on NCCL" in bench["skipped"]["ddp-sparse"]
    on_gloo = tool.parse_args(["--ranks", "1", "--device", "cuda", "--backend", "gloo", "--mode", "ddp-sparse"])
    assert on_gloo["modes"] == ["ddp-sparse"] and on_gloo["skipped"] == {}
    with pytest.raises(SystemExit) as e:
        tool.parse_args(["--ranks", "1", "--device", "cuda", "--mode", "ddp-sparse"])
    assert e.value.code == 2 and "nothing to run on nccl" in capsys.readouterr().err

    # Under torchrun the ranks of this machine count: 8 of 16 on 8 GPUs is a GPU per rank.
    fake_gpus(8)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert tool.parse_args(["--device", "cuda", "--bench"])["backend"] == "nccl"


def test_main_prints_the_skipped_mode_and_starts_nccl_ranks(monkeypatch, capsys, load_tool, fake_gpus, stop_at_launch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    tool = load_tool("dlrm")
    fake_gpus(2)
    started = stop_at_launch(tool)
    with pytest.raises(KeyboardInterrupt):
        tool.main(["--ranks", "2", "--device", "cuda", "--mode", "ddp-sparse", "colltune-fused"])
    out = capsys.readouterr().out
    assert "skipping ddp-sparse: DDP cannot reduce sparse gradients on NCCL" in out
    assert started == {"world_size": 2, "backend": "nccl", "modes": ["colltune-fused"]}


def test_none_modes_run_on_cpu_and_report_the_fused_call(tmp_path):
    out = tmp_path / "none.json"
    cmd = [sys.executable, str(_TOOL), "--ranks", "2", "--mode", "none", "none+fused-call", "colltune-fused",
           "--steps", "3", "--skip", "1", "--scale", "0.001", "--batch", "64", "--bot-mlp", "16", "--top-mlp", "16",
           "--log-every", "0", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, _failed(proc)
    for mode in ("none", "none+fused-call", "colltune-fused"):
        assert f"-- {mode}: median step" in proc.stdout, mode
    assert "the fused call's own cost (none+fused-call: one sparse_allreduce_many per step)" in proc.stdout
    assert "step time over none (no synchronization): none+fused-call" in proc.stdout

    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["fused_call_ms"] > 0 and s["modes"]["none+fused-call"]["median_sync_ms"] == s["fused_call_ms"]
    assert s["modes"]["none"]["median_sync_ms"] == 0 and s["modes"]["none"]["mib_per_step"] == 0
    assert s["modes"]["none+fused-call"]["mib_per_step"] > 0  # the call's own bytes at P = 2
    assert set(s["step_ms_over_none"]) == {"none+fused-call", "colltune-fused"}
    # The call's result is left unused: the same losses as none; the unsynchronized ranks are compared
    # only with each other.
    runs = {r["mode"]: r["losses"] for r in report["runs"]}
    assert runs["none"] == runs["none+fused-call"]
    assert set(s["loss_gaps"]["pairs"]) == {"none vs none+fused-call"}
    assert s["modes"]["none+fused-call"]["algorithms"]["dense.*"].startswith("none")


def test_one_sparse_in_flight_starts_a_sparse_allreduce_once_the_one_before_is_done(monkeypatch, load_tool):
    """``--one-sparse-in-flight``: a sparse bucket's allreduce waits for the previous sparse one; dense ones never."""
    tool = load_tool("dlrm")
    started: list[torch.futures.Future] = []

    def pending_allreduce(_state, _bucket):  # type: ignore[no-untyped-def]
        started.append(torch.futures.Future())
        return started[-1]

    monkeypatch.setattr(tool.default_hooks, "allreduce_hook", pending_allreduce)

    class Bucket:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def buffer(self) -> torch.Tensor:
            return self.t

    sparse, dense = Bucket(torch.ones(3).to_sparse()), Bucket(torch.ones(3))
    free = tool.DDPSyncTimer([])
    free._allreduce(sparse), free._allreduce(sparse)
    assert len(started) == 2  # DDP's own way: both in flight
    started.clear()
    timer = tool.DDPSyncTimer([], one_sparse_in_flight=True)
    timer._allreduce(sparse), timer._allreduce(dense)
    assert len(started) == 2  # a dense bucket is not held back
    second = threading.Thread(target=timer._allreduce, args=(sparse,))
    second.start()
    second.join(0.2)
    assert second.is_alive() and len(started) == 2  # the first sparse one is still in flight
    started[0].set_result([torch.ones(3)])
    second.join(10)
    assert not second.is_alive() and len(started) == 3
