"""Every Python block of the README runs as written on 2 local ranks, as ``torchrun --nproc-per-node 2`` would.

Each block is saved as a script and started in 2 fresh processes with the
variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``...), from the repository's root, with no
``COLLTUNE_*`` variable set. Both must exit 0 within the deadline.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
DEADLINE_S = 180


def test_the_readme_has_its_examples() -> None:
    assert len(BLOCKS) >= 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_block_runs_on_two_ranks(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(BLOCKS[index])
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLTUNE_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=DEADLINE_S))
    finally:
        for p in procs:
            p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"README block {index}, rank {r} exited {p.returncode}:\n{out}\n{err[-3000:]}"
