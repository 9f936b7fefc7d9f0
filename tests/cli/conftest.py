"""Fixtures the command-line tests share: a repository tool imported as a module, and pretend GPUs."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture
def load_tool():
    """Return a function that imports ``tools/NAME.py`` from the repository as a module."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"{name}_tool", TOOLS / f"{name}.py")
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        return tool

    return load


@pytest.fixture
def fake_gpus(monkeypatch):
    """Return a function that makes this machine seem to have ``n`` GPUs (for argument checks: no rank starts)."""

    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return fake
