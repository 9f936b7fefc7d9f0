"""``tools/accuracy16.py`` at tiny scale: a row per world size and dtype, every contender, within its bound."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from colltune.algorithms import names

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "accuracy16.py"


def test_the_tool_prints_every_contender_within_its_bound():
    proc = subprocess.run([sys.executable, str(_TOOL), "--cases", "3", "-P", "2"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("P=2 ")]
    assert [row.split()[1] for row in rows] == ["bfloat16", "float16"]
    for row in rows:
        cells = dict(re.findall(r"(\S[^()]*?) [\d.]+ \(([\d.]+) u\)", row.split(maxsplit=2)[2]))
        assert set(cells) == {*names(), "dense, 16-bit wire"}, row
        # In unit roundoffs: dense rounds once, the sparse algorithms twice, and 16 bits on the wire at P = 2
        # twice too (each rank's sum, then the one addition).
        for label, u in cells.items():
            assert float(u) <= (1.01 if label == "dense" else 2.01), (label, row)
