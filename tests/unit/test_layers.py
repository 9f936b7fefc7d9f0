"""The package's layers, read from its imports: no upward import, no cycle, no private name across modules.

Every ``import`` in the package counts, function-local ones included: a
circle hidden inside functions is still a circle. The layers, lowest first:

==================  ============================================================
``algorithms``      the Algorithm contract and registry, comm layer, metadata
``model``           features, profiles, cost models, policies (pure: no torch)
``select``          the selector
``api``             the front door (``colltune.api`` and the package facade)
``train``           the DDP hook and the sparse-gradient synchronizer
``offline``         launcher, workloads, timing engine, profiling, tuning, report
``cli``             the ``colltune`` command; nothing imports it
==================  ============================================================

A module may import its own layer and the layers below it. A name that
starts with an underscore is private to its module: no other module of the
package imports it, nor reads it as an attribute of the module, in any
layer; a private module is imported by its own package only. What a layer's
modules share has a public name (``colltune.api`` for ``colltune.fused``,
``colltune.train.common`` for the hook and the synchronizer). Tests and
tools are not part of the package and may reach inside it. The pure layer
is imported with torch blocked in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Source folder of each package, as pyproject.toml maps them.
SOURCES = {"colltune": ROOT / "tuner", "colltune.algorithms": ROOT / "algorithms"}
LAYERS = ("algorithms", "model", "select", "api", "train", "offline", "cli")


def _modules() -> dict[str, Path]:
    """Map every module name of the package to its file."""
    out: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if package == "colltune" and parts[:1] == ("algorithms",):
                continue
            out[name] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> str:
    """Return the layer of a colltune module name (the package itself sits with the front door)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] not in LAYERS:
        return "api"
    return parts[1]


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path) -> list[tuple[str, str, int]]:
    """Return ``(target module, imported name or '', line)`` for every colltune import in a module."""
    found: list[tuple[str, str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "colltune"]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if target.split(".")[0] != "colltune":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in MODULES else (target, alias.name, node.lineno))
    return found


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, _, _ in imports_of(module, path):
            if target in MODULES and target != module:
                graph[module].add(target)
    return graph


def test_the_package_is_found() -> None:
    assert "colltune.api" in MODULES and "colltune.algorithms.base" in MODULES
    assert {layer_of(m) for m in MODULES} == set(LAYERS)


def test_no_upward_import() -> None:
    upward = []
    for module, path in MODULES.items():
        mine = LAYERS.index(layer_of(module))
        for target, _, line in imports_of(module, path):
            if LAYERS.index(layer_of(target)) > mine:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {layer_of(module)} imports {target} "
                              f"({layer_of(target)})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_nothing_imports_the_cli() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line}: {target}"
           for module, path in MODULES.items() if layer_of(module) != "cli"
           for target, _, line in imports_of(module, path) if layer_of(target) == "cli"]
    assert not bad, "the CLI is imported by:\n" + "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle() -> None:
    graph = _edges()
    # A package's __init__ re-exporting its own modules is not a cycle when
    # those modules import only their siblings, never the package itself.
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def is_private(name: str) -> bool:
    """Return whether a name is private: a leading underscore, dunders (``__version__``, ``__main__``) aside."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_module_outside(target: str, importer: str) -> bool:
    """Return whether ``target`` is a private module (or inside one) that ``importer`` is not a part of.

    ``colltune.x._impl`` is private to the package ``colltune.x``: its
    ``__init__`` and its other modules may import it, no one else.
    """
    parts = target.split(".")
    for i in range(1, len(parts)):
        if is_private(parts[i]):
            owner = ".".join(parts[:i])
            if importer != owner and not importer.startswith(owner + "."):
                return True
    return False


def test_the_private_name_rules_read_names_right() -> None:
    assert is_private("_helper") and is_private("_CONSTANT") and is_private("_Class")
    assert not is_private("__version__") and not is_private("__main__") and not is_private("open_comm")
    assert private_module_outside("colltune.x._impl", "colltune.y")
    assert private_module_outside("colltune.x._impl.a", "colltune.xy")
    assert not private_module_outside("colltune.x._impl", "colltune.x")
    assert not private_module_outside("colltune.x._impl", "colltune.x.other")
    assert not private_module_outside("colltune.cli.__main__", "colltune.select.selector")


def test_no_private_name_across_modules() -> None:
    """``from colltune.x import _name`` in any other module of the package, whatever the layers."""
    bad = []
    for module, path in MODULES.items():
        for target, name, line in imports_of(module, path):
            if target == module:
                continue
            if private_module_outside(target, module) or is_private(name):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {target}{'.' + name if name else ''}")
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def _dotted(node: ast.expr) -> str | None:
    """Return ``a.b.c`` for a chain of names and attributes, else ``None``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _module_names(module: str, path: Path, tree: ast.Module) -> dict[str, str]:
    """Map each name a module binds to a colltune module (``import ... as``, ``from ... import mod``) to it."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:
                    names[a.asname or a.name] = sub
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    names[a.asname] = a.name
                elif not a.asname and a.name.split(".")[0] == "colltune":
                    names["colltune"] = "colltune"  # ``import colltune.x`` binds the package
    return names


def test_no_private_attribute_across_modules() -> None:
    """``from colltune.x import mod`` then ``mod._name`` (or ``colltune.x._name``) is a private name too."""
    bad = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        names = _module_names(module, path, tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
                continue
            base = _dotted(node.value)
            head, _, rest = (base or "").partition(".")
            if head not in names:
                continue
            target = names[head] + ("." + rest if rest else "")
            if target in MODULES and target != module:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}.{node.attr}")
    assert not bad, "private attributes read from another module:\n" + "\n".join(bad)


PURE = ("colltune.model.features", "colltune.model.profile", "colltune.model.cost_model",
        "colltune.model.policy", "colltune.model.files", "colltune.model.yamlsafe", "colltune.model.nccl")


def test_the_pure_layer_has_no_module_level_torch() -> None:
    for module, path in MODULES.items():
        if layer_of(module) != "model":
            continue
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "torch" for n in names), f"{module} imports torch at module level"


_BLOCK_TORCH = """
import importlib.abc, sys

