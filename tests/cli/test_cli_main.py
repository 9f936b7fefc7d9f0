"""``colltune`` itself: ``--version``, and a quiet exit when the reader closes standard output early (``| head``)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import colltune
from colltune import cli

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPLAIN = ["explain", "--numel", "2^20", "--density", "1e-2", "--world-size", "4", "--overlap", "0.5", "--json"]


def test_version_prints_the_package_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"colltune {colltune.__version__}\n"


def test_version_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "colltune.cli", "--version"], capture_output=True, text=True,
                          timeout=60, cwd=_ROOT)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"colltune {colltune.__version__}\n", "")


def test_a_pipe_closed_before_any_output_ends_quietly_with_141():
    proc = subprocess.Popen([sys.executable, "-m", "colltune.cli", *EXPLAIN], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=_ROOT)
    proc.stdout.close()  # long before the command prints: its first write meets a closed pipe
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE == 141
    assert err == b""


def test_explain_json_into_head_prints_no_traceback():
    command = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "colltune.cli", *EXPLAIN))
    script = f"{command} | head -1; echo \"status ${{PIPESTATUS[0]}}\" >&2"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=_ROOT)
    assert proc.stdout == "{\n"
    # 141 when the pipe closed before the last write; 0 when the output fit in the pipe's buffer first.
    assert proc.stderr in ("status 141\n", "status 0\n"), proc.stderr


def test_bench_into_head_still_writes_its_report(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["bench", "-P", "2", "--n", "2^12", "--density", "1e-2", "--overlap", "0", "1", "--repeats", "1",
            "--budget", "0.2", "--no-progress", "--json", str(out)]
    command = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "colltune.cli", *argv))
    script = f"{command} | head -1; echo \"status ${{PIPESTATUS[0]}}\" >&2"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=_ROOT)
    assert proc.stdout.split()[:3] == ["n", "density", "P"]
    # The ranks print into the closed pipe too: the run goes on quietly and writes its report.
    assert proc.stderr in ("status 141\n", "status 0\n"), proc.stderr
    assert len(json.loads(out.read_text())["configs"]) == 2


def test_a_missing_cli_extra_names_the_install_command(monkeypatch, capsys, tmp_path):
    """Without the cli extra a command that needs it exits 2 and says what to install."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    for mod in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, mod)
    from colltune.select.selector import shipped_profile

    assert cli.main(["report", str(shipped_profile("gloo")), "--out", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'colltune[cli]'" in err and "matplotlib" in err


def test_a_missing_cli_extra_is_named_before_any_work(monkeypatch, capsys, tmp_path):
    """A command checks the extra first: demo names scipy at once instead of after profiling."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "scipy" else real(name, *a))
    assert cli.main(["demo", "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert "colltune demo: error: it needs scipy" in err and "pip install 'colltune[cli]'" in err
    assert not (tmp_path / "demo").exists()  # nothing profiled, nothing written
