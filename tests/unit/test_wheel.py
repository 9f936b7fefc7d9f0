"""``pip install .`` ships the whole package: every subpackage, the shipped profiles and the PEP 561 markers.

The source lives in fixed folders mapped onto the package name (``tuner/`` is
``colltune``, ``algorithms/`` is ``colltune.algorithms``, ``profiles/`` is
``colltune/profiles/``), and setup.py finds the subpackages by walking them.
The expected contents are computed from the source tree here the same way, so
a new subpackage is covered without touching this file.

The wheel is built from a copy of the tree (without build outputs), so that
the checkout gets no ``build/`` folder and a stale one cannot leak into the
result. The slow test installs it into a fresh virtual environment that takes
torch, NumPy and PyYAML from this interpreter's site-packages (nothing is
downloaded) and runs the package from outside the source tree.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Source folder -> where its files land in the wheel.
MAPPING = {"tuner": "colltune", "algorithms": "colltune/algorithms", "profiles": "colltune/profiles"}
#: Caches (at any depth) and build outputs (at top level) that must not travel into the build copy.
CACHES = {"__pycache__", ".git", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"}
OUTPUTS = {"build", "dist", "bench-results", "out", ".venv", "venv"}
#: A local profile written by ``colltune profile`` is not a shipped one.
LOCAL_PROFILES = ("local.yaml", "-local.yaml")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def _wheel_path(src: Path) -> str:
    """The path inside the wheel of the source file ``src`` (relative to the repository root)."""
    top, *rest = src.parts
    return "/".join([MAPPING[top], *rest])


def _source_files(folder: str, pattern: str) -> list[Path]:
    out = []
    for path in sorted((ROOT / folder).rglob(pattern)):
        rel = path.relative_to(ROOT)
        if not any(part == "__pycache__" or part.startswith(".") for part in rel.parts):
            out.append(rel)
    return out


def _package_folders() -> dict[Path, list[Path]]:
    """Every folder under tuner/ and algorithms/ holding Python source, with its modules."""
    folders: dict[Path, list[Path]] = {}
    for folder in ("tuner", "algorithms"):
        for rel in _source_files(folder, "*.py"):
            folders.setdefault(rel.parent, []).append(rel)
    return folders


def _shipped_profiles() -> list[Path]:
    return [p for p in _source_files("profiles", "*.yaml") if not p.name.endswith(LOCAL_PROFILES)]


def _build_prerequisites_missing() -> str | None:
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed; pip wheel --no-build-isolation needs it"
    version = importlib.metadata.version("setuptools")
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if major_minor < (64,):
        return f"setuptools {version} is older than the 64 pyproject.toml asks for"
    # bdist_wheel moved into setuptools in 70.1; before that it comes from the wheel package.
    if major_minor < (70, 1) and importlib.util.find_spec("wheel") is None:
        return f"setuptools {version} needs the wheel package to build a wheel, and it is not installed"
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = _build_prerequisites_missing()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"

    def ignore(folder: str, names: list[str]) -> list[str]:
        top = Path(folder) == ROOT
        return [n for n in names if n in CACHES or (top and (n in OUTPUTS or n.endswith(".egg-info")))]

    shutil.copytree(ROOT, src, ignore=ignore)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-w", str(tmp / "dist"), str(src)],
                         cwd=tmp, capture_output=True, text=True, timeout=300, env=_env())
    log = out.stdout[-6000:] + out.stderr[-4000:]
    if out.returncode != 0:
        if any(s in log for s in ("No module named 'setuptools'", "No module named 'wheel'", "invalid command 'bdist_wheel'")):
            pytest.skip("cannot build a wheel here (setuptools or wheel missing):\n" + log)
        pytest.fail("pip wheel failed:\n" + log)
    wheels = sorted((tmp / "dist").glob("colltune-*.whl"))
    assert len(wheels) == 1, log
    return wheels[0]


def _names(whl: Path) -> set[str]:
    with zipfile.ZipFile(whl) as zf:
        return set(zf.namelist())


def test_wheel_holds_every_package_folder(wheel: Path) -> None:
    names = _names(wheel)
    folders = _package_folders()
    assert Path("tuner") in folders and Path("algorithms") in folders
    missing = [f"{rel} -> {_wheel_path(rel)}" for mods in folders.values() for rel in mods if _wheel_path(rel) not in names]
    assert not missing, ("source modules missing from the wheel (a package folder needs an __init__.py "
                         "for setup.py to find it):\n" + "\n".join(missing))
    for folder in folders:
        assert _wheel_path(folder / "__init__.py") in names, f"{folder} is not a package in the wheel"
    # Nothing but the package and its metadata at top level.
    top = {n.split("/")[0] for n in names} - {"colltune"}
    assert len(top) == 1 and top.pop().endswith(".dist-info"), sorted({n.split("/")[0] for n in names})


def test_wheel_holds_profiles_and_type_markers(wheel: Path) -> None:
    names = _names(wheel)
    profiles = _shipped_profiles()
    assert any(p.parent == Path("profiles", "policies") for p in profiles)
    missing = [str(p) for p in profiles if _wheel_path(p) not in names]
    assert not missing, "profiles missing from the wheel (see package-data in pyproject.toml):\n" + "\n".join(missing)
    markers = _source_files("tuner", "py.typed") + _source_files("algorithms", "py.typed")
    assert Path("tuner", "py.typed") in markers  # the PEP 561 marker of colltune covers its subpackages
    missing = [str(p) for p in markers if _wheel_path(p) not in names]
    assert not missing, "py.typed missing from the wheel:\n" + "\n".join(missing)


def test_wheel_declares_the_command(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        entry_points = next(zf.read(n).decode() for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt"))
    assert "[console_scripts]" in entry_points
    assert "colltune = colltune.cli:main" in entry_points


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_source_tree(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, capture_output=True, timeout=300, env=_env())
    bindir = venv / "bin"
    python = bindir / "python"
    out = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", str(wheel)],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]

    work = tmp_path / "work"  # outside the source tree: nothing there shadows the installed package
    work.mkdir()

    def run(*cmd: str) -> str:
        res = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=300, env=_env())
        assert res.returncode == 0, f"{cmd} exited {res.returncode}:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
        return res.stdout

    # Every module of the source resolves inside the environment. The probe finds them without running them;
    # the environment also sees this interpreter's site-packages, where an editable install may be.
    modules = sorted(_wheel_path(rel)[:-len(".py")].replace("/", ".").removesuffix(".__init__")
                     for mods in _package_folders().values() for rel in mods)
    probe = ("import importlib.util, sys\n"
             "import colltune, colltune.profiles\n"
             "print(colltune.sparse_allreduce)\n"
             "print(list(colltune.profiles.__path__)[0])\n"
             "for name in sys.argv[1:]:\n"
             "    print(importlib.util.find_spec(name).origin)\n")
    lines = run(str(python), "-c", probe, *modules).splitlines()
    assert "function sparse_allreduce" in lines[0], lines
    assert len(lines) == len(modules) + 2, lines
    site = venv.resolve()
    for name, line in zip(["colltune.profiles", *modules], lines[1:]):
        path = Path(line).resolve()
        assert path.is_relative_to(site), f"{name} is loaded from {line}, not from the virtual environment {site}"
        assert not path.is_relative_to(ROOT), f"{name} comes from the source tree: {line}"

    # tuner/cli/__main__.py makes the command line runnable as a module; the script is [project.scripts].
    assert "usage: colltune" in run(str(python), "-m", "colltune.cli", "--help")
    assert "usage: colltune" in run(str(bindir / "colltune"), "--help")
