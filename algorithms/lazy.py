"""``torch`` and ``torch.distributed``, imported on first use, for the modules of this layer.

An algorithm module holds both halves of an algorithm: how it runs (torch
code) and how it is priced (its schedule, knobs and counts: plain Python).
The cost model, ``explain``, ``simulate`` and policy checks read only the
second half, and must work where torch is not installed or not wanted, so
the modules of this layer take ``torch`` and ``dist`` from here instead of
importing them: a stand-in module that imports the real one the first time
one of its attributes is read, then puts the real module in the place of the
stand-in in every ``colltune`` module that holds it, so that a call pays
nothing for the indirection after the first. Code at module level (constants,
default arguments) must therefore not touch ``torch``: the layer test imports
every module here with torch blocked.

A plugin imports torch itself; it may import from here too, at the cost of
one attribute lookup per use.

Example:
    >>> from colltune.algorithms.lazy import torch
    >>> torch.zeros(2).tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from typing import TYPE_CHECKING, Any

__all__ = ["torch", "dist"]

_lock = threading.Lock()


class LazyModule(types.ModuleType):
    """A stand-in for the module ``name`` that imports it when one of its attributes is first read."""

    def __getattr__(self, attr: str) -> Any:
        real = self.__dict__.get("_real")
        if real is None:
            if attr.startswith("__"):  # introspection (doctest, copy, pickle) must not import torch
                raise AttributeError(attr)
            real = importlib.import_module(self.__name__)
            with _lock:
                for name, module in list(sys.modules.items()):
                    if name == "colltune" or name.startswith("colltune."):
                        held = getattr(module, "__dict__", {})
                        for key, value in list(held.items()):
                            if value is self:
                                held[key] = real
                self.__dict__["_real"] = real  # a holder outside colltune (a plugin) keeps the stand-in: one lookup
        return getattr(real, attr)


if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
else:
    torch = LazyModule("torch")
    dist = LazyModule("torch.distributed")
