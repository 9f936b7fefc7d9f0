"""The package's launcher: local ranks, results in rank order, the first real error, the deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from colltune.algorithms.errors import ColltuneValueError
from colltune.offline.launch import PARENT_POLL_S, RankError, _process_alive, in_torchrun, run_here, run_local


def _sum_of_ranks(rank, world_size, offset):
    t = torch.tensor([rank + offset], dtype=torch.int64)
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world_size, "sum": int(t), "threads": torch.get_num_threads()}


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ColltuneValueError("rank one refuses")
    dist.barrier()  # the others wait for rank 1 and then lose their connection
    return rank


def _hang(rank, world_size):
    time.sleep(60)


def _note_pid_and_hang(rank, world_size, piddir):
    with open(os.path.join(piddir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def test_ranks_exit_when_the_launcher_is_killed(tmp_path):
    """A launcher killed outright (no cleanup) leaves no ranks running."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{os.path.dirname(here)!r}, {here!r}]
        from test_launch import _note_pid_and_hang
        from colltune.offline.launch import run_local
        if __name__ == "__main__":
            run_local(_note_pid_and_hang, 2, {str(tmp_path)!r}, timeout=300)
    """))
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pidfiles = [tmp_path / f"rank{r}.pid" for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not all(p.exists() and p.read_text() for p in pidfiles):
            assert launcher.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in pidfiles]
        assert all(_process_alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + PARENT_POLL_S + 10
        while any(_process_alive(pid) for pid in pids):
            assert time.monotonic() < deadline, "ranks still running after their launcher was killed"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in pidfiles:
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def test_results_in_rank_order():
    out = run_local(_sum_of_ranks, 3, 10)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world_size"] == 3 and o["sum"] == 33 and o["threads"] == 1 for o in out)


def test_first_real_error_names_the_rank():
    with pytest.raises(RankError) as info:
        run_local(_fail_on_rank_1, 2, pg_timeout=20, grace=3)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ColltuneValueError"
    assert "rank 1 of 2 raised ColltuneValueError: rank one refuses" in str(err)
    assert isinstance(err.__cause__, ColltuneValueError)
    assert "_fail_on_rank_1" in err.remote_traceback


def test_deadline_kills_stuck_ranks():
    start = time.monotonic()
    with pytest.raises(RankError, match="deadline"):
        run_local(_hang, 2, timeout=3)
    assert time.monotonic() - start < 20


def test_bad_world_size():
    with pytest.raises(ColltuneValueError, match="world_size"):
        run_local(_sum_of_ranks, 0, 0)


def test_in_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not in_torchrun()
    with pytest.raises(ColltuneValueError, match="torchrun"):
        run_here(_sum_of_ranks, 0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert in_torchrun()
