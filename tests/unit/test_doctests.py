"""Every example in the package's docstrings runs and prints what it says (those marked ``+SKIP`` need ranks or files)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import colltune
import colltune.algorithms  # its own folder (pyproject's package-dir): walked on its own

MODULES = ["colltune", "colltune.algorithms"] + sorted(
    m.name
    for path, prefix in ((colltune.__path__, "colltune."), (colltune.algorithms.__path__, "colltune.algorithms."))
    for m in pkgutil.walk_packages(path, prefix)
    if not m.name.endswith("__main__")  # running the CLI's __main__ would start it
)


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_each_module_run(name: str) -> None:
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def test_the_package_has_examples_that_run() -> None:
    run = sum(1 for name in MODULES for t in doctest.DocTestFinder().find(importlib.import_module(name), name)
              for e in t.examples if not e.options.get(doctest.SKIP))
    assert run >= 40, run  # the suite does run examples; the +SKIP ones need ranks or files
