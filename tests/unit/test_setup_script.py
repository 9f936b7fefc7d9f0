"""``tools/setup.sh`` and the README's two commands: where torch comes from, and what CI runs.

The script runs with a stand-in interpreter (``PYTHON``) that has no torch
(or has one) and logs its pip calls instead of running them, so nothing is
installed; the index probe runs on the real Python. Unreachable indexes are a
missing ``file:`` folder and a closed local port, so no network is needed.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "tools" / "setup.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

FAKE_PYTHON = """#!/usr/bin/env bash
# A stand-in interpreter: torch importable or not; pip calls logged, not run; the index probe on the real Python.
if [[ "$1" == "-c" && "$2" == "import torch" ]]; then exit "$FAKE_TORCH_RC"; fi
if [[ "$1" == "-m" && "$2" == "pip" ]]; then echo "pip ${*:3}" >> "$FAKE_LOG"; exit 0; fi
if [[ "$1" == "-c" ]]; then exit 0; fi
exec %s "$@"
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # free once closed: nothing listens there


def _setup(tmp_path: Path, *args: str, torch_installed: bool = False, index: str | None = None) -> tuple[str, list[str]]:
    """Run setup.sh; return its stdout and the pip calls it made."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON % shlex.quote(sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "pip.log"
    env = {k: v for k, v in os.environ.items() if k != "COLLTUNE_TORCH_INDEX_URL"}
    env.update(PYTHON=str(fake), FAKE_LOG=str(log), FAKE_TORCH_RC="0" if torch_installed else "1")
    if index is not None:
        env["COLLTUNE_TORCH_INDEX_URL"] = index
    out = subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout, log.read_text().splitlines() if log.exists() else []


def test_an_installed_torch_is_kept(tmp_path):
    out, pip = _setup(tmp_path, torch_installed=True, index=(tmp_path / "index").as_uri())
    assert "torch" not in out
    assert pip == ["pip install --quiet -e .[cli]"]


def test_no_torch_installs_the_cpu_build_from_the_index(tmp_path):
    (tmp_path / "index" / "torch").mkdir(parents=True)
    index = (tmp_path / "index").as_uri()
    out, pip = _setup(tmp_path, "--test", index=index)
    assert f"installing the pinned CPU build torch==2.13.0 from {index}" in out
    assert pip == [f"pip install --quiet --index-url {index} torch==2.13.0",
                   "pip install --quiet -e .[cli,test] -c tools/constraints.txt"]


@pytest.mark.parametrize("where", ["missing folder", "closed port"])
def test_an_unreachable_index_falls_back_to_the_default_index_with_one_line(tmp_path, where):
    index = (tmp_path / "nowhere").as_uri() if where == "missing folder" else f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    out, pip = _setup(tmp_path, index=index)
    lines = [line for line in out.splitlines() if "torch==2.13.0" in line]
    assert lines == [f"setup: no torch found and {index} cannot be reached; installing torch==2.13.0 "
                     "from the default index instead"]
    assert pip == ["pip install --quiet torch==2.13.0", "pip install --quiet -e .[cli]"]


def test_an_empty_index_setting_uses_the_default_index(tmp_path):
    out, pip = _setup(tmp_path, index="")
    assert "COLLTUNE_TORCH_INDEX_URL is empty" in out
    assert pip[0] == "pip install --quiet torch==2.13.0"


def test_the_default_index_is_pytorchs_cpu_index():
    assert f'COLLTUNE_TORCH_INDEX_URL-{CPU_INDEX}' in SETUP.read_text()


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if "tools/setup.sh" in line]


def test_ci_runs_the_readmes_test_command_verbatim():
    commands = _readme_commands()
    test_cmd = [c for c in commands if "setup.sh --test" in c]
    assert len(test_cmd) == 1, commands
    assert test_cmd[0] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_both_readme_commands_set_up_a_virtual_environment_that_keeps_an_installed_torch():
    commands = _readme_commands()
    assert len(commands) == 2 and any(c.endswith("colltune demo") for c in commands), commands
    for c in commands:
        assert c.startswith("python3 -m venv --system-site-packages .venv && . .venv/bin/activate && "), c
