"""``colltune --help``, ``--version`` and every ``colltune CMD --help`` answer without torch or the cli extras.

Each runs in a fresh interpreter with torch, scikit-learn, SciPy, Optuna,
matplotlib and tqdm blocked (an import of any of them fails), and must print
its usage. The table of commands lists them without importing their modules,
and its help strings, and the constants the CLI states for ``--help``, agree
with the modules they come from.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from colltune import cli

#: Imports that a ``--help`` must not need.
BLOCKED = ("torch", "sklearn", "scipy", "optuna", "matplotlib", "tqdm")

_CHILD = """
import importlib.abc, json, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in %r:
            raise ImportError(f"{name} is blocked here")

sys.meta_path.insert(0, _Block())
from colltune.cli import main

status = main(sys.argv[1:])
print(json.dumps({"status": status, "modules": sorted(m for m in sys.modules if m.split(".")[0] in
                  ("colltune", "numpy"))}), file=sys.stderr)
""" % (BLOCKED,)


def _run(*args: str) -> tuple[str, dict]:
    """Run ``colltune ARGS`` with the heavy imports blocked; return its output and what it loaded."""
    done = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads(done.stderr.strip().splitlines()[-1])


def test_the_torch_blocker_blocks() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD.replace("from colltune.cli import main", "import torch")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "torch is blocked here" in done.stderr


def test_the_top_level_help_lists_every_command_and_imports_none() -> None:
    out, got = _run("--help")
    assert got["status"] == 0 and out.startswith("usage: colltune")
    for name, entry in cli.TABLE.items():
        assert name in out and entry.help.split()[0] in out
    assert not [m for m in got["modules"] if m.startswith("colltune.cli.") and m != "colltune.cli.common"]
    assert "numpy" not in got["modules"]


def test_version_needs_nothing_heavy() -> None:
    out, got = _run("--version")
    assert (got["status"], out) == (0, f"colltune {importlib.import_module('colltune').__version__}\n")
    assert "numpy" not in got["modules"]


#: Commands whose ``--help`` loads NumPy (none: the model layer is imported inside ``run``).
_NUMPY_AT_IMPORT: set[str] = set()


@pytest.mark.parametrize("name", list(cli.TABLE))
def test_every_command_help_needs_no_torch(name: str) -> None:
    out, got = _run(name, "--help")
    assert got["status"] == 0 and out.startswith(f"usage: colltune {name}"), out[:300]
    assert "options:" in out
    if name not in _NUMPY_AT_IMPORT:
        assert "numpy" not in got["modules"], f"colltune {name} --help imports NumPy"


def test_a_command_imports_only_its_own_module() -> None:
    _, got = _run("explain", "--help")
    loaded = {m for m in got["modules"] if m.startswith("colltune.cli.")}
    assert loaded == {"colltune.cli.common", "colltune.cli.explain"}


@pytest.mark.parametrize("name", list(cli.TABLE))
def test_the_table_agrees_with_the_command_classes(name: str) -> None:
    entry = cli.TABLE[name]
    cls = getattr(importlib.import_module(entry.module), entry.cls)
    assert (cls.name, cls.help) == (name, entry.help)
    assert cli.COMMANDS[name].name == name


def test_command_of_finds_the_subcommand() -> None:
    assert cli.command_of(["--log-level", "DEBUG", "bench", "--quick"]) == "bench"
    assert cli.command_of(["--log-level=INFO", "fit", "p.yaml"]) == "fit"
    assert cli.command_of(["--help"]) is None
    assert cli.command_of(["nope", "--help"]) is None


def test_an_unknown_command_exits_2(capsys) -> None:
    assert cli.main(["nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_the_constants_stated_for_help_agree_with_their_sources() -> None:
    from colltune.cli import bench as bench_cli
    from colltune.cli import common
    from colltune.cli import profile as profile_cli
    from colltune.model.features import MAX_WORLD_SIZE
    from colltune.offline import bench, profiling

    assert common.MAX_WORLD_SIZE == MAX_WORLD_SIZE
    assert bench_cli.FULL_WORLD == bench.FULL_WORLD
    assert profile_cli.GRID_NAMES == tuple(profiling.GRIDS)
    assert profile_cli.DTYPES == profiling.DTYPES
    assert profile_cli.STATISTICS == profiling.STATISTICS


def test_profile_help_gives_the_gpu_cluster_command(capsys) -> None:
    assert cli.main(["profile", "--help"]) == 0
    text = capsys.readouterr().out
    assert "torchrun --nnodes" in text and "-m colltune.cli -- profile --backend nccl" in text
    assert "COLLTUNE_PROFILE" in text


def test_every_command_of_the_table_is_a_command() -> None:
    for name in cli.TABLE:
        command = cli.COMMANDS[name]
        assert isinstance(command, cli.Command) and command.name == name, name
