"""``tools/train_ctr.py`` on NCCL: modes NCCL cannot run are skipped with a line saying why, checked before any rank starts.

No GPU is needed: the GPUs are pretended (``fake_gpus``) and no rank starts.
"""

from __future__ import annotations

import pytest

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@pytest.fixture
def tool(monkeypatch, load_tool):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    return load_tool("train_ctr")


def test_gloo_runs_every_mode(tool):
    bench = tool.parse_args(["--bench"])
    assert bench["modes"] == list(tool.MODES) and bench["skipped"] == {}
    assert tool.parse_args(["--mode", "ddp-sparse"])["modes"] == ["ddp-sparse"]


def test_nccl_skips_ddp_sparse_and_says_why(tool, fake_gpus):
    fake_gpus(4)
    bench = tool.parse_args(["--ranks", "4", "--backend", "nccl", "--bench"])
    assert bench["modes"] == ["ddp-dense", "colltune", "colltune-sync-all", "colltune-topk"]
    assert list(bench["skipped"]) == ["ddp-sparse"]
    assert "DDP cannot reduce sparse gradients on NCCL" in bench["skipped"]["ddp-sparse"]
    assert bench["interleave"] == "step"
    picked = tool.parse_args(["--ranks", "2", "--backend", "nccl", "--mode", "ddp-sparse", "colltune"])
    assert (picked["modes"], list(picked["skipped"]), picked["interleave"]) == (["colltune"], ["ddp-sparse"], "run")


def test_nccl_with_nothing_left_to_run_exits_2(tool, fake_gpus, capsys):
    fake_gpus(2)
    with pytest.raises(SystemExit) as e:
        tool.parse_args(["--ranks", "2", "--backend", "nccl", "--mode", "ddp-sparse"])
    assert e.value.code == 2 and "nothing to run on nccl: ddp-sparse: DDP cannot" in capsys.readouterr().err


def test_nccl_needs_a_gpu_per_rank(tool, fake_gpus, capsys, monkeypatch):
    fake_gpus(0)
    with pytest.raises(SystemExit) as e:
        tool.parse_args(["--backend", "nccl"])
    assert e.value.code == 2 and "--backend nccl needs CUDA" in capsys.readouterr().err
    fake_gpus(2)
    with pytest.raises(SystemExit) as e:
        tool.parse_args(["--ranks", "4", "--backend", "nccl"])
    assert e.value.code == 2 and "a GPU per rank: 4 ranks on this machine, 2 GPU(s)" in capsys.readouterr().err
    # Under torchrun the ranks of this machine count: 8 of 16 on 8 GPUs is a GPU per rank.
    fake_gpus(8)
    for name, value in (("RANK", "3"), ("WORLD_SIZE", "16"), ("LOCAL_WORLD_SIZE", "8")):
        monkeypatch.setenv(name, value)
    assert tool.parse_args(["--backend", "nccl", "--bench"])["skipped"].keys() == {"ddp-sparse"}


def test_main_prints_the_skip_once_and_starts_the_rest(tool, fake_gpus, stop_at_launch, capsys):
    fake_gpus(2)
    started = stop_at_launch(tool)
    with pytest.raises(KeyboardInterrupt):
        tool.main(["--ranks", "2", "--backend", "nccl", "--mode", "ddp-sparse", "colltune"])
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("skipping")] == [
        "skipping ddp-sparse: DDP cannot reduce sparse gradients on NCCL (NCCL has no sparse allreduce; "
        "run it with --backend gloo)"]
    assert started == {"world_size": 2, "backend": "nccl", "modes": ["colltune"]}