class _BlockTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked here ({name})")

sys.meta_path.insert(0, _BlockTorch())
"""


def test_the_pure_layer_imports_and_works_with_torch_blocked() -> None:
    code = _BLOCK_TORCH + f"""
import importlib
for name in {PURE!r}:
    importlib.import_module(name)
import colltune.algorithms.errors, colltune.algorithms.registry, colltune.algorithms.knobs
from colltune.algorithms import registry
from colltune.algorithms.schedule import Pricing
from colltune.model.cost_model import model_for_profile
from colltune.model.features import Features
from colltune.model.profile import load_profile
from colltune.model.policy import load_policy, parse_policy
prof = load_profile({str(ROOT / "profiles" / "cpu-gloo.yaml")!r})
nccl = load_profile({str(ROOT / "profiles" / "analytic-nccl.yaml")!r})
policy = parse_policy("version: 1\\ndefault: auto\\n", source="inline")
# The shipped policies name algorithms and set their knobs: checked against the built-ins' knobs, no torch.
example = load_policy({str(ROOT / "profiles" / "policies" / "example.yaml")!r})
embeddings = load_policy({str(ROOT / "profiles" / "policies" / "embeddings.yaml")!r})
f = Features.build(numel=2**20, row_numel=1, dtype="float32", k_per_rank=[1000, 1000], union=1500)
# Pricing a call reads every registered algorithm's schedule, knobs and counts: the algorithm modules load, no torch.
learned, analytic = model_for_profile(prof)[0].predict_times(f), model_for_profile(nccl)[0].predict_times(f)
assert set(learned) == set(analytic) == set(registry.names()) and min(analytic.values()) > 0, (learned, analytic)
assert [k.name for k in registry.knob_specs("hashpart")] == ["gather_mode"]
assert "torch" not in sys.modules
print("ok", len(prof.measurements), policy.default, f.world_size, len(example.rules), len(embeddings.rules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok "), out.stdout


def test_every_algorithm_module_imports_with_torch_blocked() -> None:
    # Their top levels touch no torch (colltune.algorithms.lazy imports it on first use), so that pricing works
    # without it; the code that runs a call imports it when it first runs.
    modules = sorted(m for m in _modules() if layer_of(m) == "algorithms")
    assert "colltune.algorithms.dense" in modules and "colltune.algorithms.lazy" in modules
    code = _BLOCK_TORCH + f"""
import importlib
for name in {modules!r}:
    importlib.import_module(name)
assert "torch" not in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


def test_the_torch_blocker_blocks() -> None:
    out = subprocess.run([sys.executable, "-c", _BLOCK_TORCH + "import torch"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "torch is blocked" in out.stderr


@pytest.mark.parametrize("top", ["tuner", "algorithms"])
def test_no_generic_top_level_package_is_installed(top: str) -> None:
    out = subprocess.run([sys.executable, "-c", f"import {top}"], capture_output=True, text=True, cwd="/",
                         timeout=60)
    assert out.returncode != 0 and "No module named" in out.stderr


#: The longest a function's code may be, in lines, its docstring not counted.
MAX_FUNCTION_LINES = 60


def test_no_function_is_longer_than_the_limit() -> None:
    """Long functions are split into steps; a docstring (the contract, the arguments) does not count."""
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if ast.get_docstring(node) is not None:
                    doc = node.body[0]
                    lines -= doc.end_lineno - doc.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code:\n" + "\n".join(long)


def test_the_torch_stand_in_imports_once_and_then_forwards() -> None:
    import json

    from colltune.algorithms.lazy import LazyModule

    held = LazyModule("json")  # held outside colltune, as a plugin would: it is never replaced there
    with pytest.raises(AttributeError):
        held.__wrapped__  # introspection before the first use imports nothing
    assert "_real" not in held.__dict__
    assert held.dumps([1]) == "[1]" and held.__dict__["_real"] is json
    assert held.loads("2") == 2 and held.__name__ == "json"
