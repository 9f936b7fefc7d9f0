"""Computes the package list; everything else is in pyproject.toml.

The import name is the distribution name, but its source lives in fixed
top-level folders: tuner/ is the package colltune, algorithms/ its subpackage
colltune.algorithms, and profiles/ (data only: shipped profiles and example
policies) is installed as colltune/profiles/. setuptools cannot discover
packages across such a mapping by itself, so every folder holding an
``__init__.py`` under tuner/ and algorithms/ is found here, and a new
subpackage ships without being listed anywhere.
"""

from __future__ import annotations

import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))

#: Source folder -> the package it holds; subfolders map onto subpackages.
ROOTS = {"tuner": "colltune", "algorithms": "colltune.algorithms"}


def _packages() -> list[str]:
    found = []
    for folder, package in ROOTS.items():
        top = os.path.join(HERE, folder)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            if "__init__.py" not in filenames:
                continue
            rel = os.path.relpath(dirpath, top)
            found.append(package if rel == "." else package + "." + rel.replace(os.sep, "."))
    return found + ["colltune.profiles"]


setup(
    packages=_packages(),
    # Parents map their subpackages: colltune.model is tuner/model.
    package_dir={"colltune": "tuner", "colltune.algorithms": "algorithms", "colltune.profiles": "profiles"},
)
