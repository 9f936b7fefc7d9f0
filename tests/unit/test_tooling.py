"""The linters the package is kept to: ruff on the repository, mypy on the pure layer.

Both read their settings from pyproject.toml. mypy resolves modules by file
path, so it checks a tree of links that lays the source folders out as the
installed package (``colltune/`` holding ``tuner/``'s files and
``algorithms/``), the way pyproject.toml maps them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The pure layer and the torch-free modules of colltune.algorithms it reads.
TYPED = ("colltune.model", "colltune.algorithms.errors", "colltune.algorithms.knobs",
         "colltune.algorithms.schedule", "colltune.algorithms.registry")


def test_ruff_passes() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "tuner", "algorithms", "tests", "tools"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def _package_tree(tmp: Path) -> Path:
    pkg = tmp / "colltune"
    pkg.mkdir()
    for entry in (ROOT / "tuner").iterdir():
        if entry.name != "__pycache__":
            os.symlink(entry, pkg / entry.name)
    os.symlink(ROOT / "algorithms", pkg / "algorithms")
    return tmp


def test_mypy_passes_on_the_pure_layer(tmp_path: Path) -> None:
    tree = _package_tree(tmp_path)
    args = [a for name in TYPED for a in (("-p", name) if name == "colltune.model" else ("-m", name))]
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(tmp_path / ".mypy_cache"), *args],
                         cwd=tree, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "Success" in out.stdout
