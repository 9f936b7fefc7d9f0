"""GPU tests: collected everywhere, skipped where CUDA is not available.

Run them on a machine with a GPU with ``python3 -m pytest -q tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

collect_ignore_glob: list[str] = []


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "/tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
