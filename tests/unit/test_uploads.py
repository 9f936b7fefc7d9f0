"""Host data reaches the device through ``colltune.algorithms.sparse.upload`` only.

A blocking copy to a CUDA device (``torch.tensor(data, device=cuda)``, or
``.to(cuda)`` of a host tensor) is followed by a stream synchronization: the
host waits for every queued kernel. On CPU tensors nothing shows it, so the
rule is read from the source: no ``torch.tensor`` / ``torch.as_tensor`` with a
``device`` argument, and no ``torch.from_numpy(...).to(...)``, anywhere in the
package. ``upload`` copies without blocking.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted(p for top in ("tuner", "algorithms") for p in (ROOT / top).rglob("*.py"))


def _blocking_uploads(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if (f.attr in ("tensor", "as_tensor") and isinstance(f.value, ast.Name) and f.value.id == "torch"
                and any(k.arg == "device" for k in node.keywords)):
            lines.append(node.lineno)
        if (f.attr == "to" and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Attribute)
                and f.value.func.attr == "from_numpy"):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_blocking_upload(path):
    found = _blocking_uploads(ast.parse(path.read_text()))
    assert not found, f"{path.name} lines {found}: copy host data with colltune.algorithms.sparse.upload"


def test_the_check_finds_them():
    code = "t = torch.tensor([1], device=d)\nu = torch.from_numpy(a).to(d)\nv = torch.tensor([1])\n"
    assert _blocking_uploads(ast.parse(code)) == [1, 2]
