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


@pytest.fixture
def stop_at_launch(monkeypatch):
    """Return a function that makes a tool's ``run_local`` record what it would start, then stop the tool.

    ``stop_at_launch(tool)`` returns the dict it fills (``world_size``,
    ``backend``, ``modes``); the tool's ``main`` then raises
    ``KeyboardInterrupt`` before any rank starts.
    """

    def patch(tool):
        started = {}

        def fake_run_local(fn, world_size, cfg, backend, **kw):
            started.update(world_size=world_size, backend=backend, modes=cfg["modes"])
            raise KeyboardInterrupt  # stop before any rank would start

        monkeypatch.setattr(tool, "run_local", fake_run_local)
        return started

    return patch
