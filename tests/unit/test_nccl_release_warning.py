"""A warning, once per process, when the installed NCCL is not the release the analytic NCCL model encodes.

The model (``colltune.model.nccl``) follows one NCCL release, named in
``profiles/nccl-tuning.yaml`` (``source.release``). Every check here runs on
CPU: the installed release is passed in, or ``installed_nccl_version`` is
replaced.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest

from colltune.model.nccl import load_tuning
from colltune.offline import profiling
from colltune.select import selector as sel_mod
from colltune.select.selector import (
    Selector,
    encoded_nccl_release,
    installed_nccl_version,
    nccl_version_warning,
    shipped_profile,
)

LOGGER = "colltune.select.selector"


@pytest.fixture
def fresh(monkeypatch):
    """This process has not warned yet; the installed NCCL is 2.28.9."""
    monkeypatch.setattr(sel_mod, "_nccl_warned", False)
    monkeypatch.setattr(sel_mod, "installed_nccl_version", lambda: (2, 28, 9))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
            and "NCCL" in r.getMessage()]


def test_the_encoded_release_is_the_tuning_files():
    tag = load_tuning().source["release"]  # e.g. v2.21.5-1
    assert tag.startswith("v") and tag.lstrip("v").startswith(".".join(map(str, encoded_nccl_release())) + "-")


def test_the_message_names_both_releases_and_the_remedy():
    msg = nccl_version_warning((2, 28, 9), (2, 21, 5))
    assert msg is not None
    assert "NCCL 2.28.9 is installed" in msg and "encodes NCCL 2.21.5" in msg
    assert "algorithm and protocol" in msg and "latencies" in msg  # what the difference means for predictions
    assert "colltune profile --backend nccl" in msg and "COLLTUNE_PROFILE" in msg


@pytest.mark.parametrize("installed", [None, (), (2, 21, 5), (2, 21, 5, "a0")])
def test_no_message_without_nccl_or_for_the_same_release(installed):
    assert nccl_version_warning(installed, (2, 21, 5)) is None


@pytest.mark.parametrize("installed", [(2, 21, 4), (2, 22, 3), (3, 0, 0)])
def test_any_other_release_warns(installed):
    assert nccl_version_warning(installed, (2, 21, 5)) is not None


def test_the_default_encoded_release_matches_itself():
    assert nccl_version_warning(encoded_nccl_release()) is None
    assert nccl_version_warning((1, 0, 0)) is not None


def test_installed_version_from_a_loaded_torch(monkeypatch):
    cuda_build = types.SimpleNamespace(cuda=types.SimpleNamespace(nccl=types.SimpleNamespace(version=lambda: (2, 28, 9))))
    monkeypatch.setitem(sys.modules, "torch", cuda_build)
    assert installed_nccl_version() == (2, 28, 9)

    def no_nccl():
        raise AttributeError("module 'torch._C' has no attribute '_nccl_version'")  # a CPU build

    cpu_build = types.SimpleNamespace(cuda=types.SimpleNamespace(nccl=types.SimpleNamespace(version=no_nccl)))
    monkeypatch.setitem(sys.modules, "torch", cpu_build)
    assert installed_nccl_version() is None
    monkeypatch.delitem(sys.modules, "torch")
    assert installed_nccl_version() is None  # the selector imports no torch itself


def test_the_real_torch_gives_a_release_or_none():
    import torch

    got = installed_nccl_version()
    if torch.distributed.is_nccl_available():
        assert isinstance(got, tuple) and len(got) == 3 and all(isinstance(v, int) for v in got)
    else:
        assert got is None


def test_a_selector_pricing_nccl_warns_once_per_process(fresh, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert shipped_profile("nccl") is not None
    assert Selector().model("gloo") is not None
    assert _warnings(caplog) == []  # gloo: no NCCL priced
    assert Selector().model("nccl") is not None
    assert Selector().model("nccl") is not None  # another selector, the same process
    got = _warnings(caplog)
    assert len(got) == 1 and "NCCL 2.28.9 is installed" in got[0]


def test_a_selector_on_the_same_release_is_silent(fresh, caplog, monkeypatch):
    monkeypatch.setattr(sel_mod, "installed_nccl_version", encoded_nccl_release)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    Selector().model("nccl")
    assert _warnings(caplog) == []


def test_profile_on_nccl_warns_when_it_starts(fresh, caplog, monkeypatch):
    class Started(Exception):
        pass

    def stop(out):
        raise Started  # the warning comes before anything is read or measured

    monkeypatch.setattr(profiling, "_run_world_sizes", lambda ws: (list(ws), True))
    monkeypatch.setattr(profiling, "journal_path", stop)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    grid = profiling.Grid(**profiling.GRIDS["quick"])
    with pytest.raises(Started):
        profiling.run_profile("unused.yaml", [2], grid, backend="gloo")
    assert _warnings(caplog) == []
    with pytest.raises(Started):
        profiling.run_profile("unused.yaml", [2], grid, backend="nccl")
    assert len(_warnings(caplog)) == 1


def test_a_measured_nccl_profile_is_silent(fresh, caplog, monkeypatch):
    analytic = sel_mod.model_for_profile(sel_mod.load_profile(shipped_profile("nccl")))
    assert analytic.learned is None and analytic.analytic.network is not None
    measured = sel_mod._Model("learned", "measured", analytic.analytic, learned=object())  # what a measured profile gives
    monkeypatch.setattr(sel_mod, "model_for_profile", lambda profile, label="": measured)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert Selector().model("nccl") is measured
    assert _warnings(caplog) == []
